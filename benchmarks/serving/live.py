# ruff: noqa: E501  (report tables are built from long f-strings)
"""Live loopback benchmark: the router vs nginx (random two least_conn) vs HAProxy (leastconn).

K emulated vLLM backends (``fastbackend.py``: one process, K ports, lognormal service time)
run once; the router, nginx and HAProxy all run at the same time in front of the same
backends, each with ONE worker process/thread, pinned to the same CPU (``--proxy-cpu``);
``wrk`` and the backends share another (``--load-cpu``). Measurements are interleaved in
rounds (direct, router, nginx, haproxy, the order rotated each round) and reported as
medians over rounds, so every target sees the same machine state on average:

* **max throughput**: closed loop, ``--max-conns`` connections. Besides requests/s, the
  proxy's own CPU time (``/proc``, all its processes) gives its CPU cost per request and so
  its throughput per core: what one fully busy core would carry. On a machine shared with
  other work that is the robust number; wall-clock max rps also depends on the load side.
* **latency at 50% of the router's max throughput**: the offered rate is half the median
  router max; ``wrk`` (Debian's 4.1 has no ``-R``) runs ``--half-conns`` connections with
  exponentially distributed think times (Lua ``delay()``), so requests arrive at about that
  rate regardless of the target. Added p50/p99 = target minus direct (straight to one
  backend), per round, then the median over rounds.
* **balance**: per-backend request counts (``/admin/stats``) during each run, max/mean.
* **the machine's floor** (``wakeup.py``): a pipe round trip between two processes on the
  load CPU, and between the load CPU and the proxy CPU, before and after the rounds. A
  proxied request crosses between the two CPUs four times (two round trips) that a direct
  one does not; on a virtual machine a cross-CPU wake-up goes through the hypervisor, and
  its tail is in every proxy's added p99 whatever the proxy does.

The direct baseline uses a port of its own (same process, same distribution), not one of the
proxies' backends: the router would otherwise see the baseline's load in its load reports.
``--aiohttp-router c9d09de`` adds the router as first committed (aiohttp) as a fifth target;
``--two-workers [CPUS]`` adds the router with two worker processes on one port
(``SO_REUSEPORT``) on CPUS (default ``0,1``: on a 2-core machine they share the cores with the
load generator and the backends).

    python benchmarks/serving/live.py [--rounds 6] [--seconds 4] [--aiohttp-router c9d09de]
        [--two-workers 0,1]

Needs wrk, nginx, haproxy, taskset on PATH (Debian: ``apt-get install -y nginx haproxy wrk``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import wakeup  # noqa: E402

from benchmarks.proccpu import process_cpu_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
BODY = '{"model":"m","prompt":"fix: i has a apple","max_tokens":50}'
LUA = f"""wrk.method = "POST"
wrk.body = '{BODY}'
wrk.headers["Content-Type"] = "application/json"
"""
# exponential think time (ms) before each request on a connection: an open-ish arrival process
LUA_RATE = (
    LUA
    + """math.randomseed(os.time())
local think = THINK_MS
function delay()
  return -math.log(1 - math.random()) * think
end
"""
)
TARGETS = ("direct", "router", "nginx", "haproxy")


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
        m = re.match(r"([\d.]+)(us|ms|s)$", s)
        v, u = float(m.group(1)), m.group(2)
        return v / 1000 if u == "us" else v if u == "ms" else v * 1000

    out = {"rps": float(re.search(r"Requests/sec:\s+([\d.]+)", text).group(1))}
    out["requests"] = int(re.search(r"(\d+) requests in", text).group(1))
    for p in ("50", "90", "99"):
        m = re.search(rf"^\s+{p}(?:\.000)?%\s+(\S+)", text, re.M)
        out[f"p{p}_ms"] = dur(m.group(1)) if m else None
    errs = re.search(r"Non-2xx or 3xx responses: (\d+)", text)
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    out["errors"] = (int(errs.group(1)) if errs else 0) + (
        sum(map(int, sock.groups())) if sock else 0
    )
    return out


def pin(cpu: str | None) -> list[str]:
    return ["taskset", "-c", cpu] if cpu else []


def wrk(port: int, conns: int, seconds: int, lua: Path, cpu: str | None) -> dict:
    cmd = [*pin(cpu), "wrk", "-t1", f"-c{conns}", f"-d{seconds}s", "--latency", "-s", str(lua)]
    cmd.append(f"http://127.0.0.1:{port}/v1/completions")
    return parse_wrk(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def cpu_seconds(pids: list[int]) -> float:
    """User+system CPU of these processes and their children (nginx workers)."""
    total = 0.0
    seen = set()
    todo = list(pids)
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            total += process_cpu_seconds(pid)
            kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        except (FileNotFoundError, ProcessLookupError):
            continue
        todo.extend(int(k) for k in kids)
    return total


def stats(ports: list[int]) -> list[int]:
    out = []
    for p in ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{p}/admin/stats", timeout=5) as r:
            out.append(json.loads(r.read())["requests"])
    return out


def start_proxy(
    kind: str, port: int, backends: list[int], tmp: Path, cpu: str | None
) -> subprocess.Popen:
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    if kind == "aiohttp-router":  # the router as first committed (see --aiohttp-router)
        urls = tuple(f"http://127.0.0.1:{b}" for b in backends)
        code = (
            f"import sys; sys.path.insert(0, {str(tmp)!r}); import old_router as r; "
            f"r.serve(r.RouterConfig(host='127.0.0.1', port={port}, backends={urls!r}))"
        )
        return subprocess.Popen([*pin(cpu), sys.executable, "-c", code], cwd=ROOT, **quiet)
    if kind in ("router", "router-2w"):
        urls = ",".join(f"http://127.0.0.1:{b}" for b in backends)
        workers = "2" if kind == "router-2w" else "1"
        cmd = [*pin(cpu), sys.executable, "-m", "serving.cli", "router"]
        cmd += ["--listen", f"127.0.0.1:{port}", "--backends", urls, "--workers", workers]
        return subprocess.Popen(cmd, cwd=ROOT, **quiet)
    if kind == "nginx":
        servers = "\n".join(f"    server 127.0.0.1:{b};" for b in backends)
        conf = tmp / "nginx.conf"
        conf.write_text(f"""
worker_processes 1;
daemon off;
pid {tmp}/nginx.pid;
error_log {tmp}/nginx.err warn;
events {{ worker_connections 4096; }}
http {{
  access_log off;
  keepalive_requests 1000000;
  client_body_temp_path {tmp}/nb; proxy_temp_path {tmp}/np; fastcgi_temp_path {tmp}/nf;
  uwsgi_temp_path {tmp}/nu; scgi_temp_path {tmp}/ns;
  upstream be {{
    random two least_conn;
{servers}
    keepalive 256;
    keepalive_requests 1000000;
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
        return subprocess.Popen([*pin(cpu), "nginx", "-c", str(conf), "-p", str(tmp)], **quiet)
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
        return subprocess.Popen([*pin(cpu), "haproxy", "-f", str(conf)], **quiet)
    raise ValueError(kind)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def balance(counts: list[int]) -> float | None:
    mean = sum(counts) / len(counts)
    return max(counts) / mean if mean else None


def run_point(target, port, pids, ports, conns, seconds, lua, cpu) -> dict:
    before, c0 = stats(ports), cpu_seconds(pids)
    r = wrk(port, conns, seconds, lua, cpu)
    c1, after = cpu_seconds(pids), stats(ports)
    counts = [y - x for x, y in zip(before, after, strict=True)]
    r["per_backend"] = counts
    if target != "direct":
        r["balance"] = balance(counts)
        r["proxy_cpu_s"] = c1 - c0
        r["cpu_us_per_req"] = 1e6 * (c1 - c0) / r["requests"] if r["requests"] else None
    return r


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--backends", type=int, default=4)
    ap.add_argument("--service-ms", type=float, default=2.0)
    ap.add_argument("--max-conns", type=int, default=64)
    ap.add_argument("--half-conns", type=int, default=128)
    ap.add_argument("--proxy-cpu", default="1", help="CPU list for the proxies ('' = no pinning)")
    ap.add_argument("--load-cpu", default="0", help="CPU list for wrk and the backends")
    ap.add_argument(
        "--aiohttp-router",
        metavar="COMMIT",
        help="also measure serving/router.py of this commit (c9d09de: the aiohttp router)",
    )
    ap.add_argument(
        "--two-workers",
        metavar="CPUS",
        nargs="?",
        const="0,1",
        help="also measure the router with 2 workers (SO_REUSEPORT) on these CPUs (default 0,1)",
    )
    ap.add_argument("--out", default=str(HERE / "results"))
    a = ap.parse_args()
    targets = TARGETS + (("aiohttp-router",) if a.aiohttp_router else ())
    targets += ("router-2w",) if a.two_workers else ()
    for tool in ("wrk", "nginx", "haproxy", "taskset"):
        if not shutil.which(tool):
            sys.exit(f"needs {tool} on PATH")
    pcpu, lcpu = a.proxy_cpu or None, a.load_cpu or None
    tmp = Path(tempfile.mkdtemp(prefix="servbench-"))
    if a.aiohttp_router:
        src = subprocess.run(
            ["git", "show", f"{a.aiohttp_router}:serving/router.py"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        (tmp / "old_router.py").write_text(src)
    lua = tmp / "post.lua"
    lua.write_text(LUA)
    # the proxies' backends, and one more port of the same kind for the direct baseline: were
    # it one of theirs, the router would read the baseline's load in its load reports
    ports = [free_port() for _ in range(a.backends)]
    direct_port = free_port()
    cmd = [*pin(lcpu), sys.executable, str(HERE / "fastbackend.py")]
    cmd += ["--ports", ",".join(map(str, [*ports, direct_port]))]
    cmd += ["--service-ms", str(a.service_ms)]
    cmd += ["--dist", "lognormal", "--sigma", "0.5"]
    bproc = subprocess.Popen(cmd, cwd=ROOT)
    procs: dict[str, subprocess.Popen] = {}
    tports = {"direct": direct_port}
    load = Path("/proc/loadavg").read_text().split()
    results: dict = {
        "cpus": os.cpu_count(),
        "loadavg_at_start": load[:3],
        "backends": a.backends,
        "service_ms": a.service_ms,
        "dist": "lognormal sigma 0.5",
        "seconds": a.seconds,
        "rounds": a.rounds,
        "max_conns": a.max_conns,
        "half_conns": a.half_conns,
        "proxy_cpu": pcpu,
        "load_cpu": lcpu,
        "targets": targets,
        "runs": {"max": {t: [] for t in targets}, "half": {t: [] for t in targets}},
    }
    cpu_pair = (int(lcpu.split(",")[0]), int(pcpu.split(",")[0])) if lcpu and pcpu else (0, 0)
    results["wakeup"] = {"start": wakeup.measure(*cpu_pair)}
    try:
        for p in [*ports, direct_port]:
            wait_port(p)
        for kind in targets[1:]:
            tports[kind] = free_port()
            cpu = (a.two_workers or None) if kind == "router-2w" else pcpu
            procs[kind] = start_proxy(kind, tports[kind], ports, tmp, cpu)
        for kind in targets[1:]:
            wait_port(tports[kind])
        pids = {k: [p.pid] for k, p in procs.items()}
        pids["direct"] = []
        for kind in targets:  # warm-up: pools, caches
            wrk(tports[kind], a.max_conns, 1, lua, lcpu)

        def rounds(phase: str, conns: int, script: Path) -> None:
            for r in range(a.rounds):
                k = r % len(targets)
                order = targets[k:] + targets[:k]
                for t in order:
                    res = run_point(t, tports[t], pids[t], ports, conns, a.seconds, script, lcpu)
                    results["runs"][phase][t].append(res)
                    print(phase, r, t, json.dumps(res), flush=True)

        rounds("max", a.max_conns, lua)
        router_max = med(x["rps"] for x in results["runs"]["max"]["router"])
        rate = router_max / 2
        think_ms = max(0.0, 1000 * a.half_conns / rate - a.service_ms)
        results["half_rate_target"] = rate
        results["think_ms"] = think_ms
        rlua = tmp / "rate.lua"
        rlua.write_text(LUA_RATE.replace("THINK_MS", f"{think_ms:.3f}"))
        rounds("half", a.half_conns, rlua)
    finally:
        results["loadavg_at_end"] = Path("/proc/loadavg").read_text().split()[:3]
        for p in procs.values():
            stop(p)
        stop(bproc)
        shutil.rmtree(tmp, ignore_errors=True)
    results["wakeup"]["end"] = wakeup.measure(*cpu_pair)
    summarize(results, a)


def summarize(results: dict, a) -> None:
    runs = results["runs"]
    summary = {}
    targets = results["targets"]
    for t in targets:
        mx, half = runs["max"][t], runs["half"][t]
        s = {
            "max_rps": med(x["rps"] for x in mx),
            "half_rps": med(x["rps"] for x in half),
            "half_p50_ms": med(x["p50_ms"] for x in half),
            "half_p99_ms": med(x["p99_ms"] for x in half),
            "errors": sum(x["errors"] for x in mx + half),
        }
        if t != "direct":
            cpu = med(x["cpu_us_per_req"] for x in mx)
            s["cpu_us_per_req"] = cpu
            s["rps_per_core"] = 1e6 / cpu if cpu else None
            s["max_cpu_util"] = med(x["proxy_cpu_s"] / a.seconds for x in mx)
            s["added_p50_ms"] = med(
                h["p50_ms"] - d["p50_ms"] for h, d in zip(half, runs["half"]["direct"], strict=True)
            )
            s["added_p99_ms"] = med(
                h["p99_ms"] - d["p99_ms"] for h, d in zip(half, runs["half"]["direct"], strict=True)
            )
            s["balance_half"] = med(x["balance"] for x in half)
            s["balance_max"] = med(x["balance"] for x in mx)
        summary[t] = s
    results["summary"] = summary
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "live.json").write_text(json.dumps(results, indent=1))
    d = summary["direct"]
    lines = [
        "# Live loopback benchmark",
        "",
        f"`python benchmarks/serving/live.py --rounds {a.rounds} --seconds {a.seconds}"
        f"{' --aiohttp-router ' + a.aiohttp_router if a.aiohttp_router else ''}"
        f"{' --two-workers ' + a.two_workers if a.two_workers else ''}`: {a.backends} emulated backends "
        f"(`fastbackend.py`, lognormal service time, mean {a.service_ms} ms, sigma 0.5); router, nginx and HAProxy "
        f"with one worker each, pinned to CPU {results['proxy_cpu']}; wrk -t1 and the backends on CPU {results['load_cpu']}"
        f"{'; router-2w: the router with 2 workers (SO_REUSEPORT) on CPUs ' + a.two_workers if a.two_workers else ''}. "
        f"{results['cpus']} CPUs, shared with other work (load average {' '.join(results['loadavg_at_start'])} at the start, "
        f"{' '.join(results['loadavg_at_end'])} at the end). "
        f"Targets measured in interleaved rounds, {a.seconds} s each; medians over {a.rounds} rounds.",
        "",
        f"**Max throughput** (closed loop, {a.max_conns} connections). *CPU/req* is the proxy's own CPU time per "
        "request; *per core* = 1 s / that, what one busy core would carry.",
        "",
        "| target | max rps (wall) | proxy CPU used | CPU/req (µs) | rps per core | balance max/mean | errors |",
        "|---|---|---|---|---|---|---|",
        f"| direct (one backend) | {d['max_rps']:.0f} | | | | | {d['errors']} |",
    ]
    for t in targets[1:]:
        s = summary[t]
        lines.append(
            f"| {t} | {s['max_rps']:.0f} | {100 * s['max_cpu_util']:.0f}% | {s['cpu_us_per_req']:.0f} | "
            f"{s['rps_per_core']:.0f} | {s['balance_max']:.3f} | {s['errors']} |"
        )
    lines += [
        "",
        f"**Latency at 50% of the router's max** (offered ~{results['half_rate_target']:.0f} req/s: "
        f"{a.half_conns} connections, exponential think time {results['think_ms']:.1f} ms). Added = target minus "
        "direct in the same round, median over rounds.",
        "",
        "| target | achieved rps | p50 (ms) | p99 (ms) | added p50 (ms) | added p99 (ms) | balance max/mean |",
        "|---|---|---|---|---|---|---|",
        f"| direct (one backend) | {d['half_rps']:.0f} | {d['half_p50_ms']:.2f} | {d['half_p99_ms']:.2f} | | | |",
    ]
    for t in targets[1:]:
        s = summary[t]
        lines.append(
            f"| {t} | {s['half_rps']:.0f} | {s['half_p50_ms']:.2f} | {s['half_p99_ms']:.2f} | "
            f"{s['added_p50_ms']:.2f} | {s['added_p99_ms']:.2f} | {s['balance_half']:.3f} |"
        )
    w = results.get("wakeup")
    if w:

        def trip(kind: str) -> str:
            return " / ".join(
                f"{w[when][kind]['p50_us']:.0f}, {w[when][kind]['p99_us']:.0f}, "
                f"{w[when][kind]['p999_us']:.0f}"
                for when in ("start", "end")
                if when in w
            )

        lines += [
            "",
            "**The machine's floor** (`wakeup.py`: a pipe round trip between two processes, µs, "
            "p50, p99, p99.9; before / after the rounds): on the load CPU alone "
            f"{trip('same_cpu')}; between the load CPU and the proxy CPU {trip('cross_cpu')}. "
            "A proxied request makes two such cross-CPU round trips more than a direct one.",
        ]
    (out / "live.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
