"""Re-creations of sequence-parallel bugs (``harness.parallel.sequence_parallel``) and their catalogue entries, judged
in scenario ``train-sp``: the tiny MoE (a dense block, then MoE blocks) with 2 TP ranks a position and the token rows
split over them, each TP rank's router routing its rows (``SP_MOE_FAULTS``: the MoE blocks' own). Each is exact
without sequence parallelism, so converge's reference (one rank, no TP) and the goldens see none of
them, and neither does ``train-tp``.
"""

from __future__ import annotations

import re

from harness.faults.fault import Fault


def make_norm_grads_not_reduced(original):
    """The split region's norm gradients never summed over the TP group: each TP rank steps its norms with the
    gradient of its own rows (gpt-neox PR #1257's first cut; NeMo PR #7184: the all-reduce looked for a
    ``sequence_parallel`` attribute that apex's norms set under another name, so it found no parameter)."""
    def reduce_grads(params, tp):
        return None
    return reduce_grads


def make_mlp_norm_unmarked(original):
    """One norm of the split region left out of the marked set: the attention's pre-norm is summed over TP, the
    MLP's is not (Megatron-LM issue #1446: ``final_layernorm``'s gradients differed between TP ranks with
    ``--sequence-parallel``, as that norm did not carry the attribute the all-reduce selects by)."""
    def in_region(name):
        return re.search(r"(^|\.)(blocks\.\d+|block)\.norm1\.weight$", name) is not None
    return in_region


def make_scatter_grad_own_rows(original):
    """The stack entry's backward returns only this rank's rows of the gradient (zeros elsewhere) instead of
    gathering every rank's: each TP rank's vocabulary shard of the embedding learns only from the tokens of its own
    rows (the change Megatron-LM issue #1635 proposed for ``_ScatterToSequenceParallelRegion.backward``)."""
    import torch

    class OwnRows(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, size, rank):
            ctx.shape, ctx.size, ctx.rank = x.shape, size, rank
            return x.chunk(size, 0)[rank].contiguous()

        @staticmethod
        def backward(ctx, grad):
            full = grad.new_zeros(ctx.shape)
            full.chunk(ctx.size, 0)[ctx.rank].copy_(grad)
            return full, None, None

    def scatter(x, tp):
        return OwnRows.apply(x, tp.size, tp.rank)
    return scatter


def make_gather_grad_reduce_scattered(original):
    """The stack exit's backward reduce-scatters the gradient, as if what follows were split over TP
    (``tensor_parallel_output_grad=True``): the head and the final norm are replicated, every TP rank already holds
    the whole gradient, and the sum makes every block's gradient tp times too large (slapo PR #20: the flag added for
    exactly this gather; VeOmni PR #681: a gather's backward scaled by the group size by default). The exit becomes
    the gather a column-parallel matrix's input takes (all-gather forward, reduce-scatter backward)."""
    from harness.parallel.sequence_parallel import _AllGatherRows

    def gather(x, tp):
        return _AllGatherRows.apply(x, tp.group, tp.size)
    return gather


def make_router_unmarked(original):
    """The MoE router left out of the split region's marked set: the norms' gradients are summed over TP, the
    router's - each rank's from its own rows - are not, and the TP ranks' routers drift apart (Megatron-LM issue
    #599 / PR #619: with MoE, TP and sequence parallelism the router weights lacked the ``sequence_parallel``
    attribute and went unsynchronised within the TP group)."""
    def in_region(name):
        return re.search(r"(^|\.)(blocks\.\d+|block)\.norm[12]\.weight$", name) is not None
    return in_region


def make_gates_gathered_detached(original):
    """The gate weights of every TP rank's rows gathered with a plain all-gather, outside autograd: the experts' outputs
    are weighted right, but the router gets no gradient from the loss through them - it learns from its z-loss alone
    (NeMo Automodel PR #2995: ``GroupedExperts.forward`` gathered the routing probabilities with a non-differentiable
    ``dist.all_gather``, silently detaching the router from the main loss)."""
    def sp_gates(weight_TK, tp):
        return tp.gather_choices(weight_TK.detach())
    return sp_gates


def make_z_loss_grad_summed(original):
    """The TP ranks' z-loss parts added up by an all-reduce whose backward all-reduces too (what
    ``torch.distributed.nn.functional.all_reduce`` does): every rank's part is differentiated tp times, so the
    router's z-loss gradient grows with the TP size (Megatron-LM PR #5047: the MoE aux / z-loss gradient scaled by
    the local token count left it depending on the TP x CP size). Built from TP's two collectives: the replicated
    input's (its gradient all-reduced) under the partial sums' (all-reduced forward)."""
    def sum_loss(x, tp):
        return tp.partial_sums(tp.replicated_input(x))
    return sum_loss


SP_FAULTS: tuple[Fault, ...] = (
    Fault(name="sp-norm-grads-not-reduced", title="the split region's norm gradients never summed over TP",
          source="gpt-neox PR #1257: with sequence parallelism the norms' gradients were not synchronised over the TP "
                 "ranks and the loss flat-lined near 8; NeMo PR #7184: the all-reduce selected no parameter (the "
                 "attribute was named otherwise)",
          url="https://github.com/EleutherAI/gpt-neox/pull/1257", layer="gradients",
          seam="harness.parallel.sequence_parallel:reduce_grads", make=make_norm_grads_not_reduced,
          check="replica-consistency", expect=r"parameters differ between ranks: ranks \[1, 3\]", scenario="train-sp"),
    Fault(name="sp-mlp-norm-unmarked", title="one norm of the split region left unmarked",
          source="Megatron-LM issue #1446: final_layernorm's main_grad differed between TP ranks with TP + SP (the "
                 "norm lacked the sequence_parallel attribute the all-reduce selects by)",
          url="https://github.com/NVIDIA/Megatron-LM/issues/1446", layer="gradients",
          seam="harness.parallel.sequence_parallel:in_region", make=make_mlp_norm_unmarked,
          check="replica-consistency", expect=r"parameters differ between ranks: ranks \[1, 3\]", scenario="train-sp"),
    Fault(name="sp-scatter-grad-own-rows", title="the stack entry's backward keeps its own rows (no all-gather)",
          source="Megatron-LM issue #1635 proposed returning only the rank's slice of the gradient from "
                 "_ScatterToSequenceParallelRegion's backward; the input is replicated, so each rank's embedding then "
                 "learns from its own rows only",
          url="https://github.com/NVIDIA/Megatron-LM/issues/1635", layer="gradients",
          seam="harness.parallel.sequence_parallel:scatter", make=make_scatter_grad_own_rows,
          check="step1-gradients", expect=r"step-1 gradient of embed\.weight", scenario="train-sp"),
    Fault(name="sp-gather-grad-reduce-scattered", title="the stack exit's backward reduce-scatters a replicated gradient",
          source="slapo PR #20: tensor_parallel_output_grad decides whether a sequence-parallel gather's backward "
                 "reduce-scatters or splits; before a replicated head it must split (VeOmni PR #681: a gather's "
                 "backward scaled by the group size)",
          url="https://github.com/awslabs/slapo/pull/20", layer="gradients",
          seam="harness.parallel.sequence_parallel:gather", make=make_gather_grad_reduce_scattered,
          check="step1-gradients", expect=r"step-1 gradient of blocks\.", scenario="train-sp"),
)
"""The sequence-parallel faults of the dense blocks, in report order (the catalogue appends them)."""

SP_MOE_FAULTS: tuple[Fault, ...] = (
    Fault(name="sp-moe-router-unmarked", title="the MoE router left out of the split region's gradient sum",
          source="Megatron-LM issue #599 / PR #619: with MoE, TP and sequence parallelism each TP rank's router saw "
                 "its share of the rows and the router weights drifted apart (they lacked the sequence_parallel "
                 "attribute)",
          url="https://github.com/NVIDIA/Megatron-LM/pull/619", layer="gradients",
          seam="harness.parallel.sequence_parallel:in_region", make=make_router_unmarked,
          check="replica-consistency", expect=r"parameters differ between ranks: ranks \[1, 3\]",
          scenario="train-sp"),
    Fault(name="sp-moe-gates-gathered-detached", title="the gate weights all-gathered outside autograd",
          source="NeMo Automodel PR #2995: routing probabilities gathered with a non-differentiable dist.all_gather "
                 "silently detached the router from the main loss (trainable through the auxiliary losses only)",
          url="https://github.com/NVIDIA-NeMo/Automodel/pull/2995", layer="gradients",
          seam="harness.runtime.layers:sp_gates", make=make_gates_gathered_detached,
          check="step1-gradients", expect=r"step-1 gradient of blocks\.\d+\.mlp\.router\.weight",
          scenario="train-sp"),
    Fault(name="sp-moe-z-loss-grad-summed", title="the z-loss's TP sum all-reduces its gradient too",
          source="Megatron-LM PR #5047: the MoE aux_loss / z_loss gradient depended on the TP x CP size (scaled by the "
                 "local token count), so otherwise identical runs with different TP trained differently",
          url="https://github.com/NVIDIA/Megatron-LM/pull/5047", layer="gradients",
          seam="harness.parallel.sequence_parallel:sum_loss", make=make_z_loss_grad_summed,
          check="step1-gradients", expect=r"step-1 gradient of blocks\.\d+\.mlp\.router\.weight",
          scenario="train-sp"),
)
"""The sequence-parallel faults of MoE blocks."""
