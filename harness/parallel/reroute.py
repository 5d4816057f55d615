"""Deliver each rank the sequences of its schedule slots and build its THD micro-batches.

``reroute``: every rank holds the samples it loaded (``owners`` maps gid -> the DP x CP position that
holds it). One ``all_to_all_single`` over the DP x CP group moves every sample to the positions whose
slots list it, in slot order; split sizes are computed from the schedule on every rank (it is
identical everywhere), so no size exchange is needed. The four token tensors of a sample travel
stacked as one int64 ``[L, 4]`` block.

``build_microbatches``: for micro-batch m, the rank concatenates its slot's samples, pads each to the
divisor (``padding="local"``: ``2 * local_cp_size``, knowing the schedule; ``"domain"``: Megatron's
``2 * dp * cp``; both times TP with sequence parallelism), and keeps its zig-zag slice for its rank in
the block. Where each kept token comes from (which sequence, which row, real or padding) is worked out on
the host with numpy, so the device sees a concatenation, a gather and the padding per column - about 17
operations a micro-batch whatever its sequence count (a static CP 4 pack of the step benchmark's batch took
65, one pad and one concatenation per sequence and column).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from harness.plan.errors import PlanInputError
from harness.plan.layout import Schedule
from harness.plan.thd import pack, pad_length, padding_divisor, zigzag_index_array

SAMPLE_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
PAD_VALUES = {"tokens": 0, "labels": -100, "loss_mask": 0}  # position_ids keep counting


def mtp_keys(depth: int) -> tuple[str, ...]:
    """The extra columns of multi-token prediction (``harness.runtime.mtp``), made per sequence before
    the CP split: depth k's input tokens ``t_{i+k}``, labels ``t_{i+k+1}`` and mask."""
    return tuple(f"mtp_{kind}_{k}" for k in range(1, depth + 1) for kind in ("tokens", "labels", "mask"))


def pad_value(key: str) -> int:
    """Padding of a column: labels -100 (ignored by the loss), everything else 0."""
    return -100 if key == "labels" or key.startswith("mtp_labels") else PAD_VALUES.get(key, 0)


class RerouteError(PlanInputError):
    """Ownership or data does not match the schedule."""


def needed_gids(schedule: Schedule, position: int) -> list[int]:
    """The gids in ``position``'s slots, micro-batch after micro-batch, in slot order."""
    out = []
    for mb in schedule.layout:
        for b in mb:
            if b.start <= position < b.start + b.size:
                out.extend(b.gids)
    return out


def reroute(local: Mapping[int, Mapping[str, torch.Tensor]], owners: Mapping[int, int], schedule: Schedule,
            position: int, group=None, keys: tuple[str, ...] = SAMPLE_KEYS) -> dict[int, dict[str, torch.Tensor]]:
    """Samples ``local`` (this rank's) -> the samples of this rank's slots (see module doc)."""
    n = schedule.n_ranks
    missing = [g for g in schedule.lengths if g not in owners]
    if missing:
        raise RerouteError(f"no owner for gids {missing[:10]}: every scheduled gid needs the position that holds it")
    needs = [needed_gids(schedule, q) for q in range(n)]
    send = [[g for g in needs[q] if owners[g] == position] for q in range(n)]
    recv = [[g for g in needs[position] if owners[g] == q] for q in range(n)]
    absent = [g for gs in send for g in gs if g not in local]
    if absent:
        raise RerouteError(f"position {position} owns gids {absent[:10]} but does not hold their samples")
    L = schedule.lengths
    device = next((t.device for s in local.values() for t in s.values()), torch.device("cpu"))
    blocks = [_stacked(local[g], L[g], keys) for gs in send for g in gs]
    buf = torch.cat(blocks) if blocks else torch.empty((0, len(keys)), dtype=torch.int64, device=device)
    out_splits = [sum(L[g] for g in gs) for gs in recv]
    out = buf.new_empty((sum(out_splits), len(keys)))
    dist.all_to_all_single(out, buf, out_splits, [sum(L[g] for g in gs) for gs in send], group=group)
    received, offset = {}, 0
    for gs in recv:
        for g in gs:
            received[g] = {k: out[offset:offset + L[g], i] for i, k in enumerate(keys)}
            offset += L[g]
    return {g: received[g] for g in needs[position]}


def _stacked(sample: Mapping[str, torch.Tensor], length: int, keys: tuple[str, ...] = SAMPLE_KEYS) -> torch.Tensor:
    cols = []
    for k in keys:
        t = sample[k]
        if t.shape != (length,):
            raise RerouteError(f"sample key {k!r} has shape {tuple(t.shape)}, the schedule says {length} tokens")
        cols.append(t.to(torch.int64))
    return torch.stack(cols, dim=1)


def block_sequences(block, position: int) -> tuple[int, ...]:
    """The sequences ``position`` packs for its ``block``, in pack order: the block's gids. Every rank
    of a block must agree on them (the zig-zag slices and the CP attention assume one pack); a seam
    that ``harness.faults`` replaces to re-create a rerouted batch that drops or misorders one."""
    return block.gids


@dataclass(frozen=True)
class ThdMicroBatch:
    """This rank's share of one micro-batch: its zig-zag slice of the block's packed THD buffer."""

    index: int
    gids: tuple[int, ...]
    block_start: int
    local_cp_size: int
    cp_rank: int
    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...]
    max_seqlen: int
    data: dict[str, torch.Tensor]  # key -> [T_local]; ``SAMPLE_KEYS`` plus ``seq`` (each token's gid)

    @property
    def num_tokens(self) -> int:
        return self.cu_seqlens[-1]


def build_microbatches(samples: Mapping[int, Mapping[str, torch.Tensor]], schedule: Schedule, position: int, *,
                       padding: str = "local", fixed_length: int = 0, tp_size: int = 1,
                       sequence_parallel: bool = False, token_multiple: int = 0) -> list[ThdMicroBatch]:
    """``padding``: ``local`` (2 x local_cp_size), ``domain`` (2 x N) or ``fixed`` (every sequence
    padded to ``fixed_length``: the bshd layout). ``token_multiple`` (0 = off; even, or 1): the last
    sequence's padding grows until every rank's slice holds a multiple of that many tokens, so the
    per-rank token counts take few values (CUDA graphs are recorded per shape); the padding is
    masked out of the loss and attends only within its sequence, after its real tokens. ``sequence_parallel``: every
    sequence (and a fixed length) padded to a multiple of ``tp_size`` times its CP divisor, so every rank's token
    rows split evenly over its TP group (``harness.parallel.sequence_parallel``)."""
    if padding not in ("local", "domain", "fixed"):
        raise RerouteError(f"padding must be 'local', 'domain' or 'fixed', got {padding!r}")
    if not isinstance(token_multiple, int) or token_multiple < 0 or (token_multiple > 1 and token_multiple % 2):
        raise RerouteError(f"token_multiple must be 0 (off), 1 or an even int, got {token_multiple!r}")
    out = []
    for m, mb in enumerate(schedule.layout):
        (b,) = [b for b in mb if b.start <= position < b.start + b.size]
        gids = tuple(block_sequences(b, position))
        lengths = [schedule.lengths[g] for g in gids]
        if padding == "fixed":
            if sequence_parallel:  # every rank's rows split evenly over the TP group (Megatron's rule)
                fixed_length = pad_length(fixed_length, padding_divisor(cp_size=b.size, tp_size=tp_size,
                                                                        sequence_parallel=True))
            if fixed_length < max(lengths) or fixed_length % (2 * b.size if b.size > 1 else 1):
                raise RerouteError(f"fixed_length={fixed_length} must hold {max(lengths)} tokens and be a "
                                   f"multiple of 2 x {b.size}")
            p = pack(lengths, 1)
            p = type(p)(p.cu_seqlens, [fixed_length * i for i in range(len(lengths) + 1)], fixed_length)
        else:
            div = padding_divisor(cp_size=b.size, tp_size=tp_size, sequence_parallel=sequence_parallel) \
                if padding == "local" else padding_divisor(n_ranks=schedule.n_ranks, tp_size=tp_size,
                                                          sequence_parallel=sequence_parallel)
            p = pack(lengths, div)
            multiple = math.lcm(token_multiple, tp_size) if sequence_parallel and token_multiple > 1 else token_multiple
            if multiple > 1 and p.cu_seqlens_padded[-1] % (multiple * b.size):
                # even multiples of b.size keep the last sequence a multiple of 2 x cp (zig-zag); with sequence
                # parallelism a multiple of tp too, so every rank's rows still split evenly over its TP group
                grow = -p.cu_seqlens_padded[-1] % (multiple * b.size)
                cup = p.cu_seqlens_padded[:-1] + [p.cu_seqlens_padded[-1] + grow]
                p = type(p)(p.cu_seqlens, cup, max(p.max_seqlen, cup[-1] - cup[-2]))
        if not gids:
            raise RerouteError(f"micro-batch {m}'s block at position {position} packs no sequence")
        idx = np.asarray(zigzag_index_array(p.cu_seqlens_padded, b.size, position - b.start), dtype=np.int64)
        out.append(ThdMicroBatch(m, gids, b.start, b.size, position - b.start, tuple(p.cu_seqlens),
                                 tuple(p.cu_seqlens_padded), p.max_seqlen,
                                 _slice(samples, gids, lengths, p.cu_seqlens_padded, idx)))
    return out


def _slice(samples, gids: tuple[int, ...], lengths: list[int], cu_padded, idx: np.ndarray) -> dict[str, torch.Tensor]:
    """The columns of this rank's slice ``idx`` (positions in the padded pack) of the packed sequences ``gids``,
    plus ``seq`` (each token's gid). A padding token takes its column's ``pad_value``; its ``position_ids`` keep
    counting within its sequence. Where each kept token comes from is worked out on the host in one pass, so the
    device sees a few operations per column (a concatenation, a gather, the padding) whatever the sequence count."""
    keys = tuple(samples[gids[0]])
    cup, L = np.asarray(cu_padded, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    which = np.searchsorted(cup, idx, side="right") - 1  # the sequence of each kept position
    within = idx - cup[which]  # its place in that sequence (past its length: padding)
    real = within < L[which]
    starts = np.concatenate([[0], np.cumsum(L)[:-1]])
    source = np.where(real, starts[which] + within, 0)  # its row in the sequences' concatenated columns
    dev = samples[gids[0]][keys[0]].device
    table = torch.from_numpy(np.stack([source, within, np.asarray(gids, dtype=np.int64)[which],
                                       real.astype(np.int64)])).to(dev)
    source_t, within_t, seq_t, real_t = table.unbind(0)
    pad = real_t == 0
    out = {}
    for k in keys:
        pieces = [samples[g][k] for g in gids]
        bad = [(g, tuple(t.shape)) for g, t, n in zip(gids, pieces, lengths) if t.shape != (n,)]
        if bad:
            raise RerouteError(f"samples' {k!r} do not match the schedule's lengths: (gid, shape) {bad[:5]}")
        got = torch.cat(pieces)[source_t]
        if k == "position_ids":
            out[k] = torch.where(pad, within_t.to(got.dtype), got)
        else:
            out[k] = got.masked_fill_(pad, pad_value(k))
    out["seq"] = seq_t
    return out


def owners_round_robin(gids, n_positions: int) -> dict[int, int]:
    """A simple ownership map (gid -> position), e.g. for tests."""
    return {g: i % n_positions for i, g in enumerate(sorted(gids))}


def sample_for(gid: int, length: int, vocab: int = 32000, device="cpu") -> dict[str, torch.Tensor]:
    """A deterministic synthetic sample (every rank can regenerate any gid's data to check it)."""
    rng = np.random.default_rng(gid)
    tokens = torch.as_tensor(rng.integers(0, vocab, size=length + 1), dtype=torch.int64, device=device)
    return {"tokens": tokens[:-1], "labels": tokens[1:], "loss_mask": torch.ones(length, dtype=torch.int64, device=device),
            "position_ids": torch.arange(length, dtype=torch.int64, device=device)}
