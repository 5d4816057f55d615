"""A synthetic corpus with learnable structure, as deterministic global batches (numpy, no torch).

Every sequence is one of two kinds, chosen per sequence:
- *Markov*: a fixed sparse bigram chain (each token has ``branching`` likely successors), so the
  bigram entropy is about ``ln(branching)`` nats against ``ln(vocab)`` for a uniform guess;
- *copy*: a random motif of 4-32 tokens repeated to the sequence's length, which an attention layer
  learns to continue (induction), so long-range attention matters.
The loss therefore falls visibly within tens of steps. Global batch ``step`` of a run is a pure
function of (config, step): every layout and every rank sees the same sequences.

>>> c = CorpusConfig(vocab=64, lengths="const:value=8", sequences_per_batch=2, seed=1)
>>> [len(s) for s in global_batch(c, step=0)]
[9, 9]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from harness.data.workloads import parse_spec, sample
from harness.plan.errors import PlanInputError, SizeLimitError

MAX_VOCAB = 1 << 18
"""Vocabulary sizes up to the largest LLM vocabularies (~256K); the Markov chain holds a row per token."""
MAX_BATCH_SEQUENCES = 1 << 16
"""Sequences per global batch: every step draws each one's tokens on every rank."""
MAX_BATCH_TOKENS = 1 << 24
"""Tokens per global batch (16M, the size of the largest production batches): every rank draws them all."""
MAX_SEED = 2**32 - 1


@dataclass(frozen=True, kw_only=True)
class CorpusConfig:
    vocab: int = 256
    """Vocabulary size (token ids 0..vocab-1)."""
    lengths: str = "lognormal:mean=192,sigma=1.0,min=16,max=1024"
    """Sequence-length spec (``harness.data.workloads``); a sequence of length L carries L+1 tokens
    (inputs and next-token labels)."""
    sequences_per_batch: int = 32
    """Sequences in one global batch."""
    branching: int = 4
    """Likely successors per token in the Markov chain."""
    copy_fraction: float = 0.5
    """Share of copy sequences."""
    seed: int = 0

    def __post_init__(self) -> None:
        """Refuse, naming the field, a config no corpus can be drawn from (``PlanInputError``)."""
        _int("vocab", self.vocab, 2, MAX_VOCAB, "the Markov chain holds a row of successors per token")
        _int("sequences_per_batch", self.sequences_per_batch, 1, MAX_BATCH_SEQUENCES,
             "every step draws each sequence's tokens on every rank")
        _int("branching", self.branching, 1, self.vocab, "successors are distinct tokens of the vocabulary")
        _int("seed", self.seed, 0, MAX_SEED, "a 32-bit unsigned seed")
        if not isinstance(self.copy_fraction, (int, float)) or not 0 <= self.copy_fraction <= 1:
            raise PlanInputError(f"copy_fraction must be a number from 0 to 1, got {self.copy_fraction!r}")
        if not isinstance(self.lengths, str):
            raise PlanInputError(f"lengths must be a length spec (harness.data.workloads), got {self.lengths!r}")
        parse_spec(self.lengths)

    def to_dict(self) -> dict:
        return asdict(self)


def _int(name: str, value, lo: int, hi: int, why: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < lo:
        raise PlanInputError(f"corpus {name} must be an int >= {lo}, got {value!r}")
    if value > hi:
        raise SizeLimitError(f"corpus {name}={value} exceeds the limit {hi} ({why})")


def _chain(c: CorpusConfig) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([c.seed, 7919])
    succ = np.stack([rng.choice(c.vocab, size=c.branching, replace=False) for _ in range(c.vocab)])
    probs = rng.dirichlet(np.full(c.branching, 2.0), size=c.vocab)
    return succ, np.cumsum(probs, axis=1)


def _markov(rng, n: int, succ, cum) -> np.ndarray:
    out = np.empty(n, dtype=np.int64)
    out[0] = rng.integers(succ.shape[0])
    u = rng.random(n)
    for i in range(1, n):
        out[i] = succ[out[i - 1], min(int(np.searchsorted(cum[out[i - 1]], u[i])), succ.shape[1] - 1)]
    return out


def batch_lengths(c: CorpusConfig, step: int) -> list[int]:
    """The sequence lengths L of global batch ``step`` (what planning needs, without drawing tokens); a
    batch of more than ``MAX_BATCH_TOKENS`` tokens is a ``SizeLimitError``."""
    lengths = sample(c.lengths, c.sequences_per_batch, seed=c.seed * 1_000_003 + step)
    if sum(lengths) > MAX_BATCH_TOKENS:
        raise SizeLimitError(f"global batch {step} has {sum(lengths)} tokens ({len(lengths)} sequences of "
                             f"{c.lengths!r}), over the limit {MAX_BATCH_TOKENS} (every rank draws all of them); use "
                             f"fewer sequences per batch or shorter lengths")
    return lengths


def global_batch(c: CorpusConfig, step: int) -> list[np.ndarray]:
    """The token arrays (length L + 1 each) of global batch ``step`` (``batch_lengths``)."""
    lengths = batch_lengths(c, step)
    succ, cum = _chain(c)
    out = []
    for i, L in enumerate(lengths):
        rng = np.random.default_rng([c.seed, step, i])
        if rng.random() < c.copy_fraction:
            motif = rng.integers(c.vocab, size=int(rng.integers(4, 33)))
            out.append(np.resize(motif, L + 1).astype(np.int64))
        else:
            out.append(_markov(rng, L + 1, succ, cum))
    return out
