"""``harness.runtime.grad_add`` off CUDA: ``add_into`` is ATen's ``add_`` (the kernel is for CUDA tensors only;
its own checks are ``suites/gpu/test_gpu_grad_add.py``)."""

from __future__ import annotations

import pytest
import torch

from harness.runtime import grad_add


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_the_cpu_add_into_is_aten_add(dtype):
    g = torch.Generator().manual_seed(0)
    dst = torch.randn(37, 5, generator=g)
    src = torch.randn(37, 5, generator=g).to(dtype)
    ref = dst.clone().add_(src)
    assert not grad_add.uses_kernel(dst, src)
    grad_add.add_into(dst, src)
    assert torch.equal(dst, ref)


def test_a_shape_add_would_refuse_is_refused_as_add_refuses_it():
    with pytest.raises(RuntimeError):
        grad_add.add_into(torch.zeros(4, 3), torch.zeros(5, 3, dtype=torch.bfloat16))
