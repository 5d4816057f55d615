"""Step-time model of a schedule: a simulated step time, a lower bound, and quality = ratio.

Simulation: every rank runs its micro-batches in order; a CP block starts when all of its ranks are
free and keeps them busy for ``sum(cost.seq_cost(L, size)) + cost.block_overhead(size)``. Blocks of one
micro-batch on disjoint ranks run concurrently; nothing else synchronises ranks (as in training
without pipeline parallelism, until the gradient all-reduce that ends the step).

Lower bound: every rank must run one block per micro-batch and the ranks together must supply each
sequence's rank-time ``s * seq_cost(L, s)``, smallest at ``s = cp_min(L)``, so

    step >= (sum_i s_i * seq_cost(L_i, cp_min_i) + N * per_microbatch * mb_min
             + cp_block * sum(L_i : cp_min_i > 1) / max_seqlen_per_rank) / N,
    mb_min = ceil(sum(L) / (N * max_seqlen_per_rank)), rounded up to a multiple of vpp_group,

(a rank of a CP block holds at most ``max_seqlen_per_rank`` tokens, so the tokens of sequences that
need CP occupy at least that many rank-blocks of size > 1, each charged ``cp_block``),

and ``step >= min_s seq_cost(L, s) + per_microbatch (+ cp_block when cp_min > 1)`` for the costliest
sequence, and ``step >= per_microbatch * mb_min + cp_block * cp_rows_min(...)`` for rank 0, which runs a
block of every micro-batch and is a rank of every micro-batch's widest block (``cp_rows_min``).

>>> from harness.plan.api import schedule
>>> s = schedule([4096, 1024, 1024], n_ranks=2, max_seqlen_per_rank=2048, algorithm="megatron-dev")
>>> round(quality(s), 3)
1.0
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.plan.binpack import min_bins, simple_bound
from harness.plan.cost import CostModel, cp_min
from harness.plan.layout import Schedule
from harness.plan.lengths import check_domain, normalize_lengths


@dataclass(frozen=True)
class Simulation:
    """Result of ``simulate``: per-rank busy time and time spent waiting for block partners."""

    step_time: float
    busy: list[float]
    waiting: list[float]


def simulate(schedule: Schedule, cost: CostModel | None = None) -> Simulation:
    """Run the step-time model of ``schedule`` under ``cost`` (default: the schedule's own)."""
    c = cost or schedule.cost
    n = schedule.n_ranks
    free, busy, wait = [0.0] * n, [0.0] * n, [0.0] * n
    for mb in schedule.layout:
        for b in mb:
            lo, hi = b.start, b.start + b.size
            start = max(free[lo:hi])
            dur = schedule.block_cost(b, c)
            for r in range(lo, hi):
                wait[r] += start - free[r]
                busy[r] += dur
                free[r] = start + dur
    return Simulation(max(free, default=0.0), busy, wait)


def simulate_step_time(schedule: Schedule, cost: CostModel | None = None) -> float:
    """Simulated step time of ``schedule`` under ``cost`` (default: the schedule's own)."""
    return simulate(schedule, cost).step_time


def lower_bound(lengths, *, n_ranks: int, max_seqlen_per_rank: int, cost: CostModel | None = None,
                min_cp_size: int = 1, vpp_group: int | None = None) -> float:
    """A lower bound on the step time of any valid schedule of ``lengths`` (see module doc)."""
    check_domain(n_ranks, max_seqlen_per_rank, min_cp_size, vpp_group)
    c = cost or CostModel.megatron()
    pairs = normalize_lengths(lengths)
    if not pairs:
        return 0.0
    area, single, tokens, wide = 0.0, 0.0, 0, 0
    for _, L in pairs:
        s0 = cp_min(L, max_seqlen_per_rank, min_cp_size)
        wide += L if s0 > 1 else 0
        area += c.seq_area(L, s0)  # cp_comm >= 0 makes s * seq_cost(L, s) non-decreasing in s
        sizes = [s0 << k for k in range((n_ranks // s0).bit_length())]
        single = max(single, min(c.seq_cost(L, s) for s in sizes) + (c.cp_block if s0 > 1 else 0.0))
        tokens += L
    mb_min = -(-tokens // (n_ranks * max_seqlen_per_rank))
    if vpp_group and vpp_group > 1:
        mb_min = -(-mb_min // vpp_group) * vpp_group
    # rank-blocks of CP blocks: tokens that need one (cp_min > 1) fill at most mslpr per rank-block
    cp_blocks = wide / max_seqlen_per_rank / n_ranks
    return max(area / n_ranks + c.per_microbatch * mb_min + c.cp_block * cp_blocks, single + c.per_microbatch,
               c.per_microbatch * mb_min + c.cp_block * cp_rows_min(pairs, n_ranks, max_seqlen_per_rank, min_cp_size))


def cp_rows_min(lengths, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1) -> int:
    """Least number of micro-batches that hold a block of more than one rank, in any valid schedule.

    Block sizes never increase from left to right (invariant ``block-order``), so such a
    micro-batch's widest block starts at rank 0: rank 0 pays ``cp_block`` once per such micro-batch.
    A micro-batch holds at most ``n_ranks x max_seqlen_per_rank`` tokens of sequences with
    ``cp_min > 1``, so their count is at least the fewest bins of that size that pack them
    (``binpack.min_bins`` when it proves its count, else ``binpack.simple_bound``); with
    ``min_cp_size > 1`` every micro-batch counts.

    >>> cp_rows_min([5000, 5000, 5000, 3000, 100], n_ranks=4, max_seqlen_per_rank=2048)  # not 2 = 18000 / 8192
    3
    """
    pairs = normalize_lengths(lengths)
    wide = [L for _, L in pairs if cp_min(L, max_seqlen_per_rank, min_cp_size) > 1]
    if not wide:
        return 0
    cap = n_ranks * max_seqlen_per_rank
    if min_cp_size > 1:
        rows = -(-sum(wide) // cap)
    else:
        packing = min_bins(wide, cap)
        rows = len(packing.bins) if packing.proven else simple_bound(wide, cap)
    return rows


def quality(schedule: Schedule, cost: CostModel | None = None) -> float:
    """Simulated step time / lower bound (1.0 is optimal) under ``cost`` (default: the schedule's)."""
    c = cost or schedule.cost
    lb = lower_bound(list(schedule.lengths.items()), n_ranks=schedule.n_ranks,
                     max_seqlen_per_rank=schedule.max_seqlen_per_rank, cost=c,
                     min_cp_size=schedule.min_cp_size, vpp_group=schedule.vpp_group)
    return simulate_step_time(schedule, c) / lb if lb > 0 else 1.0


@dataclass(frozen=True)
class ScheduleStats:
    """Figures reported for a schedule under one cost model."""

    num_microbatches: int
    step_time: float
    lower_bound: float
    quality: float
    sync_makespan: float
    """Sum over micro-batches of the most-loaded rank (every micro-batch a barrier)."""
    mean_imbalance: float
    """Mean over micro-batches of max/mean per-rank load."""
    token_fill: float
    """Tokens / (micro-batches * N * max_seqlen_per_rank)."""
    cp_histogram: dict[int, int]
    """Block size -> number of sequences run at that size."""


def stats(schedule: Schedule, cost: CostModel | None = None) -> ScheduleStats:
    c = cost or schedule.cost
    lb = lower_bound(list(schedule.lengths.items()), n_ranks=schedule.n_ranks,
                     max_seqlen_per_rank=schedule.max_seqlen_per_rank, cost=c,
                     min_cp_size=schedule.min_cp_size, vpp_group=schedule.vpp_group)
    step = simulate_step_time(schedule, c)
    loads = [schedule.load(m, c) for m in range(schedule.num_microbatches)]
    imb = [max(x) / (sum(x) / len(x)) for x in loads if sum(x) > 0]
    hist: dict[int, int] = {}
    for s in schedule.cp_size_of().values():
        hist[s] = hist.get(s, 0) + 1
    nmb = schedule.num_microbatches
    cap = nmb * schedule.n_ranks * schedule.max_seqlen_per_rank
    return ScheduleStats(
        num_microbatches=nmb, step_time=step, lower_bound=lb, quality=step / lb if lb else 1.0,
        sync_makespan=sum(max(x) for x in loads), mean_imbalance=sum(imb) / len(imb) if imb else 1.0,
        token_fill=sum(schedule.lengths.values()) / cap if cap else 0.0, cp_histogram=dict(sorted(hist.items())),
    )
