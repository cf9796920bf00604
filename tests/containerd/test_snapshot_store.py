"""The snapshot store without gRPC or root: containerd's overlayfs snapshotter rules,
persistence across reopen, filters, and the remote-snapshot bookkeeping (fake mounter)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from snapshotter.containerd.snapshots import (
    Info,
    Kind,
    Mount,
    RemoteInfo,
    SnapshotArgumentError,
    SnapshotExistsError,
    SnapshotNotFoundError,
    SnapshotStateError,
    SnapshotStore,
    parse_filter,
)


class FakeMounter:
    def __init__(self) -> None:
        self.mounted: dict[Path, str] = {}
        self.fail_unmount = False
        self._lock = threading.RLock()

    def mount(self, ref: str, mountpoint: Path) -> None:
        mountpoint.mkdir(parents=True, exist_ok=True)
        self.mounted[mountpoint] = ref

    def unmount(self, mountpoint: Path) -> None:
        if self.fail_unmount:
            raise OSError("busy")
        self.mounted.pop(mountpoint)

    def is_mounted(self, mountpoint: Path) -> bool:
        return mountpoint in self.mounted

    def lock(self, mountpoint: Path) -> threading.RLock:
        return self._lock


@pytest.fixture
def store(tmp_path: Path) -> SnapshotStore:
    s = SnapshotStore(tmp_path / "root", FakeMounter())
    yield s
    s.close()


def _layer(store: SnapshotStore, name: str, parent: str = "") -> Path:
    mounts = store.prepare(f"extract {name}", parent)
    upper = (
        Path([o for o in mounts[0].options if o.startswith("upperdir=")][0][9:])
        if parent
        else Path(mounts[0].source)
    )
    store.commit(name, f"extract {name}")
    return upper


def test_prepare_without_parent_is_a_rw_bind(store: SnapshotStore) -> None:
    (m,) = store.prepare("a")
    assert m.type == "bind" and m.options == ("rw", "rbind")
    assert Path(m.source).is_dir() and Path(m.source).name == "fs"
    assert store.stat("a").kind == Kind.ACTIVE


def test_a_relative_root_gives_containerd_absolute_paths(tmp_path: Path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    store = SnapshotStore(Path("root"), FakeMounter())
    try:
        _layer(store, "l1")
        (m,) = store.prepare("c", "l1")
        opts = dict(o.split("=", 1) for o in m.options if "=" in o)
        paths = [p for key in ("lowerdir", "upperdir", "workdir") for p in opts[key].split(":")]
        assert paths and all(p.startswith(f"{tmp_path}/root/") for p in paths)
        monkeypatch.chdir("/")  # containerd's directory is not the daemon's
        assert all(Path(p).is_dir() for p in paths)
    finally:
        store.close()


def test_overlay_lowerdirs_nearest_first(store: SnapshotStore) -> None:
    _layer(store, "l1")
    _layer(store, "l2", "l1")
    (m,) = store.prepare("c", "l2")
    assert m.type == "overlay"
    opts = dict(o.split("=", 1) for o in m.options if "=" in o)
    lowers = opts["lowerdir"].split(":")
    assert len(lowers) == 2
    assert lowers[0].endswith("/fs") and lowers[0] != lowers[1]
    assert Path(opts["upperdir"]).is_dir() and Path(opts["workdir"]).is_dir()
    assert "index=off" in m.options
    # Mounts answers the same as Prepare did.
    assert store.mounts("c") == [m]


def test_view_rules(store: SnapshotStore) -> None:
    _layer(store, "l1")
    (v,) = store.view("v1", "l1")
    assert v.type == "bind" and "ro" in v.options
    _layer(store, "l2", "l1")
    (v2,) = store.view("v2", "l2")
    assert v2.type == "overlay" and not any(o.startswith("upperdir") for o in v2.options)
    (v0,) = store.view("v0")
    assert v0.type == "bind" and "ro" in v0.options
    with pytest.raises(SnapshotStateError):
        store.commit("x", "v1")


def test_errors(store: SnapshotStore) -> None:
    with pytest.raises(SnapshotNotFoundError):
        store.stat("nope")
    with pytest.raises(SnapshotNotFoundError):
        store.prepare("a", "missing-parent")
    store.prepare("a")
    with pytest.raises(SnapshotExistsError):
        store.prepare("a")
    with pytest.raises(SnapshotArgumentError):
        store.prepare("b", "a")  # parent not committed
    with pytest.raises(SnapshotArgumentError):
        store.prepare("")
    store.commit("A", "a")
    with pytest.raises(SnapshotNotFoundError):
        store.stat("a")
    with pytest.raises(SnapshotStateError):
        store.mounts("A")
    store.prepare("b", "A")
    with pytest.raises(SnapshotExistsError):
        store.commit("A", "b")
    with pytest.raises(SnapshotStateError):
        store.remove("A")  # has a child
    store.remove("b")
    store.remove("A")
    assert store.list() == []


def test_commit_keeps_the_layer_and_merges_labels(store: SnapshotStore) -> None:
    (m,) = store.prepare("a", labels={"x": "1"})
    (Path(m.source) / "hello").write_text("hi")
    store.commit("A", "a", {"y": "2"})
    info = store.stat("A")
    assert info.kind == Kind.COMMITTED and info.labels == {"x": "1", "y": "2"}
    (v,) = store.view("v", "A")
    assert (Path(v.source) / "hello").read_text() == "hi"
    assert store.usage("A").inodes == 1


def test_update_labels_only(store: SnapshotStore) -> None:
    store.prepare("a", labels={"keep": "1", "drop": "2"})
    new = store.update(
        Info("a", "", Kind.ACTIVE, 0, 0, {"add": "3"}), ["labels.add", "labels.drop"]
    )
    assert new.labels == {"keep": "1", "add": "3"}
    new = store.update(Info("a", "", Kind.ACTIVE, 0, 0, {"only": "x"}))
    assert new.labels == {"only": "x"}
    with pytest.raises(SnapshotArgumentError):
        store.update(Info("a", "p", Kind.ACTIVE, 0, 0, {}), ["parent"])


def test_metadata_survives_reopen(tmp_path: Path) -> None:
    s = SnapshotStore(tmp_path / "r")
    _layer(s, "l1")
    s.prepare("c", "l1", {"k": "v"})
    before = {i.name: i for i in s.list()}
    s.close()
    s2 = SnapshotStore(tmp_path / "r")
    after = {i.name: i for i in s2.list()}
    assert after == before
    assert s2.mounts("c")[0].type == "overlay"
    s2.close()


def test_filters(store: SnapshotStore) -> None:
    _layer(store, "sha256:aaa")
    store.prepare("c", "sha256:aaa", {"containerd.io/snapshot.ref": "sha256:ccc", "a b": "x,y"})
    names = lambda *f: sorted(i.name for i in store.list(list(f)))  # noqa: E731
    assert names() == ["c", "sha256:aaa"]
    assert names('labels."containerd.io/snapshot.ref"==sha256:ccc,parent=="sha256:aaa"') == ["c"]
    assert names('labels."containerd.io/snapshot.ref"==sha256:ccc,parent==other') == []
    assert names("kind==committed") == ["sha256:aaa"]
    assert names("kind==committed", "name==c") == ["c", "sha256:aaa"]
    assert names('labels."a b"=="x,y"') == ["c"]
    assert names("name~=^sha") == ["sha256:aaa"]
    assert names('labels."a b"') == ["c"]
    with pytest.raises(SnapshotArgumentError):
        parse_filter("bogus==1")


def test_remote_snapshot_lifecycle(store: SnapshotStore) -> None:
    mounter: FakeMounter = store.mounter  # type: ignore[assignment]
    labels = {"containerd.io/snapshot.ref": "sha256:c1"}
    store.commit_remote("sha256:c1", "", labels, RemoteInfo("docker://h/r@d", "", "blob"))
    mp = store.mountpoint_for("sha256:c2")
    store.commit_remote(
        "sha256:c2", "sha256:c1", {"containerd.io/snapshot.ref": "sha256:c2"},
        RemoteInfo("docker://h/r@d", str(mp), "index"),
        mount=lambda: mounter.mount("docker://h/r@d", mp),
    )  # fmt: skip
    assert mounter.mounted == {mp: "docker://h/r@d"}
    with pytest.raises(SnapshotExistsError):
        store.commit_remote("sha256:c2", "sha256:c1", {}, RemoteInfo("x", str(mp), "index"))
    (m,) = store.prepare("ctr", "sha256:c2")
    lowers = dict(o.split("=", 1) for o in m.options if "=" in o)["lowerdir"].split(":")
    assert lowers[0] == str(mp)
    assert store.usage("sha256:c2").size == 0
    store.remove("ctr")
    store.remove("sha256:c2")
    assert mounter.mounted == {} and not mp.exists()
    store.remove("sha256:c1")


def test_cleanup_releases_orphans(store: SnapshotStore) -> None:
    mounter: FakeMounter = store.mounter  # type: ignore[assignment]
    orphan_dir = store.snapshots_dir / "999"
    (orphan_dir / "fs").mkdir(parents=True)
    orphan_mp = store.mounts_dir / "orphan"
    mounter.mount("ref", orphan_mp)
    store.prepare("kept")
    store.cleanup()
    assert not orphan_dir.exists() and not orphan_mp.exists() and mounter.mounted == {}
    assert store.stat("kept").kind == Kind.ACTIVE


def test_cleanup_beside_prepares_leaves_their_directories(store: SnapshotStore) -> None:
    """containerd may call Cleanup while a Prepare runs (CI saw it remove a Prepare's new
    directory, and the container's overlay mount failed): every prepared snapshot keeps its
    directories, and an orphan made during the run still goes."""
    stop = threading.Event()

    def clean() -> None:
        while not stop.is_set():
            store.cleanup()

    cleaner = threading.Thread(target=clean)
    cleaner.start()
    try:
        for i in range(300):
            (m,) = store.prepare(f"active {i}")
            own = Path(m.source)
            assert own.is_dir(), f"prepare {i}: its directory was removed"
            store.remove(f"active {i}")
        orphan = store.snapshots_dir / "99999"
        (orphan / "fs").mkdir(parents=True)
    finally:
        stop.set()
        cleaner.join()
    store.cleanup()
    assert sorted(p.name for p in store.snapshots_dir.iterdir()) == []


def test_cleanup_during_a_remote_commit_keeps_its_mount(store: SnapshotStore) -> None:
    """A remote commit mounts its image before it writes its row: a Cleanup in between must
    not take that mount for an orphan."""
    mounter: FakeMounter = store.mounter  # type: ignore[assignment]
    mp = store.mountpoint_for("sha256:r1")

    def mount() -> None:
        mounter.mount("docker://h/r@d", mp)
        store.cleanup()

    store.commit_remote("sha256:r1", "", {}, RemoteInfo("docker://h/r@d", str(mp), "blob"), mount)
    assert mounter.mounted == {mp: "docker://h/r@d"} and mp.is_dir()
    store.cleanup()
    assert mounter.mounted == {mp: "docker://h/r@d"}
    store.remove("sha256:r1")
    assert mounter.mounted == {}


def test_mount_value_objects() -> None:
    assert Mount("bind", "/x", ("ro",)) == Mount("bind", "/x", ("ro",))
