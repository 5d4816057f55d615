"""Every defect of spec 2.8 (1-12), pinned by the exact input that triggers it upstream: none of them
occurs in harness code. (``suites/upstream/test_upstream_defects.py`` detects them in the installed
megatron-core where it contains that code.)"""

from __future__ import annotations

import inspect
import time

import pytest

from harness.plan import (
    ALGORITHMS,
    BatchTooSmallError,
    NotPowerOfTwoError,
    PlanInputError,
    SequenceTooLongError,
    VPPAlignmentError,
    check_schedule,
    schedule,
    validate_schedule,
)
from harness.plan.cost import cp_min
from harness.plan.layout import blocks_from_slots, layout_from_sizes
from harness.plan.megatron_common import align_upstream, fill_free_ranks, make_buckets

ALL = list(ALGORITHMS)
VECTOR_A = [(0, 8192), (1, 4096), (2, 3000), (3, 2048), (4, 1024), (5, 1024), (6, 512), (7, 512), (8, 256)]


def _timed(fn, *args, **kw):
    t = time.perf_counter()
    try:
        return fn(*args, **kw)
    finally:
        assert time.perf_counter() - t < 1.0, "must answer within a second"


def _valid_or_static_cp_too_small(lengths, algorithm, **kw):
    """Schedules validly; static CP (dp-balanced) may instead refuse a batch with fewer sequences
    than DP replicas, with a typed error."""
    try:
        validate_schedule(_timed(schedule, lengths, algorithm=algorithm, **kw))
    except BatchTooSmallError as e:
        assert algorithm == "dp-balanced" and "DP replicas" in str(e)


def test_bug1_no_negative_index_wraparound():
    """Upstream's ``while sid0 in group[i] and i >= 0`` reads ``group[-1]`` (the last slot) when i
    reaches -1. Blocks here are runs found left to right without index arithmetic: a last slot that
    repeats the first slot's ids is a separate block (and an exactly-once violation), never merged."""
    assert [(b.start, b.size) for b in blocks_from_slots([[0], [1], [2], [0]])] == [(0, 1), (1, 1), (2, 1), (3, 1)]
    v = check_schedule([[[0], [1], [2], [0]]], [(0, 10), (1, 10), (2, 10)], n_ranks=4, max_seqlen_per_rank=10)
    assert [x.invariant for x in v] == ["exactly-once"] and v[0].ranks == (0, 3)
    # the walk to the leftmost block (all blocks equal) is the case where upstream hits i = -1
    assert align_upstream([[(2, [0]), (2, [1]), (2, [2]), (2, [3])]], 2, 8) == [
        [(4, [2]), (4, [3])], [(4, [0]), (4, [1])]]


@pytest.mark.parametrize("algorithm", ALL)
def test_bug2_expansion_needs_room(algorithm):
    """N=10, [8000, 7000], mslpr 2048: upstream expands a cp4 group to 8 and pushes the other past
    position 9 (IndexError) because its ``assert not all(...)`` precondition is vacuous."""
    with pytest.raises(NotPowerOfTwoError, match=r"n_ranks=10 .*use 8 or 16"):
        _timed(schedule, [8000, 7000], n_ranks=10, max_seqlen_per_rank=2048, algorithm=algorithm)
    for n in (8, 16):
        _valid_or_static_cp_too_small([8000, 7000], algorithm, n_ranks=n, max_seqlen_per_rank=2048)
    with pytest.raises(AssertionError, match="cannot expand"):
        fill_free_ranks([4, 4], 10)  # internal guard: never a silent overwrite


@pytest.mark.parametrize("algorithm", ALL)
@pytest.mark.parametrize("vpp", [None, 2])
def test_bug3_slots_never_alias(algorithm, vpp):
    """Upstream builds slots with ``[[]] * N`` and hands every member of an expanded group the same
    list object: ``ids[0] is ids[1]``. Every slot here is its own list."""
    s = schedule(VECTOR_A, n_ranks=8, max_seqlen_per_rank=2048, algorithm=algorithm, vpp_group=vpp)
    mbs = s.microbatches
    slots = [slot for mb in mbs for slot in mb]
    assert len({id(x) for x in slots}) == len(slots)
    before = s.microbatches
    mbs[0][0].append(999)
    assert s.microbatches == before and mbs[0][1] != mbs[0][0]


@pytest.mark.parametrize("algorithm", ALL)
def test_bug4_too_long_sequence_is_a_clear_error(algorithm):
    """N=4, [(0, 5000)], mslpr 1024: upstream fails with the truncated assert message
    'There should be at least one group existing, cannot redistribute, '."""
    with pytest.raises(SequenceTooLongError) as e:
        _timed(schedule, [(0, 5000)], n_ranks=4, max_seqlen_per_rank=1024, algorithm=algorithm)
    msg = str(e.value)
    for part in ("sequence 0", "5000 tokens", "CP group of 8 ranks", "only 4", ">= 1250"):
        assert part in msg


def test_bug5_no_dead_parameters():
    """Upstream ``next_hdp_group`` takes ``strategy="pp"`` (never passed) and ``eps_bucket`` (never read)."""
    params = inspect.signature(schedule).parameters
    assert not {"strategy", "eps_bucket", "delta"} & set(params)
    with pytest.raises(TypeError):
        schedule([1], n_ranks=1, max_seqlen_per_rank=1, strategy="pp")  # type: ignore[call-arg]


def test_bug6_expanded_group_load_counts_every_sequence():
    """Upstream sets an expanded group's load to first_len**2 / new_size. In megatron-dev's vector A,
    micro-batch 1, the cp1 group [1024, 512, 512] is doubled to 2 ranks: its load is the sum."""
    s = schedule(VECTOR_A, n_ranks=8, max_seqlen_per_rank=2048, algorithm="megatron-dev")
    block = s.blocks(1)[1]
    assert block.gids == (5, 6, 7) and block.size == 2
    assert s.load(1)[4] == (1024**2 + 512**2 + 512**2) / 2 != 1024**2 / 2


def test_bug7_positions_derive_from_sizes():
    """Upstream shifts the members of groups with a larger *creation id* after an expansion, which is
    right only while creation order equals position order. Here a micro-batch is a list of sizes in
    position order and positions are prefix sums, so no stale member list can exist."""
    sizes = [2, 1, 1, 1]
    fill_free_ranks(sizes, 8)
    assert sizes == [2, 2, 2, 2]
    blocks = layout_from_sizes([(s, [g]) for g, s in enumerate(sizes)])
    assert [(b.start, b.size) for b in blocks] == [(0, 2), (2, 2), (4, 2), (6, 2)]


def test_bug8_bucket_reservation_rule():
    """``n - i <= remaining_k - len(buckets)`` counts closed buckets twice. Pinned input
    [4000, 3000] at mslpr 1024 (one cp size, k = 1): the literal rule (kept for parity) closes a
    bucket before the last sequence; the intended rule keeps one bucket."""
    cp = lambda L: cp_min(L, 1024)  # noqa: E731
    seqs, work = [(0, 4000), (1, 3000)], (lambda L: L * L / cp(L))
    ids = lambda bs: [[g for g, _ in b] for b in bs]  # noqa: E731
    assert ids(make_buckets(seqs, cp, work, literal=True)) == [[0], [1]]
    assert ids(make_buckets(seqs, cp, work, literal=False)) == [[0, 1]]


@pytest.mark.parametrize("algorithm", ALL)
def test_bug9_vpp_alignment_never_hangs(algorithm):
    """N=24, [7152, 2208], mslpr 1024, M=2: upstream's ``align_sample_id_groups`` loops forever."""
    with pytest.raises(NotPowerOfTwoError, match="n_ranks=24"):
        _timed(schedule, [7152, 2208], n_ranks=24, max_seqlen_per_rank=1024, vpp_group=2, algorithm=algorithm)
    _valid_or_static_cp_too_small([7152, 2208], algorithm, n_ranks=32, max_seqlen_per_rank=1024, vpp_group=2)


def test_bug10_unsplittable_batches():
    """min_cp_size == N leaves one block per micro-batch: upstream asserts 'no tail microbatch has
    enough ids to split'. The parity modes raise a typed error with the fix; ``balanced`` packs
    several sequences per micro-batch and splits them, so it still succeeds."""
    batch = dict(n_ranks=4, max_seqlen_per_rank=1024, min_cp_size=4, vpp_group=2)
    for algorithm in ("megatron-pr2000", "megatron-dev"):
        with pytest.raises(VPPAlignmentError, match="vpp_group=2"):
            _timed(schedule, [100, 100, 100], algorithm=algorithm, **batch)
    validate_schedule(schedule([100, 100, 100], **batch))
    # N=4, M=4 and three sequences: four non-empty micro-batches cannot exist
    with pytest.raises(VPPAlignmentError, match="vpp_group=4"):
        _timed(schedule, [4096, 2048, 1024], n_ranks=4, max_seqlen_per_rank=1024, vpp_group=4)


def test_bug11_head_only_scan_is_kept_for_parity():
    """PR #2000 ends a micro-batch when the chosen head has a same-size group but no room, although a
    later sequence would fit. Kept in ``megatron-pr2000`` to match upstream: with N=2 and mslpr 1000,
    700 blocks the two 100s from joining micro-batch 0. ``megatron-dev`` and ``balanced`` move on."""
    lengths = [900, 800, 700, 600, 100, 100]
    kw = dict(n_ranks=2, max_seqlen_per_rank=1000)
    assert schedule(lengths, algorithm="megatron-pr2000", **kw).microbatches[0] == [[0], [1]]
    dev = schedule(lengths, algorithm="megatron-dev", **kw).microbatches[0]
    assert any(4 in slot or 5 in slot for slot in dev)


@pytest.mark.parametrize("kw, match", [
    (dict(n_ranks=12), "n_ranks=12 .*use 8 or 16"),
    (dict(n_ranks=8, min_cp_size=3), "min_cp_size=3 .*use 2 or 4"),
    (dict(n_ranks=4, min_cp_size=8), "min_cp_size=8 exceeds n_ranks=4"),
])
@pytest.mark.parametrize("algorithm", ALL)
def test_bug12_domain_and_min_cp_are_validated(algorithm, kw, match):
    """Upstream accepts a non-power-of-two min_cp and any even N, then fails at runtime because the
    process groups of those sizes do not exist."""
    with pytest.raises(PlanInputError, match=match):
        schedule([100, 200], max_seqlen_per_rank=1024, algorithm=algorithm, **kw)
