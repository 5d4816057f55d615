"""``balanced``'s padding refit: a block that holds more than its ranks may once its sequences are padded for its
size is merged with neighbours into a block twice as wide.

The candidates pack each sequence's tokens padded at its own ``cp_min`` (``harness.plan.padding``); a sequence that
shares a wider block (topped up, re-widened, in megatron-dev's rows) is padded to that block's larger divisor, so the
block can end past its capacity. Doubling a block doubles its capacity while a sequence's padding grows by at most
``2 x size x tp`` tokens, so merging settles every block but one of thousands of tiny sequences. The partners are the
row's other blocks no wider than the over-full one, widest first then fewest tokens, which always add up to its size
(powers of two whose sum is an odd multiple of it); the row's blocks are then laid out widest first, so every block
stays aligned and sizes never increase.

>>> from harness.plan.balanced.items import Item
>>> from harness.plan.cost import CostModel
>>> from harness.plan.padding import SequencePadding
>>> pad = SequencePadding(tp=4)
>>> its = [Item(g, pad.padded(L, 1), 1, CostModel.megatron(), raw=L) for g, L in enumerate([19, 34, 17, 1, 1])]
>>> fit = PaddingFit(its, n=4, capacity=48, padding=pad)
>>> rows = [[(1, [0, 2]), (1, [1]), (1, [3]), (1, [4])]]
>>> fit.rows(rows) is rows  # 20 + 20 and 36 tokens: every block fits
True
>>> fit.rows([[(2, [0, 1, 2]), (1, [3]), (1, [4])]])  # padded to 16: 32 + 48 + 32 > 2 x 48; to 32: 192 on 4 ranks
[[(4, [0, 1, 2, 3, 4])]]
"""

from __future__ import annotations

from harness.plan import padding as pad
from harness.plan.balanced.items import Item
from harness.plan.errors import PlanInputError
from harness.plan.megatron_common import Blocks
from harness.plan.padding import SequencePadding


class PaddingFitError(PlanInputError):
    """A micro-batch whose sequences, padded, do not fit even on the whole domain."""


class PaddingFit:
    """Refits candidate rows so every block's padded tokens fit ``size x capacity``."""

    def __init__(self, items: list[Item], n: int, capacity: int, padding: SequencePadding):
        self.raw = {it.gid: it.raw for it in items}
        self.n, self.capacity, self.padding = n, capacity, padding
        self.refused: str | None = None
        """Why the last candidate that could not be refitted failed (``error``)."""

    def tokens(self, size: int, gids) -> int:
        raw, padding = self.raw, self.padding
        return sum(pad.planned_tokens(padding, raw[g], size) for g in gids)

    def rows(self, rows: list[Blocks]) -> list[Blocks] | None:
        """``rows`` itself when every block fits, else new rows with each over-full block merged until it does;
        None when a micro-batch does not fit on the whole domain (the candidate is dropped)."""
        out, changed = [], False
        for row in rows:
            fitted = self._row(row)
            if fitted is None:
                return None
            changed |= fitted is not row
            out.append(fitted)
        return out if changed else rows

    def error(self) -> PaddingFitError:
        """The error when no candidate could be refitted."""
        return PaddingFitError(f"{self.refused}; raise max_seqlen_per_rank, or use fewer, longer sequences a batch")

    def _over(self, blocks) -> int | None:
        for i, (size, gids) in enumerate(blocks):
            if gids and self.tokens(size, gids) > size * self.capacity:
                return i
        return None

    def _row(self, row: Blocks) -> Blocks | None:
        i = self._over(row)
        if i is None:
            return row
        blocks = [(size, list(gids)) for size, gids in row]
        while i is not None:
            size, gids = blocks[i]
            if size >= self.n:
                self.refused = (f"a micro-batch's {len(gids)} sequences hold {self.tokens(size, gids)} tokens once "
                                f"padded ({self.padding.describe()}), more than all {self.n} ranks take at "
                                f"{self.capacity} tokens each")
                return None
            others = sorted((j for j in range(len(blocks)) if j != i and blocks[j][0] <= size),
                            key=lambda j: (-blocks[j][0], self.tokens(*blocks[j]), j))
            need, partners = size, []
            for j in others:
                if blocks[j][0] <= need:
                    partners.append(j)
                    need -= blocks[j][0]
                    if not need:
                        break
            if need:  # a row that does not cover the domain with power-of-two blocks: no buddy to merge with
                self.refused = f"a micro-batch's blocks {[b[0] for b in blocks]} leave no partner of {size} ranks"
                return None
            merged = (2 * size, gids + [g for j in partners for g in blocks[j][1]])
            drop = {i, *partners}
            blocks = [b for j, b in enumerate(blocks) if j not in drop] + [merged]
            blocks.sort(key=lambda b: -b[0])  # stable: widest first keeps every block aligned
            i = self._over(blocks)
        return blocks
