"""A store that hangs or garbles: a real registry behind a TCP proxy that stops answering,
or that corrupts, cuts and delays its answers at random.

The proxy (``support.PausableProxy``) either holds every connection and moves no byte
(``blackhole``: the registry accepts connections and never answers), or lets a response's
headers and a few body bytes through and then nothing (``stall_body``). Through a real mount
(FUSE + erofs): uncached reads fail with EIO within the fetch deadline, cached data keeps
being served, the mount server keeps answering, and once the proxy lets bytes flow again the
same reads return the right bytes. In ``chaos`` mode it garbles the registry's answers at
random; the reads through the mount return the files' bytes or EIO, never other bytes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from itool import imagetool
from mounthelp import drop_caches, with_store_options
from support import PausableProxy, Registry

from snapshotter.config import MountConfig
from snapshotter.mount import api, kernel

pytestmark = [pytest.mark.root, pytest.mark.integration]

DEADLINE = 3.0
# What a read may take beyond the deadline on a loaded machine: the kernel splits one read
# into a few FUSE requests, and the test machine is shared.
SLACK = 7.0


def _status(cfg: MountConfig) -> dict:
    """``snapshotter status --json``, as an operator runs it; must answer promptly."""
    proc = subprocess.run(
        [sys.executable, "-m", "snapshotter.cli", "status", "--json",
         "--state-dir", str(cfg.state_dir), "--cache-dir", str(cfg.cache_dir)],
        capture_output=True, text=True, timeout=30, check=True,
    )  # fmt: skip
    return json.loads(proc.stdout)


def _read_once_back(path: Path, within: float) -> bytes:
    """The file's bytes, retrying reads that fail for up to ``within`` seconds."""
    give_up = time.monotonic() + within
    while True:
        try:
            return path.read_bytes()
        except OSError:
            if time.monotonic() > give_up:
                raise
            time.sleep(0.2)


@contextlib.contextmanager
def _mount_through_proxy(
    registry: Registry, source_layout: Path, config: MountConfig, tmp_path: Path
) -> Iterator[tuple[PausableProxy, Path, MountConfig]]:
    """An image (64 KiB sectors) in the session's registry, mounted through a proxy in
    front of it, with short fetch deadlines."""
    repo = f"lazyblock/hang-{uuid.uuid4().hex[:8]}"
    imagetool("--plain-http", "convert", "-q", "--sector-size", "64KiB",
              f"oci:{source_layout}:v1", f"docker://{registry.host}/{repo}:v1")  # fmt: skip
    cfg = with_store_options(config, plain_http=True, timeout=10.0, retries=1)
    cfg = replace(
        cfg,
        fetch=replace(cfg.fetch, deadline=DEADLINE, request_timeout=1.0, retries=2),
    )
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with PausableProxy(registry.port, seed=11) as proxy:
        api.mount(f"docker://{proxy.host}/{repo}:v1", mnt, cfg)
        try:
            yield proxy, mnt, cfg
        finally:
            proxy.set_mode("pass")  # let the server's requests finish before it is unmounted
            api.unmount(mnt, cfg, lazy=True)


@pytest.fixture
def proxied_mount(
    registry: Registry, umoci_source: tuple[Path, Path], config: MountConfig, tmp_path: Path
) -> Iterator[tuple[PausableProxy, Path, MountConfig]]:
    with _mount_through_proxy(registry, umoci_source[0], config, tmp_path) as mounted:
        yield mounted


@pytest.mark.parametrize("mode", ["blackhole", "stall_body"])
def test_hanging_store_fails_reads_within_the_deadline_then_recovers(
    mode: str, proxied_mount, umoci_source
) -> None:  # noqa: ANN001
    proxy, mnt, cfg = proxied_mount
    source = umoci_source[1]
    want = (source / "data/big.bin").read_bytes()
    hostname = (mnt / "etc/hostname").read_bytes()
    assert hostname == (source / "etc/hostname").read_bytes()
    before = api.stats(mnt, cfg)["fetch"]

    proxy.set_mode(mode)
    try:
        drop_caches()
        # Cached data is served without the store.
        assert (mnt / "etc/hostname").read_bytes() == hostname
        started = time.monotonic()
        with pytest.raises(OSError) as err:
            (mnt / "data/big.bin").read_bytes()
        took = time.monotonic() - started
        assert err.value.errno == errno.EIO
        assert took < DEADLINE + SLACK, f"an uncached read hung for {took:.1f}s"
        assert proxy.held > 0  # the proxy really held the store's answers back

        # The mount server keeps answering while its store hangs, and so do parallel reads.
        results: list[BaseException | bytes] = []

        def read() -> None:
            try:
                results.append((mnt / "data/big.bin").read_bytes())
            except OSError as e:
                results.append(e)

        readers = [threading.Thread(target=read) for _ in range(4)]
        for t in readers:
            t.start()
        status = _status(cfg)
        (m,) = status["mounts"]
        assert m["alive"] and m["stats"]["fetch"]["fetch_errors"] > before["fetch_errors"]
        for t in readers:
            t.join(DEADLINE + SLACK + 5)
            assert not t.is_alive(), "a read hung past its deadline"
        assert all(isinstance(r, OSError) and r.errno == errno.EIO for r in results), results
        assert (mnt / "etc/hostname").read_bytes() == hostname
    finally:
        proxy.set_mode("pass")

    # The store is back: the same reads succeed, with the right bytes. (The first one may
    # still fail while the requests the proxy held drain: for up to the fetcher's
    # timeout_memory, a read of a sector that just timed out waits only briefly.)
    assert _read_once_back(mnt / "data/big.bin", DEADLINE + SLACK) == want
    stats = api.stats(mnt, cfg)
    assert stats["reads"]["errors"] >= 1
    assert stats["fetch"]["sectors_fetched"] > before["sectors_fetched"]


def test_a_store_that_garbles_cuts_and_delays_answers_is_never_served_wrong(
    registry, umoci_source, config, tmp_path
) -> None:  # noqa: ANN001
    # Through a real mount (FUSE + erofs) with a cache of four sectors, so that every pass
    # fetches most of the image again: 4 threads read the largest files and a sample of the
    # rest, three times over, while the proxy flips bytes, cuts connections and holds
    # answers. A read gets the file's bytes or EIO, never other bytes, and never hangs.
    source = umoci_source[1]
    files = sorted(
        p.relative_to(source) for p in source.rglob("*") if p.is_file() and not p.is_symlink()
    )
    want = {rel: (source / rel).read_bytes() for rel in files}
    small = replace(config, cache_size=4 * (64 << 10))
    with _mount_through_proxy(registry, umoci_source[0], small, tmp_path) as (proxy, mnt, cfg):
        outcomes = {"right": 0, "eio": 0}
        wrong: list[str] = []
        unexpected: list[BaseException] = []
        lock = threading.Lock()

        def reader(seed: int) -> None:
            # the largest files and a sample of the rest (thousands of small files)
            biggest = sorted(files, key=lambda rel: len(want[rel]))[-20:]
            order = biggest + random.Random(seed).sample(files, 100)
            random.Random(seed).shuffle(order)
            for rel in order:
                started = time.monotonic()
                try:
                    data = (mnt / rel).read_bytes()
                except OSError as e:
                    with lock:
                        if e.errno == errno.EIO:
                            outcomes["eio"] += 1
                        else:
                            unexpected.append(e)
                    continue
                finally:
                    took = time.monotonic() - started
                    if took > DEADLINE + SLACK:
                        with lock:
                            unexpected.append(TimeoutError(f"{rel}: {took:.1f}s"))
                with lock:
                    outcomes["right"] += 1
                    if data != want[rel]:
                        wrong.append(str(rel))

        proxy.set_mode("chaos")
        try:
            for pass_ in range(3):
                drop_caches()
                threads = [
                    threading.Thread(target=reader, args=(pass_ * 10 + i,)) for i in range(4)
                ]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(300)
                    assert not t.is_alive(), "a reader hung"
        finally:
            proxy.set_mode("pass")
        assert not unexpected, unexpected[:3]
        assert not wrong, f"{len(wrong)} reads returned other bytes than the file's: {wrong[:5]}"
        stats = api.stats(mnt, cfg)
        fetch = stats["fetch"]
        assert all(proxy.injected.values()), proxy.injected
        assert fetch["checksum_errors"] + fetch["store_errors"] > 0, fetch
        assert outcomes["right"] > 0, outcomes

        # The store is well again: every file reads back right.
        drop_caches()
        for rel in files:
            assert _read_once_back(mnt / rel, DEADLINE + SLACK) == want[rel], rel


@pytest.mark.parametrize("how", ["interrupted", "killed"])
def test_a_mount_given_up_on_while_the_store_hangs_is_not_left_behind(
    registry: Registry, umoci_source: tuple[Path, Path], config: MountConfig, tmp_path: Path, how
) -> None:  # noqa: ANN001
    """``snapshotter mount`` waiting on a store that hangs, then given up on: Ctrl-C ends its
    server at once; a requester killed outright (no chance to clean up) leaves a server
    that undoes the mount as soon as it finds nobody waiting for it, once the store is back.
    Neither leaves a mount, a server or a record."""
    repo = f"lazyblock/gone-{uuid.uuid4().hex[:8]}"
    imagetool("--plain-http", "convert", "-q", "--sector-size", "64KiB",
              f"oci:{umoci_source[0]}:v1", f"docker://{registry.host}/{repo}:v1")  # fmt: skip
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    args = ["--state-dir", str(config.state_dir), "--cache-dir", str(config.cache_dir),
            "--set", "store.plain_http=true", "--set", "store.timeout=60"]  # fmt: skip
    with PausableProxy(registry.port) as proxy:
        proxy.set_mode("blackhole")
        cli = subprocess.Popen(
            [sys.executable, "-m", "snapshotter.cli", "mount", f"docker://{proxy.host}/{repo}:v1",
             str(mnt), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        give_up = time.monotonic() + 30
        while not (servers := [m.pid for m in api.list_mounts(config) if m.alive]):
            assert time.monotonic() < give_up and cli.poll() is None, cli.stderr
            time.sleep(0.1)
        (server,) = servers
        assert server != cli.pid  # a server of its own, detached
        if how == "interrupted":
            cli.send_signal(signal.SIGINT)
            assert cli.wait(30) != 0
            assert "interrupted" in cli.stderr.read()
        else:
            cli.kill()
            cli.wait(30)
            time.sleep(1)
            assert api.list_mounts(config)  # still trying, stuck on the store
            proxy.set_mode("pass")  # the store is back: the mount completes, unwanted
        give_up = time.monotonic() + 15  # well before the server's own store timeout
        while api.list_mounts(config) or _alive(server):
            assert time.monotonic() < give_up, "the mount was left behind"
            time.sleep(0.1)
        assert not kernel.is_mountpoint(mnt)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
