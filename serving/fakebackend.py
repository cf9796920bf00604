"""An emulated vLLM OpenAI server for tests, benchmarks and ``serving up`` without a GPU.

It speaks the parts of vLLM's API the serving stack relies on:

* ``POST /v1/completions`` and ``/v1/chat/completions`` (``"stream": true`` gives server-sent
  events, one chunk per token, then ``data: [DONE]``), answering after a service time drawn
  from a distribution (constant, exponential or lognormal) and optionally a per-token delay;
* ``GET /metrics`` with ``vllm:num_requests_running`` and ``vllm:num_requests_waiting``
  (``max_running`` requests run at once; the rest wait, as in vLLM's scheduler),
  ``vllm:request_success_total`` and the ``vllm:request_inference_time_seconds`` histogram
  (time running, queueing excluded: what the autoscaler's demand estimate needs);
* ``GET /health`` (503 until ``startup_s`` has passed, like vLLM before warm-up ends);
* graceful drain on SIGTERM (stop accepting, finish in-flight requests);
* ``POST /admin/fail`` ``{"status": 500, "count": 3}`` makes the next requests fail, and
  ``GET /admin/stats`` returns request counters (test helpers, not part of vLLM).

Every response carries ``x-backend: <name>`` so tests can see who served it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import random
import time
from dataclasses import dataclass

from aiohttp import web

log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class BackendConfig:
    name: str = "backend"
    model: str = "fake-model"
    #: mean service time of a request, seconds
    service_s: float = 0.01
    #: "const", "exp" or "lognormal"
    dist: str = "const"
    #: lognormal shape (sigma of the underlying normal)
    sigma: float = 0.5
    #: multiplies every service time (a slow pod has slowdown > 1)
    slowdown: float = 1.0
    #: concurrent requests processed at once; the rest wait
    max_running: int = 256
    #: tokens per answer (stream chunks)
    tokens: int = 8
    #: /health answers 503 for this long after start
    startup_s: float = 0.0
    seed: int | None = None


def draw(cfg: BackendConfig, rng: random.Random) -> float:
    m = cfg.service_s * cfg.slowdown
    if m <= 0:
        return 0.0
    if cfg.dist == "exp":
        return rng.expovariate(1.0 / m)
    if cfg.dist == "lognormal":
        s = cfg.sigma
        return rng.lognormvariate(math.log(m) - s * s / 2, s)
    return m


def make_backend_app(cfg: BackendConfig) -> web.Application:
    rng = random.Random(cfg.seed)
    sem = asyncio.Semaphore(cfg.max_running)
    state = {"inflight": 0, "running": 0, "requests": 0, "fail_status": 0, "fail_count": 0}
    #: finished requests and their total time running (vllm:request_inference_time_seconds)
    served = {"count": 0, "seconds": 0.0}
    started = time.monotonic()
    headers = {"x-backend": cfg.name}

    async def complete(request: web.Request) -> web.StreamResponse:
        state["requests"] += 1
        body = await request.read()
        if state["fail_count"] > 0:
            state["fail_count"] -= 1
            return web.Response(
                status=state["fail_status"], text="injected failure", headers=headers
            )
        try:
            req = json.loads(body) if body else {}
        except ValueError:
            return web.json_response({"error": "bad json"}, status=400, headers=headers)
        chat = request.path.endswith("/chat/completions")
        state["inflight"] += 1
        try:
            async with sem:
                state["running"] += 1
                t0 = time.monotonic()
                try:
                    t = draw(cfg, rng)
                    if req.get("stream"):
                        resp = await _stream(request, req, chat, t)
                    else:
                        if t > 0:
                            await asyncio.sleep(t)
                        resp = web.json_response(_answer(req, chat), headers=headers)
                    served["count"] += 1
                    served["seconds"] += time.monotonic() - t0
                    return resp
                finally:
                    state["running"] -= 1
        finally:
            state["inflight"] -= 1

    def _answer(req: dict, chat: bool) -> dict:
        text = " ".join(["ok"] * cfg.tokens)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
            if chat
            else {"index": 0, "text": text, "finish_reason": "stop"}
        )
        return {
            "id": f"cmpl-{cfg.name}-{state['requests']}",
            "object": "chat.completion" if chat else "text_completion",
            "model": req.get("model", cfg.model),
            "choices": [choice],
            "usage": {
                "prompt_tokens": 10,
                "completion_tokens": cfg.tokens,
                "total_tokens": 10 + cfg.tokens,
            },
        }

    async def _stream(request: web.Request, req: dict, chat: bool, t: float) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", **headers})
        await resp.prepare(request)
        per = t / max(cfg.tokens, 1)
        for i in range(cfg.tokens):
            if per > 0:
                await asyncio.sleep(per)
            delta = {"delta": {"content": f"t{i} "}} if chat else {"text": f"t{i} "}
            chunk = {
                "id": "cmpl-s",
                "model": req.get("model", cfg.model),
                "choices": [{"index": 0, **delta}],
            }
            await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def metrics(request: web.Request) -> web.Response:
        running = state["running"]
        waiting = state["inflight"] - running
        m = cfg.model
        text = (
            "# TYPE vllm:num_requests_running gauge\n"
            f'vllm:num_requests_running{{model_name="{m}"}} {float(running)}\n'
            "# TYPE vllm:num_requests_waiting gauge\n"
            f'vllm:num_requests_waiting{{model_name="{m}"}} {float(waiting)}\n'
            "# TYPE vllm:request_success_total counter\n"
            f'vllm:request_success_total{{finished_reason="stop",model_name="{m}"}} '
            f"{float(served['count'])}\n"
            "# TYPE vllm:request_inference_time_seconds histogram\n"
            f'vllm:request_inference_time_seconds_bucket{{le="+Inf",model_name="{m}"}} '
            f"{float(served['count'])}\n"
            f'vllm:request_inference_time_seconds_count{{model_name="{m}"}} '
            f"{float(served['count'])}\n"
            f'vllm:request_inference_time_seconds_sum{{model_name="{m}"}} {served["seconds"]}\n'
        )
        return web.Response(text=text, content_type="text/plain")

    async def health(request: web.Request) -> web.Response:
        if time.monotonic() - started < cfg.startup_s:
            return web.Response(status=503, text="warming up\n")
        return web.Response(text="ok\n", headers=headers)

    async def fail(request: web.Request) -> web.Response:
        d = await request.json()
        state["fail_status"] = int(d.get("status", 500))
        state["fail_count"] = int(d.get("count", 1))
        return web.json_response({"ok": True})

    async def stats(request: web.Request) -> web.Response:
        return web.json_response({"name": cfg.name, **state})

    app = web.Application()
    app.router.add_post("/v1/completions", complete)
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/health", health)
    app.router.add_post("/admin/fail", fail)
    app.router.add_get("/admin/stats", stats)
    return app


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--name")
    ap.add_argument("--service-ms", type=float, default=10.0)
    ap.add_argument("--dist", choices=["const", "exp", "lognormal"], default="const")
    ap.add_argument("--sigma", type=float, default=0.5)
    ap.add_argument("--slowdown", type=float, default=1.0)
    ap.add_argument("--max-running", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=8)
    ap.add_argument("--startup-s", type=float, default=0.0)
    ap.add_argument("--drain-s", type=float, default=30.0, help="grace period on SIGTERM")
    a = ap.parse_args(argv)
    cfg = BackendConfig(
        name=a.name or f"{a.host}:{a.port}",
        service_s=a.service_ms / 1000.0,
        dist=a.dist,
        sigma=a.sigma,
        slowdown=a.slowdown,
        max_running=a.max_running,
        tokens=a.tokens,
        startup_s=a.startup_s,
    )
    logging.basicConfig(level=logging.WARNING)
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # pragma: no cover
        pass
    web.run_app(
        make_backend_app(cfg),
        host=a.host,
        port=a.port,
        access_log=None,
        print=None,
        shutdown_timeout=a.drain_s,
        reuse_port=True,
    )


if __name__ == "__main__":
    main()
