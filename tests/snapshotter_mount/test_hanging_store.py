"""A store that hangs: a real registry behind a TCP proxy that stops answering.

The proxy (``support.PausableProxy``) either holds every connection and moves no byte
(``blackhole``: the registry accepts connections and never answers), or lets a response's
headers and a few body bytes through and then nothing (``stall_body``). Through a real mount
(FUSE + erofs): uncached reads fail with EIO within the fetch deadline, cached data keeps
being served, the mount server keeps answering, and once the proxy lets bytes flow again the
same reads return the right bytes.
"""

from __future__ import annotations

import errno
import json
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

from snapshotter import mount as api
from snapshotter.config import MountConfig

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


@pytest.fixture
def proxied_mount(
    registry: Registry, umoci_source: tuple[Path, Path], config: MountConfig, tmp_path: Path
) -> Iterator[tuple[PausableProxy, Path, MountConfig]]:
    """An image in the session's registry, mounted through a proxy in front of it."""
    repo = f"lazyblock/hang-{uuid.uuid4().hex[:8]}"
    imagetool("--plain-http", "convert", "-q", "--sector-size", "64KiB",
              f"oci:{umoci_source[0]}:v1", f"docker://{registry.host}/{repo}:v1")  # fmt: skip
    cfg = with_store_options(config, plain_http=True, timeout=10.0, retries=1)
    cfg = replace(
        cfg,
        fetch=replace(cfg.fetch, deadline=DEADLINE, request_timeout=1.0, retries=2),
    )
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    with PausableProxy(registry.port) as proxy:
        api.mount(f"docker://{proxy.host}/{repo}:v1", mnt, cfg)
        try:
            yield proxy, mnt, cfg
        finally:
            proxy.set_mode("pass")  # let the server's requests finish before it is unmounted
            api.unmount(mnt, cfg, lazy=True)


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
