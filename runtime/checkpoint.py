"""Hugging Face safetensors checkpoints on disk: finding shards, and writing one tensor at a time.

A checkpoint directory holds ``config.json``, the weights as ``*.safetensors`` (one file, or
shards named by ``model.safetensors.index.json``) and the tokenizer and generation files.

``StreamingSafetensorsWriter`` writes a safetensors file whose header is known up front (every
tensor's name, dtype and shape), then the tensors' bytes one by one, so a converter holds one
tensor in memory at a time instead of a whole shard. The file format: an 8-byte little-endian
header length, the JSON header (padded with spaces to a multiple of 8), then the raw
little-endian, C-ordered tensor bytes at the offsets the header gives.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch

from .errors import CheckpointError

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Header alignment used by the reference implementation: tensor data starts 8-byte aligned.
_HEADER_ALIGN = 8

DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPE_SIZES: dict[str, int] = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1,
    "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip


def read_config(model_dir: Path) -> dict[str, Any]:
    path = Path(model_dir) / CONFIG
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{model_dir}: no {CONFIG}") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: {e}") from None


def shard_files(model_dir: Path) -> list[str]:
    """The checkpoint's safetensors file names, in a stable order."""
    model_dir = Path(model_dir)
    index = model_dir / INDEX
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        names = sorted(set(weight_map.values()))
    elif (model_dir / SINGLE).exists():
        names = [SINGLE]
    else:
        names = sorted(p.name for p in model_dir.glob("*.safetensors"))
    if not names:
        raise CheckpointError(f"{model_dir}: no safetensors weights (.bin is not supported)")
    for n in names:
        if not (model_dir / n).is_file():
            raise CheckpointError(f"{model_dir}: missing shard {n}")
    return names


@dataclass(frozen=True)
class TensorSpec:
    """A tensor's entry in a safetensors header."""

    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """A tensor's raw bytes as safetensors stores them (C order, little endian)."""
    t = tensor.detach().to("cpu").contiguous().reshape(-1)
    if t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.view(torch.uint8).numpy().tobytes()


class StreamingSafetensorsWriter:
    """Write a safetensors file tensor by tensor, in the order of ``specs``."""

    def __init__(
        self, path: Path, specs: list[TensorSpec], metadata: dict[str, str] | None = None
    ) -> None:
        self.path = Path(path)
        self._specs = list(specs)
        self._next = 0
        header: dict[str, Any] = {}
        if metadata:
            header["__metadata__"] = dict(metadata)
        offset = 0
        for s in self._specs:
            header[s.name] = {
                "dtype": s.dtype,
                "shape": list(s.shape),
                "data_offsets": [offset, offset + s.nbytes],
            }
            offset += s.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % _HEADER_ALIGN)
        self._f: IO[bytes] = open(self.path, "wb")  # noqa: SIM115 - closed in close()
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if self._next >= len(self._specs):
            raise CheckpointError(f"{self.path}: unexpected tensor {name}")
        spec = self._specs[self._next]
        got = TensorSpec(
            name, DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype)), tuple(tensor.shape)
        )
        if got != spec:
            raise CheckpointError(f"{self.path}: expected {spec}, got {got}")
        self._f.write(tensor_bytes(tensor))
        self._next += 1

    def close(self) -> None:
        self._f.close()
        if self._next != len(self._specs):
            missing = [s.name for s in self._specs[self._next :]]
            raise CheckpointError(
                f"{self.path}: {len(missing)} tensors never written: {missing[:3]}"
            )

    def __enter__(self) -> StreamingSafetensorsWriter:
        return self

    def __exit__(self, exc_type: object, *_: object) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()
