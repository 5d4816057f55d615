"""THD packing and zig-zag slicing: worked examples, properties, agreement with two independent
formulations (per-sequence chunk lists, and TransformerEngine's kernel index formula), bad input."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.plan.thd import (
    ThdError,
    pack,
    padding_divisor,
    whole_chunks,
    zigzag_chunks,
    zigzag_gather,
    zigzag_index_array,
    zigzag_indices,
    zigzag_permutation,
)

SPEC_EXAMPLES = [  # spec section 4 (checked against TE's own test and its kernel formula)
    ([0, 8, 16], 2, 0, [0, 1, 6, 7, 8, 9, 14, 15]),
    ([0, 8, 16], 2, 1, [2, 3, 4, 5, 10, 11, 12, 13]),
    ([0, 8, 24], 2, 0, [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]),
    ([0, 8, 24], 2, 1, [2, 3, 4, 5, *range(12, 20)]),
    ([0, 12, 16], 2, 0, [0, 1, 2, 9, 10, 11, 12, 15]),
    ([0, 12, 16], 2, 1, [*range(3, 9), 13, 14]),
    ([0, 16], 4, 0, [0, 1, 14, 15]), ([0, 16], 4, 1, [2, 3, 12, 13]),
    ([0, 16], 4, 2, [4, 5, 10, 11]), ([0, 16], 4, 3, [6, 7, 8, 9]),
]


@pytest.mark.parametrize("cu, cp, r, expected", SPEC_EXAMPLES)
def test_spec_worked_examples(cu, cp, r, expected):
    assert zigzag_indices(cu, cp, r) == expected


def chunk_rule(cu, cp, r):
    """Independent formulation: split each sequence into 2cp chunk lists, take chunks r, 2cp-1-r."""
    out = []
    for a, b in zip(cu[:-1], cu[1:]):
        chunks = np.array_split(np.arange(a, b), 2 * cp)
        out += chunks[r].tolist() + chunks[2 * cp - 1 - r].tolist()
    return out


def kernel_rule(cu, cp, r):
    """TE's kernel formula (spec section 4): for local token t, cs = cu / cp, sequence j with
    cs[j] <= t < cs[j+1], idx = t - cs[j], h = (cs[j+1] - cs[j]) / 2, offset = r or 2cp-2-r."""
    cs = [c // cp for c in cu]
    out, j = [], 0
    for t in range(cs[-1]):
        while not cs[j] <= t < cs[j + 1]:
            j += 1
        idx, h = t - cs[j], (cs[j + 1] - cs[j]) // 2
        out.append(idx + cs[j] * cp + h * (r if idx < h else 2 * cp - 2 - r))
    return out


packs = st.integers(1, 4).flatmap(lambda lcp: st.tuples(
    st.just(1 << (lcp - 1)), st.lists(st.integers(0, 12), min_size=0, max_size=6)))


@given(packs)
def test_slicing_properties(args):
    cp, units = args
    cu = np.concatenate([[0], np.cumsum([u * 2 * cp for u in units])]).astype(int).tolist()
    T = cu[-1]
    slices = [zigzag_indices(cu, cp, r) for r in range(cp)]
    assert all(len(s) == T // cp for s in slices)                      # T / cp tokens per rank
    assert sorted(i for s in slices for i in s) == list(range(T))      # disjoint cover
    for r in range(cp):
        assert slices[r] == chunk_rule(cu, cp, r) == kernel_rule(cu, cp, r)
    values = np.arange(T) * 10
    assert zigzag_gather([values[s] for s in slices], cu, cp).tolist() == values.tolist()  # inverse
    assert zigzag_permutation(cu, cp).tolist() == [i for r in range(cp) for i in chunk_rule(cu, cp, r)]  # rank-major


@given(packs)
def test_chunk_plan_matches_the_slices(args):
    """Each local chunk is a run of consecutive pack positions; its keys end at its last query."""
    cp, units = args
    cu = np.concatenate([[0], np.cumsum([u * 2 * cp for u in units])]).astype(int).tolist()
    for r in range(cp):
        idx = zigzag_index_array(cu, cp, r)
        plan = zigzag_chunks(cu, cp, r)
        assert plan.q_lens.sum() == idx.size
        pos = 0
        for q_len, q_off, k_start, k_len in zip(plan.q_lens, plan.q_offsets, plan.k_starts, plan.k_lens):
            run = idx[pos:pos + q_len]
            assert (run == k_start + q_off + np.arange(q_len)).all()
            assert k_len == q_off + q_len
            pos += q_len


def test_cp1_keeps_the_whole_pack_without_padding():
    assert zigzag_indices([0, 5, 12], 1, 0) == list(range(12))
    plan = whole_chunks([0, 5, 12])
    assert plan.q_lens.tolist() == [5, 7] and plan.k_lens.tolist() == [5, 7]


def test_packing_and_divisors():
    p = pack([5, 9, 3], divisor=4)
    assert (p.cu_seqlens, p.cu_seqlens_padded, p.max_seqlen, p.total_tokens) == ([0, 5, 14, 17], [0, 8, 20, 24], 12, 24)
    assert padding_divisor(cp_size=1) == 1 and padding_divisor(cp_size=4) == 8
    assert padding_divisor(n_ranks=8) == 16                             # dynamic CP: 2 * dp * cp
    assert padding_divisor(cp_size=2, tp_size=2, sequence_parallel=True) == 8
    assert padding_divisor(cp_size=2, tp_size=2) == 4
    assert pack([], 4).cu_seqlens_padded == [0]


@pytest.mark.parametrize("cu, cp, r, match", [
    ([0, 6, 16], 2, 0, r"cu_seqlens_padded\[1\] = 6 is not divisible by 2 \* cp_size = 4"),
    ([0, 8, 4], 2, 0, r"decreases at index 2: 8 -> 4"),
    ([0, 8], 0, 0, r"cp_size must be an int >= 1, got 0"),
    ([0, 8], 2, 2, r"cp_rank=2 is outside \[0, 2\)"),
    ([0, 8], 2, -1, r"cp_rank=-1 is outside"),
    ([4, 8], 2, 0, r"starting at 0"),
])
def test_bad_input_names_the_value(cu, cp, r, match):
    with pytest.raises(ThdError, match=match) as e:
        zigzag_indices(cu, cp, r)
    assert isinstance(e.value, ValueError)
