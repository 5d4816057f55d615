"""The fused weight mode's C++ accumulation on CUDA (``harness.runtime.native_wgrad``, ``pytest -m gpu suites/gpu``):
under the default ``auto`` it builds, runs in place of the Python kernel, and gives its gradients bit for bit (the
same mixed-dtype GEMM into fp32), eager and in an Inductor-compiled chain."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_and_triton")]


@pytest.mark.parametrize("compiled", [None, "inductor"], ids=["eager", "inductor-chain"])
def test_auto_builds_the_cpp_kernel_and_it_gives_the_python_kernels_gradients(monkeypatch, compiled):
    from harness.runtime import native_wgrad
    from suites.runtime.test_native_wgrad import _fused_grads

    monkeypatch.setenv(native_wgrad.ENV, "auto")
    torch._dynamo.reset()
    native, ops = _fused_grads("cuda", bf16=True, compiled=compiled)
    assert "dcp_harness::accumulate_wgrad_native" in ops and "dcp_harness::accumulate_wgrad" not in ops, ops
    monkeypatch.setenv(native_wgrad.ENV, "off")
    torch._dynamo.reset()
    python, ops = _fused_grads("cuda", bf16=True, compiled=compiled)
    assert "dcp_harness::accumulate_wgrad" in ops and "dcp_harness::accumulate_wgrad_native" not in ops, ops
    assert native.keys() == python.keys()
    assert all(torch.equal(native[k], python[k]) for k in python), [k for k in python
                                                                    if not torch.equal(native[k], python[k])]
