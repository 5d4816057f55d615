"""Invariants of a dynamic-CP schedule (spec section 2.7) and their checker.

``check_schedule`` returns every violation; ``validate_schedule`` raises ``ScheduleError`` for the
first one, naming the invariant, the micro-batch and the ranks. Both accept a ``Schedule`` or raw
Megatron-shaped ``microbatches`` (micro-batch -> slot -> gids) from any implementation, so the same
checks judge our schedulers and the installed upstream.

>>> validate_schedule([[[0], [0], [1], [2]]], [(0, 300), (1, 90), (2, 60)], n_ranks=4,
...                   max_seqlen_per_rank=200)
>>> validate_schedule([[[1], [0], [0], [2]]], [(0, 300), (1, 90), (2, 60)], n_ranks=4,
...                   max_seqlen_per_rank=200)
Traceback (most recent call last):
...
harness.plan.errors.ScheduleError: schedule violates invariant 'buddy-alignment' in micro-batch 0 at ranks [1, 2]: block of size 2 starts at position 1, not a multiple of 2
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.plan.cost import check_microbatch_tokens, cp_min, is_power_of_two
from harness.plan.errors import PlanInputError, ScheduleError
from harness.plan.layout import Block, Schedule, blocks_from_slots
from harness.plan.lengths import normalize_lengths
from harness.plan.padding import padded_tokens

INVARIANTS: dict[str, str] = {
    "slot-count": "every micro-batch has exactly n_ranks slots",
    "coverage": "every slot is non-empty: no rank idles in a micro-batch",
    "block-shape": "a sequence's slots form one contiguous run of identical lists (same gids, same order)",
    "exactly-once": "every gid of the batch runs in exactly one block of one micro-batch; no unknown gid",
    "block-size": "a block size is a power of two with a process group (a divisor of n_ranks) or n_ranks",
    "min-cp": "every block size is >= min_cp_size",
    "cp-min": "every block size is >= cp_min(L) for each sequence L in it",
    "buddy-alignment": "every block starts at a multiple of its size",
    "block-order": "block sizes never increase from left to right",
    "capacity": "a block's tokens fit: sum(L) <= size * microbatch_tokens_per_rank (default max_seqlen_per_rank), "
                "each L padded as the schedule's padding says",
    "vpp-multiple": "the number of micro-batches is a multiple of vpp_group",
}


@dataclass(frozen=True)
class Violation:
    invariant: str
    microbatch: int | None
    ranks: tuple[int, ...]
    detail: str

    def error(self) -> ScheduleError:
        return ScheduleError(self.invariant, self.microbatch, list(self.ranks), self.detail)


def _valid_sizes(n: int) -> set[int]:
    return {s for s in (1 << i for i in range(n.bit_length())) if n % s == 0} | {n}


def _check_block(b: Block, prev: Block | None, ctx: dict, m: int, out: list[Violation]) -> None:
    lengths, n, mslpr, min_cp = ctx["lengths"], ctx["n"], ctx["mslpr"], ctx["min_cp"]
    ranks = tuple(b.ranks)

    def bad(inv: str, detail: str) -> None:
        out.append(Violation(inv, m, ranks, detail))

    if b.size not in ctx["sizes"]:
        bad("block-size", f"block of size {b.size} has no process group in a domain of {n} ranks")
    if b.size < min_cp:
        bad("min-cp", f"block of size {b.size} is below min_cp_size={min_cp}")
    if b.start % b.size:
        bad("buddy-alignment", f"block of size {b.size} starts at position {b.start}, not a multiple of {b.size}")
    if prev is not None and prev.gids and b.size > prev.size:
        bad("block-order", f"block of size {b.size} follows a block of size {prev.size}")
    known = [g for g in b.gids if g in lengths]
    for g in known:
        need = cp_min(lengths[g], mslpr)  # min_cp_size is its own invariant
        if b.size < need:
            bad("cp-min", f"sequence {g} of {lengths[g]} tokens needs cp >= {need}, block has {b.size}")
    tokens, cap = padded_tokens(ctx["padding"], [lengths[g] for g in known], b.size), ctx["cap"]
    if tokens > b.size * cap:
        what = "max_seqlen_per_rank" if cap == mslpr else "microbatch_tokens_per_rank"
        padded = f" ({ctx['padding'].describe()})" if ctx["padding"] else ""
        bad("capacity", f"block packs {tokens} tokens{padded} on {b.size} ranks = {tokens / b.size:g} per rank "
                        f"> {what} {cap}")


def _check_microbatch(slots, m: int, ctx: dict, seen: dict[int, int], out: list[Violation]) -> None:
    n = ctx["n"]
    if not isinstance(slots, (list, tuple)) or len(slots) != n:
        size = len(slots) if isinstance(slots, (list, tuple)) else type(slots).__name__
        out.append(Violation("slot-count", m, (), f"micro-batch has {size} slots, expected {n}"))
        return
    empty = tuple(p for p, s in enumerate(slots) if not s)
    if empty:
        out.append(Violation("coverage", m, empty, f"{len(empty)} of {n} slots are empty"))
    for p, s in enumerate(slots):
        if len(set(s)) != len(s):
            out.append(Violation("block-shape", m, (p,), f"slot {list(s)} lists a gid twice"))
    blocks = [b for b in blocks_from_slots([list(s) for s in slots]) if b.gids]
    where: dict[int, list[Block]] = {}
    for b in blocks:
        for g in set(b.gids):
            where.setdefault(g, []).append(b)
    for g, bs in sorted(where.items()):
        if len(bs) > 1:
            ranks = tuple(r for b in bs for r in b.ranks)
            same = len({b.gids for b in bs}) == 1
            inv = "exactly-once" if same else "block-shape"
            what = "two separate blocks" if same else "slots whose lists differ: " + "; ".join(
                f"ranks {b.start}..{b.start + b.size - 1} hold {list(b.gids)}" for b in bs)
            out.append(Violation(inv, m, ranks, f"gid {g} appears in {what}"))
        if g in seen and seen[g] != m:
            out.append(Violation("exactly-once", m, tuple(bs[0].ranks),
                                 f"gid {g} already ran in micro-batch {seen[g]}"))
        seen.setdefault(g, m)
        if g not in ctx["lengths"]:
            out.append(Violation("exactly-once", m, tuple(bs[0].ranks), f"gid {g} is not in the batch"))
    prev = None
    for b in blocks:
        _check_block(b, prev, ctx, m, out)
        prev = b


def check_schedule(schedule, lengths=None, *, n_ranks=None, max_seqlen_per_rank=None, min_cp_size=None,
                   vpp_group=None, microbatch_tokens_per_rank=None, padding=None) -> list[Violation]:
    """All violations of ``INVARIANTS`` (empty list = valid). Parameters default to the
    ``Schedule``'s own; raw micro-batches need ``lengths``, ``n_ranks`` and ``max_seqlen_per_rank``.
    ``microbatch_tokens_per_rank`` (default the schedule's, else ``max_seqlen_per_rank``) is the capacity a
    block's tokens must fit; ``max_seqlen_per_rank`` always sets each sequence's ``cp_min``. ``padding`` (default the
    schedule's, ``harness.plan.padding.SequencePadding``): the capacity check counts each sequence padded by it."""
    if isinstance(schedule, Schedule):
        microbatch_tokens_per_rank = microbatch_tokens_per_rank or schedule.microbatch_tokens_per_rank
        padding = padding or schedule.padding
        mbs = schedule.microbatches
        lengths = schedule.lengths if lengths is None else dict(normalize_lengths(lengths))
        n_ranks = schedule.n_ranks if n_ranks is None else n_ranks
        max_seqlen_per_rank = max_seqlen_per_rank or schedule.max_seqlen_per_rank
        min_cp_size = schedule.min_cp_size if min_cp_size is None else min_cp_size
        vpp_group = schedule.vpp_group if vpp_group is None else vpp_group
    else:
        if lengths is None or n_ranks is None or max_seqlen_per_rank is None:
            raise PlanInputError("raw micro-batches need lengths, n_ranks and max_seqlen_per_rank to be validated")
        mbs, lengths = schedule, dict(normalize_lengths(lengths))
    if not isinstance(n_ranks, int) or n_ranks < 1:
        raise PlanInputError(f"n_ranks must be a positive int, got {n_ranks!r}")
    cap = check_microbatch_tokens(microbatch_tokens_per_rank, max_seqlen_per_rank)
    ctx = {"lengths": lengths, "n": n_ranks, "mslpr": max_seqlen_per_rank, "cap": cap, "min_cp": min_cp_size or 1,
           "padding": padding,
           "sizes": _valid_sizes(n_ranks) if not is_power_of_two(n_ranks) else
           {1 << i for i in range(n_ranks.bit_length())}}
    out: list[Violation] = []
    seen: dict[int, int] = {}
    for m, slots in enumerate(mbs):
        _check_microbatch(slots, m, ctx, seen, out)
    missing = sorted(set(lengths) - set(seen))
    if missing:
        shown = missing[:10] + (["..."] if len(missing) > 10 else [])
        out.append(Violation("exactly-once", None, (), f"{len(missing)} gids never scheduled: {shown}"))
    if vpp_group and vpp_group > 1 and len(mbs) % vpp_group:
        out.append(Violation("vpp-multiple", None, (),
                             f"{len(mbs)} micro-batches is not a multiple of vpp_group={vpp_group}"))
    return out


def validate_schedule(schedule, lengths=None, **kw) -> None:
    """Raise ``ScheduleError`` for the first violated invariant (see ``check_schedule``)."""
    violations = check_schedule(schedule, lengths, **kw)
    if violations:
        raise violations[0].error()
