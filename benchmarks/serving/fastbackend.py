"""Lean emulated vLLM backends for the live benchmark: many ports, one process, raw asyncio.

``serving.fakebackend`` (aiohttp) spends ~0.3 ms of CPU per request, so on a small machine the
backends, not the proxy under test, would set the ceiling. These answer
``POST /v1/completions`` after a service time drawn from a lognormal (or constant)
distribution, with a fixed JSON body, keep-alive, and nothing else costly. ``GET /admin/stats``
gives the request count of the port, ``GET /metrics`` vLLM's running/waiting gauges (the
router scrapes them). Each port counts as one backend.

    python benchmarks/serving/fastbackend.py --ports 9001,9002 --service-ms 2 --dist lognormal
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from serving.errors import ProtocolError  # noqa: E402
from serving.wire.http1 import parse_request_head  # noqa: E402

ANSWER = json.dumps(
    {
        "id": "cmpl-bench",
        "object": "text_completion",
        "model": "m",
        "choices": [{"index": 0, "text": "ok ok ok ok ok ok ok ok", "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 8, "total_tokens": 18},
    }
).encode()


def response(body: bytes, ctype: bytes = b"application/json", status: bytes = b"200 OK") -> bytes:
    return b"HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s" % (
        status,
        ctype,
        len(body),
        body,
    )


OK = response(ANSWER)


class Port:
    def __init__(self, draw) -> None:
        self.draw = draw
        self.requests = 0
        self.inflight = 0


class Conn(asyncio.Protocol):
    def __init__(self, port: Port) -> None:
        self.port = port
        self.buf = b""
        self.transport = None
        self.need = 0  # body bytes still to read
        self.loop = asyncio.get_running_loop()

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            try:
                h = parse_request_head(self.buf[:end])
            except ProtocolError:
                self.transport.close()
                return
            total = end + 4 + (h.length or 0)
            if len(self.buf) < total:
                return
            self.buf = self.buf[total:]
            self.handle(h)

    def handle(self, h) -> None:
        path = h.path
        port = self.port
        if path.startswith(b"/v1/"):
            port.requests += 1
            port.inflight += 1
            self.loop.call_later(port.draw(), self.answer)
        elif path == b"/admin/stats":
            body = json.dumps({"requests": port.requests, "inflight": port.inflight}).encode()
            self.transport.write(response(body))
        elif path == b"/metrics":
            body = b"vllm:num_requests_running %d\nvllm:num_requests_waiting 0\n" % port.inflight
            self.transport.write(response(body, b"text/plain"))
        else:
            self.transport.write(response(b"not found", b"text/plain", b"404 Not Found"))

    def answer(self) -> None:
        self.port.inflight -= 1
        if not self.transport.is_closing():
            self.transport.write(OK)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ports", required=True, help="comma-separated ports on 127.0.0.1")
    ap.add_argument("--service-ms", type=float, default=2.0)
    ap.add_argument("--dist", choices=["const", "lognormal"], default="lognormal")
    ap.add_argument("--sigma", type=float, default=0.5)
    a = ap.parse_args()
    mean = a.service_ms / 1000
    rng = random.Random()
    if a.dist == "const":

        def draw():
            return mean

    else:
        mu = math.log(mean) - a.sigma * a.sigma / 2

        def draw():
            return rng.lognormvariate(mu, a.sigma)

    import uvloop

    async def run() -> None:
        loop = asyncio.get_running_loop()
        servers = []
        for p in a.ports.split(","):
            port = Port(draw)
            servers.append(
                await loop.create_server(lambda port=port: Conn(port), "127.0.0.1", int(p))
            )
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        for s in servers:
            s.close()

    uvloop.run(run())


if __name__ == "__main__":
    main()
