"""The gathered keys' gradient sum on CUDA (``harness.runtime.row_sum``, ``pytest -m gpu suites/gpu``): the Triton
kernel against its ATen form run on the CPU (the same fp32 additions in the same order: bit for bit, also for rows of
many sources, where CUDA's atomic ``index_add_`` has no fixed order) and against ``index_add_`` where a row has at most
two sources (CP attention's case); the inverted index of real CP plans; CP attention's gradients with and without it."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("cuda_and_triton")]



def _plan_index(cp: int, rank: int):
    from harness.parallel.cp_attention import CPAttentionPlan

    cu = [0, 8192, 8192 + 2048, 8192 + 2048 + 6144, 16384 + 8192]
    plan = CPAttentionPlan.build(cu, cp, rank, "cpu")
    return plan.chunks.key_index.numpy(), cu[-1]


@pytest.mark.parametrize("parts", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("case", ["plan-cp2", "plan-cp4", "many-sources", "odd-width"])
def test_the_kernel_sums_what_its_aten_form_sums(case, dtype, parts):
    from harness.runtime import row_sum

    rng = np.random.default_rng(0)
    if case.startswith("plan"):
        index, rows = _plan_index(int(case[-1]), 1)
        shape = (16, 128)
    elif case == "many-sources":
        rows = 300
        index = rng.integers(0, rows // 2, 4000)  # ~27 sources a row, half the rows none
        shape = (64,)
    else:
        rows, index, shape = 77, rng.integers(0, 77, 200), (333,)  # a width no block divides
    srcs = [torch.randn(len(index), *shape, device="cuda").to(dtype) * 10 for _ in range(parts)]
    idx = torch.as_tensor(index, device="cuda")
    sources = row_sum.RowSources.build(index, rows, "cuda")
    out = torch.full((rows, parts, *shape), float("nan"), device="cuda")
    assert row_sum.uses_kernel(srcs, sources, out)
    row_sum.sum_rows(srcs, idx, sources, out)
    want = torch.empty(rows, parts, *shape)
    row_sum.sum_rows([s.cpu() for s in srcs], idx.cpu(), row_sum.RowSources.build(index, rows, "cpu"), want)
    assert torch.equal(out.cpu(), want)
    if np.bincount(index).max() <= 2:  # CP attention's case: CUDA's index_add_ gives the same sums
        plain = torch.empty_like(out)
        row_sum.sum_rows(srcs, idx, None, plain)
        assert torch.equal(out, plain)


def test_cp_attention_gradients_with_and_without_the_kernel_on_one_gpu():
    """A CP-4 plan's gather exchange on one rank (no group: the rank's own rows stand in for the gathered K/V):
    K's and V's gradients are the same bits with the inverted index (the kernel) as without (``index_add_``); Q's
    within flash's own run-to-run spread (its backward adds dQ with atomics)."""
    from dataclasses import replace

    from harness.parallel.cp_attention import CPAttentionPlan, cp_attention

    cu = [0, 4096, 4096 + 1024, 8192]
    plan = CPAttentionPlan.build(cu, 4, 2, "cuda")
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(2048, 16, 128, device="cuda", generator=g).bfloat16()
    kv = [torch.randn(8192, 4, 128, device="cuda", generator=g).bfloat16() for _ in range(2)]
    grads = []
    for p in (plan, replace(plan, key_sources=None)):
        leaves = [t.clone().requires_grad_() for t in (q, *kv)]
        out = cp_attention(*leaves, p, None, backend="flash")
        out.backward(torch.ones_like(out))
        grads.append([t.grad for t in leaves])
    (dq_a, dk_a, dv_a), (dq_b, dk_b, dv_b) = grads
    assert torch.equal(dk_a, dk_b) and torch.equal(dv_a, dv_b)
    torch.testing.assert_close(dq_a, dq_b, rtol=1e-2, atol=1e-3)
