"""The padding a runtime adds to each sequence of a block, priced by the schedulers' capacity checks.

A THD runtime pads every sequence of a block of ``c`` ranks to a multiple of its divisor before the zig-zag split
(``harness.plan.thd.padding_divisor``): ``2c`` (1 at ``c = 1``), times ``tp`` with sequence parallelism, or ``2N``
times ``tp`` for every block when it pads to the domain (Megatron's rule). A block whose raw tokens fit
``c x capacity`` can then hold more: with sequence parallelism at tp 8, 12-27% of ``balanced``'s blocks on Wikipedia
lengths went past their capacity, by up to 3.1%, when the schedulers saw raw lengths. Given a ``SequencePadding``,
``balanced`` and ``dp-balanced`` plan each block's padded tokens and the validator checks them
(``harness.plan.validate``, invariant ``capacity``).

>>> p = SequencePadding(tp=4)
>>> p.divisor(1), p.divisor(2), p.padded(9, 1), p.padded(9, 2), SequencePadding(tp=2, domain=8).padded(9, 1)
(4, 16, 12, 16, 32)
>>> p.cp_min(4096, 4096), p.cp_min(4093, 4096), SequencePadding(tp=8).cp_min(4090, 4092)
(1, 1, 2)
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.plan.errors import PlanInputError
from harness.plan.thd import pad_length, padding_divisor


class PaddingError(PlanInputError):
    """A ``SequencePadding`` that no runtime pads by."""


@dataclass(frozen=True)
class SequencePadding:
    """How each sequence of a block is padded: to ``padding_divisor`` of the block's size (``domain`` None) or of
    the domain's ``domain`` ranks, times ``tp`` (the TP size under sequence parallelism, else 1)."""

    tp: int = 1
    domain: int | None = None

    def __post_init__(self):
        for name, v in (("tp", self.tp), ("domain", 1 if self.domain is None else self.domain)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise PaddingError(f"SequencePadding.{name} must be a positive int, got {v!r}: tp is the TP size "
                                   f"under sequence parallelism (else 1), domain the DP x CP ranks of domain padding "
                                   f"(None for padding by block)")

    def divisor(self, size: int) -> int:
        """The multiple every sequence of a block of ``size`` ranks is padded to."""
        if self.domain is not None:
            return padding_divisor(n_ranks=self.domain, tp_size=self.tp, sequence_parallel=self.tp > 1)
        return padding_divisor(cp_size=size, tp_size=self.tp, sequence_parallel=self.tp > 1)

    def padded(self, L: int, size: int) -> int:
        """Tokens a sequence of ``L`` tokens takes in a block of ``size`` ranks."""
        return pad_length(L, self.divisor(size))

    def cp_min(self, L: int, max_seqlen_per_rank: int, min_cp_size: int = 1, limit: int | None = None) -> int:
        """Smallest power of two ``c >= min_cp_size`` whose ranks hold the padded sequence:
        ``padded(L, c) <= c * max_seqlen_per_rank`` (``harness.plan.cost.cp_min`` on padded tokens); past ``limit``
        ranks the first size above it (no larger group is tried)."""
        if L <= 0:
            raise PlanInputError(f"sequence length must be positive, got {L}")
        c = max(1 << (-(-L // max_seqlen_per_rank) - 1).bit_length(), min_cp_size)
        while self.padded(L, c) > c * max_seqlen_per_rank:
            if limit is not None and c > limit:
                return c
            if c >= 1 << 24:
                raise PaddingError(f"no CP size holds a sequence of {L} tokens padded as '{self.describe()}' at "
                                   f"max_seqlen_per_rank={max_seqlen_per_rank}; use a max_seqlen_per_rank that is a "
                                   f"multiple of 2 x tp ({2 * self.tp})")
            c *= 2
        return c

    def describe(self) -> str:
        where = f"2 x {self.domain} (the domain)" if self.domain is not None else "2 x its block's size (1 alone)"
        return f"each sequence padded to {where}" + (f" x tp {self.tp}" if self.tp > 1 else "")

    def to_dict(self) -> dict:
        return {"tp": self.tp, **({"domain": self.domain} if self.domain is not None else {})}


def planned_tokens(padding: SequencePadding | None, L: int, size: int) -> int:
    """The seam every scheduler prices a sequence's tokens in a block of ``size`` ranks through: ``L`` padded by
    ``padding`` (``L`` itself without one)."""
    return L if padding is None else padding.padded(L, size)


def padded_tokens(padding: SequencePadding | None, lengths, size: int) -> int:
    """The tokens of sequences of ``lengths`` in one block of ``size`` ranks (raw tokens without a padding): the
    validator's count, kept apart from the schedulers' seam ``planned_tokens``."""
    if padding is None:
        return sum(lengths)
    return sum(padding.padded(L, size) for L in lengths)
