"""Fixtures of the GPU suite."""

from __future__ import annotations

import pytest


@pytest.fixture
def cuda_and_triton():
    """Skips a kernel test where there is no CUDA GPU or no Triton."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    pytest.importorskip("triton")
