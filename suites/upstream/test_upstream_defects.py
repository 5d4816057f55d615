"""Defects of spec 2.8 detected, by name, in the installed megatron-core (0.16.1, the part-1 design),
plus three it has that PR #2000 fixed or never had. Each test passes when the defect is present and
documents it; it fails (and should be revisited) the day upstream fixes it.

Not applicable to 0.16.1 (no such code): bug 1 and bug 9 (``align_sample_id_groups``), bug 10 (VPP),
bug 11 (part 1 has no capacity check at all, see ``test_capacity``). Bug 7 (members shifted by
creation id) is in the code but cannot be observed: new groups always take the lowest free
positions, so creation order equals position order.
"""

from __future__ import annotations

import inspect
import random

import pytest

from harness.plan import check_schedule
from harness.plan.cost import cp_min
from harness.plan.megatron_common import make_buckets
from harness.upstream import megatron

pytestmark = pytest.mark.upstream


def _invariants(mbs, lengths, n, mslpr):
    return {v.invariant for v in check_schedule(mbs, list(enumerate(lengths)), n_ranks=n, max_seqlen_per_rank=mslpr)}


def test_bug2_vacuous_expansion_check_raises_index_error():
    with pytest.raises(IndexError):
        megatron.sample_id_groups([8000, 7000], n_ranks=10, max_seqlen_per_rank=2048)


def test_bug3_expanded_slots_alias_one_list():
    lengths = [8192, 4096, 3000, 2048, 1024, 1024, 512, 512, 256]
    groups = megatron.sample_id_groups(lengths, n_ranks=8, max_seqlen_per_rank=2048)
    assert groups[1][0] == [3] and groups[1][0] is groups[1][1]


def test_bug4_assert_message_is_truncated():
    with pytest.raises(AssertionError) as e:
        megatron.sample_id_groups([5000], n_ranks=4, max_seqlen_per_rank=1024)
    assert str(e.value).endswith("cannot reditribute, ")  # the fix hint is a separate no-op statement


def test_bug5_strategy_and_eps_bucket_are_dead():
    params = inspect.signature(megatron.scheduler(8, 1024).next_hdp_group).parameters
    assert {"strategy", "eps_bucket"} <= set(params)
    rng = random.Random(0)
    for _ in range(50):
        seqs = sorted(((i, rng.randint(1, 8 * 1024)) for i in range(rng.randint(1, 30))), key=lambda p: -p[1])
        outs = []
        for eps in (0.0, 0.1, 0.9):
            s = megatron.scheduler(8, 1024)
            outs.append(s.next_hdp_group(list(seqs), s.get_total_workload, 8, eps_bucket=eps)[3])
        assert outs[0] == outs[1] == outs[2]


def test_bug6_expanded_group_load_counts_only_its_first_sequence():
    """N=6: 4000 and 3500 both need cp4; 3500 joins 4000's group, which is then expanded to 6."""
    s = megatron.scheduler(6, 1024)
    _, _, exec_times, ids = s.next_hdp_group([(0, 4000), (1, 3500)], s.get_total_workload, 6)
    assert ids == [[0, 1]] * 6
    assert exec_times[0] == 4000**2 / 6 != (4000**2 + 3500**2) / 6


def test_bug8_buckets_count_closed_buckets_twice():
    seqs = [(0, 4000), (1, 3000)]
    s = megatron.scheduler(8, 1024)
    theirs = [[g for g, _ in b] for b in s.make_buckets_equal(seqs, s.get_total_workload)]
    cp = lambda L: cp_min(L, 1024)  # noqa: E731
    ids = lambda bs: [[g for g, _ in b] for b in bs]  # noqa: E731
    assert theirs == ids(make_buckets(seqs, cp, lambda L: L * L / cp(L), literal=True)) == [[0], [1]]
    assert ids(make_buckets(seqs, cp, lambda L: L * L / cp(L), literal=False)) == [[0, 1]]


def test_bug12_non_power_of_two_domain_gives_a_block_without_process_group():
    """N=12: 0.16.1 creates dynamic groups of sizes [2, 4] only, but the scheduler emits an 8-block."""
    mbs = megatron.sample_id_groups([7000, 100], n_ranks=12, max_seqlen_per_rank=1024)
    assert mbs == [[[0]] * 8 + [[1]] * 4]
    assert "block-size" in _invariants(mbs, [7000, 100], 12, 1024)


def test_capacity_is_not_checked_when_joining_a_group():
    mbs = megatron.sample_id_groups([13, 12], n_ranks=2, max_seqlen_per_rank=8)
    assert _invariants(mbs, [13, 12], 2, 8) == {"capacity"}


def test_trim_overload_breaks_buddy_alignment():
    """Trimmed sequences are appended to the leftovers unsorted, so a later micro-batch opens a
    4-block after 2-blocks: ranks 2..5 have no common process group."""
    lengths = [27, 27, 19, 6, 61, 56, 60, 26, 29]
    mbs = megatron.sample_id_groups(lengths, n_ranks=8, max_seqlen_per_rank=16)
    assert mbs[2] == [[3], [3], [5], [5], [5], [5], [2], [2]]
    assert {"buddy-alignment", "block-order"} <= _invariants(mbs, lengths, 8, 16)


def test_trim_overload_breaks_block_order():
    lengths = [6, 28, 29, 23, 2]
    mbs = megatron.sample_id_groups(lengths, n_ranks=4, max_seqlen_per_rank=16)
    assert mbs[1] == [[0], [4], [3], [3]]
    assert "block-order" in _invariants(mbs, lengths, 4, 16)
