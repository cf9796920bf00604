# ruff: noqa: E501  (report lines are long f-strings)
"""What the ``runtime serve`` front (``/health``, ``/ready`` after warm-up, drain) costs per request.

``runtime serve`` runs twice, each starting its own lean stand-in engine
(``fastengine.py``: raw asyncio, constant service time): the working tree's front, and with
``--ref REV`` the front as committed at REV (``git archive``, run from a temporary
directory) as the reference. ``wrk`` (one thread) then loads, in interleaved rounds with the
order rotated each round, each front and the working tree's engine port directly:

* **high load**: ``--conns`` connections, closed loop, ``--seconds`` each: requests/s, and
  the front process's CPU time (``/proc/PID/stat``) per request, i.e. what the front costs
  a core per request and how many requests/s one core of front can carry;
* **low load**: ``--low-conns`` connections: latency percentiles; added latency = front
  minus direct in the same round.

Medians over rounds. Requests are ~50-token grammar prompts (``POST /v1/completions``).

    python benchmarks/runtime/front.py [--rounds 3] [--seconds 3] [--ref HEAD]

Needs ``wrk`` on PATH (Debian: ``apt-get install -y wrk``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.proccpu import process_cpu_seconds  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ENGINE = Path(__file__).with_name("fastengine.py")
BODY = {
    "model": "model",
    "prompt": "Correct the grammar of this sentence and answer with the corrected sentence "
    "only. Sentence: Yesterday me and him goes to the store for buying some apple.\nCorrected:",
    "max_tokens": 50,
    "temperature": 0.0,
}
_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1000.0}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Front:
    name: str
    proc: subprocess.Popen
    url: str
    engine_url: str


def start_front(name: str, cwd: Path, service_ms: float, tmp: Path) -> Front:
    port, eport = free_port(), free_port()
    engine = f"{sys.executable} {ENGINE} --port {{port}} --service-ms {service_ms} --dist const"
    model = tmp / "model"
    model.mkdir(exist_ok=True)
    log = open(tmp / f"{name.replace('@', '-')}.log", "wb")  # noqa: SIM115
    env = dict(os.environ, PYTHONPATH=str(cwd))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runtime.cli",
            "serve",
            str(model),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--engine-port",
            str(eport),
            "--engine-command",
            engine,
            "--warmup-requests",
            "2",
            "--startup-timeout",
            "60",
        ],  # fmt: skip
        cwd=cwd,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"{name}: exited {proc.returncode}; see {log.name}")
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise SystemExit(f"{name}: not ready; see {log.name}")
        time.sleep(0.1)
    return Front(name, proc, url, f"http://127.0.0.1:{eport}")


def wrk(url: str, conns: int, seconds: float, script: Path) -> dict:
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{conns}",
            f"-d{seconds:g}s",
            "--latency",
            "-s",
            str(script),
            url + "/v1/completions",
        ],  # fmt: skip
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lat = {
        p: float(v) * _UNITS[u]
        for p, v, u in re.findall(r"^\s+(50|90|99)%\s+([\d.]+)(us|ms|s)\s*$", out, re.M)
    }
    reqs = int(re.search(r"(\d+) requests in", out).group(1))
    bad = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    errs = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    return {
        "rps": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "requests": reqs,
        "errors": (int(bad.group(1)) if bad else 0)
        + (sum(int(g) for g in errs.groups()) if errs else 0),
        "p50_ms": lat.get("50"),
        "p90_ms": lat.get("90"),
        "p99_ms": lat.get("99"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--conns", type=int, default=32)
    ap.add_argument("--low-conns", type=int, default=1)
    ap.add_argument("--service-ms", type=float, default=1.0)
    ap.add_argument("--ref", default=None, help="also run the front as committed at this rev")
    ap.add_argument("--json", type=Path, default=None, help="write the raw rounds here")
    a = ap.parse_args()

    tmp = Path(tempfile.mkdtemp(prefix="frontbench-"))
    script = tmp / "post.lua"
    script.write_text(
        'wrk.method = "POST"\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"wrk.body = {json.dumps(json.dumps(BODY))}\n"
    )
    fronts = [start_front("front", ROOT, a.service_ms, tmp)]
    if a.ref:
        src = tmp / "ref"
        src.mkdir()
        archive = subprocess.run(
            ["git", "archive", a.ref, "runtime", "serving"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
        fronts.append(start_front(f"front@{a.ref}", src, a.service_ms, tmp))
    targets = [("direct", fronts[0].engine_url, None)] + [
        (f.name, f.url, f.proc.pid) for f in fronts
    ]
    rows: dict[tuple[str, str], list[dict]] = {}
    try:
        for r in range(a.rounds):
            order = targets[r % len(targets) :] + targets[: r % len(targets)]
            for level, conns in (("high", a.conns), ("low", a.low_conns)):
                for name, url, pid in order:
                    c0 = process_cpu_seconds(pid) if pid else 0.0
                    res = wrk(url, conns, a.seconds, script)
                    if pid:
                        res["cpu_us_per_req"] = (
                            (process_cpu_seconds(pid) - c0) / max(res["requests"], 1) * 1e6
                        )
                    rows.setdefault((level, name), []).append(res)
                    print(f"round {r} {level:4} {name:14} {json.dumps(res)}", file=sys.stderr)
    finally:
        for f in fronts:
            f.proc.terminate()
            f.proc.wait(30)

    def med(level: str, name: str, key: str) -> float:
        vals = [x[key] for x in rows[(level, name)] if x.get(key) is not None]
        return statistics.median(vals) if vals else float("nan")

    def added(name: str, key: str) -> float:
        pairs = zip(rows[("low", name)], rows[("low", "direct")], strict=True)
        return statistics.median(x[key] - d[key] for x, d in pairs)

    print(
        f"{a.rounds} rounds x {a.seconds:g} s, engine service time {a.service_ms:g} ms, "
        f"high load {a.conns} conns, low load {a.low_conns}"
    )
    print(
        "| target | max req/s | front CPU/req | req/s per front core | p50 (low) | p99 (low) | added p50 | added p99 | errors |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, _, pid in targets:
        cpu = med("high", name, "cpu_us_per_req") if pid else float("nan")
        errs = sum(x["errors"] for lv in ("high", "low") for x in rows[(lv, name)])
        print(
            f"| {name} | {med('high', name, 'rps'):.0f} | "
            + (f"{cpu:.0f} µs | {1e6 / cpu:.0f} | " if pid else "— | — | ")
            + f"{med('low', name, 'p50_ms'):.2f} ms | {med('low', name, 'p99_ms'):.2f} ms | "
            + (
                f"{added(name, 'p50_ms'):+.2f} ms | {added(name, 'p99_ms'):+.2f} ms | "
                if pid
                else "— | — | "
            )
            + f"{errs} |"
        )
    if a.json:
        a.json.write_text(json.dumps({f"{lv}/{n}": v for (lv, n), v in rows.items()}, indent=1))
    print(f"logs: {tmp}", file=sys.stderr)


if __name__ == "__main__":
    main()
