"""``balanced``'s densest rows: the fewest micro-batches, for cost models that charge per micro-batch."""

from __future__ import annotations

from bisect import insort

from harness.plan.balanced.items import Item, rows_out
from harness.plan.cost import CostModel
from harness.plan.megatron_common import Blocks


class _Row:
    __slots__ = ("blocks", "free")

    def __init__(self):
        self.blocks: list[list] = []  # [start, size, room, items]
        self.free = 0  # first rank without a block (blocks are created in non-increasing size order)


def dense(items: list[Item], n: int, mslpr: int, leaf: int, cost: CostModel,
           spread: bool = False) -> tuple[list[Blocks], float]:
    """Fewest micro-batches: sequences at their ``cp_min``, decreasing (CP size, then length), into
    the first block of their size with room, else a new block at a row's first free ranks, else the
    room left in a wider block, else a new row. ``spread``: start from the least possible number of
    rows (tokens / (n x mslpr)), put a new block in the row with the most free ranks and a sequence
    in the fullest block that holds it (best fit), which packs batches that fill ~99% of the rows.
    Rows are then completed (every rank needs a non-empty block): a ``leaf``-sized block takes a
    sequence from the block with the most (of any row), else the row's last block widens, else the
    row becomes one block of all ``n`` ranks. Returns (rows, simulated step time); blocks may wait
    for stragglers here, and the prediction counts it (``simulate``'s arithmetic)."""
    rows: list[_Row] = [_Row() for _ in range(-(-sum(it.L for it in items) // (n * mslpr)) if spread else 0)]
    open_blocks: dict[int, list] = {}
    open_sizes: list[int] = []  # the keys of ``open_blocks``, increasing

    def fit(blocks, L):
        """The first block with room for L, or (``spread``) the first of those with the least room."""
        if not spread:
            for b in blocks:
                if b[2] >= L:
                    return b
            return None
        best = None
        for b in blocks:
            if b[2] >= L and (best is None or b[2] < best[2]):
                best = b
        return best

    for it in sorted(items, key=lambda x: (-x.cp, -x.L, x.gid)):
        s = it.cp
        blk = fit(open_blocks.get(s, ()), it.L)
        row = None
        if blk is None:  # the first row with s free ranks, or (``spread``) the first with the most
            for r in rows:
                if n - r.free >= s and (row is None or r.free < row.free):
                    row = r
                    if not spread:
                        break
        if blk is None and row is None:  # room left in a wider block beats a new micro-batch
            blk = fit([b for w in open_sizes if w > s for b in open_blocks[w]], it.L)
        if blk is None:
            if row is None:
                row = _Row()
                rows.append(row)
            blk = [row.free, s, s * mslpr, []]
            row.blocks.append(blk)
            row.free += s
            if s not in open_blocks:
                open_blocks[s] = []
                insort(open_sizes, s)
            open_blocks[s].append(blk)
        blk[3].append(it)
        blk[2] -= it.L
    for row in rows:
        while row.free < n:
            donor = None
            if n - row.free >= leaf:  # the first block holding the most (> 1) sequences, one of them leaf-sized
                most = 1
                for r in rows:
                    for b in r.blocks:
                        if len(b[3]) > most and any(x.cp <= leaf for x in b[3]):
                            donor, most = b, len(b[3])
            if donor is not None:
                it = min((x for x in donor[3] if x.cp <= leaf), key=lambda x: (x.L, x.gid))
                donor[3].remove(it)
                donor[2] += it.L
                row.blocks.append([row.free, leaf, leaf * mslpr - it.L, [it]])
                row.free += leaf
                continue
            last = row.blocks[-1]
            prev = row.blocks[-2][1] if len(row.blocks) > 1 else n
            if last[0] % (2 * last[1]) == 0 and last[0] + 2 * last[1] <= n and prev >= 2 * last[1]:
                row.free += last[1]
                last[2] += last[1] * mslpr
                last[1] *= 2
                continue
            everything = [x for b in row.blocks for x in b[3]]
            row.blocks = [[0, n, n * mslpr - sum(x.L for x in everything), everything]]
            row.free = n
    return rows_out([row.blocks for row in rows], n, cost)
