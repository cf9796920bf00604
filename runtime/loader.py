"""Load a checkpoint into transformers on CPU, FP8 checkpoints included.

An unquantized checkpoint loads with ``from_pretrained``. An FP8 checkpoint (see
``runtime.fp8format``) is read tensor by tensor: each FP8 weight is dequantized with its
per-channel scale into the compute dtype, everything else is taken as stored, and the state
dict is loaded strictly into the architecture built from config.json (without its
quantization_config). With ``emulate_activations`` (the default) each quantized Linear also
rounds its input through FP8 with a dynamic per-token scale, as the serving engine does, so
what the quality gate measures on CPU is the W8A8 error, not only the weights'.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from . import fp8format as fmt
from .checkpoint import read_config, shard_files
from .errors import CheckpointError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadConfig:
    dtype: str | None = None  # compute dtype; None: the checkpoint's own
    emulate_activations: bool = True


def checkpoint_dtype(cfg: dict) -> torch.dtype:
    name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in config.json")
    return dt


def is_fp8_checkpoint(model_dir: Path) -> bool:
    return fmt.parse_quantization_config(read_config(model_dir)) is not None


def dequantized_state_dict(model_dir: Path, dtype: torch.dtype) -> tuple[dict, set[str]]:
    """The checkpoint's tensors with FP8 weights dequantized; also the quantized module names."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    state: dict[str, torch.Tensor] = {}
    quantized: set[str] = set()
    for shard in shard_files(model_dir):
        with safe_open(model_dir / shard, framework="pt") as f:
            names = set(f.keys())
            for name in sorted(names):
                if name.endswith(fmt.SCALE_SUFFIX):
                    continue
                t = f.get_tensor(name)
                if t.dtype == fmt.FP8_DTYPE:
                    module = name.removesuffix(fmt.WEIGHT_SUFFIX)
                    scale_name = module + fmt.SCALE_SUFFIX
                    if scale_name not in names:
                        raise CheckpointError(f"{shard}: {name} is FP8 but has no {scale_name}")
                    t = fmt.dequantize(t, f.get_tensor(scale_name), dtype)
                    quantized.add(module)
                state[name] = t
    return state, quantized


def load_model(model_dir: Path, config: LoadConfig = LoadConfig()):
    """A transformers causal LM (eval mode, CPU) for ``model_dir``, FP8 or not."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = Path(model_dir)
    raw = read_config(model_dir)
    dtype = getattr(torch, config.dtype) if config.dtype else checkpoint_dtype(raw)
    scheme = fmt.parse_quantization_config(raw)
    if scheme is None:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
        return model.eval()

    cfg = AutoConfig.from_pretrained(model_dir)
    if hasattr(cfg, "quantization_config"):
        delattr(cfg, "quantization_config")
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    state, quantized = dequantized_state_dict(model_dir, dtype)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    if set(missing) - tied or unexpected:
        raise CheckpointError(
            f"{model_dir}: weights do not match the architecture"
            f" (missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]})"
        )
    if tied:
        model.tie_weights()
    if config.emulate_activations and scheme.activations_dynamic_per_token:
        modules = dict(model.named_modules())
        for name in quantized:
            modules[name].register_forward_pre_hook(_fake_quantize_input)
    log.info("%s: %d FP8 Linear layers dequantized to %s", model_dir, len(quantized), dtype)
    return model.eval()


def _fake_quantize_input(_module: torch.nn.Module, args: tuple) -> tuple:
    return (fmt.fake_quantize_per_token(args[0]), *args[1:])


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)
