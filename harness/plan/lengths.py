"""Normalisation and validation of scheduler inputs.

``lengths`` is a sequence of ``(gid, L)`` pairs, or of plain ints (then ``gid`` = index), or a
numpy array of either shape. Everything is converted to a tuple of ``(int, int)`` pairs once, so the
schedulers never see numpy scalars, bools or floats.

>>> normalize_lengths([5, 9, 3])
((0, 5), (1, 9), (2, 3))
>>> normalize_lengths([(10, 5), (4, 9)])
((10, 5), (4, 9))
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Sequence

from harness.plan.cost import check_positive_int, check_power_of_two, cp_min
from harness.plan.errors import DuplicateGidError, InvalidLengthError, PlanInputError, SequenceTooLongError

Pairs = tuple[tuple[int, int], ...]


def _as_int(value, what: str) -> int:
    if type(value) is int:
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        if isinstance(value, numbers.Real) and float(value).is_integer():
            raise InvalidLengthError(
                f"{what} must be an int, got {type(value).__name__} {value!r}; convert it with int()"
            )
        raise InvalidLengthError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def normalize_lengths(lengths: Iterable) -> Pairs:
    """Return ``((gid, L), ...)``; raise ``InvalidLengthError`` / ``DuplicateGidError`` on bad input."""
    if hasattr(lengths, "tolist"):  # numpy arrays: plain Python ints from here on
        lengths = lengths.tolist()
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, Iterable):
        raise InvalidLengthError(f"lengths must be a sequence of ints or (gid, L) pairs, got {lengths!r}")
    pairs = []
    for i, item in enumerate(lengths):
        if type(item) is int:
            gid, L = i, item
        elif isinstance(item, (tuple, list)) or (isinstance(item, Sequence) and not isinstance(item, (str, bytes))):
            if len(item) != 2:
                raise InvalidLengthError(f"lengths[{i}] = {item!r} is not a (gid, L) pair")
            gid, L = _as_int(item[0], f"gid of lengths[{i}]"), _as_int(item[1], f"length of lengths[{i}]")
        else:
            gid, L = i, _as_int(item, f"lengths[{i}]")
        if L <= 0:
            raise InvalidLengthError(
                f"sequence {gid} has length {L}; lengths must be >= 1 (drop empty sequences before scheduling)"
            )
        if gid < 0:
            raise InvalidLengthError(f"lengths[{i}] has gid {gid}; global ids must be >= 0")
        pairs.append((gid, L))
    seen: dict[int, int] = {}
    for i, (gid, _) in enumerate(pairs):
        if gid in seen:
            raise DuplicateGidError(
                f"gid {gid} appears twice (lengths[{seen[gid]}] and lengths[{i}]); every sequence needs "
                f"a unique global id"
            )
        seen[gid] = i
    return tuple(pairs)


def check_domain(n_ranks: int, max_seqlen_per_rank: int, min_cp_size: int, vpp_group: int | None) -> None:
    """Validate the DP x CP domain parameters shared by all schedulers."""
    check_positive_int("n_ranks", n_ranks)
    check_power_of_two("n_ranks", n_ranks)
    check_positive_int("max_seqlen_per_rank", max_seqlen_per_rank)
    check_positive_int("min_cp_size", min_cp_size)
    check_power_of_two("min_cp_size", min_cp_size)
    if min_cp_size > n_ranks:
        raise PlanInputError(
            f"min_cp_size={min_cp_size} exceeds n_ranks={n_ranks}; use min_cp_size <= {n_ranks}"
        )
    if vpp_group is not None:
        check_positive_int("vpp_group", vpp_group)


def check_fits(pairs: Pairs, n_ranks: int, max_seqlen_per_rank: int, padding=None) -> None:
    """Every sequence must fit on the whole domain: ``cp_min(L) <= n_ranks``, padded as ``padding`` says
    (``harness.plan.padding.SequencePadding``) when it is given."""
    if not pairs:
        return
    gid, L = max(pairs, key=lambda p: (p[1], -p[0]))
    if padding is not None and L <= n_ranks * max_seqlen_per_rank \
            and padding.cp_min(L, max_seqlen_per_rank, limit=n_ranks) > n_ranks:
        need = padding.padded(L, n_ranks)
        raise SequenceTooLongError(
            f"sequence {gid} has {L} tokens, {need} once padded ({padding.describe()}) on all {n_ranks} ranks of the "
            f"DP x CP domain, more than they hold at max_seqlen_per_rank={max_seqlen_per_rank}; raise "
            f"max_seqlen_per_rank to >= {-(-need // n_ranks)} or truncate it")
    if L > n_ranks * max_seqlen_per_rank:
        need = cp_min(L, max_seqlen_per_rank)
        raise SequenceTooLongError(
            f"sequence {gid} has {L} tokens and needs a CP group of {need} ranks at "
            f"max_seqlen_per_rank={max_seqlen_per_rank}, but the DP x CP domain has only {n_ranks}; "
            f"raise max_seqlen_per_rank to >= {-(-L // n_ranks)}, use >= {need} ranks, or truncate it"
        )


def sort_desc(pairs: Pairs) -> list[tuple[int, int]]:
    """Stable descending sort by length (Megatron's order: ties keep input order)."""
    return sorted(pairs, key=lambda p: p[1], reverse=True)
