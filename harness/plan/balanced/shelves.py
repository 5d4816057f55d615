"""Rows by shelves, for barriers where a micro-batch may hold many sequences per rank.

A stack that runs every sequence of a micro-batch as its own forward and backward (megatron-core's hybrid CP)
bounds each sequence by ``max_seqlen_per_rank`` (its ``cp_min``) but not a micro-batch: a rank may hold many
sequences of one micro-batch (``microbatch_tokens_per_rank`` above ``max_seqlen_per_rank``). There a sequence
costs every rank of its block a fixed overhead (``CostModel.per_sequence``) far above its compute, so a
widened sequence costs more ranks, and every barrier costs the micro-batch's slowest rank: the fewer
micro-batches, and the more even their ranks, the shorter the step. ``rows by levels`` fills each micro-batch
up to the level of its costliest sequence and puts every sequence left into the last one, whose blocks are
then as wide as its widest sequence: the wrong shape there. Shelves give each size its own micro-batches:

* the sequences of ``cp_min`` = s (``leaf`` at least), by decreasing load, go to the least loaded of the
  ``n / s`` blocks of size s of the shelf's micro-batches that has room (as few micro-batches as their tokens
  allow, one more while a sequence finds no room);
* widest shelves first: each block of a shelf wider than ``leaf`` takes narrower sequences, widened to its
  size, while they fit under the shelf micro-batch's slowest block and its room (the costliest first: every
  sequence taken is one less on the narrow shelves, at no cost to the wide one's micro-batch);
* ranks no block of a micro-batch uses double its costliest blocks (``rows._filled``).

With sequences of three sizes that is three micro-batches, each near the mean per-rank count of its size:
megatron-core's own scheduler's shape, balanced by the calibrated cost.
"""

from __future__ import annotations

import bisect

from harness.plan.balanced.items import Item
from harness.plan.balanced.rows import _filled
from harness.plan.cost import CostModel
from harness.plan.megatron_common import Blocks


def shelf_rows(items: list[Item], n: int, cap: int, leaf: int, cost: CostModel) -> list[Blocks] | None:
    """Micro-batches by shelves (module doc); ``cap``: tokens a rank may hold in one micro-batch."""
    if not items:
        return None
    by_size: dict[int, list[Item]] = {}
    for it in items:
        by_size.setdefault(max(it.cp, leaf), []).append(it)
    narrow = sorted((it for s, its in by_size.items() if s == leaf for it in its), key=lambda it: (it.L, it.gid))
    taken: set[int] = set()
    rows: list[list[list]] = []  # blocks as [size, load, items, room]
    for s in sorted(by_size, reverse=True):
        if s == leaf:
            break
        shelf = _shelf(by_size[s], n, s, cap, cost)
        for row in shelf:
            _top_up(row, narrow, taken, cost)
        rows += shelf
    rest = [it for it in by_size.get(leaf, []) if it.gid not in taken]
    if rest:
        rows += _shelf(rest, n, leaf, cap, cost)
    out = []
    for row in rows:
        blocks = [[b[0], b[1], b[2]] for b in row if b[2]]
        if not blocks:
            continue
        out.append(_filled(blocks, n - sum(b[0] for b in blocks), cost))
    return out or None


def _shelf(items: list[Item], n: int, s: int, cap: int, cost: CostModel) -> list[list[list]]:
    """The sequences of one size on as few micro-batches of ``n // s`` blocks of size ``s`` as their tokens allow,
    each (by decreasing load) to the least loaded block with room."""
    order = sorted(items, key=lambda it: (-it.cost(s), it.gid))
    over = cost.block_overhead(s)
    k = max(1, -(-sum(it.L for it in items) // (n * cap)))
    while True:
        rows = [[[s, over, [], s * cap] for _ in range(n // s)] for _ in range(k)]
        blocks = [b for row in rows for b in row]
        ok = True
        for it in order:
            fit = [b for b in blocks if b[3] >= it.L]
            if not fit:
                ok = False
                break
            b = min(fit, key=lambda b: b[1])
            b[1] += it.cost(s)
            b[2].append(it)
            b[3] -= it.L
        if ok:
            return rows
        k += 1


def _top_up(row: list[list], narrow: list[Item], taken: set[int], cost: CostModel) -> None:
    """Fill the blocks of a wide shelf's micro-batch with narrow sequences widened to their size, up to its slowest
    block (``narrow``: sorted by length; a sequence's per-rank cost at a fixed size grows with its length)."""
    level = max(b[1] for b in row)
    lengths = [it.L for it in narrow]
    for b in sorted(row, key=lambda b: b[1]):
        size = b[0]
        while narrow:
            hi = bisect.bisect_right(lengths, b[3])  # those with room
            k = bisect.bisect_right(narrow, level - b[1], hi=hi, key=lambda it: it.cost(size)) - 1
            if k < 0:  # the longest that fits the slack and the room, if any
                break
            it = narrow.pop(k)
            del lengths[k]
            taken.add(it.gid)
            b[1] += it.cost(size)
            b[2].append(it)
            b[3] -= it.L
