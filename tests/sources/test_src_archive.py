"""docker-archive sources: skopeo's output from a umoci image, and both `docker save` forms
written by hand."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import ocibuild
import pytest
from ocibuild import TarEntry, make_layer_tar, make_tar
from srcutil import flatten, read_layers

from imagetool.errors import DigestMismatchError, InvalidSourceError, NotFoundError
from imagetool.sources import MissingBlobError, open_source

FILES = [TarEntry("etc/os-release", data=b"ID=test\n"), TarEntry("usr/bin/tool", data=b"\x7fELF")]
UPPER = [ocibuild.whiteout("usr/bin/tool"), TarEntry("etc/motd", data=b"hi\n")]


def test_skopeo_archive_matches_layout(umoci_layout: Path, tmp_path: Path) -> None:
    out = tmp_path / "img.tar"
    ocibuild.to_docker_archive(umoci_layout, "v1", out)
    with open_source(f"oci:{umoci_layout}:v1") as oci, open_source(f"docker-archive:{out}") as da:
        assert da.config == oci.config
        assert da.platform == oci.platform
        assert [x.diff_id for x in da.layers] == [x.diff_id for x in oci.layers]
        # skopeo stores plain tars: the blob is the uncompressed layer.
        assert all(x.digest == x.diff_id for x in da.layers)
        assert all(x.media_type.endswith("rootfs.diff.tar") for x in da.layers)
        assert da.manifest_digest.startswith("sha256:")
        assert flatten(read_layers(da)) == flatten(read_layers(oci))


@pytest.mark.parametrize("form", ["legacy", "oci"])
@pytest.mark.parametrize("compression", [None, "gzip"])
def test_docker_save_forms(tmp_path: Path, form: str, compression: str | None) -> None:
    layers = [make_layer_tar(FILES, compression), make_layer_tar(UPPER, compression)]
    out = tmp_path / "save.tar"
    ocibuild.write_docker_archive(out, layers, form=form)
    with open_source(f"docker-archive:{out}") as src:
        assert [x.digest for x in src.layers] == [ocibuild.sha256(b) for b in layers]
        assert [x.diff_id for x in src.layers] == [ocibuild.diff_id(b) for b in layers]
        assert [x.size for x in src.layers] == [len(b) for b in layers]
        assert flatten(read_layers(src)) == {"etc/os-release": b"ID=test\n", "etc/motd": b"hi\n"}
        if form == "oci":  # the layout's own manifest inside the archive
            with tarfile.open(out) as tar:
                index = json.load(tar.extractfile("index.json"))
            assert src.manifest_digest == index["manifests"][0]["digest"]
    # The manifest digest is a pure function of the archive's content.
    with open_source(f"docker-archive:{out}") as again:
        assert again.manifest_digest == src.manifest_digest


def test_repo_tag_selection(tmp_path: Path) -> None:
    out = tmp_path / "save.tar"
    ocibuild.write_docker_archive(out, [make_layer_tar(FILES)], repo_tags=["a/b:1", "a/b:2"])
    assert open_source(f"docker-archive:{out}:a/b:2").layers
    with pytest.raises(NotFoundError, match=r"'a/b:3'.*tags: a/b:1, a/b:2"):
        open_source(f"docker-archive:{out}:a/b:3")


def test_layer_digest_mismatch_in_archive(tmp_path: Path) -> None:
    tar = make_tar(FILES)
    config = ocibuild.default_config([make_tar(UPPER)])
    out = tmp_path / "save.tar"
    ocibuild.write_docker_archive(out, [tar], config=config)
    with open_source(f"docker-archive:{out}") as src:
        with pytest.raises(DigestMismatchError):
            read_layers(src)


def test_config_digest_checked(tmp_path: Path) -> None:
    out = tmp_path / "save.tar"
    ocibuild.write_docker_archive(out, [make_layer_tar(FILES)])
    _rewrite(out, lambda name, data: data.replace(b"amd64", b"arm64") if name.endswith(".json")
             and name != "manifest.json" else data)  # fmt: skip
    with pytest.raises(DigestMismatchError, match="config"):
        open_source(f"docker-archive:{out}")


def test_missing_layer_member(tmp_path: Path) -> None:
    out = tmp_path / "save.tar"
    ocibuild.write_docker_archive(out, [make_layer_tar(FILES)])
    _rewrite(out, lambda name, data: None if name.endswith("layer.tar") else data)
    with pytest.raises(MissingBlobError, match="layer.tar is missing"):
        open_source(f"docker-archive:{out}")


def test_not_an_archive(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError):
        open_source(f"docker-archive:{tmp_path / 'nope.tar'}")
    (tmp_path / "junk.tar").write_bytes(b"junk" * 1000)
    with pytest.raises(InvalidSourceError):
        open_source(f"docker-archive:{tmp_path / 'junk.tar'}")
    out = tmp_path / "other.tar"
    with tarfile.open(out, "w") as tar:
        tar.add(__file__, "x.py")
    with pytest.raises(InvalidSourceError, match="manifest.json"):
        open_source(f"docker-archive:{out}")


def _rewrite(archive: Path, fn) -> None:
    with tarfile.open(archive) as tar:
        members = [(m, tar.extractfile(m).read() if m.isfile() else None) for m in tar]
    with tarfile.open(archive, "w") as tar:
        for m, data in members:
            if data is not None:
                data = fn(m.name, data)
                if data is None:
                    continue
                m.size = len(data)
            tar.addfile(m, None if data is None else io.BytesIO(data))
