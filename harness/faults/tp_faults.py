"""Re-creations of tensor-parallel bugs (``harness.parallel.tensor_parallel``, ``harness.parallel.groups``) and their
catalogue entries, judged in scenario ``train-tp`` (the ``train`` run with 2 TP ranks per position).

Each is exact at tp = 1, so converge's reference (one rank, no TP) and the goldens see none of them; the TP run's
probes hold whole gradients (gathered from the shards), so the step-1 checks compare them parameter by parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.faults.fault import Fault


def make_row_parallel_not_reduced(original):
    """A row-parallel matrix's partial sums left as they are: each TP rank goes on with its own heads' (or FFN
    slice's) share of the output projection, as with sglang's Mamba ``out_proj`` built ``reduce_results=False``."""
    def leave(x, tp):
        return x
    return leave


def make_input_grad_not_reduced(original):
    """The replicated input of a column-parallel matrix passed on without its backward all-reduce: each TP rank's
    norm weights, embedding and earlier layers get only its own shard's share of the gradient, and the replicas
    drift apart (mcore-bridge PR #173: a replicated LoRA factor's gradient never summed over the TP group)."""
    def enter(x, tp):
        return x
    return enter


def make_tp_group_position_fastest(original):
    """The TP groups built for a rank order with the DP x CP position fastest (``cp-tp``) where the world's ranks are
    laid out TP fastest (Megatron's ``tp-cp-ep-dp-pp``): each TP group joins the same shard of two positions, which
    train different tokens (TensorRT-LLM PR #10350: the TP and CP grouping order swapped)."""
    def tp_group_ranks(layout, position, stage):
        base = stage * layout.tp * layout.n_positions
        return [base + t * layout.n_positions + position for t in range(layout.tp)]
    return tp_group_ranks


def make_norm_shards_not_summed(original):
    """The gradient norm of the split parameters taken from this rank's shards only, not summed over the TP group:
    the reported norm is too small and every TP rank clips by its own factor (NeMo Automodel PR #3477: the clipping
    helper normed and clipped a partial gradient rank-locally; torchtune issue #2420)."""
    def square_norm(params, tp):
        return original(params, None)
    return square_norm


def make_replicated_norm_counted_per_rank(original):
    """Every parameter's squared norm summed over the TP group, the replicated ones included: those count tp times
    and the norm is inflated (ROCm TransformerEngine PR #715: replicated weights marked tensor-parallel; NeMo-RL PR
    #3788: TP-replicated gradients counted tp_size times)."""
    def square_norm(params, tp):
        grads = [p.grad for p in params if p.grad is not None]
        sq = torch.stack([g.detach().double().pow(2).sum() for g in grads]).sum()
        dist.all_reduce(sq, group=tp.group)
        return sq
    return square_norm


def make_gate_on_partial_expert_outputs(original):
    """The gate weights applied to each TP rank's partial expert outputs and the weighted sum reduced after: the
    forward is the same, but each rank's router sees only its shard's share of the outputs, so its gradient is a
    partial sum taken for a whole one and the TP ranks' routers drift apart (torchtitan issue #2387 / PR #2416: with
    the scores applied after the experts, gate.weight's gradient was Partial and marked Replicate)."""
    import torch

    def tp_expert_outputs(moe, x_TE, idx_TK, weight_TK, tp, dispatch=None):
        if dispatch is not None or getattr(tp, "sequence_parallel", False):
            return original(moe, x_TE, idx_TK, weight_TK, tp, dispatch)
        xin = tp.enter(x_TE)
        out = torch.zeros_like(x_TE)
        for e, expert in enumerate(moe.experts):
            tok, slot = (idx_TK == e).nonzero(as_tuple=True)
            if tok.numel():
                out = out.index_add(0, tok, expert(xin[tok]) * weight_TK[tok, slot, None])
        return tp.leave(out)
    return tp_expert_outputs


def make_dist_opt_replicated_counted_per_rank(original):
    """The distributed optimiser's squared norm summed over the TP group whole, replicated squares included: those
    count tp times (NeMo-RL PR #3788: get_grad_norm summed every local square over dp_cp and then over tp)."""
    def tp_square_norm(split, rep, tp):
        total = split + rep
        dist.all_reduce(total, group=tp.group)
        return total
    return tp_square_norm


def make_ssm_norm_rank_channels(original):
    """The SSM mixer's gated RMSNorm normalises each TP rank's channels by their own mean square, not all Di channels'
    (state-spaces/mamba PRs #908 / #916 / #951: ``RMSNormGated``'s group size taken from the unsharded group count,
    too small by the TP size; invisible at tp 1)."""
    def channel_sum(x, tp):
        return x * tp.size  # this rank's sum of squares, scaled as if every rank's were the same
    return channel_sum


def make_ssm_shared_grads_partial(original):
    """The SSM mixer's B / C projection and conv, replicated over TP, keep each rank's partial gradient (its heads'
    share): nothing sums them over the TP group (Megatron-LM issue #7452: a replicated norm weight of GatedDeltaNet
    whose gradient is a per-rank partial sum, all-reduced only when sequence parallelism is on)."""
    def partial_over_tp(name):
        return False
    return partial_over_tp


TP_FAULTS: tuple[Fault, ...] = (
    Fault(name="tp-row-parallel-not-reduced", title="a row-parallel matrix's partial sums never all-reduced",
          source="sglang PR #14811: the Mamba mixer's out_proj, a RowParallelLinear built with reduce_results=False, "
                 "returned each TP rank's partial output: garbage with TP > 1",
          url="https://github.com/sgl-project/sglang/pull/14811", layer="model",
          seam="harness.parallel.tensor_parallel:leave", make=make_row_parallel_not_reduced,
          check="replica-consistency", expect=r"parameters differ between ranks: ranks \[1, 3\]", scenario="train-tp"),
    Fault(name="tp-input-grad-not-reduced", title="a column-parallel input's gradient not all-reduced over TP",
          source="mcore-bridge PR #173: a replicated factor in front of a tensor-parallel matrix got only its own TP "
                 "rank's gradient, never summed over the TP group, so each TP rank trained a different copy "
                 "(Megatron-LM issue #19: why _CopyToModelParallelRegion's backward all-reduces)",
          url="https://github.com/modelscope/mcore-bridge/pull/173", layer="gradients",
          seam="harness.parallel.tensor_parallel:enter", make=make_input_grad_not_reduced,
          check="replica-consistency", expect=r"parameters differ between ranks: ranks \[1, 3\]", scenario="train-tp"),
    Fault(name="tp-group-position-fastest", title="TP groups built for another rank order (positions fastest)",
          source="TensorRT-LLM PR #10350: the TP and CP grouping order swapped; Megatron lays ranks out tp-cp-ep-dp-pp "
                 "(TP fastest), and a group builder that assumes another order joins ranks of different positions",
          url="https://github.com/NVIDIA/TensorRT-LLM/pull/10350", layer="groups",
          seam="harness.parallel.groups:tp_group_ranks", make=make_tp_group_position_fastest,
          check="group-audit", expect=r"the TP group holds ranks \[0, 2\], the TP ranks of its position are \[0, 1\]",
          scenario="train-tp"),
    Fault(name="tp-norm-shards-not-summed", title="the gradient norm of split parameters taken per TP rank",
          source="NeMo Automodel PR #3477: the clipping helper normed and clipped a partial gradient rank-locally "
                 "(also torchtune issue #2420: clip_grad_norm under tensor parallelism)",
          url="https://github.com/NVIDIA-NeMo/Automodel/pull/3477", layer="gradients",
          seam="harness.parallel.tensor_parallel:square_norm", make=make_norm_shards_not_summed,
          check="replica-consistency", expect=r"parameters differ between ranks: ranks \[1, 3\]", scenario="train-tp"),
    Fault(name="tp-replicated-norm-counted-per-rank", title="replicated parameters' gradient norm counted tp times",
          source="ROCm TransformerEngine PR #715: replicated weights marked tensor-model-parallel entered the "
                 "gradient norm once per TP rank (1.36-1.52x at TP 8); NeMo-RL PR #3788 alike",
          url="https://github.com/ROCm/TransformerEngine/pull/715", layer="gradients",
          seam="harness.parallel.tensor_parallel:square_norm", make=make_replicated_norm_counted_per_rank,
          check="clipped-gradients", expect=r"clipped step-1 gradient of .* differs", scenario="train-tp"),
    Fault(name="etp-gate-on-partial-expert-outputs", title="the MoE gate applied to the experts' partial TP sums",
          source="torchtitan issue #2387 / PR #2416: under TP the router's gradient from scores applied after the "
                 "experts was a partial sum marked replicated, and the MoE router weights diverged across TP ranks "
                 "from the first step",
          url="https://github.com/pytorch/torchtitan/issues/2387", layer="model",
          seam="harness.runtime.layers:tp_expert_outputs", make=make_gate_on_partial_expert_outputs,
          check="replica-consistency", expect=r"parameters differ between ranks: ranks \[1, 3\]",
          scenario="train-tp-moe"),
    Fault(name="dist-opt-tp-replicated-counted-per-rank",
          title="the distributed optimiser's norm sums replicated squares over TP",
          source="NeMo-RL PR #3788: get_grad_norm all-reduced every local squared norm over the DP x CP group and then "
                 "over the TP group, counting TP-replicated gradients tp_size times; clipping fired too early",
          url="https://github.com/NVIDIA-NeMo/RL/pull/3788", layer="optimizer",
          seam="harness.parallel.dist_opt:tp_square_norm", make=make_dist_opt_replicated_counted_per_rank,
          check="clipped-gradients", expect=r"clipped step-1 gradient of .* differs", scenario="train-tp-dist-opt"),
    Fault(name="ssm-tp-norm-rank-channels", title="the SSM's gated norm over a TP rank's channels only",
          source="state-spaces/mamba PRs #908 / #916 / #951: Mamba2's RMSNormGated group size from the unsharded "
                 "group count, too small by the TP size under tensor parallelism",
          url="https://github.com/state-spaces/mamba/pull/908", layer="model",
          seam="harness.parallel.tensor_parallel:channel_sum", make=make_ssm_norm_rank_channels,
          check="step1-gradients", expect=r"step-1 gradient of .* differs", scenario="train-hybrid"),
    Fault(name="ssm-tp-shared-grads-partial", title="the SSM's replicated B / C parameters keep partial TP gradients",
          source="Megatron-LM issue #7452 (item 11): GatedDeltaNet's replicated out_norm weight gets a per-rank partial "
                 "gradient that the finalizer all-reduces over TP only under sequence parallelism",
          url="https://github.com/NVIDIA/Megatron-LM/issues/7452", layer="gradients",
          seam="harness.parallel.tensor_parallel:partial_over_tp", make=make_ssm_shared_grads_partial,
          check="replica-consistency", expect=r"parameters differ between ranks", scenario="train-hybrid"),
)
"""The tensor-parallel faults, in report order (the catalogue appends them)."""
