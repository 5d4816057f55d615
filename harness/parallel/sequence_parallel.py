"""Sequence parallelism (Megatron's ``--sequence-parallel``, with tensor parallelism).

Under tensor parallelism alone every TP rank of a position holds the block stack's whole residual stream and runs
the norms on every token. Sequence parallelism splits that stream by token rows over the TP group: between two
tensor-parallel matrices each rank keeps ``T / tp`` consecutive rows of the micro-batch's ``T`` local tokens and
runs the norms and residual additions on those only (activation memory of that region / tp).

The TP collectives change with it (``harness.parallel.tensor_parallel.TensorParallel.enter`` / ``leave``):

========================= ========================================= =============================================
where                     forward                                   backward
========================= ========================================= =============================================
stack entry (``scatter``) keep this rank's rows                     all-gather the rows' gradients
matrix input (``enter``)  all-gather the rows                       reduce-scatter the gradient
matrix output (``leave``) reduce-scatter the partial sums           all-gather the gradient
stack exit (``gather``)   all-gather the rows                       keep this rank's rows of the gradient
========================= ========================================= =============================================

``scatter`` runs where the model's block stack starts (after the embedding; also an MTP depth's block) and ``gather``
where it ends (before the final norm): the embedding, the MTP combine, the final norm and the LM head see whole rows
(replicated compute, as without sequence parallelism), while a pipeline stage hands the next its rank's share of
the rows (``TinyLM.run_layers(split_in=, split_out=)``), as Megatron's stages do. The exit keeps its rank's rows
of the gradient rather than reduce-scattering it: everything after it is replicated, so every TP rank already holds
the whole, identical gradient (Megatron's ``tensor_parallel_output_grad=False``).

A replicated parameter inside the split region - each block's two norms, and an MoE block's router - sees only its
rank's rows, so its gradient is a partial sum: ``reduce_grads`` all-reduces those over the TP group after the
backward, before the gradient reduction, the norm and the optimiser (Megatron's ``allreduce_sequence_parallel_grads``;
the parameters carry ``MARK`` as Megatron's carry ``sequence_parallel``).

An MoE block routes its rank's rows (Megatron's router under sequence parallelism): the router's logits, top-k
choices and gate weights are of those rows; the experts, each keeping a TP shard of its FFN, run on every rank's rows
(``harness.runtime.layers.tp_expert_outputs``: the rows, the choices and the gate weights all-gathered, the gate
weights' gradient reduce-scattered) and their gate-weighted partial outputs are reduce-scattered back to the rank's
rows. The router's z-loss is a sum over the rank's real rows, and ``sum_loss`` adds the TP ranks' parts (all-reduce
forward, identity backward: each part's gradient reaches its own rows and the router once).

The rows split evenly: every sequence is padded to a multiple of ``tp`` times its CP divisor
(``harness.plan.thd.padding_divisor(sequence_parallel=True)``, Megatron's rule), so a rank's ``T`` is a multiple of
``tp``; ``SequenceParallelError`` names any other count. ``scatter``, ``gather``, ``all_gather_rows``,
``reduce_scatter_rows``, ``in_region``, ``reduce_grads`` and ``sum_loss`` are seams (``harness.faults``).
"""

from __future__ import annotations

import re

import torch
import torch.distributed as dist

from harness.parallel.collectives import all_gather, reduce_scatter
from harness.parallel.options import SequenceParallelError

MARK = "sequence_parallel"
"""The attribute ``mark`` sets on a replicated parameter of the split region (Megatron's ``sequence_parallel``)."""


def in_region(name: str) -> bool:
    """Whether parameter ``name`` of a ``TinyLM`` is a replicated parameter inside the sequence-split region: a
    block's norms (trunk blocks and MTP depths' blocks) and an MoE block's router. A seam."""
    return re.search(r"(^|\.)(blocks\.\d+|block)\.(norm[12]|mlp\.router)\.weight$", name) is not None


def mark(model) -> list[str]:
    """Mark every parameter of ``model`` that ``in_region`` names (``MARK``); returns their names."""
    names = []
    for name, p in model.named_parameters():
        if in_region(name):
            setattr(p, MARK, True)
            names.append(name)
    return names


def is_marked(p) -> bool:
    return bool(getattr(p, MARK, False))


def reduce_grads(params, tp) -> None:
    """All-reduce (SUM) the gradients of the marked ``params`` over the TP group, in place, in one collective (a seam).
    Every TP rank then holds the gradient of all the position's rows."""
    grads = [p.grad for p in params if is_marked(p) and p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=tp.group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()


def _check_rows(x: torch.Tensor, size: int, what: str) -> None:
    if x.shape[0] % size:
        raise SequenceParallelError(
            f"sequence parallelism splits the {what} {x.shape[0]} token rows over tp={size} ranks: not a multiple of "
            f"{size}; pad every sequence with padding_divisor(..., tp_size={size}, sequence_parallel=True) (the "
            "trainer does) or turn sequence parallelism off")


def _gathered(x: torch.Tensor, group, size: int) -> torch.Tensor:
    out = x.new_empty((x.shape[0] * size, *x.shape[1:]))
    all_gather(out, x.contiguous(), group=group)
    return out


def _scattered(x: torch.Tensor, group, size: int) -> torch.Tensor:
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
    reduce_scatter(out, x.contiguous(), group=group)
    return out


def _own_rows(x: torch.Tensor, size: int, rank: int) -> torch.Tensor:
    return x.chunk(size, 0)[rank].contiguous()


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.group, ctx.size = group, size
        return _own_rows(x, size, rank)

    @staticmethod
    def backward(ctx, grad):
        return _gathered(grad, ctx.group, ctx.size), None, None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size, rank):
        ctx.size, ctx.rank = size, rank
        return _gathered(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _own_rows(grad, ctx.size, ctx.rank), None, None, None


class _AllGatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _gathered(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _scattered(grad, ctx.group, ctx.size), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, size):
        ctx.group, ctx.size = group, size
        return _scattered(x, group, size)

    @staticmethod
    def backward(ctx, grad):
        return _gathered(grad, ctx.group, ctx.size), None, None


def scatter(x: torch.Tensor, tp) -> torch.Tensor:
    """This TP rank's rows of the whole (replicated) ``x``; the backward all-gathers the rows' gradients (a seam)."""
    _check_rows(x, tp.size, "micro-batch's")
    return _Scatter.apply(x, tp.group, tp.size, tp.rank)


def gather(x: torch.Tensor, tp) -> torch.Tensor:
    """The whole ``x`` from every TP rank's rows; the backward keeps this rank's rows of the (replicated) gradient
    (a seam)."""
    return _Gather.apply(x, tp.group, tp.size, tp.rank)


def all_gather_rows(x: torch.Tensor, tp) -> torch.Tensor:
    """A column-parallel matrix's input: every rank's rows gathered; the gradient reduce-scattered (a seam)."""
    return _AllGatherRows.apply(x, tp.group, tp.size)


def own_rows(x: torch.Tensor, tp) -> torch.Tensor:
    """This TP rank's rows of a whole-rows tensor that carries no gradient (a mask)."""
    _check_rows(x, tp.size, "micro-batch's")
    return x.chunk(tp.size, 0)[tp.rank]


def gather_choices(idx: torch.Tensor, tp) -> torch.Tensor:
    """Every TP rank's rows of a tensor that carries no gradient (an MoE block's expert choices), in rank order."""
    return _gathered(idx, tp.group, tp.size)


def sum_loss(x: torch.Tensor, tp) -> torch.Tensor:
    """A loss term summed over this TP rank's rows (an MoE router's z-loss), added up over the TP group: the whole
    rows' term on every rank forward; its gradient as it is backward, so each rank's part is differentiated once, on
    the rank that holds its rows (a seam; ``TensorParallel.partial_sums``' all-reduce)."""
    return tp.partial_sums(x)


def reduce_scatter_rows(x: torch.Tensor, tp) -> torch.Tensor:
    """A row-parallel matrix's partial sums over every row, summed over the TP group and split by rows; the gradient
    all-gathered (a seam)."""
    _check_rows(x, tp.size, "row-parallel output's")
    return _ReduceScatterRows.apply(x, tp.group, tp.size)
