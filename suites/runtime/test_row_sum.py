"""``harness.runtime.row_sum`` off CUDA: the inverted index, the slot-by-slot sum the kernel computes (its ATen
form, which the CPU runs) against a plain Python sum, and CP attention's gradient exchange on one rank. The Triton
kernel itself: ``suites/gpu/test_gpu_row_sum.py``."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from harness.parallel.collectives import gather_keys_values  # noqa: E402
from harness.runtime import row_sum  # noqa: E402
from harness.runtime.row_sum import RowSources, sum_rows  # noqa: E402

indices = st.integers(1, 12).flatmap(lambda rows: st.tuples(
    st.just(rows), st.lists(st.integers(0, rows - 1), max_size=30)))


@settings(max_examples=60, deadline=None)
@given(case=indices)
def test_sources_invert_the_index(case):
    rows, index = case
    s = RowSources.build(index, rows, "cpu")
    ptr, order = s.ptr.tolist(), s.order.tolist()
    for g in range(rows):
        assert order[ptr[g]:ptr[g + 1]] == [i for i, x in enumerate(index) if x == g]  # ascending sources
    assert s.most == max((index.count(g) for g in range(rows)), default=0)


@settings(max_examples=60, deadline=None)
@given(case=indices, dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_the_sum_equals_a_python_sum_in_ascending_order_bit_for_bit(case, dtype, seed):
    rows, index = case
    gen = torch.Generator().manual_seed(seed)
    srcs = [torch.randn(len(index), 3, 5, generator=gen).to(dtype) for _ in range(2)]  # K's and V's gradients
    idx = torch.as_tensor(index, dtype=torch.int64)
    out = torch.full((rows, 2, 3, 5), float("nan"))
    sum_rows(srcs, idx, RowSources.build(index, rows, "cpu"), out)
    want = torch.zeros(rows, 2, 3, 5)
    for p, src in enumerate(srcs):
        for i, g in enumerate(index):  # one fp32 addition at a time, sources ascending
            want[g, p] = want[g, p] + src[i].float()
    assert torch.equal(out, want)
    plain = torch.full((rows, 2, 3, 5), float("nan"))
    sum_rows(srcs, idx, None, plain)  # ATen's zero fill and index_add_: the same numbers
    assert torch.equal(plain, want)


def test_bad_input_names_the_fix():
    with pytest.raises(ValueError, match=r"values in \[0, 4\).*range \[0, 4\]"):
        RowSources.build([0, 4], 4, "cpu")
    src, idx = torch.ones(3, 2), torch.tensor([0, 1, 1])
    with pytest.raises(ValueError, match=r"1 sources of \[3\] rows for an output of 1 parts and an index of 2"):
        sum_rows([src], idx[:2], None, torch.empty(2, 1, 2))
    with pytest.raises(ValueError, match="1 sources .* for an output of 2 parts"):
        sum_rows([src], idx, None, torch.empty(2, 2, 2))
    with pytest.raises(ValueError, match="build them from this index"):
        sum_rows([src], idx, RowSources.build([0, 1], 2, "cpu"), torch.empty(2, 1, 2))
    assert not row_sum.uses_kernel([src], RowSources.build([0, 1, 1], 2, "cpu"), torch.empty(2, 1, 2))  # CPU


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_keys_and_their_gradients_on_one_rank(dtype):
    """Without a group the exchange is ``k[index], v[index]``; the backward sums repeated rows in fp32 and rounds
    once: the fp32 autograd of plain indexing, cast to the input dtype."""
    g = torch.Generator().manual_seed(3)
    k, v = (torch.randn(6, 2, 4, generator=g).to(dtype).requires_grad_() for _ in range(2))
    index = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4, 5, 5, 5])
    dk, dv = (torch.randn(index.numel(), 2, 4, generator=g).to(dtype) for _ in range(2))
    for sources in (None, RowSources.build(index.numpy(), 6, "cpu")):
        ks, vs = gather_keys_values(k, v, None, index, sources)
        assert torch.equal(ks, k.detach()[index]) and torch.equal(vs, v.detach()[index])
        gk, gv = torch.autograd.grad((ks, vs), (k, v), (dk, dv))
        kf, vf = (t.detach().float().requires_grad_() for t in (k, v))
        rk, rv = torch.autograd.grad((kf[index], vf[index]), (kf, vf), (dk.float(), dv.float()))
        assert gk.dtype == dtype and torch.equal(gk, rk.to(dtype)) and torch.equal(gv, rv.to(dtype))
    ks, vs = gather_keys_values(k, v, None, index)
    (gk,) = torch.autograd.grad(ks, k, dk)  # V unused: its gradient is zero, K's unchanged
    assert torch.equal(gk, torch.autograd.grad(k.float()[index], k, dk.float())[0].to(dtype))
