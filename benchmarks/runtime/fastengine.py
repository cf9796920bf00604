"""A lean stand-in for vLLM behind ``runtime serve``: ``fastbackend``'s raw-asyncio server plus
``/health``, on one port, so the front's own cost is what a benchmark sees.

    python benchmarks/runtime/fastengine.py --port 8100 --service-ms 2 --dist const
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "serving"))

import fastbackend as fb  # noqa: E402

HEALTHY = fb.response(b"", b"text/plain")


class Conn(fb.Conn):
    def handle(self, h) -> None:
        if h.path == b"/health":
            self.transport.write(HEALTHY)
        else:
            super().handle(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--service-ms", type=float, default=2.0)
    ap.add_argument("--dist", choices=["const", "lognormal"], default="const")
    ap.add_argument("--sigma", type=float, default=0.5)
    a = ap.parse_args()
    mean = a.service_ms / 1000
    rng = random.Random()
    mu = math.log(mean) - a.sigma * a.sigma / 2 if mean > 0 else 0.0

    def draw() -> float:
        return mean if a.dist == "const" else rng.lognormvariate(mu, a.sigma)

    import uvloop

    async def run() -> None:
        loop = asyncio.get_running_loop()
        port = fb.Port(draw)
        server = await loop.create_server(lambda: Conn(port), a.host, a.port)
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        server.close()

    uvloop.run(run())


if __name__ == "__main__":
    main()
