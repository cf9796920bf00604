"""The serving CLI: errors at the edge, and real processes (multi-worker router, serving up)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
from click.testing import CliRunner
from servinghelp import BackendProcess
from support import free_port, wait_port

from serving.cli import main


def test_bad_options_become_messages():
    r = CliRunner().invoke(main, ["router", "--listen", "nope"])
    assert r.exit_code == 3 and "serving: error: ConfigError: expected HOST:PORT" in r.output
    r = CliRunner().invoke(main, ["router", "--listen", "127.0.0.1:1"])
    assert r.exit_code == 3 and "give --backends or --eds" in r.output
    r = CliRunner().invoke(main, ["eds", "--listen", "127.0.0.1:1"])
    assert r.exit_code == 3 and "exactly one of" in r.output


def _complete(port: int) -> tuple[int, str | None]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        data=json.dumps({"prompt": "x"}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status, r.headers.get("x-backend")


def _stop(proc: subprocess.Popen) -> int:
    proc.terminate()
    try:
        return proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@pytest.mark.integration
def test_router_workers_share_a_port(backend_procs):
    b = BackendProcess(name="solo")
    backend_procs.append(b)
    b.wait()
    port, admin = free_port(), free_port()
    cmd = [sys.executable, "-m", "serving.cli", "router", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--backends", b.url, "--workers", "2", "--admin-port", str(admin)]
    proc = subprocess.Popen(cmd)
    try:
        wait_port(port, 30)
        wait_port(admin, 30)
        assert all(_complete(port) == (200, "solo") for _ in range(20))
        with urllib.request.urlopen(f"http://127.0.0.1:{admin}/metrics", timeout=10) as r:
            assert b"serving_router_requests_total" in r.read()
    finally:
        assert _stop(proc) == 0


@pytest.mark.integration
def test_serving_up_runs_the_stack():
    port, eport = free_port(), free_port()
    cmd = [sys.executable, "-m", "serving.cli", "up", "--listen", f"127.0.0.1:{port}"]
    cmd += ["--eds-listen", f"127.0.0.1:{eport}", "--target-per-pod", "4", "--min-replicas", "2"]
    proc = subprocess.Popen(cmd)
    try:
        wait_port(port, 30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with urllib.request.urlopen(f"http://127.0.0.1:{eport}/v1/endpoints", timeout=5) as r:
                eps = json.loads(r.read())["endpoints"]
            if sum(e["ready"] for e in eps) == 2:
                break
            time.sleep(0.1)
        assert sum(e["ready"] for e in eps) == 2
        seen = set()
        deadline = time.monotonic() + 10
        while len(seen) < 2 and time.monotonic() < deadline:
            status, who = _complete(port)
            assert status == 200
            seen.add(who)
        assert len(seen) == 2  # the router learned both pods from the EDS
    finally:
        assert _stop(proc) == 0
