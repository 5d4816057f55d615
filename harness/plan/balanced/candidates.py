"""``balanced``'s candidate schedules, each a list of rows (``Blocks`` per micro-batch), for ``choose`` to judge.

* ``phased``: the level-synchronous plans of ``phased.PhasedBuilder`` (every ``theta`` of ``THETAS``) at the
  finest leaf size that is feasible: fast when ranks run independently, since no block waits.
* ``dense`` / ``tight``: the fewest micro-batches, when the cost charges per micro-batch or CP block.
* ``per_microbatch``: ``rows.lpt_rows`` at the least micro-batch count the tokens need and a few more.
* ``megatron``: ``megatron-dev``'s schedule itself (exact parity model) when the batch is small enough for
  it to be cheap (``DEV_MAX_WORK``), so the best candidate is never slower than it.
"""

from __future__ import annotations

from harness.plan.balanced.dense import dense
from harness.plan.balanced.items import Infeasible, Item
from harness.plan.balanced.phased import THETAS, PhasedBuilder
from harness.plan.balanced.rows import lpt_rows, spread_rows
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
                   cost: CostModel, full: bool = True) -> list[list[Blocks]]:
    """``lpt_rows`` (with ``full``, both ways of sizing its blocks, and ``spread_rows`` with few sequences per
    rank) at the least micro-batch count (a multiple of ``vpp``) and ``EXTRA_ROWS`` more while none fits."""
    step = vpp or 1
    least = -(-sum(it.L for it in items) // (n * mslpr))
    least = -(-least // step) * step
    out = []
    for k in range(EXTRA_ROWS + 1):
        if out:
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


def megatron(pairs, n: int, mslpr: int, min_cp: int, vpp: int | None) -> list[list[Blocks]]:
    """``megatron-dev``'s rows when cheap (``DEV_MAX_WORK``) and feasible."""
    if len(pairs) * min(n, len(pairs)) > DEV_MAX_WORK:
        return []
    try:
        return [schedule_dev(pairs, n, mslpr, min_cp, vpp)]
    except VPPAlignmentError:
        return []
