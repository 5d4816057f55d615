"""``harness.plan.binpack`` (bin packing behind ``balanced``'s row layouts) and the bound it gives,
``cp_rows_min``: exact against brute force on small instances, honest about proof, deterministic."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.plan import ALGORITHMS, PlanInputError, schedule
from harness.plan.binpack import min_bins, simple_bound
from harness.plan.bounds import cp_rows_min
from harness.testing import batches


def _brute_force(sizes: list[int], cap: int) -> int:
    """Least bins by trying every assignment of items to bins (items <= 7)."""
    n = len(sizes)
    for k in range(1, n + 1):
        for assign in itertools.product(range(k), repeat=n):
            load = [0] * k
            for x, b in zip(sizes, assign):
                load[b] += x
            if max(load) <= cap:
                return k
    return 0


@given(sizes=st.lists(st.integers(1, 100), min_size=1, max_size=7), cap=st.integers(100, 160))
def test_min_bins_is_a_packing_and_its_proven_count_is_least(sizes, cap):
    got = min_bins(sizes, cap)
    assert sorted(i for b in got.bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= cap for b in got.bins) and all(got.bins)
    best = _brute_force(sizes, cap)
    assert simple_bound(sizes, cap) <= best <= len(got.bins)
    assert got.proven and len(got.bins) == best  # 7 items never exhaust the node limit
    assert min_bins(list(sizes), cap) == got  # deterministic


def test_branch_and_bound_beats_first_fit_decreasing_and_says_when_it_gave_up():
    # first fit decreasing: 9 | 5+4 | 3+2+2+2 | 2 = 4 bins; least: 9 | 5+3+2 | 4+2+2+2 = 3
    sizes = [9, 5, 4, 3, 2, 2, 2, 2]
    assert len(min_bins(sizes, 10, node_limit=0).bins) == 4 and not min_bins(sizes, 10, node_limit=0).proven
    got = min_bins(sizes, 10)
    assert len(got.bins) == 3 and got.proven


def test_bad_items_raise_a_typed_error_naming_them():
    with pytest.raises(PlanInputError, match=r"cap=10, got \[11\]"):
        min_bins([5, 11], 10)
    with pytest.raises(PlanInputError, match=r"got \[0\]"):
        min_bins([5, 0], 10)
    assert min_bins([], 10).bins == [] and simple_bound([], 10) == 0


def test_cp_rows_min_counts_rows_that_hold_a_cp_block():
    # three 5000-token sequences need a CP-4 row each (two never share 8192 slots); the 3000 joins one
    assert cp_rows_min([5000, 5000, 5000, 3000, 100], n_ranks=4, max_seqlen_per_rank=2048) == 3
    assert cp_rows_min([3000, 3000, 3000], n_ranks=4, max_seqlen_per_rank=2048) == 2  # 6000 + 3000
    assert cp_rows_min([100, 2048], n_ranks=4, max_seqlen_per_rank=2048) == 0
    assert cp_rows_min([100, 100], n_ranks=4, max_seqlen_per_rank=2048, min_cp_size=2) == 1


@given(batch=batches(vpp=False))
def test_no_schedule_has_fewer_cp_rows_than_cp_rows_min(batch):
    """Rank 0 is in every micro-batch's widest block (sizes never increase left to right), so the
    micro-batches holding a CP block are at least ``cp_rows_min`` in every algorithm's schedule."""
    floor = cp_rows_min(batch.lengths, n_ranks=batch.n_ranks, max_seqlen_per_rank=batch.max_seqlen_per_rank,
                        min_cp_size=batch.min_cp_size)
    for algorithm in ALGORITHMS:
        try:
            s = schedule(batch.lengths, algorithm=algorithm, **batch.kwargs())
        except Exception as e:  # dp-balanced may refuse a batch it cannot split (its own suite checks why)
            assert algorithm == "dp-balanced", e
            continue
        rows = sum(1 for m in range(s.num_microbatches) if s.blocks(m)[0].size > 1)
        assert rows >= floor, (algorithm, rows, floor)
