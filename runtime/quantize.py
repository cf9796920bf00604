"""Offline FP8 weight quantization of a safetensors checkpoint (``runtime quantize``).

Every ``nn.Linear`` weight becomes FP8 E4M3 with one absmax scale per output channel, written
in the compressed-tensors format that vLLM loads natively (see ``runtime.fp8format``). Layer
groups chosen with ``keep`` patterns stay in their original precision ("hybrid precision");
``lm_head`` always does. Embeddings, norms, biases and anything that is not a Linear weight
are copied unchanged, byte for byte.

Memory stays near one tensor: the input is read tensor by tensor with ``safe_open`` and the
output is written by ``StreamingSafetensorsWriter``, one output shard per input shard, under
a ``.partial`` directory renamed into place at the end.

Patterns match Linear module names (``model.layers.3.self_attn.q_proj``, ``lm_head``): a glob
(``model.layers.0.*``, ``*.self_attn.*``) or, prefixed with ``re:``, a full-match regex.
``{first}`` and ``{last}`` stand for the first and last block's index.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from . import fp8format as fmt
from .checkpoint import (
    CONFIG,
    INDEX,
    StreamingSafetensorsWriter,
    TensorSpec,
    read_config,
    shard_files,
)
from .errors import CheckpointError, QuantizationError

log = logging.getLogger(__name__)

# vLLM expects the output head unquantized in compressed-tensors checkpoints.
ALWAYS_KEPT = ("lm_head",)
PARTIAL_SUFFIX = ".partial"


@dataclass(frozen=True)
class QuantizeConfig:
    """Options of one quantization run.

    keep: patterns of Linear modules kept in original precision (see the module docstring).
    overwrite: replace an existing output directory.
    """

    keep: tuple[str, ...] = ()
    overwrite: bool = False


@dataclass(frozen=True)
class QuantizeResult:
    out_dir: Path
    quantized: tuple[str, ...]  # module names now in FP8
    kept: tuple[str, ...]  # Linear module names left in original precision
    bytes_in: int
    bytes_out: int
    shards: tuple[str, ...] = field(default=())


def _compile(pattern: str, num_layers: int | None) -> re.Pattern[str]:
    if num_layers:
        pattern = pattern.replace("{first}", "0").replace("{last}", str(num_layers - 1))
    if "{first}" in pattern or "{last}" in pattern:
        raise QuantizationError(f"{pattern!r}: config.json has no num_hidden_layers")
    try:
        if pattern.startswith("re:"):
            return re.compile(pattern[3:])
        return re.compile(fnmatch.translate(pattern))
    except re.error as e:
        raise QuantizationError(f"bad pattern {pattern!r}: {e}") from None


def select_kept(linears: set[str], patterns: tuple[str, ...], num_layers: int | None) -> set[str]:
    """The Linear modules to keep in original precision (pure; raises on a useless pattern)."""
    kept = {m for m in linears if m in ALWAYS_KEPT}
    for p in patterns:
        rx = _compile(p, num_layers)
        hits = {m for m in linears if rx.fullmatch(m)}
        if not hits:
            raise QuantizationError(f"--keep-precision {p!r} matches no Linear layer")
        kept |= hits
    _check_fused(linears, kept)
    return kept


def _check_fused(linears: set[str], kept: set[str]) -> None:
    """vLLM fuses q/k/v and gate/up: a fused layer cannot mix FP8 and original precision."""
    for m in kept:
        parent, _, leaf = m.rpartition(".")
        for group in fmt.FUSED_SIBLINGS:
            if leaf not in group:
                continue
            siblings = {f"{parent}.{s}" for s in group} & linears
            split = sorted(siblings - kept)
            if split:
                raise QuantizationError(
                    f"{m} is kept but its fused siblings {split} are not: vLLM fuses them into "
                    "one layer, keep all of them or none"
                )


def linear_modules(model_dir: Path) -> set[str]:
    """Names of the model's ``nn.Linear`` modules, from its architecture (built on 'meta')."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        cfg = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except (ValueError, KeyError, OSError) as e:
        raise CheckpointError(f"{model_dir}: cannot build the architecture: {e}") from None
    return {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def quantize_checkpoint(
    model_dir: Path, out_dir: Path, config: QuantizeConfig = QuantizeConfig()
) -> QuantizeResult:
    """Write an FP8 (W8A8, per-channel weights) copy of ``model_dir`` to ``out_dir``."""
    from safetensors import safe_open

    model_dir, out_dir = Path(model_dir), Path(out_dir)
    cfg = read_config(model_dir)
    if cfg.get("quantization_config"):
        raise QuantizationError(f"{model_dir} is already quantized")
    if out_dir.exists() and any(out_dir.iterdir()) and not config.overwrite:
        raise QuantizationError(f"{out_dir} exists and is not empty (use overwrite)")

    linears = linear_modules(model_dir)
    kept = select_kept(linears, config.keep, cfg.get("num_hidden_layers"))
    shards = shard_files(model_dir)

    tmp = out_dir.with_name(out_dir.name + PARTIAL_SUFFIX)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)

    quantized: list[str] = []
    weight_map: dict[str, str] = {}
    bytes_in = bytes_out = 0
    for shard in shards:
        with safe_open(model_dir / shard, framework="pt") as f:
            names = sorted(f.keys())
            specs: list[TensorSpec] = []
            to_quantize: set[str] = set()
            for name in names:
                sl = f.get_slice(name)
                shape = tuple(sl.get_shape())
                spec = TensorSpec(name, sl.get_dtype(), shape)
                bytes_in += spec.nbytes
                module = name.removesuffix(fmt.WEIGHT_SUFFIX)
                if name.endswith(fmt.WEIGHT_SUFFIX) and module in linears and module not in kept:
                    if len(shape) != 2:
                        raise CheckpointError(f"{name}: Linear weight of shape {shape}")
                    to_quantize.add(name)
                    specs.append(TensorSpec(name, "F8_E4M3", shape))
                    specs.append(TensorSpec(module + fmt.SCALE_SUFFIX, "F32", (shape[0], 1)))
                else:
                    specs.append(spec)
            with StreamingSafetensorsWriter(tmp / shard, specs, {"format": "pt"}) as w:
                for name in names:
                    tensor = f.get_tensor(name)
                    if name in to_quantize:
                        module = name.removesuffix(fmt.WEIGHT_SUFFIX)
                        try:
                            q, scale = fmt.quantize_per_channel(tensor)
                        except ValueError as e:
                            raise QuantizationError(f"{name}: {e}") from None
                        w.write(name, q)
                        w.write(module + fmt.SCALE_SUFFIX, scale)
                        quantized.append(module)
                    else:
                        w.write(name, tensor)
                    del tensor
            for s in specs:
                weight_map[s.name] = shard
                bytes_out += s.nbytes
        log.info("quantized %s (%d tensors to FP8)", shard, len(to_quantize))

    _write_metadata(model_dir, tmp, cfg, kept, weight_map, bytes_out, shards)
    if out_dir.exists():
        shutil.rmtree(out_dir)
    tmp.rename(out_dir)
    result = QuantizeResult(
        out_dir=out_dir,
        quantized=tuple(sorted(quantized)),
        kept=tuple(sorted(kept)),
        bytes_in=bytes_in,
        bytes_out=bytes_out,
        shards=tuple(shards),
    )
    log.info(
        "%s: %d Linear layers in FP8, %d kept; weights %.1f MiB -> %.1f MiB",
        out_dir,
        len(result.quantized),
        len(result.kept),
        bytes_in / 2**20,
        bytes_out / 2**20,
    )
    return result


def _write_metadata(
    model_dir: Path,
    out: Path,
    cfg: dict,
    kept: set[str],
    weight_map: dict[str, str],
    total_size: int,
    shards: list[str],
) -> None:
    for p in sorted(model_dir.iterdir()):
        if p.name in (CONFIG, INDEX) or p.suffix == ".safetensors" or p.name.startswith("."):
            continue
        if p.is_dir():
            shutil.copytree(p, out / p.name)
        else:
            shutil.copy2(p, out / p.name)
    new_cfg = dict(cfg)
    new_cfg["quantization_config"] = fmt.quantization_config(sorted(kept))
    (out / CONFIG).write_text(json.dumps(new_cfg, indent=2, sort_keys=True) + "\n")
    if (model_dir / INDEX).exists() or len(shards) > 1:
        index = {
            "metadata": {"total_size": total_size},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
