"""``snapshotter pull``'s reading of image names and its snapshot names (no containerd)."""

from __future__ import annotations

import hashlib

import pytest

from imagetool.errors import InvalidReferenceError
from snapshotter.containerd.pull import ImageName, _chain_ids
from snapshotter.errors import PullError

D1, D2, D3 = (f"sha256:{c * 64}" for c in "abc")


@pytest.mark.parametrize(
    ("text", "name", "host", "repository", "reference"),
    [
        ("127.0.0.1:5000/lazy/app:v1", "127.0.0.1:5000/lazy/app:v1", "127.0.0.1:5000",
         "lazy/app", "v1"),
        ("127.0.0.1:5000/app", "127.0.0.1:5000/app:latest", "127.0.0.1:5000", "app", "latest"),
        (f"reg.example/team/app@{D1}", f"reg.example/team/app@{D1}", "reg.example", "team/app",
         D1),
        ("busybox", "docker.io/library/busybox:latest", "registry-1.docker.io",
         "library/busybox", "latest"),
        ("user/app:1.0", "docker.io/user/app:1.0", "registry-1.docker.io", "user/app", "1.0"),
        ("localhost/app:x", "localhost/app:x", "localhost", "app", "x"),
    ],
)  # fmt: skip
def test_names_as_containerd_records_them(
    text: str, name: str, host: str, repository: str, reference: str
) -> None:
    assert ImageName.parse(text) == ImageName(name, host, repository, reference)


@pytest.mark.parametrize("text", ["", "Host/App:v1", "reg.example/app:bad tag", "s3://b/app"])
def test_bad_names_are_refused(text: str) -> None:
    with pytest.raises((InvalidReferenceError, PullError)):
        ImageName.parse(text)


def test_chain_ids_are_containerds() -> None:
    """identity.ChainID: the first diff ID, then sha256("<previous chain ID> <diff ID>")."""
    second = "sha256:" + hashlib.sha256(f"{D1} {D2}".encode()).hexdigest()
    third = "sha256:" + hashlib.sha256(f"{second} {D3}".encode()).hexdigest()
    config = {"rootfs": {"type": "layers", "diff_ids": [D1, D2, D3]}}
    assert _chain_ids(config, 3, "img") == [D1, second, third]
    with pytest.raises(PullError, match="diff_ids do not match its 2 layers"):
        _chain_ids(config, 2, "img")
