"""The GPU suite: runs on an NVIDIA GPU with flashinfer installed, skips elsewhere.

Every test here is marked `gpu` (`pytest -m gpu tests/gpu` selects them). The skip
is a session-scoped autouse fixture so that it is decided before any CUDA fixture
is built: on a CPU machine, or without flashinfer, each test reports SKIPPED.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.gpu import write_model_dir


@pytest.fixture(scope="session", autouse=True)
def needs_cuda_and_flashinfer() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    pytest.importorskip("flashinfer", reason="needs flashinfer-python (pip install 'sluice[gpu]')")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("tiny-llama"))
