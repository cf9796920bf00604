"""Registry sources against a real registry on loopback, fed by skopeo."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import ocibuild
import pytest
from ocibuild import TarEntry, make_layer_tar
from srcutil import flatten, read_layers

from imagetool.errors import DigestMismatchError, InvalidReferenceError, NotFoundError
from imagetool.sources import MissingBlobError, open_source
from imagetool.sources._registry import parse_registry_spec
from imagetool.stores.base import StoreOptions

PLAIN = StoreOptions(plain_http=True, timeout=10.0, retries=0)


def repo() -> str:
    return "test/" + uuid.uuid4().hex[:10]


def test_pull_umoci_image(registry, umoci_layout: Path) -> None:
    name = repo()
    ocibuild.push_to_registry(umoci_layout, "v1", registry.host, name)
    with open_source(f"oci:{umoci_layout}:v1") as oci:
        expected = flatten(read_layers(oci))
        manifest_digest = oci.manifest_digest
        config = oci.config
    with open_source(f"docker://{registry.host}/{name}:v1", options=PLAIN) as src:
        assert src.manifest_digest == manifest_digest  # skopeo copies the manifest as is
        assert src.config == config
        assert flatten(read_layers(src)) == expected
    by_digest = f"docker://{registry.host}/{name}@{manifest_digest}"
    with open_source(by_digest, options=PLAIN) as src:
        assert src.manifest_digest == manifest_digest


def test_pull_index_by_platform(registry, tmp_path: Path) -> None:
    layout = tmp_path / "multi"
    ocibuild.write_multiplatform_layout(
        layout,
        {
            "linux/amd64": [make_layer_tar([TarEntry("arch", data=b"amd64")], "zstd")],
            "linux/arm64/v8": [make_layer_tar([TarEntry("arch", data=b"arm64")])],
        },
        tag="v1",
    )
    name = repo()
    ocibuild.push_to_registry(layout, "v1", registry.host, name, all_platforms=True)
    spec = f"docker://{registry.host}/{name}:v1"
    for platform, arch in [("linux/amd64", b"amd64"), ("linux/arm64", b"arm64")]:
        with open_source(spec, platform=platform, options=PLAIN) as src:
            assert flatten(read_layers(src)) == {"arch": arch}
    with pytest.raises(NotFoundError, match="available: linux/amd64, linux/arm64/v8"):
        open_source(spec, platform="linux/riscv64", options=PLAIN)


def test_no_such_tag_or_repo(registry, umoci_layout: Path) -> None:
    name = repo()
    ocibuild.push_to_registry(umoci_layout, "v1", registry.host, name)
    with pytest.raises(NotFoundError):
        open_source(f"docker://{registry.host}/{name}:nope", options=PLAIN)
    with pytest.raises(NotFoundError):
        open_source(f"docker://{registry.host}/{repo()}:v1", options=PLAIN)


def test_missing_and_corrupt_blobs(registry, tmp_path: Path) -> None:
    files = [TarEntry("a", data=b"a" * 1000)]
    layer = make_layer_tar(files)
    bad_config = ocibuild.default_config([make_layer_tar([TarEntry("b")])])
    layout = tmp_path / "img"
    ocibuild.write_oci_layout(layout, [layer], config=bad_config, tag="bad")
    name = repo()
    ocibuild.push_to_registry(layout, "bad", registry.host, name)
    with open_source(f"docker://{registry.host}/{name}:bad", options=PLAIN) as src:
        with pytest.raises(DigestMismatchError, match="diff_id"):
            read_layers(src)
        digest = src.layers[0].digest
        resp = httpx.delete(f"http://{registry.host}/v2/{name}/blobs/{digest}")
        assert resp.status_code == 202
        with pytest.raises(MissingBlobError, match="missing from the registry"):
            read_layers(src)


@pytest.mark.parametrize(
    ("rest", "expected"),
    [
        ("localhost:5000/app", ("localhost:5000", "app", "latest")),
        ("127.0.0.1:5000/team/app:v1.2", ("127.0.0.1:5000", "team/app", "v1.2")),
        ("reg.example.com/a/b/c:x", ("reg.example.com", "a/b/c", "x")),
        ("h/app@sha256:" + "a" * 64, ("h", "app", "sha256:" + "a" * 64)),
        ("h/app:v1@sha256:" + "b" * 64, ("h", "app", "sha256:" + "b" * 64)),
    ],
)
def test_parse_registry_spec(rest: str, expected: tuple[str, str, str]) -> None:
    assert parse_registry_spec(rest, rest) == expected


@pytest.mark.parametrize(
    "rest", ["", "hostonly", "h/", "h/UPPER", "h/app:bad tag", "h/app@sha256:123", "h/a//b"]
)
def test_bad_registry_specs(rest: str) -> None:
    with pytest.raises(InvalidReferenceError):
        open_source(f"docker://{rest}")
