"""CPU of ranged blob reads through an HTTP proxy: the data path's own client against httpx.

Until the fast client (``imagetool.registry.ranged``) spoke proxies, a read whose URL the
environment sends through ``HTTP(S)_PROXY`` went through httpx. This measures, in one run,
the reading process's CPU seconds per GB and its throughput for the same reads:

* ``direct``: no proxy, the fast client (the reference a node without a proxy gets);
* ``proxy-fast``: through a real proxy (Debian's tinyproxy), the fast client;
* ``proxy-httpx``: through the same proxy, httpx (the fast client turned off), as before.

The registry (Debian's docker-registry) and the proxy are other processes on loopback, so
their CPU is not counted; the reads are 16 MiB ranges (the fetcher's largest) received into
one reused buffer, as the fetcher does.

    python -m benchmarks.fleet.proxyread [--mib 512] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from imagetool.stores.base import StoreOptions
from imagetool.stores.registry import RegistryStore

RANGE = 16 << 20
BLOB = 64 << 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(port: int) -> None:
    for _ in range(300):
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise RuntimeError(f"nothing on port {port}")


@contextmanager
def servers(work: Path) -> Iterator[tuple[str, str]]:
    """(registry host:port, proxy URL), both on loopback, stopped on exit."""
    rport, pport = _port(), _port()
    (work / "registry.yml").write_text(
        f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n"
        f"    rootdirectory: {work / 'data'}\nhttp:\n  addr: 127.0.0.1:{rport}\n"
    )
    (work / "tinyproxy.conf").write_text(
        f"Port {pport}\nListen 127.0.0.1\nTimeout 60\nMaxClients 16\nAllow 127.0.0.1\n"
        f'LogFile "{work / "tinyproxy.log"}"\nLogLevel Warning\nDisableViaHeader Yes\n'
    )
    procs = [
        subprocess.Popen(["docker-registry", "serve", str(work / "registry.yml")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
        subprocess.Popen(["tinyproxy", "-d", "-c", str(work / "tinyproxy.conf")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL),
    ]  # fmt: skip
    try:
        _wait(rport)
        _wait(pport)
        yield f"127.0.0.1:{rport}", f"http://127.0.0.1:{pport}"
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def read_all(host: str, digest: str, total: int, fast: bool) -> tuple[float, float, str]:
    """(CPU seconds, wall seconds, body type) to read ``total`` bytes in 16 MiB ranges."""
    options = StoreOptions(plain_http=True, docker_config=Path("/nonexistent/config.json"))
    buf = memoryview(bytearray(RANGE))
    with RegistryStore(host, "bench/proxy", options) as store:
        if not fast:
            store.client._ranges.disable("benchmark: httpx path")
        kind = ""
        cpu0, t0 = time.process_time(), time.monotonic()
        done = 0
        while done < total:
            offset = done % BLOB
            with store.open_range(digest, offset, RANGE) as body:
                kind = type(body).__name__
                body.readinto(buf)
            done += RANGE
        return time.process_time() - cpu0, time.monotonic() - t0, kind


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="bytes read per case and round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    total = args.mib << 20
    with tempfile.TemporaryDirectory() as tmp, servers(Path(tmp)) as (registry, proxy):
        blob = os.urandom(BLOB)
        digest = "sha256:" + hashlib.sha256(blob).hexdigest()
        options = StoreOptions(plain_http=True, docker_config=Path("/nonexistent/config.json"))
        with RegistryStore(registry, "bench/proxy", options) as store:
            store.put_blob(digest, blob, "application/octet-stream")
        results: dict[str, list[dict[str, float]]] = {}
        for _ in range(args.rounds):
            for case, use_proxy, fast in (("direct", False, True), ("proxy-fast", True, True),
                                          ("proxy-httpx", True, False)):  # fmt: skip
                for name in ("HTTP_PROXY", "http_proxy", "NO_PROXY", "no_proxy"):
                    os.environ.pop(name, None)
                if use_proxy:
                    os.environ["HTTP_PROXY"] = proxy
                cpu, wall, kind = read_all(registry, digest, total, fast)
                gb = total / 1e9
                results.setdefault(case, []).append(
                    {"cpu_s_per_gb": cpu / gb, "mb_per_s": total / 1e6 / wall, "body": kind}
                )
    summary = {
        case: {
            "cpu_s_per_gb": sorted(r["cpu_s_per_gb"] for r in runs)[len(runs) // 2],
            "mb_per_s": sorted(r["mb_per_s"] for r in runs)[len(runs) // 2],
            "body": runs[0]["body"],
            "runs": runs,
        }
        for case, runs in results.items()
    }
    for case, s in summary.items():
        print(
            f"{case:12s} {s['cpu_s_per_gb']:.2f} CPU-s/GB  {s['mb_per_s']:.0f} MB/s  ({s['body']})"
        )
    if args.out:
        args.out.write_text(
            json.dumps({"mib": args.mib, "rounds": args.rounds, **summary}, indent=2)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
