"""``runtime evaluate --engine vllm``: the gate starts vLLM (CPU backend) for each side in turn.

Needs ``runtime/.venv-vllm`` (``runtime/scripts/setup-vllm-cpu.sh``). Each vLLM start takes
~25 s on an idle 2-core machine (minutes on a loaded one): two full starts and one
interrupted start in all.
"""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import support

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / "runtime" / ".venv-vllm" / "bin" / "python"
PROMPTS = 4
MAX_NEW = 12


def _session(sid: int) -> list[int]:
    """Live processes in session ``sid`` (the engine's: vLLM and everything it spawned)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def _evaluate(ref: Path, cand: Path, tmp: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runtime.cli",
            "-v",
            "evaluate",
            str(ref),
            str(cand),
            "--engine",
            "vllm",
            "--device",
            "cpu",
            "--python",
            str(VLLM_PYTHON),
            "--limit",
            str(PROMPTS),
            "--max-new-tokens",
            str(MAX_NEW),
            "--engine-log",
            str(tmp / "engine.log"),
            *extra,
        ],  # fmt: skip
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _engine_pids(log: str) -> list[int]:
    return [int(p) for p in re.findall(r"engine pid (\d+):", log)]


@pytest.mark.integration
def test_evaluate_starts_vllm_per_side(tiny_model: Path, tiny_fp8: Path, tmp_path: Path) -> None:
    support.require(VLLM_PYTHON.exists(), "needs runtime/.venv-vllm (setup-vllm-cpu.sh)")
    from runtime.evaluate import EvalConfig, evaluate
    from runtime.prompts import load_prompts

    proc = _evaluate(tiny_model, tiny_fp8, tmp_path, "--report", str(tmp_path / "r.json"))
    out, err = proc.communicate(timeout=1800)
    assert proc.returncode in (0, 1), err[-4000:]  # 1: the tiny random model may fail the gate
    pids = _engine_pids(err)
    assert len(pids) == 2, err[-4000:]  # the reference's engine, then the candidate's
    assert err.index("engine ready") < err.index(f"engine pid {pids[1]}")  # one at a time
    for pid in pids:
        assert _session(pid) == [], f"engine {pid} left processes behind"
    assert "APIServer" in (tmp_path / "engine.log").read_text()  # vLLM's output went there
    assert "APIServer" not in out and ("PASS" in out or "FAIL" in out)

    r = json.loads((tmp_path / "r.json").read_text())
    assert r["prompts"] == PROMPTS and len(r["results"]) == PROMPTS
    assert all(0 < x["tokens"] <= MAX_NEW for x in r["results"])
    # FP8 against the original, as vLLM serves them: close, but not the same model
    assert 0 < r["logprob_gap"] < 0.1 and r["token_agreement"] > 0.5
    # the same comparison on CPU with transformers measures the same FP8 error
    cpu = evaluate(tiny_model, tiny_fp8, load_prompts()[:PROMPTS], EvalConfig(max_new_tokens=12))
    assert cpu.logprob_gap / 2 < r["logprob_gap"] < cpu.logprob_gap * 2, (cpu, r)


@pytest.mark.integration
def test_ctrl_c_during_startup_leaves_no_process(tiny_model: Path, tmp_path: Path) -> None:
    support.require(VLLM_PYTHON.exists(), "needs runtime/.venv-vllm (setup-vllm-cpu.sh)")
    proc = _evaluate(tiny_model, tiny_model, tmp_path)
    try:
        pid = None
        while pid is None:
            line = proc.stderr.readline()
            assert line, proc.communicate()[1][-4000:]
            pid = next(iter(_engine_pids(line)), None)
        # Wait until vLLM has spawned its engine-core process: the tree to clean up.
        deadline = time.monotonic() + 600
        while len(_session(pid)) < 2:
            assert proc.poll() is None, proc.communicate()[1][-4000:]
            assert time.monotonic() < deadline, "vLLM never spawned its engine core"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode != 0
        assert "Traceback" not in err, err[-4000:]
        deadline = time.monotonic() + 10
        while _session(pid):
            assert time.monotonic() < deadline, f"left behind: {_session(pid)}"
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
