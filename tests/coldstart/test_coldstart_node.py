"""The benchmark node's pure parts: containerd's config for each node path and the hand-encoded
CRI PullImage request (checked against protobuf's own wire format). No root."""

from __future__ import annotations

import tomllib
from pathlib import Path

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from benchmarks.coldstart import node


def test_config_ctr_only_disables_cri(tmp_path: Path) -> None:
    doc = tomllib.loads(node.containerd_config(tmp_path, "10.0.0.2:5000", None, None))
    assert doc["disabled_plugins"] == ["io.containerd.grpc.v1.cri"]
    assert doc["root"] == str(tmp_path / "root")
    assert doc["grpc"]["address"] == str(tmp_path / "containerd.sock")
    assert "proxy_plugins" not in doc and "plugins" not in doc


def test_config_cri_with_the_proxy_snapshotter(tmp_path: Path) -> None:
    sock = tmp_path / "snap.sock"
    doc = tomllib.loads(node.containerd_config(tmp_path, "10.0.0.2:5000", "lazyblock", sock))
    assert "disabled_plugins" not in doc
    assert doc["proxy_plugins"]["lazyblock"] == {"type": "snapshot", "address": str(sock)}
    cri = doc["plugins"]["io.containerd.grpc.v1.cri"]
    assert cri["containerd"]["snapshotter"] == "lazyblock"
    # the remote-snapshot handshake needs the image labels on every Prepare
    assert cri["containerd"]["disable_snapshot_annotations"] is False
    assert cri["registry"]["mirrors"]["10.0.0.2:5000"]["endpoint"] == ["http://10.0.0.2:5000"]


def test_config_cri_with_overlayfs_has_no_proxy(tmp_path: Path) -> None:
    doc = tomllib.loads(node.containerd_config(tmp_path, "r:5000", "overlayfs", None))
    assert "proxy_plugins" not in doc
    assert doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["snapshotter"] == "overlayfs"


def _cri_messages() -> tuple[type, type]:
    """PullImageRequest / PullImageResponse as CRI's api.proto declares them (the fields
    the benchmark uses), built with protobuf at run time."""
    f = descriptor_pb2.FileDescriptorProto(name="cri_test.proto", package="runtime.v1",
                                           syntax="proto3")  # fmt: skip
    spec = f.message_type.add(name="ImageSpec")
    spec.field.add(name="image", number=1, type=9, label=1)
    req = f.message_type.add(name="PullImageRequest")
    req.field.add(name="image", number=1, type=11, label=1, type_name=".runtime.v1.ImageSpec")
    resp = f.message_type.add(name="PullImageResponse")
    resp.field.add(name="image_ref", number=1, type=9, label=1)
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    get = message_factory.GetMessageClass
    return (get(pool.FindMessageTypeByName("runtime.v1.PullImageRequest")),
            get(pool.FindMessageTypeByName("runtime.v1.PullImageResponse")))  # fmt: skip


def test_pull_request_is_a_cri_pull_image_request() -> None:
    request, response = _cri_messages()
    image = "10.213.77.2:5000/lazybench/block:ml-512m-profile" + "x" * 200  # 2-byte lengths
    parsed = request.FromString(node.pull_request(image))
    assert parsed.image.image == image
    reply = response(image_ref="sha256:" + "ab" * 32).SerializeToString()
    assert node.string_field(reply, 1) == "sha256:" + "ab" * 32
    assert node.string_field(b"", 1) == ""
