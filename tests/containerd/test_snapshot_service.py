"""The gRPC service over a real unix socket with grpc's client: every method, the status
codes, and the remote-snapshot handshake as containerd performs it (fake mounter, fake
manifests: no root, no registry)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from google.protobuf.field_mask_pb2 import FieldMask
from test_snapshot_store import FakeMounter

from imagetool.format import ANNOTATION_ROLE, BLOB_MEDIA_TYPE, INDEX_MEDIA_TYPE
from imagetool.stores.refs import split_image_ref
from snapshotter.containerd.handshake import RemoteLayers
from snapshotter.containerd.layers import (
    LABEL_CRI_IMAGE_REF,
    LABEL_CRI_LAYER_DIGEST,
    LABEL_CRI_MANIFEST_DIGEST,
    LABEL_REMOTE,
    LABEL_TARGET_REF,
    LayerResolver,
)
from snapshotter.containerd.proto import load
from snapshotter.containerd.service import start_server
from snapshotter.containerd.snapshots import SnapshotStore

_, pb, pb_grpc = load()

BLOB = "sha256:" + "b" * 64
INDEX = "sha256:" + "1" * 64
ORDINARY = "sha256:" + "0" * 64
MANIFEST = "sha256:" + "m" * 64
PLAIN_MANIFEST = "sha256:" + "p" * 64
MANIFESTS = {
    MANIFEST: {
        "layers": [
            {
                "mediaType": BLOB_MEDIA_TYPE,
                "digest": BLOB,
                "annotations": {ANNOTATION_ROLE: "blob"},
            },
            {"mediaType": INDEX_MEDIA_TYPE, "digest": INDEX},
        ]
    },
    PLAIN_MANIFEST: {
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": ORDINARY}]
    },
}


class Daemon:
    def __init__(self, tmp: Path) -> None:
        self.fetches: list[tuple[str, str, str]] = []
        self.mounter = FakeMounter()

        def fetch(host: str, repo: str, digest: str) -> dict:
            self.fetches.append((host, repo, digest))
            return MANIFESTS[digest]

        self.remote = RemoteLayers(LayerResolver(fetch), self.mounter)
        self.store = SnapshotStore(tmp / "root", self.mounter)
        self.remote.attach(self.store)
        self.address = tmp / "sn.sock"
        self.server = start_server(self.address, self.store, self.remote, workers=4)
        self.channel = grpc.insecure_channel(f"unix://{self.address}")
        self.stub = pb_grpc.SnapshotsStub(self.channel)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(None).wait()
        self.store.close()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[Daemon]:
    d = Daemon(tmp_path)
    try:
        yield d
    finally:
        d.close()


def code_of(call) -> grpc.StatusCode:  # noqa: ANN001
    with pytest.raises(grpc.RpcError) as e:
        call()
    return e.value.code()


def test_ordinary_layers_and_container(daemon: Daemon) -> None:
    s = daemon.stub
    r = s.Prepare(pb.PrepareSnapshotRequest(key="ns/1/extract a", labels={"x": "1"}))
    assert r.mounts[0].type == "bind"
    s.Commit(pb.CommitSnapshotRequest(name="ns/2/sha256:l1", key="ns/1/extract a"))
    r = s.Prepare(pb.PrepareSnapshotRequest(key="ns/3/ctr", parent="ns/2/sha256:l1"))
    assert r.mounts[0].type == "overlay"
    assert s.Mounts(pb.MountsRequest(key="ns/3/ctr")).mounts == r.mounts
    v = s.View(pb.ViewSnapshotRequest(key="ns/4/view", parent="ns/2/sha256:l1"))
    assert v.mounts[0].type == "bind" and "ro" in v.mounts[0].options
    info = s.Stat(pb.StatSnapshotRequest(key="ns/2/sha256:l1")).info
    assert info.kind == pb.COMMITTED and info.labels == {"x": "1"}
    assert info.created_at.seconds > 0
    names = {i.name for resp in s.List(pb.ListSnapshotsRequest()) for i in resp.info}
    assert names == {"ns/2/sha256:l1", "ns/3/ctr", "ns/4/view"}
    upd = s.Update(
        pb.UpdateSnapshotRequest(
            info=pb.Info(name="ns/3/ctr", labels={"a": "b"}),
            update_mask=FieldMask(paths=["labels.a"]),
        )
    )
    assert upd.info.labels == {"a": "b"}
    assert s.Usage(pb.UsageRequest(key="ns/2/sha256:l1")).inodes == 0
    s.Cleanup(pb.CleanupRequest())
    for key in ("ns/3/ctr", "ns/4/view", "ns/2/sha256:l1"):
        s.Remove(pb.RemoveSnapshotRequest(key=key))
    assert [r.info for r in s.List(pb.ListSnapshotsRequest())] in ([], [[]])


def test_status_codes(daemon: Daemon) -> None:
    s = daemon.stub
    C = grpc.StatusCode
    assert code_of(lambda: s.Stat(pb.StatSnapshotRequest(key="nope"))) == C.NOT_FOUND
    s.Prepare(pb.PrepareSnapshotRequest(key="a"))
    assert code_of(lambda: s.Prepare(pb.PrepareSnapshotRequest(key="a"))) == C.ALREADY_EXISTS
    assert code_of(lambda: s.Prepare(pb.PrepareSnapshotRequest(key=""))) == C.INVALID_ARGUMENT
    s.Commit(pb.CommitSnapshotRequest(name="A", key="a"))
    s.Prepare(pb.PrepareSnapshotRequest(key="b", parent="A"))
    assert code_of(lambda: s.Remove(pb.RemoveSnapshotRequest(key="A"))) == C.FAILED_PRECONDITION
    assert code_of(lambda: s.Mounts(pb.MountsRequest(key="A"))) == C.FAILED_PRECONDITION
    bad = pb.ListSnapshotsRequest(filters=["what==ever"])
    assert code_of(lambda: list(s.List(bad))) == C.INVALID_ARGUMENT


def _cri_labels(chain: str, layer: str, manifest: str = MANIFEST) -> dict[str, str]:
    return {
        LABEL_TARGET_REF: chain,
        LABEL_CRI_IMAGE_REF: "127.0.0.1:5000/team/app:v1",
        LABEL_CRI_MANIFEST_DIGEST: manifest,
        LABEL_CRI_LAYER_DIGEST: layer,
        "containerd.io/snapshot/cri.image-layers": f"{BLOB},{INDEX}",
    }


def _handshake(s, key: str, parent: str, labels: dict[str, str]) -> str:  # noqa: ANN001
    """What containerd's metadata snapshotter does on ALREADY_EXISTS: find the target."""
    target = labels[LABEL_TARGET_REF]
    code = code_of(
        lambda: s.Prepare(pb.PrepareSnapshotRequest(key=key, parent=parent, labels=labels))
    )
    assert code == grpc.StatusCode.ALREADY_EXISTS
    flt = f'labels."{LABEL_TARGET_REF}"=={target},parent=="{parent}"'
    found = [i for r in s.List(pb.ListSnapshotsRequest(filters=[flt])) for i in r.info]
    assert len(found) == 1 and found[0].kind == pb.COMMITTED
    assert found[0].labels[LABEL_REMOTE] == "remote"
    assert found[0].labels[LABEL_TARGET_REF] == target
    return found[0].name


def test_remote_snapshot_handshake(daemon: Daemon) -> None:
    s = daemon.stub
    c1, c2 = "sha256:" + "c" * 64, "sha256:" + "d" * 64
    n1 = _handshake(s, "k8s.io/1/extract-1 " + c1, "", _cri_labels(c1, BLOB))
    assert daemon.mounter.mounted == {}  # the blob layer holds no files of its own
    n2 = _handshake(s, "k8s.io/2/extract-2 " + c2, n1, _cri_labels(c2, INDEX))
    ((mountpoint, ref),) = daemon.mounter.mounted.items()
    assert ref == f"docker://127.0.0.1:5000/team/app@{MANIFEST}"
    assert daemon.fetches == [("127.0.0.1:5000", "team/app", MANIFEST)]  # fetched once
    # A second pull (another namespace) finds the same snapshots.
    assert _handshake(s, "default/9/extract-3 " + c2, n1, _cri_labels(c2, INDEX)) == n2
    # The container: an overlay over the lazily mounted tree.
    r = s.Prepare(pb.PrepareSnapshotRequest(key="k8s.io/3/ctr", parent=n2))
    opts = dict(o.split("=", 1) for o in r.mounts[0].options if "=" in o)
    assert opts["lowerdir"].split(":")[0] == str(mountpoint)
    # Removing the container, then the image's snapshots, frees the mount.
    s.Remove(pb.RemoveSnapshotRequest(key="k8s.io/3/ctr"))
    s.Remove(pb.RemoveSnapshotRequest(key=n2))
    s.Remove(pb.RemoveSnapshotRequest(key=n1))
    assert daemon.mounter.mounted == {}


def test_lost_remote_mounts_are_remounted(daemon: Daemon) -> None:
    s = daemon.stub
    c1, c2 = "sha256:" + "c" * 64, "sha256:" + "d" * 64
    n1 = _handshake(s, "k8s.io/1/extract-1 " + c1, "", _cri_labels(c1, BLOB))
    n2 = _handshake(s, "k8s.io/2/extract-2 " + c2, n1, _cri_labels(c2, INDEX))
    ((mountpoint, ref),) = daemon.mounter.mounted.items()
    # The mount server died: the periodic check (and a daemon start) remounts it ...
    daemon.mounter.mounted.clear()
    assert daemon.remote.restore() == 1
    assert daemon.mounter.mounted == {mountpoint: ref}
    assert daemon.remote.restore() == 0  # alive mounts are left alone
    # ... and so does a Prepare, View or Mounts whose chain holds it, before answering.
    daemon.mounter.mounted.clear()
    s.Prepare(pb.PrepareSnapshotRequest(key="k8s.io/3/ctr", parent=n2))
    assert daemon.mounter.mounted == {mountpoint: ref}
    daemon.mounter.mounted.clear()
    s.Mounts(pb.MountsRequest(key="k8s.io/3/ctr"))
    assert daemon.mounter.mounted == {mountpoint: ref}
    daemon.mounter.mounted.clear()
    s.View(pb.ViewSnapshotRequest(key="k8s.io/4/view", parent=n2))
    assert daemon.mounter.mounted == {mountpoint: ref}
    # A removed snapshot is not remounted.
    for key in ("k8s.io/3/ctr", "k8s.io/4/view", n2):
        s.Remove(pb.RemoveSnapshotRequest(key=key))
    assert daemon.mounter.mounted == {}
    assert daemon.remote.restore() == 0 and daemon.mounter.mounted == {}


def test_ordinary_layer_with_cri_labels_unpacks_normally(daemon: Daemon) -> None:
    labels = _cri_labels("sha256:" + "e" * 64, ORDINARY, PLAIN_MANIFEST)
    r = daemon.stub.Prepare(pb.PrepareSnapshotRequest(key="k/1/extract", labels=labels))
    assert r.mounts[0].type == "bind"
    # No CRI labels at all (ctr image pull): no registry round trip.
    daemon.stub.Prepare(
        pb.PrepareSnapshotRequest(key="k/2/extract", labels={LABEL_TARGET_REF: "x"})
    )
    assert len(daemon.fetches) == 1


@pytest.mark.parametrize(
    ("ref", "expected"),
    [
        ("127.0.0.1:5000/team/app:v1", ("127.0.0.1:5000", "team/app")),
        ("docker.io/library/busybox:latest", ("registry-1.docker.io", "library/busybox")),
        ("busybox", ("registry-1.docker.io", "library/busybox")),
        ("ghcr.io/o/r@sha256:" + "a" * 64, ("ghcr.io", "o/r")),
        ("localhost/x:1", ("localhost", "x")),
    ],
)
def test_split_image_ref(ref: str, expected: tuple[str, str]) -> None:
    assert split_image_ref(ref) == expected
