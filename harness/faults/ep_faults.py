"""Re-creations of expert-parallel bugs: the token dispatch (``harness.parallel.expert_parallel``) and the experts'
gradients (``harness.train.step.reduce_gradients``), code every layout runs under expert parallelism and no run
without it.

Shape legend: ``T`` a rank's local tokens, ``K`` top-k, ``X`` experts.
"""

from __future__ import annotations

import torch

from harness.parallel.expert_parallel import is_expert_param, shard_square_norm
from harness.train.step import all_reduce_flat


def make_dispatch_other_chunk(original):
    """The dispatch reads the routes of the other zig-zag chunk of the rank's CP slice: under CP a rank
    holds chunks r and 2cp - 1 - r of each sequence, and a dispatcher that indexes the routing map in
    the unsharded order of those chunks (back before front) sends every token of a split sequence to
    the experts chosen for another token. Right for CP 1 blocks, wrong wherever a sequence is split."""
    def dispatch_routes(idx_TK, tokens):
        idx_TK = original(idx_TK, tokens)
        if tokens is None or tokens.cp_size == 1:
            return idx_TK
        parts, offset, cu = [], 0, tokens.cu_seqlens_padded
        for a, b in zip(cu[:-1], cu[1:]):
            half = (b - a) // (2 * tokens.cp_size)
            front, back = idx_TK[offset:offset + half], idx_TK[offset + half:offset + 2 * half]
            parts += [back, front]
            offset += 2 * half
        return torch.cat(parts) if parts else idx_TK
    return dispatch_routes


def make_counts_off_by_one(original):
    """Every rank announces its per-expert counts one expert off (the count of expert e under e + 1, an
    off-by-one in the owners' expert offsets): the owners size their receive buffers for other row
    counts than the senders send (an all-to-all with disagreeing split sizes hangs or corrupts)."""
    def announced_counts(counts_X, shard):
        return torch.roll(original(counts_X, shard), 1)
    return announced_counts


def make_expert_grads_all_reduced(original):
    """Expert gradients summed over the expert-parallel domain with the replicated ones, as if every rank held
    the same experts: each rank's experts receive the sum of all ranks' experts' gradients (Megatron-LM PR
    #5916: expert parameters reduced over a group in which they are not replicated - "unrelated gradients will
    mix"). Without expert parallelism nothing changes."""
    def reduce_gradients(model, groups, lcfg):
        if not lcfg.expert_parallel:
            return original(model, groups, lcfg)

        return all_reduce_flat(model, groups.group(lcfg.n_ranks))
    return reduce_gradients


def make_expert_grads_times_ep(original):
    """Expert gradients ``ep_size`` times too large: an expert's gradient already sums every rank's tokens routed
    to it (the all-to-all's backward), and the reduction scales it as one rank's share (DeepSpeed PR #5259: with
    EP = 2 the MoE parameters' gradients came out exactly 2x those of one GPU; Megatron-LM PR #5956: expert
    gradients ``ep_size`` times too large under Megatron-FSDP v2). Without expert parallelism nothing changes."""
    def reduce_gradients(model, groups, lcfg):
        norm = original(model, groups, lcfg)
        if not lcfg.expert_parallel:
            return norm

        shards = [p for n, p in model.named_parameters() if is_expert_param(n) and p.grad is not None]
        sq = float(shard_square_norm(shards, groups.group(lcfg.n_ranks)))
        for p in shards:
            p.grad.mul_(lcfg.n_ranks)
        return (norm ** 2 + (lcfg.n_ranks ** 2 - 1) * sq) ** 0.5
    return reduce_gradients


def make_expert_norm_not_summed_over_tp(original):
    """With expert and tensor parallelism the experts' part of the gradient norm taken from this TP rank's shards only:
    their squares summed over the DP x CP group but not over TP, so the norm misses the other TP ranks' halves of every
    expert and clipping applies less than it should (Megatron-LM PR #5916: "if EP > 1 and TP > 1, then the gradient
    norm calculations omit some experts")."""
    from harness.parallel import expert_parallel

    def expert_square_norm(shards, tp=None):
        return expert_parallel.shard_square_norm(shards[0], shards[1])
    return expert_square_norm


def make_expert_norm_local(original):
    """The experts' part of the clipping norm taken from this rank's own experts only, never summed over the domain
    that shards them: every rank clips by a norm of different experts, so the replicated parameters are scaled
    differently on each rank and the replicas part (ColossalAI issue #2192: "experts' gradient norms are supposed to be
    summed up since it is another kind of model parallelism"; DeepSpeed issue #8475: norms of ranks with different
    expert ownership averaged instead of summed; NeMo Automodel issue #3816: a different "global" norm on every EP
    group)."""
    import torch

    def expert_square_norm(shards, tp=None):
        grads = [p.grad for p in shards[0] if p.grad is not None]
        dev = grads[0].device if grads else torch.device("cpu")
        sq = torch.zeros((), dtype=torch.float64, device=dev)
        for g in grads:
            sq += g.detach().double().pow(2).sum()
        return sq
    return expert_square_norm
