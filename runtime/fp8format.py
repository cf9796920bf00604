"""The FP8 checkpoint format: the only module that knows how an FP8 checkpoint is laid out.

``runtime quantize`` writes it, the CPU loader (``runtime.loader``) reads it, and vLLM loads it
natively. It is the *compressed-tensors* "float-quantized" format, scheme FP8 W8A8:

* every quantized ``nn.Linear`` keeps its tensor name ``<module>.weight``, now
  ``float8_e4m3fn`` with the original ``[out_features, in_features]`` shape;
* beside it, ``<module>.weight_scale``: float32, shape ``[out_features, 1]``, one symmetric
  absmax scale per output channel, so ``weight ≈ weight_fp8.float() * weight_scale``;
* activations are quantized by the engine at run time, dynamically, one scale per token;
* ``config.json`` carries a ``quantization_config`` (below) whose ``ignore`` list names every
  Linear module kept in its original precision (``lm_head`` always); the KV cache is not
  quantized (``kv_cache_scheme: null``), so it stays in the model's dtype.

vLLM fuses q/k/v and gate/up projections into one layer and requires the modules it fuses to
share one scheme; ``FUSED_SIBLINGS`` lists them so the writer can refuse a split.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .errors import CheckpointError

FP8_DTYPE = torch.float8_e4m3fn
# Largest finite E4M3FN value; absmax scaling maps each channel's largest |w| onto it.
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
SCALE_DTYPE = torch.float32
SCALE_SUFFIX = ".weight_scale"
WEIGHT_SUFFIX = ".weight"

QUANT_METHOD = "compressed-tensors"
FORMAT = "float-quantized"
# compressed-tensors version whose schema this module writes (the fields below).
CT_VERSION = "0.10.2"

# Modules vLLM packs into one layer for Llama-family models: all of a group share one scheme.
FUSED_SIBLINGS: tuple[frozenset[str], ...] = (
    frozenset({"q_proj", "k_proj", "v_proj"}),
    frozenset({"gate_proj", "up_proj"}),
)


def _quant_args(*, dynamic: bool, strategy: str, observer: str | None) -> dict[str, Any]:
    return {
        "num_bits": 8,
        "type": "float",
        "symmetric": True,
        "strategy": strategy,
        "dynamic": dynamic,
        "group_size": None,
        "block_structure": None,
        "actorder": None,
        "observer": observer,
        "observer_kwargs": {},
    }


def quantization_config(ignore: list[str]) -> dict[str, Any]:
    """The ``quantization_config`` entry of config.json for FP8 W8A8 (channel / dynamic token)."""
    return {
        "quant_method": QUANT_METHOD,
        "format": FORMAT,
        "quantization_status": "compressed",
        "version": CT_VERSION,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": _quant_args(dynamic=False, strategy="channel", observer="minmax"),
                "input_activations": _quant_args(dynamic=True, strategy="token", observer=None),
                "output_activations": None,
                "format": FORMAT,
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "sparsity_config": {},
        "transform_config": {},
    }


@dataclass(frozen=True)
class Fp8Scheme:
    """What a reader needs from a checkpoint's quantization_config."""

    ignore: tuple[str, ...]
    activations_dynamic_per_token: bool


def parse_quantization_config(config: dict[str, Any]) -> Fp8Scheme | None:
    """Read config.json's quantization_config: ``None`` for an unquantized checkpoint.

    Raises ``CheckpointError`` for a quantization this module does not handle.
    """
    qc = config.get("quantization_config")
    if qc is None:
        return None
    if qc.get("quant_method") != QUANT_METHOD or qc.get("format") != FORMAT:
        raise CheckpointError(
            f"unsupported quantization: {qc.get('quant_method')}/{qc.get('format')}"
            f" (expected {QUANT_METHOD}/{FORMAT})"
        )
    groups = list((qc.get("config_groups") or {}).values())
    if len(groups) != 1:
        raise CheckpointError(f"expected one config group, found {len(groups)}")
    w = groups[0].get("weights") or {}
    if (w.get("type"), w.get("num_bits"), w.get("strategy"), w.get("dynamic")) != (
        "float",
        8,
        "channel",
        False,
    ):
        raise CheckpointError(f"unsupported weight scheme: {w}")
    a = groups[0].get("input_activations") or {}
    per_token = a.get("dynamic") is True and a.get("strategy") == "token"
    return Fp8Scheme(ignore=tuple(qc.get("ignore") or ()), activations_dynamic_per_token=per_token)


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize a ``[out, in]`` weight to FP8 E4M3 with one absmax scale per output row.

    Returns ``(weight_fp8, scale)`` with ``scale`` float32 of shape ``[out, 1]``. All-zero rows
    get scale 1 (their FP8 values are all zero anyway).
    """
    if weight.ndim != 2:
        raise ValueError(f"per-channel quantization needs a 2-D weight, got {tuple(weight.shape)}")
    w = weight.to(torch.float32)
    if not torch.isfinite(w).all():
        raise ValueError("weight has non-finite values")
    amax = w.abs().amax(dim=1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale.to(SCALE_DTYPE)


def dequantize(weight_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of ``quantize_per_channel``, in ``dtype``."""
    return (weight_fp8.to(torch.float32) * scale.to(torch.float32)).to(dtype)


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """Round activations through FP8 with one dynamic absmax scale per token (last dim).

    This is what the engine does to a quantized layer's input; the CPU loader applies it so
    the quality gate sees the W8A8 error, not only the weights'.
    """
    xf = x.to(torch.float32)
    amax = xf.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.to(torch.float32) * scale).to(x.dtype)
