"""OCI layout sources: hand-written layouts (exact control, bad input) and umoci's."""

from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import ocibuild
import pytest
import zstandard
from ocibuild import TarEntry, make_layer_tar, opaque, whiteout
from srcutil import flatten, read_layers

from imagetool.errors import (
    DigestMismatchError,
    ImageToolError,
    InvalidReferenceError,
    InvalidSourceError,
    NotFoundError,
    UnsupportedMediaTypeError,
)
from imagetool.sources import Layer, MissingBlobError, SourceImage, open_source

FILES = [
    TarEntry("etc", type="dir"),
    TarEntry("etc/hello", data=b"hello\n"),
    TarEntry("bin/sh", data=b"#!shell", mode=0o4755, uid=0, gid=0),
    TarEntry("bin/link", type="symlink", link="sh"),
]


def one_layer(path: Path, compression: str | None = "gzip", **kw) -> str:
    return ocibuild.write_oci_layout(path, [make_layer_tar(FILES, compression)], **kw)


def corrupt_blob(layout: Path, digest: str, data: bytes) -> None:
    p = ocibuild.blob_path(layout, digest)
    p.chmod(0o644)
    p.write_bytes(data)


def open_only_layer(src: SourceImage) -> bytes:
    (layer,) = src.layers
    with src.open_layer(layer) as f:
        return f.read()


@pytest.mark.parametrize("compression", ["gzip", "zstd", None])
def test_layer_compressions(tmp_path: Path, compression: str | None) -> None:
    digest = one_layer(tmp_path / "img", compression)
    with open_source(f"oci:{tmp_path / 'img'}:latest") as src:
        assert src.manifest_digest == digest
        assert src.platform == "linux/amd64"
        (layer,) = src.layers
        assert layer.media_type == ocibuild.layer_media_type(make_layer_tar(FILES, compression))
        assert layer.diff_id == ocibuild.sha256(ocibuild.make_tar(FILES))
        assert read_layers(src) == [
            {"etc": None, "etc/hello": b"hello\n", "bin/sh": b"#!shell", "bin/link": None}
        ]


def test_all_entry_kinds_pass_through(tmp_path: Path) -> None:
    entries = [
        TarEntry("d", type="dir", mode=0o1777),
        TarEntry("d/f", data=b"x" * 5000, mode=0o2755, uid=1000, gid=1000, xattrs={"user.a": b"1"}),
        TarEntry("d/hl", type="hardlink", link="d/f"),
        TarEntry("dev/null", type="char", devmajor=1, devminor=3),
        TarEntry("dev/loop0", type="block", devmajor=7, devminor=0),
        TarEntry("run/fifo", type="fifo"),
        whiteout("old/file"),
        opaque("var"),
        TarEntry("../escape", data=b"bad"),
        TarEntry("/abs", data=b"bad"),
    ]
    layer = make_layer_tar(entries, "zstd")
    ocibuild.write_oci_layout(tmp_path / "img", [layer])
    with open_source(f"oci:{tmp_path / 'img'}") as src:
        # The source hands the tar through untouched: judging entries is the consumer's job.
        assert open_only_layer(src) == ocibuild.make_tar(entries)


def test_tag_selection(tmp_path: Path) -> None:
    layout = tmp_path / "img"
    a = ocibuild.write_oci_layout(layout, [make_layer_tar(FILES)], tag="a")
    b = ocibuild.write_oci_layout(layout, [make_layer_tar(FILES[:2], "zstd")], tag="b")
    assert open_source(f"oci:{layout}:a").manifest_digest == a
    assert open_source(f"oci:{layout}:b").manifest_digest == b
    with pytest.raises(NotFoundError, match=r"no image tagged 'c'.*tags: a, b"):
        open_source(f"oci:{layout}:c")
    with pytest.raises(InvalidSourceError, match="holds 2 images"):
        open_source(f"oci:{layout}")


def test_path_with_colon(tmp_path: Path) -> None:
    layout = tmp_path / "odd:name"
    digest = one_layer(layout, tag="v:1")
    assert open_source(f"oci:{layout}").manifest_digest == digest
    assert open_source(f"oci:{layout}:v:1").manifest_digest == digest


def test_docker_media_types_in_layout(tmp_path: Path) -> None:
    layers = [make_layer_tar(FILES, "gzip"), make_layer_tar([TarEntry("x", data=b"1")], None)]
    ocibuild.write_oci_layout(tmp_path / "img", layers, docker=True)
    with open_source(f"oci:{tmp_path / 'img'}") as src:
        assert [x.media_type for x in src.layers] == [
            "application/vnd.docker.image.rootfs.diff.tar.gzip",
            "application/vnd.docker.image.rootfs.diff.tar",
        ]
        assert flatten(read_layers(src))["x"] == b"1"


def test_nondistributable_media_type(tmp_path: Path) -> None:
    mt = "application/vnd.oci.image.layer.nondistributable.v1.tar+gzip"
    ocibuild.write_oci_layout(tmp_path / "img", [make_layer_tar(FILES)], media_types=[mt])
    with open_source(f"oci:{tmp_path / 'img'}") as src:
        assert src.layers[0].media_type == mt
        assert b"hello" in open_only_layer(src)


# --- image indexes -------------------------------------------------------------------------------


@pytest.fixture
def multi(tmp_path: Path) -> Path:
    layout = tmp_path / "multi"
    ocibuild.write_multiplatform_layout(
        layout,
        {
            "linux/amd64": [make_layer_tar([TarEntry("arch", data=b"amd64")])],
            "linux/arm64/v8": [make_layer_tar([TarEntry("arch", data=b"arm64")], "zstd")],
            "linux/arm/v7": [make_layer_tar([TarEntry("arch", data=b"armv7")], None)],
        },
        tag="v1",
    )
    return layout


@pytest.mark.parametrize(
    ("platform", "arch", "expected"),
    [
        ("linux/amd64", b"amd64", "linux/amd64"),
        ("linux/arm64", b"arm64", "linux/arm64/v8"),
        ("linux/arm64/v8", b"arm64", "linux/arm64/v8"),
        ("linux/aarch64", b"arm64", "linux/arm64/v8"),
        ("linux/arm", b"armv7", "linux/arm/v7"),
        ("linux/arm/v7", b"armv7", "linux/arm/v7"),
    ],
)
def test_index_platform(multi: Path, platform: str, arch: bytes, expected: str) -> None:
    with open_source(f"oci:{multi}:v1", platform=platform) as src:
        assert src.platform == expected
        assert flatten(read_layers(src)) == {"arch": arch}


def test_index_default_platform(multi: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import platform

    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    assert open_source(f"oci:{multi}:v1").platform == "linux/amd64"
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    assert open_source(f"oci:{multi}:v1").platform == "linux/arm64/v8"


def test_index_no_such_platform(multi: Path) -> None:
    with pytest.raises(NotFoundError) as e:
        open_source(f"oci:{multi}:v1", platform="linux/s390x")
    msg = str(e.value)
    assert "linux/s390x" in msg
    assert "available: linux/amd64, linux/arm/v7, linux/arm64/v8" in msg
    assert "\n" not in msg


def test_docker_manifest_list(tmp_path: Path) -> None:
    layout = tmp_path / "list"
    ocibuild.write_multiplatform_layout(
        layout,
        {"linux/amd64": [make_layer_tar(FILES)], "linux/ppc64le": [make_layer_tar(FILES[:1])]},
        docker=True,
    )
    assert open_source(f"oci:{layout}", platform="linux/ppc64le").platform == "linux/ppc64le"


def test_single_image_explicit_platform_must_match(tmp_path: Path) -> None:
    one_layer(tmp_path / "img")
    assert open_source(f"oci:{tmp_path / 'img'}", platform="linux/amd64").platform == "linux/amd64"
    with pytest.raises(NotFoundError, match="linux/amd64, not linux/arm64"):
        open_source(f"oci:{tmp_path / 'img'}", platform="linux/arm64")


@pytest.mark.parametrize("platform", ["amd64", "linux/", "a/b/c/d"])
def test_bad_platform(tmp_path: Path, platform: str) -> None:
    one_layer(tmp_path / "img")
    with pytest.raises(InvalidReferenceError):
        open_source(f"oci:{tmp_path / 'img'}", platform=platform)


# --- bad input ------------------------------------------------------------------------------------


def test_layer_digest_mismatch(tmp_path: Path) -> None:
    good = make_layer_tar(FILES, None)
    other = make_layer_tar([FILES[0], TarEntry("etc/hello", data=b"HELLO\n"), *FILES[2:]], None)
    assert len(other) == len(good)  # same size: only the digest can tell
    layout = tmp_path / "img"
    digest = ocibuild.write_oci_layout(layout, [good])
    layer_digest = ocibuild.manifest_of(layout, digest)["layers"][0]["digest"]
    corrupt_blob(layout, layer_digest, other)
    with open_source(f"oci:{layout}") as src:
        with pytest.raises(
            DigestMismatchError,
            match=r"layer 1/1 sha256:\w+ of oci:.*blob does not match its digest",
        ):
            open_only_layer(src)


def test_diff_id_mismatch(tmp_path: Path) -> None:
    layer = make_layer_tar(FILES)
    config = ocibuild.default_config([layer])
    config["rootfs"]["diff_ids"] = [ocibuild.sha256(b"something else")]
    ocibuild.write_oci_layout(tmp_path / "img", [layer], config=config)
    with open_source(f"oci:{tmp_path / 'img'}") as src:
        with pytest.raises(DigestMismatchError, match="diff_id"):
            open_only_layer(src)


def test_blob_longer_than_descriptor(tmp_path: Path) -> None:
    layout = tmp_path / "img"
    digest = one_layer(layout, compression=None)
    layer_digest = ocibuild.manifest_of(layout, digest)["layers"][0]["digest"]
    corrupt_blob(layout, layer_digest, ocibuild.make_tar(FILES) + bytes(10240))
    with open_source(f"oci:{layout}") as src:
        with pytest.raises(DigestMismatchError, match="larger than"):
            open_only_layer(src)


def test_verified_on_exit_when_consumer_stops_early(tmp_path: Path) -> None:
    """A tar reader stops at the end-of-archive marker; the rest is still checked."""
    layer = make_layer_tar(FILES, None)
    config = ocibuild.default_config([layer])
    config["rootfs"]["diff_ids"] = [ocibuild.sha256(b"wrong")]
    ocibuild.write_oci_layout(tmp_path / "img", [layer], config=config)
    with open_source(f"oci:{tmp_path / 'img'}") as src:
        with pytest.raises(DigestMismatchError):
            with src.open_layer(src.layers[0]) as f:
                assert f.read(512)
        # An exception from the consumer is not replaced by a verification error.
        with pytest.raises(KeyError):
            with src.open_layer(src.layers[0]) as f:
                raise KeyError("consumer")


@pytest.mark.parametrize("cut", [10, 100, -9, -1])
def test_truncated_gzip(tmp_path: Path, cut: int) -> None:
    layer = make_layer_tar(FILES, "gzip")
    truncated = layer[:cut]
    config = ocibuild.default_config([layer])
    ocibuild.write_oci_layout(tmp_path / "img", [truncated], config=config)
    with open_source(f"oci:{tmp_path / 'img'}") as src:
        with pytest.raises(InvalidSourceError) as e:
            open_only_layer(src)
        assert not isinstance(e.value, DigestMismatchError)
        assert "gzip" in str(e.value) and "layer 1/1" in str(e.value)
        assert "\n" not in str(e.value)


def test_corrupt_gzip(tmp_path: Path) -> None:
    layer = bytearray(make_layer_tar(FILES, "gzip"))
    layer[20:40] = b"\xff" * 20
    config = ocibuild.default_config([make_layer_tar(FILES)])
    ocibuild.write_oci_layout(tmp_path / "img", [bytes(layer)], config=config)
    with open_source(f"oci:{tmp_path / 'img'}") as src:
        with pytest.raises(InvalidSourceError, match="corrupt gzip|truncated gzip"):
            open_only_layer(src)


@pytest.mark.parametrize("damage", ["truncate", "truncate-header", "flip", "garbage-after"])
def test_corrupt_zstd(tmp_path: Path, damage: str) -> None:
    good = make_layer_tar(FILES, "zstd")
    layer = {
        "truncate": good[:-3],
        "truncate-header": good[:6],
        "flip": good[:12] + bytes(b ^ 0x5A for b in good[12:30]) + good[30:],
        "garbage-after": good + b"garbage!",
    }[damage]
    config = ocibuild.default_config([good])
    ocibuild.write_oci_layout(tmp_path / "img", [layer], config=config)
    with open_source(f"oci:{tmp_path / 'img'}") as src:
        with pytest.raises(InvalidSourceError, match="zstd") as e:
            open_only_layer(src)
        assert "\n" not in str(e.value)


def test_multi_member_gzip_and_multi_frame_zstd(tmp_path: Path) -> None:
    tar = ocibuild.make_tar(FILES)
    half = len(tar) // 2
    gz = gzip.compress(tar[:half], mtime=0) + gzip.compress(tar[half:], mtime=0)
    cctx = zstandard.ZstdCompressor(write_checksum=True)
    skippable = b"\x50\x2a\x4d\x18" + (3).to_bytes(4, "little") + b"abc"
    zst = cctx.compress(tar[:half]) + skippable + cctx.compress(tar[half:])
    config = ocibuild.default_config([tar, tar])
    ocibuild.write_oci_layout(tmp_path / "img", [gz, zst], config=config)
    with open_source(f"oci:{tmp_path / 'img'}") as src:
        for layer in src.layers:
            with src.open_layer(layer) as f:
                assert f.read() == tar


def test_trailing_garbage_after_gzip(tmp_path: Path) -> None:
    layer = make_layer_tar(FILES, "gzip") + b"junk"
    config = ocibuild.default_config([make_layer_tar(FILES)])
    ocibuild.write_oci_layout(tmp_path / "img", [layer], config=config)
    with open_source(f"oci:{tmp_path / 'img'}") as src:
        with pytest.raises(InvalidSourceError, match="after gzip"):
            open_only_layer(src)


@pytest.mark.parametrize(
    ("compression", "media_type"),
    [
        ("gzip", "application/vnd.oci.image.layer.v1.tar+zstd"),
        (None, "application/vnd.oci.image.layer.v1.tar+gzip"),
        ("zstd", "application/vnd.oci.image.layer.v1.tar"),
    ],
)
def test_media_type_disagrees_with_data(
    tmp_path: Path, compression: str | None, media_type: str
) -> None:
    layer = make_layer_tar(FILES, compression)
    ocibuild.write_oci_layout(tmp_path / "img", [layer], media_types=[media_type])
    with open_source(f"oci:{tmp_path / 'img'}") as src:
        with pytest.raises(InvalidSourceError, match="media type says"):
            open_only_layer(src)


def test_unknown_layer_media_type(tmp_path: Path) -> None:
    mt = "application/vnd.example.layer.v1.squashfs"
    ocibuild.write_oci_layout(tmp_path / "img", [make_layer_tar(FILES)], media_types=[mt])
    with pytest.raises(UnsupportedMediaTypeError, match="squashfs"):
        open_source(f"oci:{tmp_path / 'img'}")


def test_unknown_config_media_type(tmp_path: Path) -> None:
    layout = tmp_path / "img"
    digest = one_layer(layout)
    manifest = ocibuild.manifest_of(layout, digest)
    manifest["config"]["mediaType"] = "application/vnd.oci.empty.v1+json"
    _retag(layout, manifest)
    with pytest.raises(UnsupportedMediaTypeError, match="config media type"):
        open_source(f"oci:{layout}")


@pytest.mark.parametrize(
    "media_type",
    [
        "application/vnd.docker.distribution.manifest.v1+prettyjws",
        "application/vnd.oci.artifact.manifest.v1+json",
    ],
)
def test_unknown_manifest_media_type(tmp_path: Path, media_type: str) -> None:
    layout = tmp_path / "img"
    digest = one_layer(layout)
    manifest = ocibuild.manifest_of(layout, digest)
    manifest["mediaType"] = media_type
    _retag(layout, manifest, media_type)
    with pytest.raises(UnsupportedMediaTypeError, match="manifest media type"):
        open_source(f"oci:{layout}")


def _retag(layout: Path, manifest: dict, media_type: str | None = None) -> str:
    body = ocibuild.canonical_json(manifest)
    desc = {"mediaType": media_type or manifest["mediaType"], **ocibuild.write_blob(layout, body)}
    (layout / "index.json").unlink()
    ocibuild.tag_descriptor(layout, desc, "latest")
    return desc["digest"]


def test_missing_layer_blob(tmp_path: Path) -> None:
    layout = tmp_path / "img"
    digest = one_layer(layout)
    layer_digest = ocibuild.manifest_of(layout, digest)["layers"][0]["digest"]
    ocibuild.blob_path(layout, layer_digest).unlink()
    with open_source(f"oci:{layout}") as src:
        with pytest.raises(MissingBlobError, match="missing") as e:
            open_only_layer(src)
    assert isinstance(e.value, InvalidSourceError) and isinstance(e.value, NotFoundError)
    assert layer_digest in str(e.value)


def test_missing_config_and_manifest_blobs(tmp_path: Path) -> None:
    layout = tmp_path / "img"
    digest = one_layer(layout)
    config_digest = ocibuild.manifest_of(layout, digest)["config"]["digest"]
    ocibuild.blob_path(layout, config_digest).unlink()
    with pytest.raises(MissingBlobError, match=config_digest):
        open_source(f"oci:{layout}")
    ocibuild.blob_path(layout, digest).unlink()
    with pytest.raises(MissingBlobError, match=digest):
        open_source(f"oci:{layout}")


def test_manifest_and_config_digests_verified(tmp_path: Path) -> None:
    layout = tmp_path / "img"
    digest = one_layer(layout)
    manifest = ocibuild.manifest_of(layout, digest)
    config_digest = manifest["config"]["digest"]
    config = ocibuild.read_blob(layout, config_digest)
    corrupt_blob(layout, config_digest, config.replace(b"amd64", b"arm64"))
    with pytest.raises(DigestMismatchError, match="config|" + config_digest):
        open_source(f"oci:{layout}")
    corrupt_blob(layout, digest, ocibuild.read_blob(layout, digest).replace(b"2", b"3", 1))
    with pytest.raises(DigestMismatchError, match=digest):
        open_source(f"oci:{layout}")


def test_diff_ids_count_must_match(tmp_path: Path) -> None:
    layer = make_layer_tar(FILES)
    config = ocibuild.default_config([layer, layer])
    ocibuild.write_oci_layout(tmp_path / "img", [layer], config=config)
    with pytest.raises(InvalidSourceError, match="2 diff_ids for 1 layers"):
        open_source(f"oci:{tmp_path / 'img'}")


def test_not_a_layout(tmp_path: Path) -> None:
    with pytest.raises(NotFoundError, match="no such directory"):
        open_source(f"oci:{tmp_path / 'nothing'}")
    (tmp_path / "empty").mkdir()
    with pytest.raises(InvalidSourceError, match="oci-layout"):
        open_source(f"oci:{tmp_path / 'empty'}")
    one_layer(tmp_path / "img")
    (tmp_path / "img" / "index.json").write_text("{nope")
    with pytest.raises(InvalidSourceError, match="index.json: not valid JSON"):
        open_source(f"oci:{tmp_path / 'img'}")


def test_hostile_digest_is_not_a_path(tmp_path: Path) -> None:
    layout = tmp_path / "img"
    one_layer(layout)
    index = json.loads((layout / "index.json").read_text())
    index["manifests"][0]["digest"] = "sha256:../../../etc/passwd"
    (layout / "index.json").write_text(json.dumps(index))
    with pytest.raises(InvalidSourceError, match="invalid digest"):
        open_source(f"oci:{layout}")


@pytest.mark.parametrize("spec", ["", "oci", "oci:", "tar:/x", "docker:/x", "/some/path"])
def test_bad_specs(spec: str) -> None:
    with pytest.raises(InvalidReferenceError):
        open_source(spec)


def test_errors_share_the_base(tmp_path: Path) -> None:
    with pytest.raises(ImageToolError):
        open_source(f"oci:{tmp_path / 'missing'}")


# --- a real image built by umoci --------------------------------------------------------------


def test_umoci_image(umoci_layout: Path, tmp_path: Path) -> None:
    with open_source(f"oci:{umoci_layout}:v1") as src:
        index = json.loads((umoci_layout / "index.json").read_text())
        assert src.manifest_digest == index["manifests"][0]["digest"]
        assert src.config["config"]["Entrypoint"] == ["/bin/sh", "-c"]
        assert src.config["config"]["Env"][-1] == "MODE=test"
        assert src.config["config"]["User"] == "1000:1000"
        assert src.config["config"]["WorkingDir"] == "/srv"
        assert len(src.layers) == 2
        assert all(isinstance(x, Layer) and x.diff_id for x in src.layers)
        layers = read_layers(src)
    assert "gone/.wh.x" not in layers[1] and ".wh.gone" in layers[1]
    tree = flatten(layers)
    rootfs = ocibuild.unpack_with_umoci(umoci_layout, "v1", tmp_path / "bundle")
    listing = ocibuild.tree_listing(rootfs)
    assert set(tree) == set(listing)
    for path, (kind, *_rest) in listing.items():
        if kind == "file":
            assert tree[path] == (rootfs / path).read_bytes(), path
    assert tree["data.bin"] == b"replaced"
    shutil.rmtree(tmp_path / "bundle")


def test_public_exports() -> None:
    import imagetool.sources as sources

    assert sorted(sources.__all__) == [
        "ANY_PLATFORM",
        "Layer",
        "MissingBlobError",
        "SourceImage",
        "default_platform",
        "open_source",
    ]
    for name in sources.__all__:
        if name == "ANY_PLATFORM":
            continue  # a constant
        module = getattr(sources, name).__module__
        # default_platform is the one platform module's (shared with stores and pull)
        assert module.startswith("imagetool.sources") or module == "imagetool.platforms"
