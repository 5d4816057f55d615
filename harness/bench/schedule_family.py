"""The seeded input family of ``dcp-harness bench schedule``: varied global batches like upstream's sweeps.

Each case draws, from one ``numpy`` generator seeded by the family seed: a domain of 2..64 ranks (powers of
two; a few cases of 1024 and 4096 ranks), 512..8192 tokens per rank (powers of two), ``min_cp_size`` in
{1, 2, 4} (at most the domain), a VPP group in {none, 2, 4}, 1..256 sequences (log-uniform), and lengths
either lognormal with median 1/8..4 x the tokens per rank (log-uniform) and sigma 0.5..1.5, or uniform on
[1, 2 x median]. Lengths are padded to a multiple of 2N (N = the domain's ranks, as zig-zag CP slicing
over any block of the domain needs) and capped at what the domain holds.

>>> cases = family(seed=0, count=3, large=0)
>>> [(c.n_ranks, c.max_seqlen_per_rank, len(c.lengths)) for c in cases] == [
...     (c.n_ranks, c.max_seqlen_per_rank, len(c.lengths)) for c in family(seed=0, count=3, large=0)]
True
>>> all(L % (2 * c.n_ranks) == 0 and L <= c.n_ranks * c.max_seqlen_per_rank for c in cases for L in c.lengths)
True
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

LARGE_DOMAINS = (1024, 4096)


@dataclass(frozen=True)
class Case:
    """One scheduler input of the family."""

    index: int
    lengths: tuple[int, ...]
    n_ranks: int
    max_seqlen_per_rank: int
    min_cp_size: int
    vpp_group: int | None
    distribution: str
    """How the lengths were drawn, e.g. ``lognormal median 512 sigma 1.2`` or ``uniform [1, 1024]``."""

    def kwargs(self) -> dict:
        return dict(n_ranks=self.n_ranks, max_seqlen_per_rank=self.max_seqlen_per_rank,
                    min_cp_size=self.min_cp_size, vpp_group=self.vpp_group)

    def describe(self) -> str:
        vpp = f", vpp_group {self.vpp_group}" if self.vpp_group else ""
        return (f"#{self.index}: {self.n_ranks} ranks x {self.max_seqlen_per_rank} tokens, {len(self.lengths)} "
                f"sequences ({self.distribution}, {sum(self.lengths)} tokens), min_cp {self.min_cp_size}{vpp}")


def _case(index: int, rng: np.random.Generator, n_ranks: int) -> Case:
    mslpr = 1 << int(rng.integers(9, 14))
    min_cp = min(int(rng.choice([1, 2, 4])), n_ranks)
    vpp = [None, 2, 4][int(rng.integers(0, 3))]
    num = int(round(math.exp(rng.uniform(0.0, math.log(256)))))
    median = mslpr * 2.0 ** rng.uniform(-3.0, 2.0)
    if rng.random() < 0.75:
        sigma = float(rng.uniform(0.5, 1.5))
        x = rng.lognormal(math.log(median), sigma, size=num)
        dist = f"lognormal median {median:.0f} sigma {sigma:.2f}"
    else:
        x = rng.uniform(1.0, 2.0 * median, size=num)
        dist = f"uniform [1, {2 * median:.0f}]"
    pad, cap = 2 * n_ranks, n_ranks * mslpr
    lengths = np.minimum(-(-np.maximum(np.rint(x), 1).astype(np.int64) // pad) * pad, cap)
    return Case(index, tuple(int(v) for v in lengths), n_ranks, mslpr, min_cp, vpp, dist)


def family(seed: int = 0, count: int = 120, large: int = 4) -> list[Case]:
    """``count`` cases on 2..64 ranks, then ``large`` cases on each of ``LARGE_DOMAINS``; deterministic in
    ``seed``."""
    rng = np.random.default_rng(seed)
    cases = [_case(i, rng, 1 << int(rng.integers(1, 7))) for i in range(count)]
    for n in LARGE_DOMAINS:
        cases += [_case(len(cases), rng, n) for _ in range(large)]
    return cases
