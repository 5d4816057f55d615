"""Re-creations of integration bugs in the training runtime (``harness.train.trainer`` / ``reroute``).

Each ``make_*`` takes the seam's original function and returns the faulty one; state a fault needs
(a group kept from the previous micro-batch, the DP-only groups) lives in that closure, so it is
created fresh for every run and dropped with it. Shape legend: ``T`` a rank's local tokens.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import torch
import torch.distributed as dist

from harness.parallel.cp_attention import CPAttentionPlan
from harness.plan import CostModel
from harness.plan.layout import Block, Schedule
from harness.runtime.ssm import SequenceLayout
from harness.train.step import all_reduce_flat


def make_rope_per_rank(original):
    """RoPE positions numbered along the rank's own slice: each sequence's local part counts from 0 on
    every CP rank (Megatron-LM PR #3405 / #5243: THD + CP offsets lost; positions [0, 3, 0, 3] where
    [0, 3, 4, 7] belong). Right for CP 1 blocks, wrong wherever a sequence is split."""
    def rope_positions(mb):
        cu, cp = mb.cu_seqlens_padded, mb.local_cp_size
        local = [(cu[i + 1] - cu[i]) // cp for i in range(len(cu) - 1)]
        dev = mb.data["tokens"].device
        return torch.cat([torch.arange(n, dtype=torch.int64, device=dev) for n in local])
    return rope_positions


def make_labels_after_split(original):
    """Labels made by rolling the rank's *local* tokens by one after the CP split (verl PR #4250): at
    every chunk and sequence boundary the label is the next token of the rank's buffer, not of the
    sequence."""
    def labels_for(mb):
        return torch.roll(mb.data["tokens"], -1)
    return labels_for


def make_loss_tokens_per_cp_rank(original):
    """The loss divided by tokens that every rank counts for the *whole* sequences of its block,
    summed over DP x CP: a sequence in a CP block of s ranks is counted s times (verl PR #5869,
    prime-rl PR #2562: 'CP overcounts global tokens')."""
    def loss_denominator(mbs, group):
        dev = mbs[0].data["loss_mask"].device if mbs else torch.device("cpu")
        count = torch.tensor([float(sum(mb.cu_seqlens[-1] for mb in mbs))], dtype=torch.float64, device=dev)
        dist.all_reduce(count, group=group)
        return float(count)
    return loss_denominator


def make_loss_counts_padding(original):
    """The loss divided by every token the ranks process, padding included (the zig-zag slices' and the token
    bucket's): each rank counts its slices' length instead of their loss mask (prime-rl PR #674: 'we count the padded
    token in the loss_scale'; maxtext PR #366: normalise the loss by unpadded tokens). The step's loss and
    gradients shrink by the padding's share: 7% of head.weight's step-1 gradient in the train-bucketed scenario."""
    def loss_denominator(mbs, group):
        dev = mbs[0].data["loss_mask"].device if mbs else torch.device("cpu")
        count = torch.tensor([float(sum(mb.data["tokens"].numel() for mb in mbs))], dtype=torch.float64, device=dev)
        dist.all_reduce(count, group=group)
        return count[0]
    return loss_denominator


def make_padding_trained_on(original):
    """Padding labelled as loss tokens: every padding token (the token bucket's and the zig-zag slices') gets loss
    mask 1 and the pad id 0 as its label, not -100 (axolotl PR #2227: padding not labelled -100, the loss computed
    over the padding tokens too; TRL PR #1625: pad tokens copied into the labels unmasked). The loss then trains the
    padded positions to predict token 0 and counts them in its denominator."""
    def pad_value(key: str) -> int:
        if key == "loss_mask":
            return 1
        if key == "labels" or key.startswith("mtp_labels"):
            return 0
        return original(key)
    return pad_value


def make_adam_eps_underflow(original):
    """AdamW whose epsilon is 0: Adam's default 1e-8 added in float16 rounds to 0 (its smallest subnormal is
    ~6e-8), so a parameter row whose gradient has been exactly zero so far - the embedding row of a token no batch
    has held yet - is updated by 0 / 0 = NaN (optax issue #1754; apex issue #240). Exact until then; the loss turns
    NaN at the first step whose batch holds such a token, in every layout, and stays NaN."""
    def make_optimizer(params, **kw):
        opt = original(params, **kw)
        for group in opt.param_groups:
            group["eps"] = 0.0
        return opt
    return make_optimizer


def make_grad_reduce_dp_only(original):
    """Gradients all-reduced over the data-parallel group of the static layout only (ranks with the
    same index in their static CP group): the CP ranks' partial gradients are never summed (the
    ``get_data_parallel_group()`` vs ``with_context_parallel=True`` mix-up of verl PR #6049 / #5993)."""
    state: dict = {}

    def reduce_gradients(model, groups, lcfg):
        C = lcfg.static_cp
        if "mine" not in state:  # every rank creates every group, in one order (a collective)
            for c in range(C):
                ranks = [groups.layout.rank_of(c + C * d) for d in range(lcfg.n_ranks // C)]
                g = dist.new_group(ranks)
                if groups.rank in ranks:
                    state["mine"] = g

        return all_reduce_flat(model, state["mine"])
    return reduce_gradients


def make_grad_reduce_average(original):
    """Gradients averaged over the DP x CP ranks (DDP's ``average_in_collective``) although the loss is
    already divided by the global token count: every gradient is 1/N of the right one."""
    def reduce_gradients(model, groups, lcfg):
        original(model, groups, lcfg)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        for g in grads:
            g.div_(lcfg.n_ranks)
        return float(torch.cat([g.reshape(-1) for g in grads]).double().norm())
    return reduce_gradients


def make_drop_last_sequence(original):
    """A rerouted block that loses its last sequence (an off-by-one over the received samples; cf.
    Megatron-LM PR #6816: the rerouted batch schema the real dataloader produces was never tested)."""
    def block_sequences(block, position):
        gids = tuple(original(block, position))
        return gids[:-1] if len(gids) > 1 else gids
    return block_sequences


def make_misorder_sequences(original):
    """The ranks of one CP block pack its sequences in different orders (each starts at its own index
    in the block, as an arrival-ordered receive does): the zig-zag slices no longer belong to one pack
    (spec 2.7 invariant 3: 'identical order inside the list')."""
    def block_sequences(block, position):
        gids = tuple(original(block, position))
        k = (position - block.start) % len(gids) if gids else 0
        return gids[k:] + gids[:k]
    return block_sequences


def make_pack_without_cu_seqlens(original):
    """The attention told the pack is one sequence: the rerouted batch lost ``cu_seqlens`` /
    ``max_seqlen`` (Megatron-LM PR #6816, bug 1), so tokens attend across sequence boundaries."""
    def attention_plan(mb, device, exchange):
        return CPAttentionPlan.build([0, mb.cu_seqlens_padded[-1]], mb.local_cp_size, mb.cp_rank, device,
                                     exchange=exchange)
    return attention_plan


def make_zigzag_r_plus_cp(original):
    """The data sliced with chunks (r, r + cp) of each sequence while the attention assumes TE's
    (r, 2cp - 1 - r): every rank attends as if it held other tokens."""
    def zigzag_index_array(cu_seqlens_padded, cp_size, cp_rank):
        cu = np.asarray(cu_seqlens_padded, dtype=np.int64)
        if cp_size == 1:
            return np.arange(cu[-1], dtype=np.int64)
        out = []
        for a, b in zip(cu[:-1], cu[1:]):
            c = (b - a) // (2 * cp_size)
            for k in (cp_rank, cp_rank + cp_size):
                out.append(np.arange(a + k * c, a + (k + 1) * c, dtype=np.int64))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
    return zigzag_index_array


def make_stale_group(original):
    """The CP group of the previous micro-batch kept for the next one: a module that stored the
    dynamic group and was not restored after its forward (PR #2000's ``attention.py`` fix; Megatron-LM
    PR #6821 / issue #5352: RoPE given the static CP group under runtime CP)."""
    state = {"previous": None}

    def cp_group_for(groups, mb):
        group = original(groups, mb)
        previous, state["previous"] = state["previous"], group
        return group if previous is None else previous
    return cp_group_for


def make_cp_inactive_for_small_batches(original):
    """A global batch with fewer sequences than DP x CP ranks skips the dynamic-CP split: every rank
    runs the whole batch with CP off (verl PR #5869: ``dynamic_cp_split_batch`` returned early).
    No loss or gradient changes (the token count grows with the duplicates); the work is done N times."""
    def deliver(sched):
        if len(sched.lengths) >= sched.n_ranks:
            return original(sched)
        gids = tuple(sorted(sched.lengths))
        return Schedule.from_blocks([[Block(p, 1, gids) for p in range(sched.n_ranks)]],
                                    lengths=list(sched.lengths.items()), n_ranks=sched.n_ranks,
                                    max_seqlen_per_rank=sched.max_seqlen_per_rank, algorithm=sched.algorithm,
                                    cost=sched.cost)
    return deliver


# ------------------------------------------------------------------------------------ pipeline
def make_local_cp_size_not_propagated(original):
    """Later pipeline stages never receive ``local_cp_size``: they run every block's sequences as CP-1
    blocks of their own (PR #2000 had to add it to ``broadcast_to_pp_group`` and ``create_data_iterator``
    for PP / VPP stages)."""
    def stage_view(sched, stage):
        sched = original(sched, stage)
        if stage == 0:
            return sched
        layout = [[Block(p, 1, b.gids) for b in mb for p in b.ranks] for mb in sched.layout]
        return Schedule.from_blocks(layout, lengths=list(sched.lengths.items()), n_ranks=sched.n_ranks,
                                    max_seqlen_per_rank=sched.max_seqlen_per_rank, vpp_group=sched.vpp_group,
                                    algorithm=sched.algorithm, cost=sched.cost)
    return stage_view


def make_stage_own_cost(original):
    """Every stage plans the batch itself with a cost model of its own (a per-stage calibration, or
    upstream's default estimator on the later stages): the stages' schedules differ."""
    def stage_cost(cost, stage):
        return original(cost, stage) if stage == 0 else CostModel.megatron()
    return stage_cost


def make_vpp_group_not_passed(original):
    """The scheduler is not told the interleaved pipeline's micro-batch group
    (``microbatch_group_size_per_vp_stage``), nor the pipeline it runs under (whose execution model
    carries the group): the micro-batch count is whatever the batch gives."""
    def schedule(lengths, **kw):
        kw.pop("vpp_group", None)
        kw.pop("execution", None)
        return original(lengths, **kw)
    return schedule


def make_clip_by_stage_norm(original):
    """Gradients clipped by each stage's own norm: the squared norms are not summed over the pipeline
    (Megatron all-reduces the norm over the model-parallel group before clipping), so every stage
    scales its gradients by a different factor."""
    def clip_gradients(params, max_norm, pipeline_group, **kw):
        return original(params, max_norm, None, **kw)
    return clip_gradients


def make_embedding_grad_dropped(original):
    """The replica's gradient is left where it is: the first stage steps its table by the trunk's lookups alone, and
    the last stage's replica gradient stays behind (Megatron-Bridge #5380: the MTP stage outside the embedding
    group)."""
    def gather_grad(model, stage, group):
        return None
    return gather_grad


def make_embedding_grad_after_reduce(original):
    """The replica's gradient joins the first stage's after the DP x CP reduction (Megatron-LM issue #844: the
    embedding's all-reduce between the first and last stage ran after the distributed optimiser's reduce-scatter and
    added partial sums): the first stage's pieces are summed over the domain before the replica's unreduced share
    joins them, and the norm and the clipping never see it."""
    def before_reduction():
        return False
    return before_reduction


def make_embedding_replica_stale(original):
    """The updated table is never sent to the last stage: from step 2 the MTP block looks its tokens up in the
    initial table (Megatron-Bridge #5380: the live MTP embedding diverged from the first stage's)."""
    def refresh(model, stage, group, first_rank):
        return None
    return refresh


# ------------------------------------------------------------------ model components and groups
def make_mtp_shift_after_split(original):
    """Multi-token prediction's inputs and labels shifted on the rank's zig-zag slice, after the CP split:
    at every chunk and sequence boundary depth k reads the wrong token (the MTP analogue of the labels
    bug; PR #2000 added MTP under dynamic CP)."""
    def mtp_columns(mb, k):
        tokens, labels, mask = mb.data["tokens"], mb.data["labels"], mb.data["loss_mask"]
        return torch.roll(tokens, -k), torch.roll(labels, -k), torch.roll(mask, -k)
    return mtp_columns


def make_scan_across_sequences(original):
    """The SSM scan fed the pack without its sequence boundaries: the state of one sequence runs on into
    the next (a Mamba kernel called without ``seq_idx`` / ``cu_seqlens`` on a THD pack)."""
    def scan_layout(seqs):
        return SequenceLayout((0, seqs.total))
    return scan_layout


def make_module_keeps_group(original):
    """Every CP-aware module keeps the CP operations (and group) of the first micro-batch it ran and
    reuses them: the dynamic group is not restored per micro-batch (PR #2000: Mamba and MTP switch the
    CP group per micro-batch and must restore it after each forward)."""
    kept: dict = {}

    def cp_ops(module, attention, mixing):
        attention, mixing = original(module, attention, mixing)
        return kept.setdefault(id(module), (attention, mixing))
    return cp_ops


def make_destroyed_group_reused(original):
    """A cache of group handles outlives a re-initialisation: after the dynamic groups are destroyed and
    created again, the new registry still hands out the first generation's (destroyed) handles - which
    keep working on gloo, silently (PR #2000: clean up ``_DYNAMIC_DP_CP_GROUPS`` in
    ``destroy_model_parallel``)."""
    first: dict = {}

    def new_groups(groups):
        groups = original(groups)
        if not first:
            first.update(groups._mine)
        else:
            groups._mine = dict(first)
        return groups
    return new_groups


# ------------------------------------------------------------------------------- the step's weight copies
def make_weight_copy_never_refreshed(original):
    """The step's compute-dtype copy of a weight is made once and kept: after the first step the layers compute
    with the weights training started with while the optimiser updates the fp32 masters (a cache that nothing
    invalidates; its addresses and, under some optimisers, its version counters never move)."""
    def refresh(w, buf, first):
        if first:
            original(w, buf, first)
    return refresh


def make_wgrad_first_microbatch_only(original):
    """A per-step "already added" flag gates the weight-gradient add: only each weight's first micro-batch of a
    step reaches ``.grad``, the others are dropped (the flag means "the gradient lives in the main buffer", not
    "an add happened")."""
    from harness.runtime import weight_cache

    added: dict[int, int] = {}

    def accumulate(w, g):
        step = weight_cache.step_number()
        if added.get(id(w)) != step:
            original(w, g)
            added[id(w)] = step
    return accumulate


def make_wgrad_gemm_overwrites(original):
    """The fused weight-gradient GEMM runs with beta = 0: each micro-batch's product overwrites ``.grad``, so a step
    keeps only its last micro-batch's weight gradient (per weight)."""
    def gemm_accumulate(main_grad, go_TO, x_TI):
        main_grad.zero_()
        original(main_grad, go_TO, x_TI)
    return gemm_accumulate


# ----------------------------------------------------------------------------------- the fp32 step of bf16 runs
def make_fp32_step_in_bf16(original):
    """The probe step keeps the run's dtype: its "fp32" numbers are bf16's, and a step-1 bug hides in bf16's bands."""
    def probe_config(cfg):
        return replace(original(cfg), dtype=cfg.dtype)
    return probe_config


def make_fp32_step_of_another_model(original):
    """The probe step starts from another seed: another initial model and batch, in every run alike (the layouts'
    and the reference's fp32 lines agree with each other and judge nothing of the bf16 step)."""
    def probe_config(cfg):
        out = original(cfg)
        return replace(out, corpus=replace(out.corpus, seed=out.corpus.seed + 1))
    return probe_config
