# ruff: noqa: E501  (report tables are built from long f-strings)
"""Live loopback benchmark: the router vs nginx (random two least_conn) vs HAProxy (leastconn).

K emulated vLLM backends (``serving.fakebackend``, lognormal service time) run as processes;
each proxy in turn is put in front of the same backends with ONE worker/process/thread, and
``wrk`` drives it (closed loop, POST /v1/completions):

* max throughput: many connections;
* latency at about half of that: few connections; compared with wrk straight to one backend
  at the same connection count, which gives the latency the proxy *adds*;
* balance: per-backend request counts (backends' ``/admin/stats``), max/mean.

    python benchmarks/serving/live.py [--seconds 5] [--backends 4] [--out benchmarks/serving/results]

Needs wrk, nginx, haproxy on PATH (Debian: ``apt-get install -y nginx haproxy wrk``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LUA = 'wrk.method = "POST"\nwrk.body = \'{"model":"m","prompt":"fix: i has a apple","max_tokens":50}\'\nwrk.headers["Content-Type"] = "application/json"\n'


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port: int, timeout: float = 30) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(port)


def parse_wrk(text: str) -> dict:
    def dur(s: str) -> float:
        m = re.match(r"([\d.]+)(us|ms|s)", s)
        v, u = float(m.group(1)), m.group(2)
        return v / 1000 if u == "us" else v if u == "ms" else v * 1000

    out = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))}
    for p in ("50", "99"):
        m = re.search(rf"^\s+{p}(?:\.000)?%\s+(\S+)", text, re.M)
        out[f"p{p}_ms"] = dur(m.group(1)) if m else None
    errs = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    out["errors"] = (int(errs.group(1)) if errs else 0) + (
        sum(map(int, sock.groups())) if sock else 0
    )
    return out


def wrk(port: int, conns: int, seconds: float, lua: Path) -> dict:
    cmd = [
        "wrk",
        "-t1",
        f"-c{conns}",
        f"-d{max(1, int(seconds))}s",
        "--latency",
        "-s",
        str(lua),
        f"http://127.0.0.1:{port}/v1/completions",
    ]
    return parse_wrk(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def stats(ports: list[int]) -> list[int]:
    out = []
    for p in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{p}/admin/stats", timeout=5) as r:
            out.append(json.loads(r.read())["requests"])
    return out


def start_proxy(kind: str, port: int, backends: list[int], tmp: Path) -> subprocess.Popen:
    if kind == "router":
        urls = ",".join(f"http://127.0.0.1:{b}" for b in backends)
        cmd = [
            sys.executable,
            "-m",
            "serving.cli",
            "router",
            "--listen",
            f"127.0.0.1:{port}",
            "--backends",
            urls,
            "--workers",
            "1",
        ]
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    servers = "\n".join(f"    server 127.0.0.1:{b};" for b in backends)
    if kind == "nginx":
        conf = tmp / "nginx.conf"
        conf.write_text(f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx.err warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  client_body_temp_path {tmp}/nb; proxy_temp_path {tmp}/np; fastcgi_temp_path {tmp}/nf;
  uwsgi_temp_path {tmp}/nu; scgi_temp_path {tmp}/ns;
  upstream be {{
    random two least_conn;
{servers}
    keepalive 256;
  }}
  server {{
    listen 127.0.0.1:{port} reuseport;
    location / {{
      proxy_pass http://be;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_buffering off;
    }}
  }}
}}
""")
        return subprocess.Popen(
            ["nginx", "-c", str(conf), "-p", str(tmp)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    if kind == "haproxy":
        conf = tmp / "haproxy.cfg"
        srv = "\n".join(f"  server b{i} 127.0.0.1:{b}" for i, b in enumerate(backends))
        conf.write_text(f"""
global
  nbthread 1
  maxconn 4000
defaults
  mode http
  timeout connect 1s
  timeout client 60s
  timeout server 60s
  http-reuse always
frontend fe
  bind 127.0.0.1:{port}
  default_backend be
backend be
  balance leastconn
{srv}
""")
        return subprocess.Popen(
            ["haproxy", "-f", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
    raise ValueError(kind)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--service-ms", type=float, default=2.0)
    ap.add_argument("--max-conns", type=int, default=64)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results"))
    a = ap.parse_args()
    for tool in ("wrk", "nginx", "haproxy"):
        if not shutil.which(tool):
            sys.exit(f"needs {tool} on PATH")
    tmp = Path(tempfile.mkdtemp(prefix="servbench-"))
    lua = tmp / "post.lua"
    lua.write_text(LUA)
    ports = [free_port() for _ in range(a.backends)]
    bprocs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "serving.fakebackend",
                "--port",
                str(p),
                "--service-ms",
                str(a.service_ms),
                "--dist",
                "lognormal",
                "--sigma",
                "0.5",
                "--max-running",
                "100000",
            ],
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for p in ports
    ]
    results = {
        "cpus": os.cpu_count(),
        "backends": a.backends,
        "service_ms": a.service_ms,
        "seconds": a.seconds,
    }
    try:
        for p in ports:
            wait_port(p)
        # direct baseline at low and high concurrency: one backend, no proxy
        direct = {}
        for c in (2, 4, 8):
            direct[c] = wrk(ports[0], c, a.seconds, lua)
        results["direct"] = direct
        for kind in ("router", "nginx", "haproxy"):
            port = free_port()
            proc = start_proxy(kind, port, ports, tmp)
            try:
                wait_port(port)
                wrk(port, 8, 1, lua)  # warm-up: pools, JIT-free but caches
                before = stats(ports)
                mx = wrk(port, a.max_conns, a.seconds, lua)
                after = stats(ports)
                counts = [y - x for x, y in zip(before, after, strict=True)]
                mean = sum(counts) / len(counts)
                low = {c: wrk(port, c, a.seconds, lua) for c in (2, 4, 8)}
                # the connection count whose throughput is nearest half of the max
                c50 = min(low, key=lambda c: abs(low[c]["rps"] - mx["rps"] / 2))
                r = low[c50]
                d = direct[c50]
                results[kind] = {
                    "max": mx,
                    "low": low,
                    "c_at_half": c50,
                    "half_load_fraction": r["rps"] / mx["rps"],
                    "added_p50_ms": r["p50_ms"] - d["p50_ms"],
                    "added_p99_ms": r["p99_ms"] - d["p99_ms"],
                    "per_backend": counts,
                    "max_mean_balance": max(counts) / mean if mean else None,
                }
                print(kind, json.dumps(results[kind]), flush=True)
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(15)
                except subprocess.TimeoutExpired:
                    proc.kill()
    finally:
        for p in bprocs:
            p.terminate()
        for p in bprocs:
            p.wait(15)
        shutil.rmtree(tmp, ignore_errors=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "live.json").write_text(json.dumps(results, indent=1))
    lines = [
        "# Live loopback benchmark",
        "",
        f"`python benchmarks/serving/live.py`: {a.backends} emulated backends (lognormal, mean {a.service_ms} ms), "
        f"one proxy process/worker/thread each, wrk -t1, {a.seconds} s per point, {os.cpu_count()} CPUs shared by "
        "wrk, proxy and backends (so absolute numbers are low and noisy).",
        "",
        "| proxy | max rps (1 core) | conns at ~50% | load at that point | added p50 (ms) | added p99 (ms) | balance max/mean | errors |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for kind in ("router", "nginx", "haproxy"):
        r = results[kind]
        errs = r["max"]["errors"] + sum(x["errors"] for x in r["low"].values())
        lines.append(
            f"| {kind} | {r['max']['rps']:.0f} | {r['c_at_half']} | {100 * r['half_load_fraction']:.0f}% | "
            f"{r['added_p50_ms']:.2f} | {r['added_p99_ms']:.2f} | {r['max_mean_balance']:.3f} | {errs} |"
        )
    (out / "live.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
