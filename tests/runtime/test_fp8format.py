"""Per-channel FP8 quantization math and the compressed-tensors config (no checkpoint)."""

from __future__ import annotations

import pytest
import torch

from runtime import fp8format as fmt
from runtime.errors import CheckpointError

# E4M3: 3 mantissa bits, so round-to-nearest is within 2^-4 of |x| for normal values; below
# the smallest normal (2^-6) the step is 2^-9, so the absolute error is at most 2^-10
# (both in units of the channel's scale).
REL = 2.0**-4
ABS_SUBNORMAL = 2.0**-10


def _bound(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return torch.maximum(w.abs() * REL, ABS_SUBNORMAL * scale) * (1 + 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_error_is_bounded_per_channel(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(64, 96, generator=g) * torch.logspace(-4, 2, 64)[:, None]
    w[3, 7] = 50.0  # an outlier only widens its own row's scale
    w = w.to(dtype)
    q, scale = fmt.quantize_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (64, 1)
    wf = w.float()
    back = fmt.dequantize(q, scale, torch.float32)
    assert (back - wf).abs().le(_bound(wf, scale)).all()
    # each row's absmax lands exactly on the FP8 maximum
    assert torch.allclose(q.float().abs().amax(dim=1), torch.full((64,), fmt.FP8_MAX))
    assert torch.allclose(scale[:, 0], wf.abs().amax(dim=1) / fmt.FP8_MAX)


def test_per_channel_scales_are_independent() -> None:
    w = torch.ones(4, 8)
    w[0] *= 1000.0
    _, scale = fmt.quantize_per_channel(w)
    assert scale[0, 0] == pytest.approx(1000.0 / 448.0)
    assert scale[1:, 0].tolist() == pytest.approx([1 / 448.0] * 3)


def test_zero_rows_and_bad_input() -> None:
    w = torch.zeros(3, 4)
    w[1] = 2.0
    q, scale = fmt.quantize_per_channel(w)
    assert scale[0, 0] == 1.0 and q[0].float().eq(0).all()
    assert fmt.dequantize(q, scale, torch.float32).equal(w)
    with pytest.raises(ValueError):
        fmt.quantize_per_channel(torch.ones(3))
    with pytest.raises(ValueError):
        fmt.quantize_per_channel(torch.tensor([[1.0, float("nan")]]))


def test_fake_quantize_per_token_bounds() -> None:
    x = torch.randn(2, 5, 64) * torch.logspace(-2, 2, 5)[None, :, None]
    y = fmt.fake_quantize_per_token(x)
    scale = x.abs().amax(dim=-1, keepdim=True) / fmt.FP8_MAX
    assert y.shape == x.shape and y.dtype == x.dtype
    assert (y - x).abs().le(_bound(x, scale)).all()


def test_config_round_trip_and_schema() -> None:
    qc = fmt.quantization_config(["model.layers.0.mlp.down_proj", "lm_head"])
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "float-quantized"
    group = qc["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"]
    w, a = group["weights"], group["input_activations"]
    assert (w["type"], w["num_bits"], w["strategy"], w["dynamic"], w["symmetric"]) == (
        "float", 8, "channel", False, True,
    )  # fmt: skip
    assert (a["type"], a["num_bits"], a["strategy"], a["dynamic"]) == ("float", 8, "token", True)
    assert qc["kv_cache_scheme"] is None
    scheme = fmt.parse_quantization_config({"quantization_config": qc})
    assert scheme.ignore == ("lm_head", "model.layers.0.mlp.down_proj")
    assert scheme.activations_dynamic_per_token
    assert fmt.parse_quantization_config({}) is None


def test_config_rejects_other_schemes() -> None:
    with pytest.raises(CheckpointError):
        fmt.parse_quantization_config({"quantization_config": {"quant_method": "fp8"}})
    qc = fmt.quantization_config([])
    qc["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    with pytest.raises(CheckpointError):
        fmt.parse_quantization_config({"quantization_config": qc})
