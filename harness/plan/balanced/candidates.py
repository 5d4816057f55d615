"""``balanced``'s candidate schedules, each a list of rows (``Blocks`` per micro-batch), for ``choose`` to judge.

* ``phased``: the level-synchronous plans of ``phased.PhasedBuilder`` (every ``theta`` of ``THETAS``) at the
  finest leaf size that is feasible: fast when ranks run independently, since no block waits.
* ``dense`` / ``tight``: the fewest micro-batches, when the cost charges per micro-batch or CP block.
* ``per_microbatch``: ``rows.lpt_rows`` at the least micro-batch count the tokens need and a few more.
* ``by_levels``: ``levels.level_rows`` (sequences at their cp_min, micro-batches filled by levels), for barriers.
* ``by_tall``: ``tall.tall_rows`` (one tall micro-batch of the longest sequences, the rest by levels), for
  barriers when the levels are not good enough.
* ``megatron``: ``megatron-dev``'s schedule itself (exact parity model) when the batch is small enough for
  it to be cheap (``DEV_MAX_WORK``), so the best candidate is never slower than it.
"""

from __future__ import annotations

from harness.plan.balanced.dense import dense
from harness.plan.balanced.items import Infeasible, Item
from harness.plan.balanced.levels import level_rows
from harness.plan.balanced.phased import THETAS, PhasedBuilder
from harness.plan.balanced.rows import lpt_rows, spread_rows
from harness.plan.balanced.tall import tall_rows
from harness.plan.balanced.tight import TIGHT_MAX_WORK, tight
from harness.plan.cost import CostModel
from harness.plan.errors import VPPAlignmentError
from harness.plan.megatron_common import Blocks
from harness.plan.megatron_dev import schedule_dev

DEV_MAX_WORK = 16_384
"""``megatron-dev`` joins the candidates when sequences x min(ranks, sequences) is at most this: its search
tries every group of every size for every sequence (~2.5 ms at 64 ranks x 201 sequences on the CPU machine;
seconds at 1024 ranks x 8192)."""

SPREAD_MAX_PER_RANK = 2
"""``spread_rows`` joins ``per_microbatch`` up to this many sequences per rank and micro-batch."""

EXTRA_ROWS = 2
"""``per_microbatch`` tries up to this many more micro-batches than the least (VPP multiples) until one of its
candidates fits."""

FEW_ROWS = 3
"""With barriers (``roomy``), when the least micro-batch count is at most this, ``per_microbatch`` also tries one
more (VPP multiple) even when the least fits: each extra micro-batch then adds a third of the room or more, so
the densest sequences need to share a micro-batch with light ones less (at 1024 ranks x 8192 sequences of mean
4096, 16384 tokens per rank, 2 micro-batches give 2.2x the lower bound, 3 give 1.6x)."""


def phased(builder: PhasedBuilder, n: int, min_cp: int) -> tuple[list[tuple[list[Blocks], float]], str]:
    """((rows, predicted independent step time) of the phased plans of the finest feasible leaf size, why
    coarser leaves were needed)."""
    leaf, why = min_cp, ""
    while leaf <= n:
        out, seen = [], set()
        for theta in THETAS:
            try:
                width = builder.widths(theta, leaf)
                key = tuple(width.values())  # every ``width`` lists the items in the same order
                if key in seen:
                    continue
                seen.add(key)
                out.append(builder.plan(theta, leaf, width))
            except Infeasible as e:
                why = str(e)
        if out:
            return out, why
        leaf *= 2
    return [], why


def packed(items: list[Item], n: int, mslpr: int, min_cp: int, cost: CostModel) -> list[list[Blocks]]:
    """``dense`` (both spreads) and ``tight`` rows, when micro-batches or CP blocks cost."""
    if not (cost.per_microbatch > 0 or cost.cp_block > 0):
        return []
    out = [dense(items, n, mslpr, min_cp, cost, spread)[0] for spread in (False, True)]
    if len(items) * n <= TIGHT_MAX_WORK:
        got = tight(items, n, mslpr, min_cp, cost)
        if got is not None:
            out.append(got[0])
    return out


def per_microbatch(items: list[Item], n: int, mslpr: int, min_cp: int, vpp: int | None,
                   cost: CostModel, full: bool = True, roomy: bool = False) -> list[list[Blocks]]:
    """``lpt_rows`` (with ``full``, both ways of sizing its blocks, and ``spread_rows`` with few sequences per
    rank) at the least micro-batch count (a multiple of ``vpp``) and ``EXTRA_ROWS`` more while none fits; with
    ``roomy``, one more than the first that fits when the least is at most ``FEW_ROWS``."""
    step = vpp or 1
    least = -(-sum(it.L for it in items) // (n * mslpr))
    least = -(-least // step) * step
    out, fits = [], None
    for k in range(EXTRA_ROWS + 2):
        if out and fits is None:
            fits = k
        if fits is not None and not (roomy and least <= FEW_ROWS and k == fits):
            break
        if k > EXTRA_ROWS and fits is None:
            break
        for alone in (False, True) if full else (False,):
            rows = lpt_rows(items, n, mslpr, min_cp, least + k * step, cost, alone=alone)
            if rows is not None:
                out.append(rows)
        if full and len(items) <= SPREAD_MAX_PER_RANK * n * (least + k * step):
            rows = spread_rows(items, n, mslpr, min_cp, least + k * step, cost)
            if rows is not None:
                out.append(rows)
    return out


LEVEL_CAPS = (None, 1.25, 1.15, 1.1)
"""``by_levels``: ``level_rows`` with no sequence widened, then with those above these many times the mean per-rank
load of the least micro-batch count widened (the quadratic term dominates the longest sequences: at cp_min one
of them can cost several micro-batches' worth). The caller stops at the first good enough; at 1024 ranks x 8192
sequences of lognormal mean 4096 (16384 tokens per rank) none is, and the best cap differs by batch: 1.14 / 1.20
/ 1.17 of the lower bound at 1.25 on seeds 0 / 1 / 2, 1.12 / 1.14 / 1.13 with the best of the four."""


def by_levels(items: list[Item], n: int, mslpr: int, min_cp: int, cost: CostModel):
    """``level_rows`` at each of ``LEVEL_CAPS`` in turn (a generator: the caller stops when one is good)."""
    least = -(-sum(it.L for it in items) // (n * mslpr))
    if not least:
        return
    mean = sum(it.own * it.cp for it in items) / (n * least)
    for f in LEVEL_CAPS:
        rows = level_rows(items, n, mslpr, min_cp, cost, None if f is None else f * mean)
        if rows is not None:
            yield rows


def by_tall(items: list[Item], n: int, mslpr: int, min_cp: int, cost: CostModel):
    """``tall_rows``: a generator of rows, each a tall micro-batch and the rest by levels."""
    yield from tall_rows(items, n, mslpr, min_cp, cost)


def megatron(pairs, n: int, mslpr: int, min_cp: int, vpp: int | None) -> list[list[Blocks]]:
    """``megatron-dev``'s rows when cheap (``DEV_MAX_WORK``) and feasible."""
    if len(pairs) * min(n, len(pairs)) > DEV_MAX_WORK:
        return []
    try:
        return [schedule_dev(pairs, n, mslpr, min_cp, vpp)]
    except VPPAlignmentError:
        return []
