"""The rows by levels at scale: the pools find exactly the least loaded block with room, the skips change no
row, ``balanced`` under barriers uses the levels beyond ``EXTRA_MAX_SEQUENCES``, and the helpers the speed
rests on (``cp_min`` without a loop, the paused cyclic collector) keep their contracts."""

from __future__ import annotations

import gc
import heapq
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.data.workloads import sample
from harness.plan import SYNCHRONOUS, CostModel, check_schedule, gpt_benchmark_cost, quality, schedule, simulate
from harness.plan.api import cyclic_gc_paused
from harness.plan.balanced import EXTRA_MAX_SEQUENCES, levels
from harness.plan.balanced.evaluate import Judge
from harness.plan.balanced.items import Item
from harness.plan.cost import cp_min
from harness.testing import batches

GPT = gpt_benchmark_cost()
LN1024 = "lognormal:mean=1024,sigma=1.5,min=128,max=8192"


def _items(pairs, mslpr, min_cp, cost):
    return [Item(g, L, cp_min(L, mslpr, min_cp), cost) for g, L in pairs]


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as m:
        yield m


@settings(max_examples=40, deadline=None)
@given(batch=batches(max_log_ranks=6, max_sequences=64), many=st.booleans(), cap=st.sampled_from([None, 0.5, 1.25]))
def test_skipping_changes_no_row(batch, many, cap, monkeypatch_module):
    """``_next_candidate`` skips only sequences that could find no block: the rows equal those of trying every
    sequence in turn (skipping off), under costs with and without a quadratic term and with widening caps."""
    pairs = sorted(batch.lengths)
    if many and pairs:
        lens = sample(LN1024, 16 * batch.n_ranks, seed=len(pairs))
        pairs = [(g, min(L, batch.n_ranks * batch.max_seqlen_per_rank)) for g, L in enumerate(lens)]
    if not pairs:
        return
    n, mslpr, leaf = batch.n_ranks, batch.max_seqlen_per_rank, batch.min_cp_size
    for cost in (GPT, CostModel.megatron(), CostModel(quadratic=0.0, linear=1.0, cp_comm=0.1)):
        items = _items(pairs, mslpr, leaf, cost)
        mean = sum(it.own * it.cp for it in items) / n
        limit = None if cap is None else cap * mean
        fast = levels.level_rows(items, n, mslpr, leaf, cost, limit)
        with monkeypatch_module.context() as m:
            m.setattr(levels, "_skips", lambda *_: False)
            slow = levels.level_rows(items, n, mslpr, leaf, cost, limit)
        assert fast == slow


def test_a_cost_of_constants_alone_never_skips():
    """Every sequence costs the same whatever its tokens: ``narrow`` is not by decreasing tokens, so the skips
    are off, and the rows hold every sequence."""
    cost = CostModel(quadratic=0.0, linear=0.0, constant=1.0)
    assert not levels._skips(cost, 1)
    assert levels._skips(CostModel(quadratic=0.0, linear=0.0, cp_comm=1.0), 2)
    pairs = list(enumerate([700, 100, 2000, 50, 1500, 900, 300, 1200, 40, 1900] * 3))
    rows = levels.level_rows(_items(pairs, 2048, 1, cost), 4, 2048, 1, cost)
    assert sorted(g for row in rows for _, gids in row for g in gids) == [g for g, _ in pairs]


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10**6), floor=st.sampled_from([0, 1, 40]))
def test_a_pool_finds_the_least_loaded_block_with_room(seed, floor):
    """``_Pool.least_fitting`` against a scan of every block: the least (load, index) with room for the tokens
    (and room for ``floor``), or None when that one would pass the level; ``max_room`` / ``least_load`` are
    the scans' figures, whatever order the sequences come in."""
    rnd = random.Random(seed)
    pool = levels._Pool(1, rnd.choice([0.0, 0.5]), 400, floor)
    for _ in range(rnd.randint(1, 12)):
        k = pool.open()
        pool.room[k] = rnd.randint(50, 400)  # blocks that opened with different rooms
        pool.rooms.append((-pool.room[k], k))
    heapq.heapify(pool.rooms)
    for _ in range(60):
        L, c, level = rnd.randint(1, 300), rnd.uniform(0.1, 3.0), rnd.uniform(1.0, 12.0)
        if rnd.random() < 0.2:  # as a wide sequence that found no block does: a new block, added to off the top
            k = pool.open()
            pool.add(k, Item(0, min(L, 400), 1, CostModel.megatron()), min(L, 400), rnd.uniform(0.1, 6.0))
            continue
        fits = [(pool.load[k], k) for k in range(len(pool.load)) if pool.room[k] >= max(L, floor)]
        want = min(fits, default=None)
        got = pool.least_fitting(L, c, level)
        if want is None or want[0] + c > level:
            assert got is None
        else:
            assert got == want[1]
            pool.add(got, Item(len(pool.items[got]), L, 1, CostModel.megatron()), L, c, top=True)
        alive = [k for k in range(len(pool.load)) if pool.room[k] >= floor]
        assert pool.max_room() == max((pool.room[k] for k in alive), default=0)
        assert pool.least_load() == min((pool.load[k] for k in alive), default=float("inf"))
    assert [b[1:3] for b in pool.blocks()] == [[ld, r] for ld, r in zip(pool.load, pool.room)]


def test_balanced_under_barriers_uses_the_levels_beyond_the_small_sizes():
    """Above ``EXTRA_MAX_SEQUENCES`` the synchronous model still builds the rows by levels: ``balanced`` is never
    slower than them, and close to the lower bound (the levels' 1.04-1.05 at this density)."""
    n, mslpr = 256, 2048
    lengths = sample(LN1024, 2 * EXTRA_MAX_SEQUENCES, seed=3)
    ours = schedule(lengths, n_ranks=n, max_seqlen_per_rank=mslpr, cost=GPT, execution="synchronous")
    assert not check_schedule(ours)
    items = _items(list(enumerate(lengths)), mslpr, 1, GPT)
    rows = levels.level_rows(items, n, mslpr, 1, GPT)
    assert simulate(ours).step_time <= Judge(items, n, mslpr, GPT, SYNCHRONOUS).time(rows) * (1 + 1e-12)
    assert quality(ours) < 1.06


@settings(max_examples=300, deadline=None)
@given(L=st.integers(1, 1 << 22), mslpr=st.integers(1, 1 << 16), min_cp=st.sampled_from([1, 2, 4, 8]))
def test_cp_min_is_the_least_power_of_two_that_holds_the_sequence(L, mslpr, min_cp):
    p = cp_min(L, mslpr, min_cp)
    assert p >= min_cp and p & (p - 1) == 0
    assert p * mslpr >= L
    assert p == min_cp or (p // 2) * mslpr < L


def test_the_cyclic_collector_is_paused_and_restored():
    assert gc.isenabled()
    with cyclic_gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with cyclic_gc_paused():
            raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()  # a caller's own pause stays
    finally:
        gc.enable()
