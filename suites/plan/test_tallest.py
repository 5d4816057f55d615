"""The synchronous model's tallest-micro-batch bound (``harness.plan.tallest``) and the rows it suggests
(``harness.plan.balanced.tall``): the bound never exceeds the best schedule of a batch (exhaustive search on
small batches), the rows are valid, and both are deterministic."""

from __future__ import annotations

import functools
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.data.workloads import sample
from harness.plan import CostModel, check_schedule, gpt_benchmark_cost, lower_bound, schedule, simulate, tallest
from harness.plan.balanced.candidates import by_levels
from harness.plan.balanced.evaluate import Judge
from harness.plan.balanced.items import Item
from harness.plan.balanced.tall import tall_rows
from harness.plan.cost import cp_min
from harness.plan.execution import SYNCHRONOUS
from harness.plan.layout import Schedule, layout_from_sizes


def _set_partitions(items: tuple):
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _set_partitions(rest):
        yield [(first,)] + part
        for k in range(len(part)):
            yield part[:k] + [(first,) + part[k]] + part[k + 1:]


def _optimum(lengths: list[int], n: int, mslpr: int, cost: CostModel, min_cp: int) -> float:
    """Least synchronous step time over every valid schedule (rows of blocks covering all ``n`` ranks)."""
    sizes = [1 << k for k in range(n.bit_length()) if 1 << k >= min_cp]
    need = [cp_min(L, mslpr, min_cp) for L in lengths]

    @functools.cache
    def row(members: frozenset) -> float:
        best = float("inf")
        for blocks in _set_partitions(tuple(sorted(members))):
            options = []
            for b in blocks:
                lo = max(need[i] for i in b)
                tokens = sum(lengths[i] for i in b)
                options.append([(s, sum(cost.seq_cost(lengths[i], s) for i in b) + cost.block_overhead(s))
                                for s in sizes if s >= lo and tokens <= s * mslpr])
            for pick in itertools.product(*options):
                if sum(s for s, _ in pick) == n:
                    best = min(best, max(c for _, c in pick))
        return best

    @functools.cache
    def rest(left: frozenset) -> float:
        if not left:
            return 0.0
        first = min(left)
        others = sorted(left - {first})
        best = float("inf")
        for k in range(len(others) + 1):
            for extra in itertools.combinations(others, k):
                members = frozenset((first,) + extra)
                best = min(best, row(members) + rest(left - members))
        return best

    return rest(frozenset(range(len(lengths))))


COSTS = [CostModel.megatron(), gpt_benchmark_cost(),
         CostModel(quadratic=1.0, linear=3.0, cp_comm=2.0),
         CostModel(quadratic=1.0, linear=1.0, constant=5.0, cp_comm=0.5, per_microbatch=4.0, cp_block=3.0),
         CostModel(quadratic=0.0, linear=1.0, cp_comm=1.0),
         CostModel(quadratic=1.0, linear=1.0, cp_comm=0.5, per_microbatch=2.0, per_sequence=6.0)]


@st.composite
def small_batches(draw):
    n = draw(st.sampled_from([1, 2, 4]))
    mslpr = draw(st.integers(2, 12))
    min_cp = draw(st.sampled_from([m for m in (1, 2) if m <= n]))
    lengths = draw(st.lists(st.integers(1, n * mslpr), min_size=1, max_size=5))
    return lengths, n, mslpr, min_cp, draw(st.sampled_from(COSTS))


@settings(max_examples=120, deadline=None)
@given(small_batches())
def test_no_schedule_beats_the_synchronous_bound(batch):
    lengths, n, mslpr, min_cp, cost = batch
    best = _optimum(lengths, n, mslpr, cost, min_cp)
    bound = lower_bound(lengths, n_ranks=n, max_seqlen_per_rank=mslpr, cost=cost, min_cp_size=min_cp,
                        execution=SYNCHRONOUS)
    assert bound <= best * (1 + 1e-12), (bound, best)


def test_the_costliest_sequence_may_run_wider_than_its_cp_min():
    """One long sequence and four short ones on 2 ranks (each fits one rank), L**2 plus a K/V exchange of 10 per
    token: the best schedule runs the long one on both ranks (1600 / 2 + 10 * 40 / 2 = 1000, then 6, 6 | 6, 6:
    72), not alone on one (1600). The independent bound sees the area at cp_min (872) or the long sequence alone
    (1000); the tallest micro-batch's bound knows it widens unless a micro-batch is 1600 tall, and meets the
    optimum."""
    lengths, n, mslpr, cost = [40, 6, 6, 6, 6], 2, 64, CostModel(quadratic=1.0, cp_comm=10.0)
    best = _optimum(lengths, n, mslpr, cost, 1)
    bound = lower_bound(lengths, n_ranks=n, max_seqlen_per_rank=mslpr, cost=cost, execution=SYNCHRONOUS)
    area = lower_bound(lengths, n_ranks=n, max_seqlen_per_rank=mslpr, cost=cost)
    assert (area, best) == (1000.0, 1072.0)
    assert bound == pytest.approx(best, rel=1e-3) and bound <= best  # within the search's finest interval


def test_the_bound_is_deterministic_never_above_its_ceiling_and_loosens_with_a_smaller_budget(monkeypatch):
    lengths = sample("lognormal:mean=4096,sigma=1.5,min=256,max=131072", 512, 3)
    kw = dict(n_ranks=64, max_seqlen_per_rank=16384, cost=gpt_benchmark_cost(), execution=SYNCHRONOUS)
    full = lower_bound(lengths, **kw)
    assert full == lower_bound(lengths, **kw) > 1.02 * lower_bound(lengths, **{**kw, "execution": "independent"})
    assert tallest.tallest_bound(lengths, 64, 16384, gpt_benchmark_cost(), 1, 2, ceiling=1.0) == 1.0
    monkeypatch.setattr(tallest, "EVALUATIONS", 40)
    assert lower_bound(lengths, **kw) <= full


def test_a_cost_of_fixed_terms_only_bounds_by_the_micro_batches():
    cost = CostModel(quadratic=0.0, per_microbatch=3.0)
    kw = dict(n_ranks=4, max_seqlen_per_rank=8, cost=cost, execution=SYNCHRONOUS)
    assert lower_bound([8] * 9, **kw) == 9.0  # 72 tokens need 3 micro-batches of 32
    assert tallest.tallest_bound([8] * 9, 4, 8, cost, 1, 3, ceiling=100.0) == 9.0


@st.composite
def long_tail_batches(draw):
    n = draw(st.sampled_from([4, 8, 16, 32]))
    mslpr = draw(st.sampled_from([256, 1024, 4096]))
    per = draw(st.integers(4, 12))
    spec = f"lognormal:mean={mslpr // 4},sigma=1.5,min=16,max={mslpr * n}"
    lengths = sample(spec, n * per, draw(st.integers(0, 10_000)))
    min_cp = draw(st.sampled_from([1, 2]))
    return lengths, n, mslpr, min_cp, draw(st.sampled_from(COSTS))


@settings(max_examples=40, deadline=None)
@given(long_tail_batches())
def test_tall_rows_are_valid_and_deterministic(batch):
    lengths, n, mslpr, min_cp, cost = batch
    items = [Item(g, L, cp_min(L, mslpr, min_cp), cost) for g, L in enumerate(lengths)]
    made = list(tall_rows(items, n, mslpr, min_cp, cost))
    assert made == list(tall_rows(items, n, mslpr, min_cp, cost))
    needs_two = sum(lengths) > n * mslpr and any(it.cp > min_cp for it in items)
    assert bool(made) == needs_two  # candidates whenever the tokens need two micro-batches and one is wide
    for rows in made:
        s = Schedule([layout_from_sizes(mb) for mb in rows], dict(enumerate(lengths)), n, mslpr, min_cp)
        assert check_schedule(s) == []


def test_balanced_leads_a_long_tail_batch_with_one_tall_micro_batch():
    """64 ranks x 512 sequences of mean 4096 at 16384 tokens per rank under the GPT cost: the tall rows beat the
    rows by levels by 6% (on such batches they win about half the time), and ``balanced`` returns them."""
    lengths = sample("lognormal:mean=4096,sigma=1.5,min=256,max=131072", 512, 1)
    n, mslpr, cost = 64, 16384, gpt_benchmark_cost()
    items = [Item(g, L, cp_min(L, mslpr), cost) for g, L in enumerate(lengths)]
    judge = Judge(items, n, mslpr, cost, SYNCHRONOUS, 1, None)
    levels = min(judge.time(r) for r in by_levels(items, n, mslpr, 1, cost))
    tall = min(judge.time(r) for r in tall_rows(items, n, mslpr, 1, cost))
    got = schedule(lengths, n_ranks=n, max_seqlen_per_rank=mslpr, cost=cost, execution="synchronous")
    assert tall < 0.95 * levels
    assert simulate(got).step_time <= tall


@pytest.mark.parametrize("cost", COSTS, ids=lambda c: c.name)
def test_no_tall_rows_when_nothing_needs_a_wide_block(cost):
    items = [Item(g, L, cp_min(L, 64), cost) for g, L in enumerate([10, 20, 30, 40] * 8)]
    assert list(tall_rows(items, 4, 64, 1, cost)) == []
