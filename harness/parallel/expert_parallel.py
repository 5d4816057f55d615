"""Expert parallelism (EP) of the tiny MoE over a pipeline stage's DP x CP domain.

The domain's ``R`` ranks each own ``X / R`` experts of every MoE layer (rank q: experts
``[q * X/R, (q + 1) * X/R)``; ``shard_experts`` drops the others from its model); the routers stay
replicated. In every MoE layer of every micro-batch, ``ExpertDispatch`` (a ``layers.Experts``):

1. sorts the rank's (token, k) pairs by expert (stable: token order within an expert) and all-gathers
   its per-expert pair counts with the rows it is about to send each rank, so every rank holds the
   ``[R, X + R]`` table of all split sizes; each rank checks that every sender's counts for a rank's
   experts add up to the rows it sends there (``DispatchAuditError``, raised alike on every rank before
   any token moves: an all-to-all with disagreeing split sizes hangs or corrupts);
2. dispatch: one all-to-all of the pairs' hidden states to the experts' owners (variable split sizes);
3. each owner runs each of its experts on the rows for it from every rank (also on none);
4. combine: the reverse all-to-all brings every row back to its pair, which is weighted by its gate
   weight and added into its token in expert order (as ``layers.local_experts``).

Both all-to-alls are differentiable (the backward of one is the other with the split sizes swapped), so
an expert's weight gradient lands on its owner, computed from every token of the domain routed to it:
the whole gradient under ``harness.train.trainer``'s convention (loss / tokens of the global batch,
gradients summed). Hence expert gradients are neither all-reduced nor rescaled (``reduce_gradients``
leaves them as they are) and the gradient norm sums the shards' squares over the domain
(``shard_square_norm``).

Every rank joins both all-to-alls of every MoE layer of every micro-batch, also with no pair for its
experts or no tokens at all, so the ranks of a domain must run the same number of micro-batches - the
synchronous execution model (``harness.plan.execution``); ``check_lockstep`` verifies it per step. The
layouts' schedules give it by construction (every micro-batch spans every position).

The routers' losses are computed before the dispatch, on the rank's own tokens: the z-loss per token, the
sequence-level balance loss (``harness.runtime.balance``) with its counts summed over the micro-batch's CP block.
With tensor parallelism (under sequence parallelism) the dispatch runs in each TP coordinate's domain on the
position's gathered rows, each owner running its TP shard of the expert (``harness.runtime.layers.tp_experts``).
Not modelled: a capacity factor or token dropping, EP across pipeline stages.

Shape legend: ``T`` local tokens, ``E`` hidden size, ``X`` experts, ``K`` top-k, ``P`` the (token, k)
pairs (T * K), ``R`` ranks of the domain, ``Q`` rows received from all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn

from harness.parallel.options import ExpertParallelError, check_divisible  # noqa: F401 - re-exported
from harness.runtime.layers import MoE

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
EXPERT_PREFIX = ".experts."


class DispatchAuditError(RuntimeError):
    """A rank's announced per-expert counts disagree with the rows it sends (raised on every rank alike)."""

    def __init__(self, layer: int, sender: int, receiver: int, announced: int, sending: int):
        self.layer, self.sender, self.receiver, self.announced, self.sending = layer, sender, receiver, announced, sending
        super().__init__(f"expert dispatch audit: MoE layer {layer}: rank {sender} announces {announced} token rows "
                         f"for the experts of rank {receiver} but sends it {sending}; every rank must size its "
                         "all-to-all buffers from the counts of the rows it is sent (split sizes must agree)")


class LockstepError(RuntimeError):
    """The ranks of an expert-parallel domain would run different numbers of micro-batches."""


@dataclass(frozen=True)
class ExpertShard:
    """Which experts a rank owns: ``num_experts`` split evenly over the ``size`` ranks of the domain."""

    num_experts: int
    size: int
    rank: int

    def __post_init__(self):
        check_divisible(self.num_experts, self.size)
        if not 0 <= self.rank < self.size:
            raise ExpertParallelError(f"EP rank {self.rank} is outside the domain of {self.size} ranks")

    @property
    def per_rank(self) -> int:
        return self.num_experts // self.size

    @property
    def local(self) -> range:
        return range(self.rank * self.per_rank, (self.rank + 1) * self.per_rank)

    def owner(self, expert: int) -> int:
        return expert // self.per_rank


def is_expert_param(name: str) -> bool:
    """Whether parameter ``name`` (of a ``TinyLM`` or an ``MoE``) is an expert's: sharded under EP, never all-reduced."""
    return EXPERT_PREFIX in f".{name}"


def shard_experts(model: nn.Module, shard: ExpertShard) -> nn.Module:
    """Keep only ``shard.local`` experts in every MoE layer of ``model`` (in place). The kept experts keep
    their global names (``blocks.1.mlp.experts.3.down.weight``) and weights, so a sharded model's
    parameters are the non-EP model's, restricted."""
    for m in model.modules():
        if isinstance(m, MoE):
            if len(m.experts) != m.num_experts:
                raise ExpertParallelError(f"MoE layer {m.layer} is already sharded")
            if m.num_experts != shard.num_experts:
                raise ExpertParallelError(f"MoE layer {m.layer} has {m.num_experts} experts, the shard plans "
                                          f"{shard.num_experts}")
            m.experts = nn.ModuleDict({str(e): m.experts[e] for e in shard.local})
    return model


def shard_square_norm(params, group) -> torch.Tensor:
    """Sum over ``group`` of the squared norms of this rank's expert gradients (fp64, a 0-d tensor)."""
    grads = [p.grad for p in params if p.grad is not None]
    dev = grads[0].device if grads else torch.device("cpu")
    sq = torch.zeros((), dtype=torch.float64, device=dev)
    for g in grads:
        sq += g.detach().double().pow(2).sum()
    dist.all_reduce(sq, group=group)
    return sq


def check_lockstep(num_microbatches: int, group, device) -> None:
    """Every rank of the domain runs ``num_microbatches``; else ``LockstepError`` on every rank."""
    t = torch.tensor([num_microbatches, -num_microbatches], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    most, fewest = int(t[0]), -int(t[1])
    if most != fewest:
        raise LockstepError(f"expert parallelism: the ranks of the DP x CP domain run {fewest} to {most} "
                            "micro-batches; every rank joins every micro-batch's all-to-alls (synchronous "
                            "execution), so every rank needs the same number (empty ones where it has no tokens)")


# ------------------------------------------------------------------------------- collectives
class _AllToAll(torch.autograd.Function):
    """Rows ``x`` to the ranks of ``group``: ``send[q]`` rows to rank q, ``recv[s]`` rows from rank s.
    Backward: the same exchange with the split sizes swapped."""

    @staticmethod
    def forward(ctx, x, recv: list[int], send: list[int], group):
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


# ---------------------------------------------------------------------------------------- seams
@dataclass(frozen=True)
class TokenSlice:
    """Where a rank's tokens of a micro-batch come from: its zig-zag slice (``cp_rank`` of a block of
    ``cp_size``) of the pack ``cu_seqlens_padded``."""

    cu_seqlens_padded: tuple[int, ...]
    cp_size: int
    cp_rank: int


def dispatch_routes(idx_TK: torch.Tensor, tokens: TokenSlice | None) -> torch.Tensor:
    """The experts each local token is sent to: its own routes, row for row (a seam: ``harness.faults``
    re-creates a dispatch that reads the routes of the other zig-zag chunk of its CP slice)."""
    return idx_TK


def announced_counts(counts_X: torch.Tensor, shard: ExpertShard) -> torch.Tensor:
    """The per-expert pair counts a rank announces to the experts' owners, who size their receive
    buffers by them (a seam: ``harness.faults`` re-creates counts that are off between ranks)."""
    return counts_X


# ------------------------------------------------------------------------------------- dispatch
class ExpertDispatch:
    """``layers.Experts`` of one micro-batch under expert parallelism over ``group`` (the domain's group,
    ranks in position order; this rank's group rank is ``shard.rank``)."""

    def __init__(self, shard: ExpertShard, group, tokens: TokenSlice | None = None, before=None):
        self.shard, self.group, self.tokens, self.before = shard, group, tokens, before

    def _split_table(self, layer: int, counts_X: torch.Tensor, send_R: torch.Tensor) -> list[list[int]]:
        """Every rank's announced counts and send sizes ``[R][X + R]``, audited (see the module doc)."""
        s = self.shard
        mine = torch.cat([announced_counts(counts_X, s), send_R]).to(torch.int64)
        table = mine.new_empty((s.size * mine.numel(),))
        _all_gather(table, mine, group=self.group)
        rows = table.view(s.size, -1).tolist()
        for sender, row in enumerate(rows):
            for q in range(s.size):
                announced = sum(row[q * s.per_rank:(q + 1) * s.per_rank])
                if announced != row[s.num_experts + q]:
                    raise DispatchAuditError(layer, sender, q, announced, row[s.num_experts + q])
        return rows

    def __call__(self, moe: MoE, x_TE: torch.Tensor, idx_TK: torch.Tensor, weight_TK: torch.Tensor) -> torch.Tensor:
        if self.before is not None:
            self.before()  # the call audit of harness.train.passes
        s, K = self.shard, idx_TK.shape[1]
        routes_P = dispatch_routes(idx_TK, self.tokens).reshape(-1)
        order_P = torch.argsort(routes_P, stable=True)
        token_P = order_P // K
        counts_X = torch.bincount(routes_P, minlength=s.num_experts)
        send_R = counts_X.view(s.size, s.per_rank).sum(1)
        rows = self._split_table(moe.layer, counts_X, send_R)
        mine = [row[s.local.start:s.local.stop] for row in rows]  # [R][X / R]: rows from s for my expert j
        recv = [sum(c) for c in mine]
        x_QE = _AllToAll.apply(x_TE[token_P], recv, send_R.tolist(), self.group)
        y_QE = self._run_experts(moe, x_QE, mine)
        back_PE = _AllToAll.apply(y_QE, send_R.tolist(), recv, self.group)
        weight_P = weight_TK.reshape(-1)[order_P]
        return x_TE.new_zeros(x_TE.shape).index_add(0, token_P, back_PE * weight_P[:, None])

    def _run_experts(self, moe: MoE, x_QE: torch.Tensor, mine: list[list[int]]) -> torch.Tensor:
        """Each local expert on its rows (received source-major, expert-minor), also on none: every rank
        keeps the all-to-alls in its autograd graph, so that every rank joins their backward."""
        s, dev = self.shard, x_QE.device
        counts = torch.as_tensor(mine, dtype=torch.int64, device=dev).reshape(-1)
        expert_Q = torch.arange(s.per_rank, device=dev).repeat(s.size).repeat_interleave(counts)
        by_expert = torch.argsort(expert_Q, stable=True)
        sizes = torch.bincount(expert_Q, minlength=s.per_rank).tolist()
        parts = x_QE[by_expert].split(sizes)
        y = torch.cat([moe.experts[str(e)](p) for e, p in zip(s.local, parts)])
        return y.new_empty(y.shape).index_copy(0, by_expert, y)  # back to the received order
