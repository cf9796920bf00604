"""Closed-loop load against a running ``runtime serve`` (GPU or CPU): latency and throughput.

    python benchmarks/runtime/load.py --url http://127.0.0.1:8000 --concurrency 64 --seconds 30

Each worker sends grammar-correction prompts from the shipped set (~50 tokens in, ``--max-tokens``
out, greedy) back to back. Prints requests/s, output tokens/s and latency percentiles. On an
H100 with an FP8 checkpoint this is the check of the tuned settings (API servers, async
scheduling, CUDA graphs, batch size); pointed at the engine port (``--url
http://127.0.0.1:8100``) it gives the same figures without the front. The front's own cost
per request is measured apart, against a lean stand-in engine: ``front.py``. At high QPS this
Python client can itself be the limit: watch its CPU, or use ``vllm bench serve``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import httpx

from runtime.prompts import load_prompts


async def _worker(client, prompts, args, stop_at, lat, toks, errors, offset) -> None:
    i = offset
    while time.monotonic() < stop_at:
        body = {
            "model": args.model,
            "prompt": prompts[i % len(prompts)].prompt,
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
        }
        i += 1
        t0 = time.monotonic()
        try:
            r = await client.post("/v1/completions", json=body)
        except httpx.HTTPError:
            errors.append(1)
            continue
        if r.status_code != 200:
            errors.append(r.status_code)
            continue
        lat.append(time.monotonic() - t0)
        toks.append(r.json()["usage"]["completion_tokens"])


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="model")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--max-tokens", type=int, default=50)
    args = ap.parse_args()
    prompts = load_prompts()
    lat: list[float] = []
    toks: list[int] = []
    errors: list[int] = []
    limits = httpx.Limits(max_connections=args.concurrency)
    async with httpx.AsyncClient(base_url=args.url, timeout=120, limits=limits) as client:
        t0 = time.monotonic()
        stop_at = t0 + args.seconds
        await asyncio.gather(
            *(
                _worker(client, prompts, args, stop_at, lat, toks, errors, k)
                for k in range(args.concurrency)
            )
        )
        elapsed = time.monotonic() - t0
    q = statistics.quantiles(lat, n=100) if len(lat) > 1 else [float("nan")] * 99
    print(
        json.dumps(
            {
                "requests": len(lat),
                "errors": len(errors),
                "req_per_s": round(len(lat) / elapsed, 1),
                "out_tok_per_s": round(sum(toks) / elapsed, 1),
                "p50_ms": round(q[49] * 1000, 1),
                "p90_ms": round(q[89] * 1000, 1),
                "p99_ms": round(q[98] * 1000, 1),
            }
        )
    )


if __name__ == "__main__":
    asyncio.run(main())
