"""The chunked loss head on CUDA (``harness.runtime.chunked_loss``, ``pytest -m gpu suites/gpu``): under bf16 autocast
and in the fused weight mode (the weight's gradient added into its fp32 ``.grad`` by the mixed-dtype GEMM of
``fused_linear.gemm_accumulate``), the losses and gradients of the whole head in fp32, within bf16's rounding, and no
further from them than the whole head's own bf16 run; the memory it saves: ``dcp-harness bench loss``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_and_triton")]


def _case(T=4096, E=512, V=32000, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    h = (torch.randn(T, E, generator=g) / E ** 0.5 * 4).cuda()
    w = (torch.randn(V, E, generator=g) / E ** 0.5).cuda()
    labels = torch.randint(0, V, (T,), generator=g).cuda()
    weight = ((torch.rand(T, generator=g) > 0.1).float() / T).cuda()
    return h, w, labels, weight


def _run(h, w, labels, weight, chunk, bf16, fused=False):
    import torch.nn.functional as F

    from harness.runtime.chunked_loss import head_losses
    from harness.runtime.weight_cache import FusedWeight

    hh = h.detach().requires_grad_()
    ww = w.detach().requires_grad_()
    main_grad = torch.zeros_like(w) if fused else None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=bf16):
        if chunk:
            arg = FusedWeight(ww.bfloat16(), main_grad) if fused else ww
            loss = head_losses(hh, arg, labels, chunk)
        else:
            loss = F.cross_entropy(F.linear(hh, ww).float(), labels, reduction="none")
    (loss * weight).sum().backward()
    return loss.detach(), hh.grad, main_grad if fused else ww.grad


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max()).item()


@pytest.mark.parametrize("fused", [False, True], ids=["autocast", "fused-weight"])
def test_the_chunked_head_in_bf16_is_as_close_to_fp32_as_the_whole_head_in_bf16(fused):
    h, w, labels, weight = _case()
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # the reference in fp32 proper
    try:
        exact = _run(h, w, labels, weight, 0, bf16=False)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    whole = _run(h, w, labels, weight, 0, bf16=True)
    chunked = _run(h, w, labels, weight, 1000, bf16=True, fused=fused)  # a partial last chunk
    for name, a, b, c in zip(("loss", "dh", "dw"), exact, whole, chunked, strict=True):
        assert torch.isfinite(c).all(), name
        assert _rel(c, a) < 5e-2, (name, _rel(c, a))
        assert _rel(c, a) <= 1.5 * _rel(b, a) + 1e-3, (name, _rel(c, a), _rel(b, a))
