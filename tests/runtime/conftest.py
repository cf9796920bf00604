"""Fixtures for runtime tests: one tiny model (and its FP8 copy) per session."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session", autouse=True)
def _one_thread():
    # Tiny matrices on shared cores: threads only add contention.
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from runtime.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def tiny_fp8(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from runtime.quantize import quantize_checkpoint

    out = tmp_path_factory.mktemp("tiny-fp8") / "model"
    quantize_checkpoint(tiny_model, out)
    return out
