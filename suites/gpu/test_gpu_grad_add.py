"""The weight copies' accumulation kernel on CUDA (``harness.runtime.grad_add``, ``pytest -m gpu suites/gpu``):
``dst + float(src)`` bit for bit as ATen's ``add_`` computes it, for every tail length a block can leave; where it does
not apply, ATen's ``add_`` itself; through the cached weight mode, the per-call path's gradients bit for bit."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_and_triton")]



@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("shape", [(1,), (4095,), (4096,), (4097,), (3, 5, 7), (2048, 2048), (6144, 2048), (1, 8193)])
def test_the_kernel_adds_what_aten_adds(shape, dtype):
    from harness.runtime import grad_add

    g = torch.Generator(device="cuda").manual_seed(0)
    dst = torch.randn(shape, device="cuda", generator=g) * 100
    src = torch.randn(shape, device="cuda", generator=g).to(dtype)
    ref = dst.clone().add_(src)
    assert grad_add.uses_kernel(dst, src)
    for _ in range(2):  # the second add reads the first's result: no element may be skipped or written twice
        grad_add.add_into(dst, src)
    assert torch.equal(dst, ref.add_(src))


def test_where_the_kernel_does_not_apply_aten_adds():
    from harness.runtime import grad_add

    dst = torch.randn(64, 32, device="cuda")
    cases = [(dst.t(), torch.randn(32, 64, device="cuda").bfloat16()),  # not contiguous
             (dst, torch.randn(64, 32, device="cuda")),  # fp32 source
             (dst, torch.randn(32, device="cuda").bfloat16()),  # broadcast
             (dst.bfloat16(), torch.randn(64, 32, device="cuda").bfloat16())]  # bf16 destination
    for a, b in cases:
        assert not grad_add.uses_kernel(a, b)
        ref = a.clone().add_(b)
        grad_add.add_into(a, b)
        assert torch.equal(a, ref)


def test_the_cached_mode_on_cuda_gives_the_per_call_gradients_bit_for_bit():
    """Two steps of three micro-batches of tiny-gpt under bf16 autocast on the GPU, gradients in a flat buffer as the
    training step's: the cached mode (its adds through the kernel, counted) equals the per-call path exactly."""
    from harness.runtime import grad_add
    from harness.runtime import weight_cache as wc
    from suites.runtime.test_weight_cache import _both

    used = []
    original = wc.add_into
    wc.add_into = lambda d, s: (used.append(grad_add.uses_kernel(d, s)), original(d, s))[1]
    try:
        (loss_a, grads_a), (loss_b, grads_b) = _both("tiny-gpt", True, steps=2, flat=True, device="cuda")
    finally:
        wc.add_into = original
    assert used and all(used), f"{sum(used)} of {len(used)} adds ran the kernel"
    assert loss_a == loss_b
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n
