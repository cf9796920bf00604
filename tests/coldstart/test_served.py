"""The served workload's parts (the ``vllm`` image): I/O counters, ``ctr task ps``, the
completion probe and ``run_until_served`` against a real HTTP server process that answers
502 until its "engine" is up, and the report lines of a served image. No root, no vLLM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from benchmarks.coldstart import image, node, run

SERVER = textwrap.dedent(
    """
    import json, os, sys, time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    port, up_after, pidfile = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
    start = time.monotonic()

    class H(BaseHTTPRequestHandler):
        def do_POST(self):
            n = int(self.headers["Content-Length"])
            req = json.loads(self.rfile.read(n))
            if time.monotonic() - start < up_after:
                code, body = 502, b"engine unavailable\\n"
            else:
                code = 200
                body = json.dumps({"choices": [{"text": " hi " + req["model"]}]}).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = HTTPServer(("127.0.0.1", port), H)
    open(pidfile, "w").write(str(os.getpid()))
    print("listening", flush=True)
    open("/proc/self/io").read()
    srv.serve_forever()
    """
)


def _server(tmp_path: Path, up_after: float) -> tuple[list[str], int, Path]:
    script = tmp_path / "server.py"
    script.write_text(SERVER)
    port = _free_port()
    pidfile = tmp_path / "pid"
    return [sys.executable, str(script), str(port), str(up_after), str(pidfile)], port, pidfile


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pid(pidfile: Path) -> list[int]:
    return [int(pidfile.read_text())]


def _kill(pidfile: Path) -> None:
    os.kill(int(pidfile.read_text()), signal.SIGKILL)


def test_parse_proc_io_and_io_of():
    text = "rchar: 100\nwchar: 5\nread_bytes: 4096\nwrite_bytes: 0\ncancelled_write_bytes: 0\n"
    assert run.parse_proc_io(text) == {
        "rchar": 100, "wchar": 5, "read_bytes": 4096, "write_bytes": 0,
        "cancelled_write_bytes": 0,
    }  # fmt: skip
    assert run.parse_proc_io("garbage\nrchar: x\n") == {}
    # our own process and one that does not exist (exited meanwhile): only ours counts
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)  # fmt: skip
    gone = int(proc.stdout)
    total = run.io_of([os.getpid(), gone])
    assert total["processes"] == 1 and total["rchar"] > 0


def test_parse_task_ps():
    out = "PID      INFO\n4242     -\n4250     -\n\n"
    assert node.parse_task_ps(out) == [4242, 4250]
    assert node.parse_task_ps("PID    INFO\n") == []


def test_completion_text():
    assert run.completion_text(b'{"choices": [{"text": " ok"}]}') == " ok"
    for body in (b"engine unavailable", b"{}", b'{"choices": []}', b"[1]"):
        assert run.completion_text(body) is None


def test_run_until_served_waits_for_an_answer_not_the_listener(tmp_path):
    cmd, port, pidfile = _server(tmp_path, up_after=1.0)
    probe = run.CompletionProbe(f"http://127.0.0.1:{port}", model="m", timeout_s=5)
    assert probe.ask() == ("refused", None)  # nothing listens yet
    ready = run.run_until_served(cmd, 30, probe, pids=lambda: _pid(pidfile),
                                 stop=lambda: _kill(pidfile), interval=0.05)  # fmt: skip
    # the server answered 502 first (front up, engine not), then the completion
    assert ready.at - ready.marks["front"] >= 0.5
    assert json.loads(ready.fields["completion"]) == " hi m"
    assert ready.fields["processes"] == "1" and int(ready.fields["rchar"]) > 0
    assert ready.exit_code == 0  # SIGKILLed after the answer, as intended
    assert "listening" in ready.output
    assert not run.port_in_use("127.0.0.1", port)  # stopped


def test_run_until_served_fails_when_the_server_exits(tmp_path):
    probe = run.CompletionProbe(f"http://127.0.0.1:{_free_port()}", timeout_s=5)
    cmd = [sys.executable, "-c", "print('engine failed'); raise SystemExit(3)"]
    with pytest.raises(run.BenchError, match=r"exited \(3\) before answering: engine failed"):
        run.run_until_served(cmd, 30, probe, pids=list, stop=lambda: None, interval=0.05)


def test_run_until_served_times_out(tmp_path):
    cmd, port, pidfile = _server(tmp_path, up_after=3600)
    probe = run.CompletionProbe(f"http://127.0.0.1:{port}", timeout_s=5)
    with pytest.raises(run.BenchError, match="no completion answered within 1s"):
        run.run_until_served(cmd, 1, probe, pids=lambda: _pid(pidfile),
                             stop=lambda: _kill(pidfile), interval=0.05)  # fmt: skip
    assert not run.port_in_use("127.0.0.1", port)  # stopped on the way out too


def test_vllm_image_command_and_report():
    argv = image.vllm_command()
    assert argv[:4] == ["/opt/venv/bin/python", "-m", "runtime.cli", "serve"]
    assert argv[argv.index("--port") + 1] == str(image.VLLM_PORT)
    assert argv[argv.index("--device") + 1] == "cpu"
    with pytest.raises(ValueError, match="--size"):
        image.build("vllm", 1 << 20)

    def scen(secs: float, front: float, pull: float | None = None) -> dict:
        phases = {"front_s": front, **({"pull_s": pull} if pull is not None else {})}
        runs = [{"seconds": secs, "registry_bytes": 1, "wire_bytes": 1, "read_bytes": 10,
                 "phases_s": phases}]  # fmt: skip
        return run.summarize_runs(runs, image_bytes=1000)

    scenarios = {"full-pull": scen(90.0, 50.0, 40.0), "local": scen(45.0, 8.0)}
    notes = run.explain(scenarios)
    assert any("full-pull 40.0 / 50.0 / 90.0; local - / 8.0 / 45.0" in n for n in notes)
    # local disk is 2x faster than the full pull: 5x is out of reach for any start
    assert any("only 2.0x less than full-pull's 90.00 s" in n for n in notes)
    res = {
        "image": {"tag": "vllm-tiny", "kind": "vllm", "compressed_bytes": 1_000_000_000,
                  "rootfs_bytes": 4_000_000_000, "weights_bytes": 1_500_000, "layers": 4},
        "runs": 1,
        "presets": {"1g-1ms": {"preset": {"name": "1g-1ms", "rate_mbit": 1000.0, "rtt_ms": 1.0},
                               "scenarios": scenarios, "notes": notes}},
    }  # fmt: skip
    md = run.markdown_table(res)
    assert "model 1.5 MB." in md and "first completion asked over HTTP" in md
