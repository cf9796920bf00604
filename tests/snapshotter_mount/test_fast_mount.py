"""What makes a mount fast, tested for behaviour: servers forked from the fork server, the
node's index cache, and the data blob's size checked alongside the metadata fetch."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
from itool import snapshot

from imagetool.image import open_image
from snapshotter.mount import api, forkserver, kernel

pytestmark = [pytest.mark.root, pytest.mark.integration]


def _proc_status(pid: int, field: str) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def test_forked_server_serves_the_mount_in_the_callers_context(
    config, umoci_source, umoci_dir_ref, tmp_path
) -> None:  # noqa: ANN001
    assert forkserver.ensure_running(timeout=120)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    old = os.umask(0o027)
    try:
        info = api.mount(umoci_dir_ref, mnt, config)
    finally:
        os.umask(old)
    stats = api.stats(mnt, config)
    assert stats["launch"] == "fork"
    assert int(_proc_status(info.pid, "PPid")) != os.getpid()  # the fork server's child
    assert _proc_status(info.pid, "Umask") == "0027"  # the caller's, not the fork server's
    assert os.getsid(info.pid) == info.pid  # its own session, like a started server
    assert snapshot(mnt) == snapshot(umoci_source[1])

    api.unmount(mnt, config)
    assert not kernel.is_mountpoint(mnt) and api.list_mounts(config) == []


def test_mount_without_the_fork_server(config, umoci_source, umoci_dir_ref, tmp_path) -> None:  # noqa: ANN001
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    info = api.mount(umoci_dir_ref, mnt, config, fork_server=False)
    assert api.stats(mnt, config)["launch"] == "exec"
    assert int(_proc_status(info.pid, "PPid")) == os.getpid()
    assert snapshot(mnt) == snapshot(umoci_source[1])


def test_remount_takes_the_index_from_the_cache_and_checks_it(
    config, umoci_source, umoci_dir_ref, tmp_path
) -> None:  # noqa: ANN001
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    info = api.mount(umoci_dir_ref, mnt, config)
    assert api.stats(mnt, config)["index_cached"] is False
    api.unmount(mnt, config)
    cached = config.cache_dir / "indexes" / info.index_digest.replace(":", "-")
    good = cached.read_bytes()

    api.mount(umoci_dir_ref, mnt, config)
    assert api.stats(mnt, config)["index_cached"] is True
    assert snapshot(mnt) == snapshot(umoci_source[1])
    api.unmount(mnt, config)

    # A damaged copy is not used: the index comes from the store again and is re-cached.
    cached.write_bytes(b" " + good)
    api.mount(umoci_dir_ref, mnt, config)
    assert api.stats(mnt, config)["index_cached"] is False
    assert snapshot(mnt) == snapshot(umoci_source[1])
    assert cached.read_bytes() == good


def test_data_blob_of_the_wrong_size_fails_the_mount(config, umoci_source, tmp_path) -> None:  # noqa: ANN001
    import mountimages as images

    store = tmp_path / "store"
    ref = str(store / "app:v1")
    images.convert(umoci_source[0], "v1", ref, "--sector-size", "64KiB")
    with open_image(ref) as img:
        index = img.index
    blob = store / "blobs" / "sha256" / index.blobs[-1].digest.removeprefix("sha256:")
    os.chmod(blob, 0o644)
    with open(blob, "ab") as f:
        f.write(b"extra")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with pytest.raises(api.MountError, match="the index says"):
        api.mount(ref, mnt, replace(config, mount_timeout=30))
    assert not kernel.is_mountpoint(mnt) and api.list_mounts(config) == []


def test_fork_server_serves_only_its_own_uid(tmp_path) -> None:  # noqa: ANN001
    import subprocess
    import sys

    assert forkserver.ensure_running(timeout=120)
    client = (
        "import array, json, os, socket, sys\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n"
        "s.connect(bytes.fromhex(sys.argv[1]))\n"
        "r, w = os.pipe()\n"
        "fds = array.array('i', [w, w])\n"
        "s.sendmsg([b'{}'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])\n"
        "print(s.recv(65536).decode())\n"
    )
    name = forkserver.socket_name(forkserver.context_key()).hex()
    # An interpreter user "nobody" may run (this one may live under /root).
    for python in (sys.executable, "/usr/bin/python3"):
        try:
            proc = subprocess.run(
                [python, "-I", "-c", client, name], capture_output=True, text=True,
                user=65534, group=65534, cwd="/", check=True, timeout=60,
            )  # fmt: skip
            break
        except PermissionError:
            continue
    answer = json.loads(proc.stdout)
    assert "pid" not in answer and "uid 65534" in answer["error"]


_FORK_SELF = """
import json, os, sys, threading
from pathlib import Path
from snapshotter.mount import api
from snapshotter.config import MountConfig
cfg = MountConfig.from_dict(json.loads(sys.argv[1]))
if sys.argv[4] == "threads":
    threading.Thread(target=threading.Event().wait, daemon=True).start()
try:
    info = api.mount(sys.argv[2], Path(sys.argv[3]), cfg, fork_server=False, fork_self=True)
    out = {"pid": info.pid, "launch": api.stats(info.mountpoint, cfg)["launch"]}
except api.MountError as e:
    out = {"error": str(e)}
try:  # every child of ours is reaped (a failed server too), or still serving
    out["unreaped"] = os.waitpid(-1, os.WNOHANG)[0] != 0
except ChildProcessError:
    out["unreaped"] = False
print(json.dumps(out))
"""


def _mount_forking_self(config, ref: str, mnt: Path, threads: bool = False) -> dict:  # noqa: ANN001
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _FORK_SELF, json.dumps(config.to_dict()), ref, str(mnt),
         "threads" if threads else "-"],
        capture_output=True, text=True, check=True, timeout=120,
    )  # fmt: skip
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.parametrize("threads", [False, True], ids=["single-threaded", "with-threads"])
def test_a_caller_without_a_fork_server_forks_itself_into_the_server(
    threads, config, umoci_source, umoci_dir_ref, tmp_path
) -> None:  # noqa: ANN001
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = _mount_forking_self(config, umoci_dir_ref, mnt, threads)
    # A caller with threads must not fork: it starts a new interpreter instead.
    assert out["launch"] == ("exec" if threads else "self")
    assert os.getsid(out["pid"]) == out["pid"]  # detached: its own session
    assert (config.state_dir / "mounts").exists() and api.list_mounts(config)[0].alive
    assert snapshot(mnt) == snapshot(umoci_source[1])
    api.unmount(mnt, config)
    assert not kernel.is_mountpoint(mnt) and api.list_mounts(config) == []


def test_a_server_forked_from_its_caller_that_fails_is_reaped_and_leaves_nothing(
    config, tmp_path
) -> None:  # noqa: ANN001
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    out = _mount_forking_self(config, str(tmp_path / "nostore" / "img:v1"), mnt)
    assert "cannot mount" in out["error"] and "\n" not in out["error"]
    assert out["unreaped"] is False
    assert not kernel.is_mountpoint(mnt) and api.list_mounts(config) == []
