"""``runtime quantize`` on the tiny model: format, error bounds, kept layers, patterns."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors import safe_open

from runtime import fp8format as fmt
from runtime.checkpoint import INDEX, tensor_bytes
from runtime.cli import main
from runtime.errors import QuantizationError
from runtime.quantize import QuantizeConfig, linear_modules, quantize_checkpoint, select_kept
from runtime.tiny import TinyModelConfig, make_tiny_model


def _tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(model_dir.glob("*.safetensors")):
        with safe_open(shard, framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def test_fp8_checkpoint_layout(tiny_model: Path, tiny_fp8: Path) -> None:
    src, dst = _tensors(tiny_model), _tensors(tiny_fp8)
    linears = linear_modules(tiny_model)
    cfg = json.loads((tiny_fp8 / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["ignore"] == ["lm_head"]
    assert fmt.parse_quantization_config(cfg) is not None
    quantized = linears - {"lm_head"}
    assert len(quantized) == 7 * 4
    for m in quantized:
        w, s = dst[m + ".weight"], dst[m + ".weight_scale"]
        assert w.dtype == torch.float8_e4m3fn and w.shape == src[m + ".weight"].shape
        assert s.dtype == torch.float32 and s.shape == (w.shape[0], 1)
        ref = src[m + ".weight"].float()
        err = (fmt.dequantize(w, s, torch.float32) - ref).abs()
        bound = torch.maximum(ref.abs() * 2**-4, s * 2**-10) * (1 + 1e-6)
        assert err.le(bound).all(), m
    # everything that is not a quantized Linear weight is copied byte for byte
    for name, t in src.items():
        if name.removesuffix(".weight") not in quantized:
            assert tensor_bytes(dst[name]) == tensor_bytes(t) and dst[name].dtype == t.dtype
    assert set(dst) == set(src) | {m + ".weight_scale" for m in quantized}
    # tokenizer and generation config travel with the weights
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (tiny_fp8 / f).read_bytes() == (tiny_model / f).read_bytes()


def test_keep_precision_groups_are_untouched(tiny_model: Path, tmp_path: Path) -> None:
    keep = ("model.layers.{first}.*", "model.layers.{last}.*", "re:.*\\.self_attn\\.o_proj")
    r = quantize_checkpoint(tiny_model, tmp_path / "out", QuantizeConfig(keep=keep))
    src, dst = _tensors(tiny_model), _tensors(tmp_path / "out")
    expected_kept = {
        m
        for m in linear_modules(tiny_model)
        if m == "lm_head"
        or m.startswith(("model.layers.0.", "model.layers.3."))
        or m.endswith("o_proj")
    }
    assert set(r.kept) == expected_kept
    ignore = json.loads((tmp_path / "out/config.json").read_text())["quantization_config"]["ignore"]
    assert set(ignore) == expected_kept
    for m in expected_kept:
        assert tensor_bytes(dst[m + ".weight"]) == tensor_bytes(src[m + ".weight"])
        assert dst[m + ".weight"].dtype == torch.bfloat16
        assert m + ".weight_scale" not in dst
    assert dst["model.layers.1.mlp.up_proj.weight"].dtype == torch.float8_e4m3fn


def test_sharded_checkpoint_keeps_its_shards(tmp_path: Path) -> None:
    src = make_tiny_model(tmp_path / "src", TinyModelConfig(max_shard_size="300KB"))
    assert (src / INDEX).exists()
    r = quantize_checkpoint(src, tmp_path / "out")
    assert len(r.shards) > 1
    index = json.loads((tmp_path / "out" / INDEX).read_text())
    for shard in r.shards:
        with safe_open(tmp_path / "out" / shard, framework="pt") as f:
            for k in f.keys():
                assert index["weight_map"][k] == shard
    assert len(index["weight_map"]) == len(_tensors(tmp_path / "out"))
    assert not (tmp_path / "out.partial").exists()


def test_select_kept_patterns() -> None:
    linears = {
        f"model.layers.{i}.{p}"
        for i in range(3)
        for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj",
                  "mlp.gate_proj", "mlp.down_proj")
    } | {"lm_head"}  # fmt: skip
    assert select_kept(linears, (), 3) == {"lm_head"}
    assert select_kept(linears, ("*.mlp.down_proj",), 3) == {"lm_head"} | {
        f"model.layers.{i}.mlp.down_proj" for i in range(3)
    }
    last = select_kept(linears, ("model.layers.{last}.*",), 3) - {"lm_head"}
    assert last and all(m.startswith("model.layers.2.") for m in last)
    with pytest.raises(QuantizationError, match="matches no"):
        select_kept(linears, ("model.layers.9.*",), 3)
    with pytest.raises(QuantizationError, match="fused"):
        select_kept(linears, ("*.q_proj",), 3)
    with pytest.raises(QuantizationError, match="fused"):
        select_kept(linears, ("re:.*gate_proj",), 3)
    with pytest.raises(QuantizationError, match="bad pattern"):
        select_kept(linears, ("re:(",), 3)


def test_refusals(tiny_model: Path, tiny_fp8: Path, tmp_path: Path) -> None:
    with pytest.raises(QuantizationError, match="already quantized"):
        quantize_checkpoint(tiny_fp8, tmp_path / "again")
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "x").write_text("x")
    with pytest.raises(QuantizationError, match="not empty"):
        quantize_checkpoint(tiny_model, tmp_path / "busy")


def test_cli_quantize(tiny_model: Path, tmp_path: Path) -> None:
    runner = CliRunner()
    out = tmp_path / "cli"
    r = runner.invoke(main, ["quantize", str(tiny_model), str(out), "--keep-precision", "*.mlp.*"])
    assert r.exit_code == 0, r.output
    assert "Linear layers in FP8" in r.output
    r = runner.invoke(main, ["quantize", str(tiny_model), str(out), "--keep-precision", "nope"])
    assert r.exit_code == 3
    assert "runtime: error: QuantizationError" in r.output
