"""``balanced``: our scheduler - the candidate of least simulated step time under the given execution model.

A schedule's step time depends on how the step runs (``harness.plan.execution``): with independent CP
blocks a rank's imbalance in one micro-batch can be made up in the next, so plans that balance the ranks'
*totals* win; with a barrier after every micro-batch (MoE with expert parallelism: ``synchronous``) each
micro-batch must be balanced on its own; a pipeline sits in between. ``balanced`` therefore builds several
kinds of candidates (``candidates``: phased plans, densest rows, rows balanced per micro-batch, rows by levels
and rows led by one tall micro-batch with barriers, ``megatron-dev``'s own schedule when it is cheap), re-sizes
each row's blocks (``rows.rewiden``), judges every one with the simulator of the given model and cost
(``evaluate.Judge``: exact, the same arithmetic as ``simulate``) and returns the least (ties: the first built,
in the order above; so the result is deterministic).

Work is bounded by the batch, never by the clock: the independent model stops after the phased plans when
they are within ``GOOD_ENOUGH`` (``FAIR`` with many sequences per rank) of the area lower bound, and
the costlier candidates run below fixed sizes (``EXTRA_MAX_SEQUENCES``, ``candidates.DEV_MAX_WORK``).
Every candidate is valid by construction (``suites/plan`` checks them all with ``validate_schedule``).

>>> from harness.plan.api import schedule
>>> s = schedule([8192, 4096, 3000, 2048, 1024, 1024, 512, 512, 256], n_ranks=8,
...              max_seqlen_per_rank=2048)
>>> s.microbatches  # under L**2/cp: 8192 widened to all 8 ranks, then the rest balanced per block
[[[0], [0], [0], [0], [0], [0], [0], [0]], [[1, 6, 7, 8], [1, 6, 7, 8], [1, 6, 7, 8], [1, 6, 7, 8], [2], [2], [3], [4, 5]]]
>>> sync = schedule([8192, 4096, 3000, 2048, 1024, 1024, 512, 512, 256], n_ranks=8, max_seqlen_per_rank=2048,
...                 execution="synchronous")
>>> sync.microbatches  # with barriers: by levels, 4096 alone on all 8 ranks rather than beside light ranks
[[[0], [0], [0], [0], [0], [0], [0], [0]], [[1], [1], [1], [1], [1], [1], [1], [1]], [[2], [2], [2], [2], [3], [3], [4, 6, 8], [5, 7]]]
>>> from harness.plan.bounds import simulate
>>> simulate(sync).step_time < simulate(s, execution="synchronous").step_time
True
"""

from __future__ import annotations

from harness.plan import padding as pad
from harness.plan.balanced import candidates as cands
from harness.plan.balanced.evaluate import Judge
from harness.plan.balanced.fit import PaddingFit
from harness.plan.balanced.items import Item
from harness.plan.balanced.phased import PhasedBuilder
from harness.plan.balanced.rows import rewiden
from harness.plan.balanced.shelves import shelf_rows
from harness.plan.cost import CostModel, cp_min
from harness.plan.errors import VPPAlignmentError
from harness.plan.execution import INDEPENDENT, Execution
from harness.plan.megatron_common import Blocks
from harness.plan.padding import SequencePadding

GOOD_ENOUGH = 0.01
"""Independent model: the phased plans end the search when within this of the area lower bound ..."""

FEW_PER_RANK, FAIR = 4, 0.05
"""... or, beside megatron-dev's schedule, within ``FAIR`` of it with more than ``FEW_PER_RANK`` sequences per
rank (the rows balanced per micro-batch win where sequences are few per rank)."""

SHELVES = "up to EXTRA_MAX_SEQUENCES sequences, and at any size with a micro-batch capacity above max_seqlen_per_rank"
"""Where the synchronous model builds the shelves (``shelves.shelf_rows``): at scale with the plain capacity the rows
by levels are within ~4% of the bound and the shelves would cost ~200 ms at 4096 ranks x 32768 sequences."""

EXTRA_MAX_SEQUENCES = 1024
"""Sequences up to which every kind of candidate is built (``megatron-dev`` only below its own bound,
``candidates.DEV_MAX_WORK``; with barriers and more than ``FEW_PER_RANK`` sequences per rank, no phased
plans: they lose there). Above it the
independent model keeps the phased plans (within ~1% of the bound there), the synchronous one the rows by
levels and, when those are not within ``SYNC_ENOUGH``, the rows led by one tall micro-batch and the rows
balanced per micro-batch at the least count, the pipeline those rows (the phased plans only when those fail): the latency targets are 50 ms at 1024 ranks
x 8192 sequences and 250 ms at 4096 x 32768 on two CPU cores."""


SYNC_ENOUGH = 0.06
"""Synchronous model: the rows by levels (``candidates.by_levels``) come first, at every size, and with more
than ``FEW_PER_RANK`` sequences per rank they end the search for rows balanced per micro-batch (``lpt_rows``,
which widen sequences) when within this of the area bound (which bounds those too); within it the rows led by
one tall micro-batch (``candidates.by_tall``) are skipped whatever the count per rank; up to
``EXTRA_MAX_SEQUENCES`` sequences ``megatron-dev``'s rows still join."""


def schedule_balanced(pairs, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1,
                      vpp_group: int | None = None, cost: CostModel | None = None,
                      execution: Execution | None = None, microbatch_tokens_per_rank: int | None = None,
                      padding: SequencePadding | None = None) -> list[Blocks]:
    """Our scheduler; inputs assumed validated (see ``harness.plan.api.schedule``)."""
    return plan_balanced(pairs, n_ranks, max_seqlen_per_rank, min_cp_size, vpp_group, cost, execution,
                         microbatch_tokens_per_rank, padding)[0]


class _Best:
    """The least (time, arrival) of the rows offered."""

    def __init__(self, judge: Judge, fit: PaddingFit | None = None):
        self.judge, self.fit, self.rows, self.time = judge, fit, None, float("inf")

    def offer(self, rows: list[Blocks] | None, time: float | None = None) -> None:
        """``time``: the rows' step time under the judge's model when the caller knows it (not after a padding
        refit changed them)."""
        if rows and self.fit is not None:
            fitted = self.fit.rows(rows)
            if fitted is not rows:  # refitted (or None: dropped)
                rows, time = fitted, None
        if not rows or not self.judge.feasible(rows):
            return
        t = self.judge.time(rows) if time is None else time
        if t < self.time:
            self.rows, self.time = rows, t


def _items(pairs, max_seqlen_per_rank: int, capacity: int, min_cp_size: int, cost: CostModel,
           padding: SequencePadding | None = None) -> list[Item]:
    """The sequences as the candidates see them, each at the ``cp_min`` of ``max_seqlen_per_rank`` (a micro-batch's
    ``capacity`` bounds a block's tokens, never one sequence's CP size); with a ``padding`` each at the least CP size
    that holds it padded, taking its padded tokens there (its cost stays its own length's)."""
    if padding is None:
        return [Item(g, L, cp_min(L, max_seqlen_per_rank, min_cp_size), cost) for g, L in pairs]
    out = []
    for g, L in pairs:
        cp = padding.cp_min(L, max_seqlen_per_rank, min_cp_size)
        out.append(Item(g, pad.planned_tokens(padding, L, cp), cp, cost, raw=L))
    return out


def plan_balanced(pairs, n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int = 1,
                  vpp_group: int | None = None, cost: CostModel | None = None,
                  execution: Execution | None = None,
                  microbatch_tokens_per_rank: int | None = None,
                  padding: SequencePadding | None = None) -> tuple[list[Blocks], float]:
    """(micro-batches, simulated step time under ``cost`` and ``execution``) of the best candidate.
    ``microbatch_tokens_per_rank``: what a rank may hold in one micro-batch over its block's sequences (default
    ``max_seqlen_per_rank``, which always sets each sequence's smallest CP). ``padding``: the candidates pack each
    sequence's tokens padded at its ``cp_min``, and a block that holds more once its sequences are padded for its own
    size is merged with neighbours into a wider one (``fit.PaddingFit``) before it is judged."""
    cost = cost or CostModel.megatron()
    ex = execution or INDEPENDENT
    independent = ex.kind == "independent"
    n, mslpr = n_ranks, microbatch_tokens_per_rank or max_seqlen_per_rank
    pairs = sorted(pairs)  # by gid: the input order never matters (``megatron-dev`` keeps it among ties)
    items = _items(pairs, max_seqlen_per_rank, mslpr, min_cp_size, cost, padding)
    judge = Judge(items, n, max_seqlen_per_rank, cost, ex, min_cp_size, vpp_group)
    best = _Best(judge, PaddingFit(items, n, mslpr, padding) if padding is not None else None)
    small = len(items) <= EXTRA_MAX_SEQUENCES
    few = len(items) <= FEW_PER_RANK * n
    barriers = ex.kind == "synchronous"
    enough = (1 + SYNC_ENOUGH) * (sum(it.own * it.cp for it in items) / n + cost.per_microbatch)
    if barriers:  # rows by levels first: every sequence at its cp_min
        for rows in cands.by_levels(items, n, mslpr, min_cp_size, cost):
            best.offer(rows)
            if best.time <= enough:
                break
        if best.time > enough:  # the longest sequences dominate: one tall micro-batch takes them first
            for rows in cands.by_tall(items, n, mslpr, min_cp_size, cost):
                best.offer(rows)
        if small or mslpr > max_seqlen_per_rank:  # a micro-batch per size, topped up (module doc: where it runs)
            best.offer(shelf_rows(items, n, mslpr, min_cp_size, cost))
    skip = barriers and not few and best.time <= enough
    per_mb = [] if independent or skip else cands.per_microbatch(items, n, mslpr, min_cp_size, vpp_group, cost,
                                                                 small, roomy=True)
    for rows in per_mb:  # balanced per micro-batch: at scale the only ones built for barriers
        best.offer(rows)
    why = ""
    if independent or (small and few) or best.rows is None:
        builder = PhasedBuilder(items, n, mslpr, min_cp_size, vpp_group, cost)
        phased, why = cands.phased(builder, n, min_cp_size)
        for rows in cands.packed(items, n, mslpr, min_cp_size, cost):
            best.offer(rows)
        for rows, time in phased:  # the builder's prediction is the independent model's step time
            best.offer(rows, time if independent else None)
        area = sum(it.own * it.cp for it in items) / n
        if independent and best.rows is not None and (best.time <= area * (1 + GOOD_ENOUGH) or not small):
            return best.rows, best.time
        if independent and not few and best.time <= area * (1 + FAIR):
            for rows in cands.megatron(pairs, n, max_seqlen_per_rank, min_cp_size, vpp_group):
                best.offer(rows)
            return best.rows, best.time
        if independent:
            per_mb = cands.per_microbatch(items, n, mslpr, min_cp_size, vpp_group, cost, small)
        for rows in per_mb + cands.megatron(pairs, n, max_seqlen_per_rank, min_cp_size, vpp_group):
            best.offer(rows)
            best.offer(rewiden(rows, judge.by_gid, n, mslpr, min_cp_size, cost))
    elif small:  # barriers, many sequences per rank: the per-micro-batch rows re-sized, and megatron-dev's
        for rows in per_mb:
            best.offer(rewiden(rows, judge.by_gid, n, mslpr, min_cp_size, cost))
        for rows in cands.megatron(pairs, n, max_seqlen_per_rank, min_cp_size, vpp_group):
            best.offer(rows)
            best.offer(rewiden(rows, judge.by_gid, n, mslpr, min_cp_size, cost))
    if best.rows is not None:
        return best.rows, best.time
    if best.fit is not None and best.fit.refused:
        raise best.fit.error()
    tokens = sum(L for _, L in pairs)
    least = -(-tokens // (n * mslpr))
    raise VPPAlignmentError(
        f"cannot make the micro-batch count a multiple of vpp_group={vpp_group}: {len(pairs)} sequences "
        f"({tokens} tokens) allow between ~{least} and {len(pairs)} micro-batches ({why}); schedule "
        f"more sequences per global batch or use a smaller vpp_group"
    )
