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

Other execution models (``harness.plan.execution``: ``execution=`` of ``simulate``, ``lower_bound``,
``quality``, ``stats``). Synchronous (a barrier after every micro-batch): the same bound (barriers only
delay blocks), or the bound of the tallest micro-batch when that is higher (``harness.plan.tallest``: no
micro-batch is taller than the tallest, so the longest sequences widen to fit it or it holds them, and the
others hold what its ranks cannot). Pipeline of ``pp`` stages: every term above bounds some rank's *busy* time, a stage's ranks
run ``w_s`` (its chunks' share of the model, ``1 / pp`` evenly split) of each of their blocks, and a rank of
stage s can start only after the forward of its first micro-batch crossed the chunks before its first one
(``A_s`` of the model: ``s / (pp * vpp)`` evenly split) and ends before the backward of its last one crosses
them back, each of those passes at least ``smallest_block`` (the least per-rank cost of any block:
``per_microbatch`` plus the smallest ``seq_cost(L, s) (+ cp_block when s > 1)`` over sequences and sizes
``cp_min(L) <= s <= N``; every rank runs a sequence in every micro-batch), so

    step >= max( max_s [w_s * bound + A_s * smallest_block],  costliest block ),

the last term because one micro-batch's forward and backward through all the chunks run one after the
other, a whole block's cost (``min_s seq_cost(L, s) + per_microbatch (+ cp_block)`` for the costliest
sequence). With pp 1 it is the bound above.

>>> from harness.plan.api import schedule
>>> s = schedule([4096, 1024, 1024], n_ranks=2, max_seqlen_per_rank=2048, algorithm="megatron-dev")
>>> round(quality(s), 3)
1.0

Under a pipeline of 2 stages, with cost = L on one rank: each stage runs half of the 24 tokens' work (12);
stage 1 cannot start before stage 0 ran the forward of the first micro-batch (1/3 of half its cost) and
stage 0 runs the backward of the last one after stage 1 ended it (2/3 of half): at least half of the
smallest block (6 tokens), 12 + 3 = 15. With 2 virtual chunks per stage only a quarter of the model lies
before stage 1: 12 + 1.5.

>>> from harness.plan.execution import Execution
>>> lin = CostModel(quadratic=0.0, linear=1.0)
>>> lower_bound([6, 6, 12], n_ranks=1, max_seqlen_per_rank=12, cost=lin)
24.0
>>> lower_bound([6, 6, 12], n_ranks=1, max_seqlen_per_rank=12, cost=lin, execution=Execution.pipeline(2))
15.0
>>> lower_bound([6, 6, 12], n_ranks=1, max_seqlen_per_rank=12, cost=lin, execution=Execution.pipeline(2, vpp=2))
13.5
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.plan.binpack import min_bins, simple_bound
from harness.plan.cost import CostModel, check_microbatch_tokens, cp_min
from harness.plan.execution import (
    INDEPENDENT,
    BoundTerms,
    Execution,
    Simulation,
    execution_bound,
    resolve_execution,
    simulate_execution,
)
from harness.plan.layout import Schedule
from harness.plan.lengths import check_domain, normalize_lengths
from harness.plan.tallest import tallest_bound


def simulate(schedule: Schedule, cost: CostModel | None = None, execution: Execution | str | None = None) -> Simulation:
    """Run the step-time model of ``schedule`` under ``cost`` (default: the schedule's own) and ``execution``
    (an ``Execution`` or its name; default: the one the schedule was made for, ``Schedule.execution``;
    ``harness.plan.execution`` has the models and their rules)."""
    return simulate_execution(schedule, cost or schedule.cost, resolve_execution(execution, schedule.execution))


def simulate_step_time(schedule: Schedule, cost: CostModel | None = None,
                       execution: Execution | str | None = None) -> float:
    """Simulated step time of ``schedule`` under ``cost`` (default: the schedule's own) and ``execution``
    (default: ``Schedule.execution``)."""
    return simulate(schedule, cost, execution).step_time


def lower_bound(lengths, *, n_ranks: int, max_seqlen_per_rank: int, cost: CostModel | None = None,
                min_cp_size: int = 1, vpp_group: int | None = None,
                execution: Execution | str | None = None, microbatch_tokens_per_rank: int | None = None) -> float:
    """A lower bound on the step time of any valid schedule of ``lengths`` under ``execution`` (an ``Execution``
    or its name; default independent; see module doc). An interleaved pipeline's micro-batch group counts as
    ``vpp_group`` when that is not given. With ``microbatch_tokens_per_rank`` (a micro-batch's capacity per rank
    above ``max_seqlen_per_rank``) the terms that count micro-batches or rank-blocks by tokens use it (the
    tallest micro-batch's argument and the CP rows are those of the problem with both at that capacity: a
    relaxation, so still a bound); each sequence's ``cp_min`` stays ``max_seqlen_per_rank``'s."""
    check_domain(n_ranks, max_seqlen_per_rank, min_cp_size, vpp_group)
    cap = check_microbatch_tokens(microbatch_tokens_per_rank, max_seqlen_per_rank)
    execution = resolve_execution(execution)
    c = cost or CostModel.megatron()
    pairs = normalize_lengths(lengths)
    if not pairs:
        return 0.0
    group = vpp_group or execution.vpp_group
    area, single, tokens, wide = 0.0, 0.0, 0, 0
    for _, L in pairs:
        s0 = cp_min(L, max_seqlen_per_rank, min_cp_size)
        wide += L if s0 > 1 else 0
        area += c.seq_area(L, s0)  # cp_comm >= 0 makes s * seq_cost(L, s) non-decreasing in s
        sizes = [s0 << k for k in range((n_ranks // s0).bit_length())]
        single = max(single, min(c.seq_cost(L, s) for s in sizes) + (c.cp_block if s0 > 1 else 0.0))
        tokens += L
    mb_min = -(-tokens // (n_ranks * cap))
    if group and group > 1:
        mb_min = -(-mb_min // group) * group
    # rank-blocks of CP blocks: tokens that need one (cp_min > 1) fill at most mslpr per rank-block
    cp_blocks = wide / cap / n_ranks
    busy = max(area / n_ranks + c.per_microbatch * mb_min + c.cp_block * cp_blocks, single + c.per_microbatch,
               c.per_microbatch * mb_min + c.cp_block * cp_rows_min(pairs, n_ranks, cap, min_cp_size))
    if execution == INDEPENDENT:
        return busy
    terms = BoundTerms(busy=busy, chain=single + c.per_microbatch,
                       smallest_block=smallest_block(pairs, n_ranks, max_seqlen_per_rank, c, min_cp_size))
    bound = execution_bound(terms, execution)
    if execution.kind == "synchronous":  # the tallest micro-batch's argument (``harness.plan.tallest``)
        bound = max(bound, tallest_bound([L for _, L in pairs], n_ranks, cap, c, min_cp_size,
                                         mb_min, ceiling=2 * bound))
    return bound


def smallest_block(lengths, n_ranks: int, max_seqlen_per_rank: int, cost: CostModel, min_cp_size: int = 1) -> float:
    """Least per-rank cost of any block of a valid schedule: it holds a sequence (coverage) on ``s`` ranks,
    ``cp_min(L) <= s <= n_ranks``, and costs at least ``seq_cost(L, s) + block_overhead(s)``.

    >>> smallest_block([100, 300], 4, 200, CostModel(quadratic=1.0, cp_block=5.0))  # 100**2 / 4 + 5
    2505.0
    """
    best = float("inf")
    for _, L in normalize_lengths(lengths):
        s = cp_min(L, max_seqlen_per_rank, min_cp_size)
        while s <= n_ranks:
            best = min(best, cost.seq_cost(L, s) + cost.block_overhead(s))
            s *= 2
    return best if best < float("inf") else 0.0


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


def schedule_lower_bound(schedule: Schedule, cost: CostModel | None = None,
                         execution: Execution | str | None = None) -> float:
    """``lower_bound`` of ``schedule``'s batch and domain under ``cost`` and ``execution`` (default: the
    schedule's own)."""
    execution = resolve_execution(execution, schedule.execution)
    return lower_bound(list(schedule.lengths.items()), n_ranks=schedule.n_ranks,
                       max_seqlen_per_rank=schedule.max_seqlen_per_rank, cost=cost or schedule.cost,
                       min_cp_size=schedule.min_cp_size, vpp_group=schedule.vpp_group, execution=execution,
                       microbatch_tokens_per_rank=schedule.microbatch_tokens_per_rank)


def quality(schedule: Schedule, cost: CostModel | None = None, execution: Execution | str | None = None) -> float:
    """Simulated step time / lower bound (1.0 is optimal) under ``cost`` and ``execution`` (default: the
    schedule's own, ``Schedule.cost`` / ``Schedule.execution``)."""
    c = cost or schedule.cost
    execution = resolve_execution(execution, schedule.execution)
    lb = schedule_lower_bound(schedule, c, execution)
    return simulate_step_time(schedule, c, execution) / lb if lb > 0 else 1.0


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
    """Tokens / (micro-batches * N * the capacity of a rank in a micro-batch, ``Schedule.capacity``)."""
    cp_histogram: dict[int, int]
    """Block size -> number of sequences run at that size."""
    bubble_fraction: float = 0.0
    """Share of the ranks' simulated time not spent computing (``Simulation.bubble_fraction``)."""
    execution: str = "independent"
    """The execution model of ``step_time``, ``lower_bound`` and ``quality`` (``Execution.describe``)."""


def stats(schedule: Schedule, cost: CostModel | None = None,
          execution: Execution | str | None = None) -> ScheduleStats:
    """The figures of ``ScheduleStats`` under ``cost`` and ``execution`` (default: the schedule's own)."""
    c = cost or schedule.cost
    execution = resolve_execution(execution, schedule.execution)
    lb = schedule_lower_bound(schedule, c, execution)
    sim = simulate(schedule, c, execution)
    step = sim.step_time
    loads = [schedule.load(m, c) for m in range(schedule.num_microbatches)]
    imb = [max(x) / (sum(x) / len(x)) for x in loads if sum(x) > 0]
    hist: dict[int, int] = {}
    for s in schedule.cp_size_of().values():
        hist[s] = hist.get(s, 0) + 1
    nmb = schedule.num_microbatches
    cap = nmb * schedule.n_ranks * schedule.capacity
    return ScheduleStats(
        num_microbatches=nmb, step_time=step, lower_bound=lb, quality=step / lb if lb else 1.0,
        sync_makespan=sum(max(x) for x in loads), mean_imbalance=sum(imb) / len(imb) if imb else 1.0,
        token_fill=sum(schedule.lengths.values()) / cap if cap else 0.0, cp_histogram=dict(sorted(hist.items())),
        bubble_fraction=sim.bubble_fraction, execution=execution.describe(),
    )
