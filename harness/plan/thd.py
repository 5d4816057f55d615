"""THD packing and TransformerEngine's zig-zag CP slicing, in numpy (no torch).

Padding. Every sequence of a CP-sliced pack must be divisible by ``2 * cp`` (TE splits it into
``2 * cp`` equal chunks). ``padding_divisor`` gives Megatron's rule: ``2 * cp`` for static CP (1 when
cp = 1), ``2 * n_ranks`` (= 2 * dp * cp) for dynamic CP because the block size is unknown when the
data is prepared, times ``tp`` with sequence parallelism. Knowing the schedule, a block of
``local_cp_size`` ranks only needs ``2 * local_cp_size`` (``padding_divisor(cp_size=local)``).

>>> p = pack([5, 9, 3], divisor=4)
>>> p.cu_seqlens, p.cu_seqlens_padded, p.max_seqlen
([0, 5, 14, 17], [0, 8, 20, 24], 12)

Zig-zag slicing (``thd_get_partitioned_indices``): each padded sequence is split into ``2 * cp``
chunks of ``c = L / (2 * cp)`` tokens; rank r takes chunk r and chunk ``2 * cp - 1 - r``; sequences in
pack order. Worked examples (spec section 4, checked against TE's own unit test):

>>> zigzag_indices([0, 8, 16], 2, 0)
[0, 1, 6, 7, 8, 9, 14, 15]
>>> zigzag_indices([0, 8, 16], 2, 1)
[2, 3, 4, 5, 10, 11, 12, 13]
>>> zigzag_indices([0, 16], 4, 3)
[6, 7, 8, 9]

``zigzag_gather`` puts the ranks' slices back into pack order (the inverse).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from harness.plan.errors import PlanInputError


class ThdError(PlanInputError):
    """Bad THD input: offsets, CP size or rank."""


def padding_divisor(*, cp_size: int = 1, n_ranks: int | None = None, tp_size: int = 1,
                    sequence_parallel: bool = False) -> int:
    """Megatron's per-sequence padding divisor: ``2 * n_ranks`` for dynamic CP (pass ``n_ranks``),
    else ``2 * cp_size`` (1 when cp_size = 1); times ``tp_size`` with sequence parallelism."""
    for name, v in (("cp_size", cp_size), ("tp_size", tp_size), ("n_ranks", n_ranks or 1)):
        if not isinstance(v, int) or v < 1:
            raise ThdError(f"{name} must be a positive int, got {v!r}")
    div = 2 * n_ranks if n_ranks is not None else (2 * cp_size if cp_size > 1 else 1)
    return div * (tp_size if sequence_parallel else 1)


def pad_length(L: int, divisor: int) -> int:
    return -(-L // divisor) * divisor


@dataclass(frozen=True)
class ThdPack:
    """Offsets of a packed THD micro-batch: real lengths, padded lengths, longest padded sequence."""

    cu_seqlens: list[int]
    cu_seqlens_padded: list[int]
    max_seqlen: int

    @property
    def total_tokens(self) -> int:
        return self.cu_seqlens_padded[-1]


def pack(lengths: list[int], divisor: int = 1) -> ThdPack:
    """Pack sequences of ``lengths`` tokens, each padded up to a multiple of ``divisor``."""
    if divisor < 1:
        raise ThdError(f"divisor must be >= 1, got {divisor}")
    if any(L < 0 for L in lengths):
        raise ThdError(f"sequence lengths must be >= 0, got {min(lengths)}")
    padded = [pad_length(L, divisor) for L in lengths]
    cu = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).tolist()
    cup = np.concatenate([[0], np.cumsum(padded, dtype=np.int64)]).tolist()
    return ThdPack(cu, cup, max(padded, default=0))


def _check(cu_seqlens_padded, cp_size: int, cp_rank: int | None = None, divisible: bool = True) -> np.ndarray:
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ThdError(f"cp_size must be an int >= 1, got {cp_size!r}")
    if cp_rank is not None and not 0 <= cp_rank < cp_size:
        raise ThdError(f"cp_rank={cp_rank} is outside [0, {cp_size}); use a rank of the CP block")
    cu = np.asarray(cu_seqlens_padded, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0:
        raise ThdError(f"cu_seqlens_padded must be a 1-D list starting at 0, got {list(cu[:5])}...")
    steps = np.diff(cu)
    if (steps < 0).any():
        i = int(np.argmax(steps < 0))
        raise ThdError(f"cu_seqlens_padded decreases at index {i + 1}: {int(cu[i])} -> {int(cu[i + 1])}")
    bad = cu % (2 * cp_size) != 0
    if divisible and bad.any():
        i = int(np.argmax(bad))
        raise ThdError(f"cu_seqlens_padded[{i}] = {int(cu[i])} is not divisible by 2 * cp_size = {2 * cp_size}; "
                       f"pad every sequence to a multiple of {2 * cp_size} (harness.plan.thd.pack)")
    return cu


def _segments(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate ``arange(s, s + n)`` for every (s, n), vectorised."""
    total = int(lengths.sum())
    offsets = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.repeat(starts, lengths) + np.arange(total, dtype=np.int64) - offsets


def zigzag_index_array(cu_seqlens_padded, cp_size: int, cp_rank: int) -> np.ndarray:
    """``zigzag_indices`` as an int64 numpy array (the fast path). With ``cp_size == 1`` the rank keeps
    the whole pack and no divisibility is required (Megatron skips the slicing there)."""
    cu = _check(cu_seqlens_padded, cp_size, cp_rank, divisible=cp_size > 1)
    if cp_size == 1:
        return np.arange(cu[-1], dtype=np.int64)
    start, chunk = cu[:-1], np.diff(cu) // (2 * cp_size)
    starts = np.stack([start + cp_rank * chunk, start + (2 * cp_size - 1 - cp_rank) * chunk], axis=1).ravel()
    return _segments(starts, np.repeat(chunk, 2))


def zigzag_indices(cu_seqlens_padded, cp_size: int, cp_rank: int) -> list[int]:
    """Indices into the packed (padded) tokens held by ``cp_rank`` of a CP block of ``cp_size``."""
    return zigzag_index_array(cu_seqlens_padded, cp_size, cp_rank).tolist()


def zigzag_permutation(cu_seqlens_padded, cp_size: int) -> np.ndarray:
    """All ranks' indices, rank after rank: ``values[perm]`` concatenates the ranks' slices (every rank's
    ``zigzag_index_array`` at once: one validation, one pass)."""
    cu = _check(cu_seqlens_padded, cp_size, divisible=cp_size > 1)
    if cp_size == 1:
        return np.arange(cu[-1], dtype=np.int64)
    start, chunk = cu[:-1], np.diff(cu) // (2 * cp_size)
    r = np.arange(cp_size, dtype=np.int64)[:, None]
    starts = np.stack([start + r * chunk, start + (2 * cp_size - 1 - r) * chunk], axis=2).ravel()  # rank, seq, pair
    return _segments(starts, np.tile(np.repeat(chunk, 2), cp_size))


def zigzag_gather(slices, cu_seqlens_padded, cp_size: int) -> np.ndarray:
    """Inverse of the slicing: ``slices[r]`` is rank r's slice (leading axis = tokens); returns the
    pack in order."""
    if len(slices) != cp_size:
        raise ThdError(f"expected {cp_size} slices, got {len(slices)}")
    perm = zigzag_permutation(cu_seqlens_padded, cp_size)
    stacked = np.concatenate([np.asarray(s) for s in slices])
    if stacked.shape[0] != perm.size:
        raise ThdError(f"the slices hold {stacked.shape[0]} tokens, the pack has {perm.size}")
    out = np.empty_like(stacked)
    out[perm] = stacked
    return out


@dataclass(frozen=True)
class ChunkPlan:
    """What one CP rank computes: its local queries are ``2 * n`` chunks (per sequence: chunk r, then
    chunk ``2 * cp - 1 - r``), chunk i of ``q_lens[i]`` tokens sits at ``q_offsets[i]`` inside its
    sequence and attends keys ``[k_starts[i], k_starts[i] + k_lens[i])`` of the gathered pack - the
    sequence's prefix up to its own last token (causal, bottom-right aligned)."""

    q_lens: np.ndarray
    q_offsets: np.ndarray
    k_starts: np.ndarray
    k_lens: np.ndarray

    @property
    def cu_q(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.q_lens)])

    @property
    def cu_k(self) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(self.k_lens)])

    def key_index(self) -> np.ndarray:
        """Pack positions of every chunk's keys, chunk after chunk (for one gather)."""
        return _segments(self.k_starts, self.k_lens)


def zigzag_chunks(cu_seqlens_padded, cp_size: int, cp_rank: int) -> ChunkPlan:
    """The ``ChunkPlan`` of ``cp_rank`` in a CP block of ``cp_size`` over the pack.

    >>> p = zigzag_chunks([0, 8, 16], 2, 0)   # two sequences of 8, chunks of 2
    >>> p.q_offsets.tolist(), p.k_lens.tolist()
    ([0, 6, 0, 6], [2, 8, 2, 8])
    """
    cu = _check(cu_seqlens_padded, cp_size, cp_rank)
    start, chunk = cu[:-1], np.diff(cu) // (2 * cp_size)
    first, last = cp_rank, 2 * cp_size - 1 - cp_rank
    q_offsets = np.stack([first * chunk, last * chunk], axis=1).ravel()
    k_lens = np.stack([(first + 1) * chunk, (last + 1) * chunk], axis=1).ravel()
    return ChunkPlan(np.repeat(chunk, 2), q_offsets, np.repeat(start, 2), k_lens)


def whole_chunks(cu_seqlens) -> ChunkPlan:
    """The no-CP plan: one chunk per sequence attending its own prefix (any lengths)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    if cu.ndim != 1 or cu.size < 1 or cu[0] != 0 or (np.diff(cu) < 0).any():
        raise ThdError(f"cu_seqlens must be non-decreasing and start at 0, got {cu[:6].tolist()}...")
    lens = np.diff(cu)
    return ChunkPlan(lens, np.zeros_like(lens), cu[:-1], lens)
