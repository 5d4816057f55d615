"""Ring CP attention: the K/V exchange overlapped with attention (TransformerEngine's ``p2p`` pattern).

Each rank of a CP block of ``P`` ranks holds its zig-zag slice of the pack (``harness.plan.thd``):
per sequence, chunk ``r`` then chunk ``2P - 1 - r``, both of ``c`` tokens. In ``P`` steps every
rank's K/V travels once around the ring (rank ``r`` sends to ``r + 1`` and receives from ``r - 1``),
and while step ``t``'s block is in flight the rank computes the attention part of the block it
already has, the one of rank ``j = r - t``:

- ``t = 0`` (its own): causal attention of the local slice - chunk r precedes chunk 2P - 1 - r, so the
  local order is causal order;
- ``j < r``: every local query against the *first* chunk of j's slice (chunk j < r <= 2P - 1 - r), no mask;
- ``j > r``: the *second* local chunk (2P - 1 - r) against all of j's slice (j and 2P - 1 - j are both
  earlier), no mask; the first local chunk (r < j) sees none of it.

Both off-diagonal kinds are the same work (c x 2c per sequence), so zig-zag keeps the ranks in step.
Parts are merged by log-sum-exp in fp32. The backward recomputes each part's gradients from the
merged output and log-sum-exp (K/V blocks received in the forward are kept, as the all-gather
exchange keeps the gathered keys) and passes each block's fp32 dK/dV accumulator along the ring: it
starts at the rank after the owner and reaches the owner after P - 1 shifts, holding every other
rank's contribution; the owner adds its own and rounds once.

Communication is the same bytes as the all-gather exchange (P - 1 blocks of K/V forward, P - 1 fp32
dK/dV blocks backward, as the fp32 reduce-scatter), but it runs on NCCL's stream while the attention
kernels run, instead of in front of them.

When it pays (``bench attention`` on H200s, bf16, 16 x 128 heads; the figures: ``reports/recorded/README.md``,
"bench attention" and "Ring probes"): long packs, where each part's attention outlasts a shift - there
the ring's per-GPU efficiency beats the all-gather's, for one long sequence and for packs of 8. Not for
short blocks: at 2048 tokens per rank (the step benchmark's CP-4 blocks) a layer's forward + backward
takes about 1.5-2x the all-gather's time, since a ring shift of the block's K/V and each part's host
work (merges, row selections, a batched send/receive per step) are not covered by its kernels. Hence
``exchange="auto"`` in ``harness.parallel.cp_attention``.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from harness.plan.thd import _check
from harness.runtime.attention import Segments, attention_backward_lse, attention_forward_lse

_GROUP_PEER = "group_peer" in inspect.signature(dist.P2POp.__init__).parameters


@dataclass(frozen=True)
class RingPlan:
    """Per micro-batch, per rank: offsets and row indices every layer's ring attention reuses."""

    cp_size: int
    cp_rank: int
    full: Segments  # per sequence 2c local rows (both chunks)
    half: Segments  # per sequence c rows
    causal: Segments  # the local slice against itself
    first: torch.Tensor  # int64: local rows of every sequence's first chunk
    second: torch.Tensor  # int64: local rows of every sequence's second chunk

    @classmethod
    def build(cls, cu_seqlens_padded, cp_size: int, cp_rank: int, device) -> RingPlan:
        cu = _check(cu_seqlens_padded, cp_size, cp_rank)
        c = np.diff(cu) // (2 * cp_size)  # chunk length per sequence
        base = 2 * (np.cumsum(c) - c)  # local row of each sequence's first chunk
        first = np.repeat(base, c) + np.arange(int(c.sum()), dtype=np.int64) - np.repeat(np.cumsum(c) - c, c)
        as_i64 = lambda a: torch.as_tensor(a, dtype=torch.int64, device=device)  # noqa: E731
        return cls(cp_size, cp_rank, Segments.build(2 * c, c, device), Segments.build(c, 2 * c, device),
                   Segments.build(2 * c, 2 * c, device), as_i64(first), as_i64(first + np.repeat(c, c)))

    def kind(self, t: int) -> str:
        """What step ``t`` computes: ``causal`` (own block), ``kv_first`` (j < r), ``q_second`` (j > r)."""
        j = (self.cp_rank - t) % self.cp_size
        return "causal" if t == 0 else ("kv_first" if j < self.cp_rank else "q_second")


def _peer(group, r: int) -> dict:
    return {"group_peer": r} if _GROUP_PEER else {"peer": dist.get_global_rank(group, r)}


def _shift(send: torch.Tensor, recv: torch.Tensor, plan: RingPlan, group) -> list:
    """Start sending ``send`` to the next rank of the ring and receiving ``recv`` from the previous one."""
    P, r = plan.cp_size, plan.cp_rank
    ops = [dist.P2POp(dist.isend, send, group=group, **_peer(group, (r + 1) % P)),
           dist.P2POp(dist.irecv, recv, group=group, **_peer(group, (r - 1) % P))]
    return dist.batch_isend_irecv(ops)


def _wait(works) -> None:
    for w in works:
        w.wait()


def _merge(o_acc, lse_acc, o, lse, rows=None) -> None:
    """Fold one part (o [T', H, D], lse [H, T']) into the fp32 accumulators, at ``rows`` (None: all):
    out = (1 - w) out + w o with w = exp(lse - logaddexp(lse_acc, lse)) = sigmoid(lse - lse_acc),
    in place (five kernels for all rows)."""
    la = lse_acc if rows is None else lse_acc.index_select(1, rows)
    oa = o_acc if rows is None else o_acc.index_select(0, rows)
    w = torch.sigmoid(lse - la).T.unsqueeze(-1)  # [T', H, 1]
    oa.lerp_(o.to(oa.dtype), w)
    torch.logaddexp(la, lse, out=la)
    if rows is not None:
        o_acc.index_copy_(0, rows, oa)
        lse_acc.index_copy_(1, rows, la)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RingPlan, group, backend: str, scale):
        P = plan.cp_size
        acc_dtype = torch.promote_types(q.dtype, torch.float32)  # merges and gradient sums: fp32 (fp64 for fp64)
        kv = torch.stack([k, v], dim=1)  # [T, 2, Hkv, D]: one message per step
        blocks, pending, recv = [kv], None, None
        o_acc = lse_acc = None
        for t in range(P):
            cur = blocks[t]
            if t + 1 < P:  # the next block travels while this one's part is computed
                recv = torch.empty_like(cur)
                pending = _shift(cur, recv, plan, group)
            kind = plan.kind(t)
            if kind == "causal":
                o, lse = attention_forward_lse(q, cur[:, 0], cur[:, 1], plan.causal, causal=True, backend=backend,
                                               scale=scale)
                o_acc, lse_acc = o.to(acc_dtype), lse.to(acc_dtype).contiguous()
            elif kind == "kv_first":
                kf = cur.index_select(0, plan.first)
                o, lse = attention_forward_lse(q, kf[:, 0], kf[:, 1], plan.full, causal=False, backend=backend,
                                               scale=scale)
                _merge(o_acc, lse_acc, o, lse)
            else:
                o, lse = attention_forward_lse(q.index_select(0, plan.second), cur[:, 0], cur[:, 1], plan.half,
                                               causal=False, backend=backend, scale=scale)
                _merge(o_acc, lse_acc, o, lse, plan.second)
            if t + 1 < P:
                _wait(pending)
                blocks.append(recv)
        out = o_acc.to(q.dtype)
        ctx.plan, ctx.group, ctx.backend, ctx.scale = plan, group, backend, scale
        ctx.save_for_backward(q, out, lse_acc, *blocks)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, out, lse, *blocks = ctx.saved_tensors
        plan, group, backend, scale = ctx.plan, ctx.group, ctx.backend, ctx.scale
        P = plan.cp_size
        dout = dout.contiguous()
        acc_dtype = torch.promote_types(q.dtype, torch.float32)
        dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
        acc, pending, recv = None, None, None
        # Blocks in the order 1, 2, ..., P - 1, then its own (0): the accumulator of block j starts at
        # rank j + 1 and reaches its owner after P - 1 shifts, where the owner's own part is added last.
        order = list(range(1, P)) + [0]
        for i, t in enumerate(order):
            cur, kind = blocks[t], plan.kind(t)
            if kind == "causal":
                g = attention_backward_lse(dout, q, cur[:, 0], cur[:, 1], out, lse, plan.causal, causal=True,
                                           backend=backend, scale=scale)
                dq += g[0].to(acc_dtype)
                part, rows = torch.stack([g[1], g[2]], dim=1), None
            elif kind == "kv_first":
                kf = cur.index_select(0, plan.first)
                g = attention_backward_lse(dout, q, kf[:, 0], kf[:, 1], out, lse, plan.full, causal=False,
                                           backend=backend, scale=scale)
                dq += g[0].to(acc_dtype)
                part, rows = torch.stack([g[1], g[2]], dim=1), plan.first
            else:
                sec = plan.second
                g = attention_backward_lse(dout.index_select(0, sec), q.index_select(0, sec), cur[:, 0], cur[:, 1],
                                           out.index_select(0, sec), lse.index_select(1, sec), plan.half,
                                           causal=False, backend=backend, scale=scale)
                dq.index_add_(0, sec, g[0].to(acc_dtype))
                part, rows = torch.stack([g[1], g[2]], dim=1), None
            if i == 0:  # this rank starts the accumulator of the block it received first
                acc = (part.to(acc_dtype) if rows is None else
                       torch.zeros(cur.shape, dtype=acc_dtype, device=cur.device).index_add_(0, rows, part.to(acc_dtype)))
            else:  # it arrives from the rank that held the block one step before
                _wait(pending)
                acc = recv
                if rows is None:
                    acc += part.to(acc_dtype)
                else:
                    acc.index_add_(0, rows, part.to(acc_dtype))
            if i < P - 1:
                recv = torch.empty_like(acc)
                pending = _shift(acc, recv, plan, group)  # on to the next rank (the last shift: to its owner)
        # after its own part, acc is this rank's block's gradient summed over the ring, rounded once below
        return dq.to(q.dtype), acc[:, 0].to(q.dtype), acc[:, 1].to(q.dtype), None, None, None, None


def ring_attention(q_TH, k_TH, v_TH, plan: RingPlan, group, *, backend: str = "sdpa", scale=None):
    """This rank's causal attention output for its zig-zag slice, K/V exchanged around ``group``'s
    ring while attention runs (``backend``: one of ``harness.runtime.attention.LSE_BACKENDS``)."""
    rows = int(plan.first.numel()) * 2
    if q_TH.shape[0] != rows or k_TH.shape[0] != rows or v_TH.shape[0] != rows:
        raise ValueError(f"q/k/v hold {q_TH.shape[0]}/{k_TH.shape[0]}/{v_TH.shape[0]} rows; this rank's zig-zag slice "
                         f"of the plan has {rows} (slice with harness.plan.thd.zigzag_index_array)")
    if group is None or dist.get_world_size(group) != plan.cp_size:
        have = "no group" if group is None else f"a group of {dist.get_world_size(group)} ranks"
        raise ValueError(f"ring exchange of a CP block of {plan.cp_size} ranks got {have}; pass the block's process "
                         f"group (DynamicGroups.for_block(block_start, {plan.cp_size}))")
    return _RingAttention.apply(q_TH, k_TH, v_TH, plan, group, backend, scale)
