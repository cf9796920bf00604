"""The serve launcher: vLLM command line (pure) and the front with a real engine process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support import free_port

from runtime.launch import EngineConfig, engine_command

STANDIN = Path(__file__).with_name("standin_engine.py")
ROOT = Path(__file__).resolve().parents[2]


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_gpu_command_for_short_requests(tiny_model: Path, tiny_fp8: Path) -> None:
    argv = engine_command(EngineConfig(model_dir=tiny_model), "127.0.0.1", 8100)
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == str(tiny_model)
    assert int(_flag(argv, "--api-server-count")) > 1
    assert "--async-scheduling" in argv and "--enforce-eager" not in argv
    assert _flag(argv, "--max-cudagraph-capture-size") == _flag(argv, "--max-num-seqs")
    assert int(_flag(argv, "--max-num-seqs")) >= 128
    assert _flag(argv, "--kv-cache-dtype") == "auto"
    assert "--quantization" not in argv
    fp8 = engine_command(EngineConfig(model_dir=tiny_fp8), "127.0.0.1", 8100)
    assert _flag(fp8, "--quantization") == "compressed-tensors"


def test_cpu_command(tiny_fp8: Path) -> None:
    argv = engine_command(EngineConfig.for_cpu(tiny_fp8, extra_args=("--seed", "1")), "h", 1)
    assert "--enforce-eager" in argv and "--no-async-scheduling" in argv
    assert _flag(argv, "--api-server-count") == "1"
    assert float(_flag(argv, "--gpu-memory-utilization")) < 0.5
    assert argv[-2:] == ["--seed", "1"]


class Launcher:
    """``runtime serve`` as a real process, fronting the stand-in engine."""

    def __init__(self, model: Path, tmp: Path, *engine_args: str, drain_grace: float = 0.0):
        self.port, self.engine_port = free_port(), free_port()
        self.pid_file = tmp / f"engine-{self.port}.pid"
        cmd = f"{sys.executable} {STANDIN} --port {{port}} --pid-file {self.pid_file} "
        cmd += " ".join(engine_args)
        self.log = open(tmp / f"launcher-{self.port}.log", "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "runtime.cli",
                "-v",
                "serve",
                str(model),
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--engine-port",
                str(self.engine_port),
                "--engine-command",
                cmd,
                "--warmup-requests",
                "4",
                "--startup-timeout",
                "30",
                "--drain-grace",
                str(drain_grace),
                "--drain-timeout",
                "20",
            ],  # fmt: skip
            cwd=ROOT,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        self.url = f"http://127.0.0.1:{self.port}"

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, timeout=5)

    def wait_status(self, path: str, status: int, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if self.get(path).status_code == status:
                    return
            except httpx.TransportError:
                pass
            assert self.proc.poll() is None, self.output()
            time.sleep(0.05)
        raise AssertionError(f"{path} never {status}\n{self.output()}")

    def engine_stats(self) -> dict:
        return httpx.get(f"http://127.0.0.1:{self.engine_port}/stats", timeout=5).json()

    def engine_pid(self) -> int:
        return int(self.pid_file.read_text())

    def output(self) -> str:
        self.log.flush()
        return Path(self.log.name).read_text(errors="replace")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.pid_file.exists():
            try:
                os.kill(self.engine_pid(), signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.log.close()


@pytest.fixture
def launcher(tiny_model: Path, tmp_path: Path):
    made: list[Launcher] = []

    def make(*engine_args: str, **kw) -> Launcher:
        made.append(Launcher(tiny_model, tmp_path, *engine_args, **kw))
        return made[-1]

    yield make
    for la in made:
        la.close()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie of an exited child still answers kill(0); look at its state
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _complete(url: str, delay: float = 0.0) -> httpx.Response:
    body = {"model": "model", "prompt": "Correct: a", "max_tokens": 4, "delay": delay}
    return httpx.post(url + "/v1/completions", json=body, timeout=30)


@pytest.mark.integration
def test_ready_only_after_warmup_then_proxies(launcher) -> None:
    la = launcher("--startup-delay", "1.5")
    la.wait_status("/health", 200)
    assert la.get("/ready").status_code == 503  # engine still starting
    early = _complete(la.url)  # the engine does not listen yet: retryable, not logged
    assert early.status_code == 503 and early.text == "engine starting\n"
    la.wait_status("/ready", 200)
    assert "engine unreachable" not in la.output()
    assert la.engine_stats()["completions"] >= 4  # the warm-up batch went through the engine
    r = _complete(la.url)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == " corrected."
    assert la.get("/v1/unknown").status_code == 404  # engine's answer, passed through


@pytest.mark.integration
def test_sigterm_drains_in_flight_then_exits(launcher) -> None:
    la = launcher()
    la.wait_status("/ready", 200)
    results: list[httpx.Response] = []
    threads = [
        threading.Thread(target=lambda: results.append(_complete(la.url, delay=2.0)))
        for _ in range(3)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while la.engine_stats()["in_flight"] < 3:  # all three are in the engine now
        assert time.monotonic() < deadline
        time.sleep(0.02)
    la.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(httpx.TransportError):  # no longer accepting
        _complete(la.url)
    for t in threads:
        t.join(10)
    assert [r.status_code for r in results] == [200, 200, 200]
    assert la.proc.wait(15) == 0, la.output()
    assert not _alive(la.engine_pid())


@pytest.mark.integration
def test_drain_grace_keeps_serving_while_unready(launcher) -> None:
    la = launcher(drain_grace=1.5)
    la.wait_status("/ready", 200)
    la.proc.send_signal(signal.SIGTERM)
    la.wait_status("/ready", 503, timeout=5)
    assert _complete(la.url).status_code == 200  # the load balancer may still send some
    assert la.proc.wait(15) == 0, la.output()


@pytest.mark.integration
def test_failed_warmup_exits_nonzero(launcher) -> None:
    la = launcher("--fail-completions")
    assert la.proc.wait(30) == 1
    assert "warm-up failed" in la.output()
    assert not _alive(la.engine_pid())


@pytest.mark.integration
def test_engine_death_exits_nonzero(launcher) -> None:
    la = launcher()
    la.wait_status("/ready", 200)
    os.kill(la.engine_pid(), signal.SIGKILL)
    assert la.proc.wait(15) == 1
    assert "engine exited" in la.output()


def test_print_command(tiny_fp8: Path) -> None:
    from click.testing import CliRunner

    from runtime.cli import main

    r = CliRunner().invoke(main, ["serve", str(tiny_fp8), "--device", "cpu", "--print-command"])
    assert r.exit_code == 0, r.output
    assert "--quantization compressed-tensors" in r.output and "--enforce-eager" in r.output
    json.dumps(r.output)


def _standin_cfg(model: Path, tmp: Path, *engine_args: str) -> tuple[object, Path]:
    from runtime.launch import FrontConfig, ServeConfig

    pid_file = tmp / "engine.pid"
    cmd = (sys.executable, str(STANDIN), "--port", "{port}", "--pid-file", str(pid_file))
    cfg = ServeConfig(
        engine=EngineConfig(model_dir=model),
        front=FrontConfig(engine_port=free_port(), startup_timeout_s=30, warmup_requests=2),
        engine_command=cmd + engine_args,
    )
    return cfg, pid_file


@pytest.mark.integration
def test_running_engine_stops_engine_when_the_block_fails(tiny_model: Path, tmp_path) -> None:
    from runtime.launch import running_engine

    cfg, _ = _standin_cfg(tiny_model, tmp_path, "--startup-delay", "0.5")
    with pytest.raises(RuntimeError, match="boom"), running_engine(cfg) as eng:
        assert _complete(eng.url).status_code == 200  # healthy and warmed up
        pid = eng.pid
        raise RuntimeError("boom")
    assert not _alive(pid)


@pytest.mark.integration
def test_running_engine_failed_warmup(tiny_model: Path, tmp_path: Path) -> None:
    from runtime.errors import LaunchError
    from runtime.launch import running_engine

    cfg, pid_file = _standin_cfg(tiny_model, tmp_path, "--fail-completions")
    with pytest.raises(LaunchError, match="warm-up failed"), running_engine(cfg):
        pass
    assert not _alive(int(pid_file.read_text()))


@pytest.mark.integration
def test_engine_gets_sigterm_when_the_launcher_is_killed(launcher) -> None:
    """SIGKILL leaves no cleanup code to run: the kernel's parent-death signal stops the engine."""
    la = launcher()
    la.wait_status("/ready", 200)
    pid = la.engine_pid()
    la.proc.kill()
    la.proc.wait()
    deadline = time.monotonic() + 10
    while _alive(pid):
        assert time.monotonic() < deadline, "the engine outlived its launcher"
        time.sleep(0.05)


@pytest.mark.integration
def test_warm_up_command_for_an_engine_we_did_not_start(tmp_path: Path) -> None:
    """``runtime warm-up URL``: the startup probe when vLLM owns the port (no front)."""
    from click.testing import CliRunner

    from runtime.cli import main

    port = free_port()
    engine = subprocess.Popen(
        [sys.executable, str(STANDIN), "--port", str(port), "--startup-delay", "0.5"]
    )
    try:
        url = f"http://127.0.0.1:{port}"
        r = CliRunner().invoke(main, ["warm-up", url, "--requests", "3", "--timeout", "30"])
        assert r.exit_code == 0 and "warm" in r.output, r.output
        assert httpx.get(url + "/stats").json()["completions"] == 3
    finally:
        engine.terminate()
        engine.wait()
    r = CliRunner().invoke(main, ["warm-up", url, "--timeout", "0.5"])
    assert r.exit_code == 3 and "runtime: error: LaunchError: engine not healthy" in r.output
