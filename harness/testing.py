"""Hypothesis strategies for scheduler inputs, importable by users' own test suites.

>>> from hypothesis import given
>>> from harness.testing import batches
>>> @given(batches())
... def test_my_scheduler(batch):
...     mbs = my_scheduler(batch.lengths, batch.n_ranks, batch.max_seqlen_per_rank)
...     harness.plan.validate_schedule(mbs, batch.lengths, n_ranks=batch.n_ranks,
...                                    max_seqlen_per_rank=batch.max_seqlen_per_rank)

Lengths mix uniform draws with the boundaries where ``cp_min`` changes (``k * mslpr`` and one past
it), tiny sequences and whole-domain sequences; global ids are sometimes sparse and shuffled.
"""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import strategies as st

MSLPRS = (8, 64, 256, 1024, 2048, 3072)


@dataclass(frozen=True)
class Batch:
    lengths: list[tuple[int, int]]
    n_ranks: int
    max_seqlen_per_rank: int
    min_cp_size: int = 1
    vpp_group: int | None = None

    def kwargs(self) -> dict:
        return dict(n_ranks=self.n_ranks, max_seqlen_per_rank=self.max_seqlen_per_rank,
                    min_cp_size=self.min_cp_size, vpp_group=self.vpp_group)


def _length(mslpr: int, n_ranks: int) -> st.SearchStrategy[int]:
    cap = n_ranks * mslpr
    edges = sorted({v for k in range(n_ranks.bit_length()) for v in ((mslpr << k), (mslpr << k) + 1)
                    if 1 <= v <= cap} | {1, 2, cap})
    return st.one_of(st.integers(1, cap), st.sampled_from(edges), st.integers(1, max(1, mslpr // 4)))


@st.composite
def batches(draw, *, max_log_ranks: int = 5, max_sequences: int = 48, min_cp: bool = True,
            vpp: bool = True) -> Batch:
    """A valid scheduler input: power-of-two domain, every length fits the domain."""
    n_ranks = 1 << draw(st.integers(0, max_log_ranks))
    mslpr = draw(st.sampled_from(MSLPRS))
    min_cp_size = 1 << draw(st.integers(0, n_ranks.bit_length() - 1)) if min_cp and draw(st.booleans()) else 1
    vpp_group = draw(st.sampled_from([None, None, 1, 2, 3, 4])) if vpp else None
    lens = draw(st.lists(_length(mslpr, n_ranks), min_size=0, max_size=max_sequences))
    if draw(st.booleans()):
        gids = draw(st.lists(st.integers(0, 10**6), min_size=len(lens), max_size=len(lens), unique=True))
    else:
        gids = list(range(len(lens)))
    return Batch(list(zip(gids, lens)), n_ranks, mslpr, min_cp_size, vpp_group)
