"""Loading FP8 checkpoints in transformers, and the quality gate."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from runtime import fp8format as fmt
from runtime.cli import main
from runtime.evaluate import EvalConfig, GateThresholds, evaluate, gate
from runtime.loader import LoadConfig, load_model
from runtime.prompts import DEFAULT_PROMPTS, load_prompts

PROMPTS = load_prompts()[:8]
FAST = EvalConfig(max_new_tokens=16)


def test_shipped_prompt_set() -> None:
    prompts = load_prompts(DEFAULT_PROMPTS)
    assert len(prompts) >= 40
    assert len({p.id for p in prompts}) == len(prompts)
    assert all(p.prompt.startswith("Correct the grammar:") and p.target for p in prompts)


def test_fp8_checkpoint_loads_in_transformers(tiny_model: Path, tiny_fp8: Path) -> None:
    ref = load_model(tiny_model, LoadConfig(dtype="float32"))
    cand = load_model(tiny_fp8, LoadConfig(dtype="float32", emulate_activations=False))
    rw = ref.model.layers[1].mlp.up_proj.weight
    cw = cand.model.layers[1].mlp.up_proj.weight
    assert cw.dtype == torch.float32 and not torch.equal(rw, cw)
    assert (cw - rw).abs().le(rw.abs() * 2**-4 + rw.abs().amax() / 448 * 2**-10 + 1e-9).all()
    assert torch.equal(ref.lm_head.weight, cand.lm_head.weight)  # kept
    x = torch.tensor([[0, 10, 20, 30, 40]])
    with torch.inference_mode():
        a, b = ref(x).logits, cand(x).logits
    # FP8 E4M3 rounds each weight by up to 2^-4: a few percent at the logits of random layers
    assert 0 < (a - b).norm() / a.norm() < 0.1


def test_gate_is_pure_thresholds() -> None:
    t = GateThresholds(min_exact_match=0.9, min_token_agreement=0.95, max_logprob_gap=0.1)
    assert gate(1.0, 1.0, 0.0, t) == ()
    assert len(gate(0.5, 0.9, 0.2, t)) == 3
    assert gate(0.9, 0.95, float("nan"), t)


def test_model_against_itself_is_identical(tiny_model: Path) -> None:
    r = evaluate(tiny_model, tiny_model, PROMPTS, FAST)
    assert r.passed, r.failures
    assert r.exact_match == 1.0 and r.token_agreement == 1.0 and r.logprob_gap == 0.0
    assert all(p.reference == p.candidate and p.tokens > 0 for p in r.results)


@pytest.fixture(scope="module")
def damaged(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("damaged") / "model"
    shutil.copytree(tiny_model, out)
    sd = load_file(out / "model.safetensors")
    g = torch.Generator().manual_seed(7)
    for name in ("lm_head.weight", "model.layers.2.mlp.down_proj.weight"):
        w = sd[name]
        sd[name] = (w.float() + torch.randn(w.shape, generator=g) * w.float().std() * 3).to(w.dtype)
    save_file(sd, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_damaged_model_is_flagged(tiny_model: Path, damaged: Path) -> None:
    r = evaluate(tiny_model, damaged, PROMPTS, FAST)
    assert not r.passed
    assert r.exact_match < 0.5 and r.token_agreement < 0.5 and r.logprob_gap > 0.1


def test_fp8_candidate_is_close(tiny_model: Path, tiny_fp8: Path) -> None:
    # A random tiny model has almost flat logits, so greedy outputs flip easily: the FP8 copy
    # must still be much closer to the reference than a damaged model, not pass a release gate.
    r = evaluate(tiny_model, tiny_fp8, PROMPTS, FAST)
    assert r.token_agreement > 0.5
    assert r.logprob_gap < 0.1


def test_cli_evaluate_exit_codes(tiny_model: Path, damaged: Path, tmp_path: Path) -> None:
    data = tmp_path / "p.jsonl"
    data.write_text("\n".join(json.dumps({"id": p.id, "prompt": p.prompt}) for p in PROMPTS[:3]))
    runner = CliRunner()
    args = ["evaluate", str(tiny_model), "--data", str(data), "--max-new-tokens", "8"]
    r = runner.invoke(
        main, [*args[:2], str(tiny_model), *args[2:], "--report", str(tmp_path / "r.json")]
    )
    assert r.exit_code == 0, r.output
    assert "PASS" in r.output
    assert json.loads((tmp_path / "r.json").read_text())["passed"] is True
    r = runner.invoke(main, [*args[:2], str(damaged), *args[2:]])
    assert r.exit_code == 1 and "FAIL" in r.output
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{not json\n")
    r = runner.invoke(main, ["evaluate", str(tiny_model), str(tiny_model), "--data", str(bad)])
    assert r.exit_code == 3 and "runtime: error: EvaluationError" in r.output


def test_fp8_scheme_matches_written_config(tiny_fp8: Path) -> None:
    cfg = json.loads((tiny_fp8 / "config.json").read_text())
    assert fmt.parse_quantization_config(cfg).ignore == ("lm_head",)
