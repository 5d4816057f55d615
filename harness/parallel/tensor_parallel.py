"""Tensor parallelism of the dense transformer blocks (Megatron's TP, with or without sequence parallelism).

A block's attention splits by heads and its MLP by the FFN over the ``tp`` ranks that share a (pipeline stage,
DP x CP position): the QKV projection and the MLP's first matrix are column-parallel (each rank keeps its query heads,
its key/value heads and its slice of the FFN), the output projection and the MLP's second matrix row-parallel (their
partial sums all-reduced). The embedding table and the LM head split by vocabulary rows
(``harness.parallel.vocab_parallel``); the norms and the MTP combine are replicated.

Every TP rank of a position runs the same micro-batches on the same tokens: the schedule, the reroute and the dynamic
CP groups belong to one TP coordinate (``harness.parallel.groups``: a CP block's group holds ranks of one TP
coordinate), so a CP block exchanges the keys and values of the same heads.

Two collectives per half-block, Megatron's ``f`` and ``g``: ``enter`` (identity forward; the gradient all-reduced over
the TP group, as the replicated input's gradient is the sum of every shard's contribution) and ``leave`` (the partial
sums all-reduced forward; identity backward). The gradients of the replicated parameters are then equal on every TP
rank, and the DP x CP reduction of each TP coordinate completes every gradient, sharded or not. Both are seams
(``harness.faults``). With sequence parallelism (``TensorParallel.sequence_parallel``) the block stack's residual
stream is split by token rows over the same ranks and ``enter`` / ``leave`` become an all-gather and a
reduce-scatter of rows (``harness.parallel.sequence_parallel``).

Each rank builds the whole model from the seed and keeps its shards (``shard_model``); ``whole`` gathers a tensor's
shards back (the probes read whole tensors, so a TP run is judged parameter by parameter against the unsharded
reference). The gradient norm counts a sharded parameter's shards once each and a replicated parameter once
(``square_norm``).

Shape legend: ``H`` query heads, ``Hkv`` key/value heads, ``D`` head dim, ``F`` FFN size.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.distributed as dist

from harness.parallel import sequence_parallel as seq_par
from harness.parallel import vocab_parallel
from harness.parallel.options import TensorParallelError, check_tp_model  # noqa: F401 - re-exported


@dataclass(frozen=True)
class TensorParallel:
    """This rank's TP coordinate: ``size`` ranks, this one's ``rank`` among them, their ``group`` (one per layout's run:
    created and destroyed with the dynamic groups, ``harness.parallel.groups.DynamicGroups.tp_group``)."""

    size: int
    rank: int
    group: object
    sequence_parallel: bool = False
    """Whether the block stack's residual stream is split by token rows over the group (``sequence_parallel``)."""
    vocab_multiple: int = 1
    """The vocabulary is padded to a multiple of this times ``size`` (Megatron's ``--make-vocab-size-divisible-by``;
    ``harness.parallel.vocab_parallel.padded_vocab``)."""

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        """A column-parallel matrix's input: ``enter(x, self)``, or with sequence parallelism
        ``harness.parallel.sequence_parallel.all_gather_rows(x, self)`` - seams looked up at each call (what a
        model's blocks call: they never import this module, the runtime sits below it)."""
        if self.sequence_parallel:
            return seq_par.all_gather_rows(x, self)
        return enter(x, self)

    def leave(self, x: torch.Tensor) -> torch.Tensor:
        """A row-parallel matrix's partial sums: ``leave(x, self)``, or with sequence parallelism
        ``harness.parallel.sequence_parallel.reduce_scatter_rows(x, self)``."""
        if self.sequence_parallel:
            return seq_par.reduce_scatter_rows(x, self)
        return leave(x, self)

    def scatter(self, x: torch.Tensor) -> torch.Tensor:
        """Where a block stack starts: this rank's token rows of ``x`` with sequence parallelism, else ``x``."""
        return seq_par.scatter(x, self) if self.sequence_parallel else x

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Where a block stack ends: every rank's rows gathered with sequence parallelism, else ``x``."""
        return seq_par.gather(x, self) if self.sequence_parallel else x

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of ``x`` (this rank's rows of a sequence-split tensor), the gradient reduce-scattered
        (``harness.parallel.sequence_parallel.all_gather_rows``): an MoE block's gate weights, whose gradient on each
        rank is a partial sum over the experts' shards."""
        return seq_par.all_gather_rows(x, self)

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a whole-rows tensor that carries no gradient (a mask), with sequence parallelism; else
        ``x``."""
        if not self.sequence_parallel:
            return x
        return seq_par.own_rows(x, self)

    def gather_choices(self, idx: torch.Tensor) -> torch.Tensor:
        """Every rank's rows of a tensor that carries no gradient (an MoE block's expert choices), with sequence
        parallelism; else ``idx``."""
        if not self.sequence_parallel:
            return idx
        return seq_par.gather_choices(idx, self)

    def sum_loss(self, x: torch.Tensor) -> torch.Tensor:
        """A loss term of this rank's rows summed over the group with sequence parallelism
        (``harness.parallel.sequence_parallel.sum_loss``); else ``x`` (every rank computed the whole)."""
        return seq_par.sum_loss(x, self) if self.sequence_parallel else x

    def channel_sum(self, x: torch.Tensor) -> torch.Tensor:
        """``channel_sum(x, self)``: a per-token sum over channels this rank holds a share of, summed over the group."""
        return channel_sum(x, self)

    def replicated_input(self, x: torch.Tensor) -> torch.Tensor:
        """``enter(x, self)`` whether or not the rows are split: a column-parallel matrix's input of whole rows."""
        return enter(x, self)

    def partial_sums(self, x: torch.Tensor) -> torch.Tensor:
        """``leave(x, self)`` whether or not the rows are split: partial sums of whole rows, all-reduced."""
        return leave(x, self)

    def lookup(self, tokens: torch.Tensor, table: torch.Tensor, vocab: int) -> torch.Tensor:
        """Every token's embedding row from this rank's vocabulary shard ``table``
        (``harness.parallel.vocab_parallel.lookup``)."""
        return vocab_parallel.lookup(tokens, table, vocab, self)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """The vocabulary-parallel LM head's input (``harness.parallel.vocab_parallel.head_input``)."""
        return vocab_parallel.head_input(h, self)

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor:
        """Per-token cross-entropy from this rank's logits of its vocabulary range
        (``harness.parallel.vocab_parallel.cross_entropy``)."""
        return vocab_parallel.cross_entropy(logits, labels, vocab, self)

    def head_losses(self, h: torch.Tensor, w, labels: torch.Tensor, vocab: int, chunk: int) -> torch.Tensor:
        """Per-token cross-entropy of this rank's head shard ``w`` applied to ``h``, ``chunk`` tokens at a time
        (``harness.parallel.vocab_parallel.chunked_cross_entropy``)."""
        return vocab_parallel.chunked_cross_entropy(h, w, labels, vocab, self, chunk)


MARK = "tensor_parallel"
"""The attribute ``shard_model`` sets on a sharded parameter (Megatron's ``tensor_model_parallel``)."""


def spec(name: str, c) -> tuple[int, list[int]] | None:
    """How parameter ``name`` of a ``TinyLM`` of config ``c`` is split: ``(dim, segments)`` - each segment along
    ``dim`` is cut into ``tp`` equal pieces and a rank keeps piece ``rank`` of every segment - or None (replicated).
    An SSM mixer (``harness.runtime.ssm``) splits by heads: ``in_proj``'s z, x and dt rows, the x conv's channels, the
    norm weight, ``out_proj``'s columns, dt bias, A and D."""
    D = c.hidden // c.heads
    if ".mixer." in name:
        Di, H = c.ssm_heads * c.ssm_head_dim, c.ssm_heads
        for pattern, how in ((r"in_proj\.weight$", (0, [Di, Di, H])), (r"conv_x_(weight|bias)$", (0, [Di])),
                             (r"norm_weight$", (0, [Di])), (r"out_proj\.weight$", (1, [Di])),
                             (r"\.(dt_bias|A_log|D)$", (0, [H]))):
            if re.search(pattern, name):
                return how
        return None
    if re.search(r"(^|\.)qkv\.weight$", name):
        return 0, [c.heads * D, c.kv_heads * D, c.kv_heads * D]
    if re.search(r"(^|\.)proj\.weight$", name):
        return 1, [c.heads * D]
    if re.search(r"(^|\.)mlp\.(experts\.\d+\.)?up\.weight$", name):  # a dense MLP's, or an MoE expert's
        return 0, [c.ffn]
    if re.search(r"(^|\.)mlp\.(experts\.\d+\.)?gate_up\.weight$", name):
        return 0, [c.ffn, c.ffn]
    if re.search(r"(^|\.)mlp\.(experts\.\d+\.)?down\.weight$", name):
        return 1, [c.ffn]
    if re.search(r"^(embed|head)\.weight$", name):  # the vocabulary (``harness.parallel.vocab_parallel``)
        return 0, [c.vocab]
    return None


def take(t: torch.Tensor, how: tuple[int, list[int]], size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the whole tensor ``t`` (``spec``'s split), contiguous."""
    dim, segments = how
    return torch.cat([piece.chunk(size, dim)[rank] for piece in t.split(segments, dim)], dim).contiguous()


def partial_over_tp(name: str) -> bool:
    """Whether replicated parameter ``name`` gets a partial gradient on each TP rank, with or without sequence
    parallelism: an SSM mixer's B / C projection and conv (every TP rank computes B and C whole, its heads read them).
    The trainer sums their gradients over the TP group with the row-split region's (``sequence_parallel.MARK``,
    ``sequence_parallel.reduce_grads``). A seam."""
    return re.search(r"\.mixer\.(bc_proj\.weight|conv_bc_(weight|bias))$", name) is not None


def shard_model(model, tp: TensorParallel) -> None:
    """Keep this rank's shard of every split parameter of ``model`` (built whole, the same on every rank), in place,
    and mark it (``MARK``); mark the replicated parameters whose gradient is partial per TP rank for the TP sum after
    the backward (``sequence_parallel.MARK``): ``partial_over_tp``'s, and with sequence parallelism the row-split
    region's (``sequence_parallel.mark``)."""
    if tp.size == 1:
        return
    check_tp_model(model.c, tp.size)
    with torch.no_grad():
        for name, p in model.named_parameters():
            how = spec(name, model.c)
            if how is not None:
                t = p.data
                if is_vocab(name):  # zero rows up to the padded vocabulary (``vocab_parallel.padded_vocab``)
                    rows = vocab_parallel.padded_vocab(model.c.vocab, tp.size, tp.vocab_multiple)
                    t, how = torch.cat([t, t.new_zeros((rows - t.shape[0], *t.shape[1:]))]), (0, [rows])
                p.data = take(t, how, tp.size, tp.rank)
                setattr(p, MARK, True)
            elif partial_over_tp(name):
                setattr(p, seq_par.MARK, True)
    if tp.sequence_parallel:
        seq_par.mark(model)


def has_partial(params) -> bool:
    """Whether any of ``params`` carries a partial gradient per TP rank (``sequence_parallel.MARK``)."""
    return any(seq_par.is_marked(p) for p in params)


def is_sharded(p) -> bool:
    return bool(getattr(p, MARK, False))


def is_vocab(name: str) -> bool:
    """Whether parameter ``name`` is split by vocabulary rows (the embedding table, the LM head)."""
    return re.search(r"^(embed|head)\.weight$", name) is not None


def whole(name: str, t: torch.Tensor, c, tp: TensorParallel | None) -> torch.Tensor:
    """The whole tensor of parameter ``name`` (or its gradient) from every TP rank's shard ``t`` (collective over the TP
    group when the parameter is split; ``t`` itself otherwise)."""
    how = spec(name, c)
    if how is None or tp is None or tp.size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(tp.size)]
    dist.all_gather(parts, t.contiguous(), group=tp.group)
    if is_vocab(name):  # the padded vocabulary's rows, the padding dropped
        return assemble(parts, (0, [t.shape[0] * tp.size]))[:c.vocab]
    return assemble(parts, how)


def assemble(parts: list[torch.Tensor], how: tuple[int, list[int]]) -> torch.Tensor:
    """The whole tensor from every TP rank's shard (``parts[r]``: rank r's ``take``), ``take``'s inverse."""
    dim, segments = how
    local = [s // len(parts) for s in segments]
    pieces = [p.split(local, dim) for p in parts]
    return torch.cat([pieces[r][j] for j in range(len(segments)) for r in range(len(parts))], dim)


def square_norm(params, tp: TensorParallel | None) -> torch.Tensor:
    """The squared norm (fp64, 0-d) of ``params``' gradients over the TP group: each sharded parameter's shards summed
    over the group, each replicated one counted once."""
    grads = [p for p in params if p.grad is not None]
    dev = grads[0].grad.device if grads else torch.device("cpu")
    split, rep = (torch.zeros((), dtype=torch.float64, device=dev) for _ in range(2))
    for p in grads:
        sq = p.grad.detach().double().pow(2).sum()
        if is_sharded(p):
            split += sq
        else:
            rep += sq
    if tp is not None and tp.size > 1:
        dist.all_reduce(split, group=tp.group)
    return split + rep


# ------------------------------------------------------------------------------------- collectives
class _Enter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Leave(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ChannelSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        y = x.contiguous().clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)  # every rank's use of the sum reads every rank's channels
        return grad, None


def channel_sum(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A per-token sum over channels split by TP (an SSM mixer's mean square over Di): summed over the TP group
    forward, and its gradient summed backward (a seam)."""
    return _ChannelSum.apply(x, tp.group)


def enter(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The replicated input of a column-parallel matrix: itself forward, its gradient all-reduced over the TP group
    backward (a seam)."""
    return _Enter.apply(x, tp.group)


def leave(x: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """A row-parallel matrix's partial sums, all-reduced over the TP group forward; the gradient as it is backward
    (a seam)."""
    return _Leave.apply(x, tp.group)
