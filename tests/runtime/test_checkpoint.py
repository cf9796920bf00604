"""The streaming safetensors writer against the reference reader."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from runtime.checkpoint import DTYPE_NAMES, StreamingSafetensorsWriter, TensorSpec, shard_files
from runtime.errors import CheckpointError


def _spec(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, DTYPE_NAMES[t.dtype], tuple(t.shape))


def test_streamed_file_reads_back_exactly(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 5, dtype=torch.bfloat16),
        "b": torch.randn(7, 2).to(torch.float8_e4m3fn),
        "c": torch.arange(6, dtype=torch.int64).reshape(2, 3),
        "d": torch.tensor(1.5),  # 0-d
        "e": torch.randn(4, 1),
        "f": torch.empty(0, 4),
    }
    path = tmp_path / "x.safetensors"
    with StreamingSafetensorsWriter(
        path, [_spec(k, v) for k, v in tensors.items()], {"k": "v"}
    ) as w:
        for k, v in tensors.items():
            w.write(k, v)
    with safe_open(path, framework="pt") as f:
        assert f.metadata() == {"k": "v"}
        assert set(f.keys()) == set(tensors)
        for k, v in tensors.items():
            got = f.get_tensor(k)
            assert got.dtype == v.dtype and got.shape == v.shape
            assert got.reshape(-1).view(torch.uint8).equal(v.reshape(-1).view(torch.uint8))


def test_writer_refuses_wrong_or_missing_tensors(tmp_path: Path) -> None:
    spec = [TensorSpec("a", "F32", (2,)), TensorSpec("b", "F32", (2,))]
    with pytest.raises(CheckpointError):
        with StreamingSafetensorsWriter(tmp_path / "x.safetensors", spec) as w:
            w.write("a", torch.zeros(3))
    w = StreamingSafetensorsWriter(tmp_path / "y.safetensors", spec)
    w.write("a", torch.zeros(2))
    with pytest.raises(CheckpointError, match="never written"):
        w.close()


def test_shard_files_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no safetensors"):
        shard_files(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a": "s1.safetensors"}}'
    )
    with pytest.raises(CheckpointError, match="missing shard"):
        shard_files(tmp_path)
