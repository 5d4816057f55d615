"""Seams: the named places where a fault replaces one function of the harness for the length of a run.

A seam is a module-level function that its caller looks up *when it runs* (a module global, not a
name bound at import time elsewhere), so replacing the module attribute changes what the run does and
nothing else. ``replaced(seam, make)`` installs ``make(original)`` and always puts the original back,
also when the run raises; it refuses to stack a second replacement on a seam, so two faults can never
be active at once by accident. Nothing outlives the ``with`` block: no flag, no registry entry.

>>> from harness.faults.seam import replaced, resolve
>>> module, attr, original = resolve("harness.train.passes:labels_for")
>>> with replaced("harness.train.passes:labels_for", lambda orig: (lambda mb: orig(mb))):
...     module.labels_for is original
False
>>> module.labels_for is original
True
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

SEAMS: dict[str, str] = {
    "harness.train.passes:rope_positions": "RoPE position ids of a rank's slice of a micro-batch",
    "harness.train.passes:labels_for": "next-token labels of a rank's slice",
    "harness.train.passes:attention_plan": "the CP attention plan of a micro-batch (its cu_seqlens)",
    "harness.train.passes:attention_call": "the attention a micro-batch's layers call (its plan and CP group bound)",
    "harness.train.passes:mtp_columns": "multi-token prediction's shifted tokens, labels and mask of a rank's slice",
    "harness.runtime.layers:cp_ops": "the CP operations (attention, SSM mixing) a module uses for a call",
    "harness.runtime.ssm:scan_layout": "the sequence boundaries the SSM scan resets its state at",
    "harness.runtime.weight_cache:refresh": "the step's compute-dtype copy of a weight, made at its first use in a step",
    "harness.runtime.weight_cache:accumulate": "one use's weight gradient added into the weight's fp32 .grad",
    "harness.runtime.fused_linear:gemm_accumulate": "the fused weight-gradient GEMM's go^T @ x added into the fp32 .grad",
    "harness.train.trainer:probe_config": "the configuration a bf16 layout's fp32 step 1 runs (dtype, seed, steps)",
    "harness.stack.runtime:sharpen_queries_and_keys": "the query / key scaling of the harness stack's sharpen (verify's "
                                                       "sharp step 1 in bf16)",
    "harness.train.step:new_groups": "the dynamic groups a layout's run uses after (re-)initialisation",
    "harness.train.step:cp_group_for": "the process group a micro-batch's CP-aware calls get",
    "harness.train.step:loss_denominator": "the token count the summed loss is divided by",
    "harness.train.step:reduce_gradients": "the gradient all-reduce after the micro-batches",
    "harness.train.step:make_optimizer": "the optimiser a layout's run steps its parameters with",
    "harness.parallel.dist_opt:grad_square_norm": "the distributed optimiser's squared gradient norm over its shards",
    "harness.parallel.dist_opt:tp_square_norm": "the distributed optimiser's squared norm over the TP group (split "
                                                 "pieces summed, replicated ones once)",
    "harness.parallel.dist_opt:gather_params": "the distributed optimiser's all-gather of the updated parameters",
    "harness.runtime.row_sum:sum_rows": "the fp32 sum of the gathered keys' repeated gradient rows (CP attention's "
                                        "backward, before the reduce-scatter)",
    "harness.parallel.reroute:block_sequences": "the sequences a rank packs for its block, in pack order",
    "harness.parallel.reroute:zigzag_index_array": "the zig-zag slice of the packed data a rank keeps",
    "harness.parallel.reroute:pad_value": "the value a padding token takes in a column (labels -100, loss mask 0)",
    "harness.train.layouts:deliver": "the blocks every rank runs, rebuilt from the sample_id_groups it is handed",
    "harness.train.layouts:schedule": "the scheduler call of the thd / dcp layouts (with the pipeline's VPP group)",
    "harness.train.pipeline:stage_view": "the schedule as a later pipeline stage runs it (its local_cp_size per block)",
    "harness.train.step:stage_cost": "the cost model a pipeline stage plans with",
    "harness.train.step:clip_gradients": "gradient clipping by the whole model's norm (summed over pipeline stages)",
    "harness.train.layouts:sample_id_groups": "the Megatron-shaped schedule (micro-batch -> slot -> gids) handed to ranks",
    "harness.plan.layout:blocks_from_slots": "slot lists -> CP blocks (how a rank finds its block and local_cp_size)",
    "harness.plan.megatron_pr2000:fill_free_ranks": "PR #2000's expansion of CP groups into free positions",
    "harness.plan.balanced.levels:_Pool": "the blocks of one size the rows by levels fill (balanced, barriers)",
    "harness.plan.balanced.tall:_tightest": "the block a long sequence joins in the tall micro-batch (balanced, barriers)",
    "harness.plan.tallest:lowest_height": "the least height of the tallest micro-batch (the synchronous lower bound)",
    "harness.plan.balanced:Item": "a sequence as balanced's candidates price it (its per-rank cost at each CP size)",
    "harness.parallel.tensor_parallel:channel_sum": "a per-token sum over channels split by TP (the SSM's gated norm), "
                                                    "summed over the TP group both ways",
    "harness.parallel.tensor_parallel:partial_over_tp": "the replicated parameters whose gradient is partial per TP rank "
                                                        "(the SSM's B / C projection and conv)",
    "harness.plan.padding:planned_tokens": "the tokens a scheduler counts for a sequence in a block (padded by its "
                                           "size and tp under sequence parallelism)",
    "harness.plan.balanced.shelves:_pick": "the narrow sequence a wide block of balanced's shelves takes next (barriers)",
    "harness.plan.balanced:_items": "the sequences balanced schedules, each at its cp_min (of max_seqlen_per_rank, not "
                                    "a micro-batch's capacity)",
    "harness.parallel.expert_parallel:dispatch_routes": "the experts each local token is sent to (expert parallelism)",
    "harness.parallel.expert_parallel:announced_counts": "the per-expert token counts a rank announces to the experts' owners",
    "harness.train.passes:balance_sequences": "each token's sequence in its pack, for the routers' balance loss",
    "harness.train.passes:balance_group": "the group a micro-batch's balance counts are summed over (its CP block)",
    "harness.train.passes:balance_tp_group": "the TP group the balance counts are summed over too (sequence "
                                             "parallelism)",
    "harness.train.step:expert_square_norm": "the experts' part of the gradient norm (expert parallelism; summed "
                                             "over TP too)",
    "harness.train.replay:route_columns": "which layers of the rollout's routes feed the routers of a PP stage",
    "harness.train.replay:thd_routes": "the replayed route rows of one CP rank (zig-zag front / back halves)",
    "harness.plan.generator_output:check_step_wise_fields": "step-wise validation of a generator's output",
    "harness.train.pipeline:split": "the global layers of every stage's virtual chunks (the layer offsets)",
    "harness.train.pipeline:pre_process": "whether a virtual chunk embeds the micro-batch's tokens (model chunk 0 only)",
    "harness.train.shared_embedding:gather_grad": "the last stage's embedding-replica gradient added to the first "
                                                  "stage's (multi-token prediction under a pipeline)",
    "harness.train.shared_embedding:before_reduction": "whether the replica's gradient joins the first stage's before "
                                                       "the DP x CP reduction (or after it)",
    "harness.train.shared_embedding:refresh": "the first stage's updated embedding sent to the last stage's replica",
    "harness.train.step:_global_norm": "the whole model's gradient norm a run reports (summed over pipeline stages)",
    "harness.train.passes:mtp_loss_scales": "the weight of each multi-token prediction depth's summed loss",
    "harness.train.passes:ssm_sequences": "the sequences the SSM mixer's conv and scan run over (restarting at each)",
    "harness.parallel.tensor_parallel:enter": "a column-parallel matrix's replicated input (its gradient all-reduced "
                                              "over the TP group)",
    "harness.parallel.tensor_parallel:leave": "a row-parallel matrix's partial sums all-reduced over the TP group",
    "harness.parallel.tensor_parallel:square_norm": "the squared gradient norm over the TP group (shards summed, "
                                                    "replicated parameters once)",
    "harness.parallel.groups:tp_group_ranks": "the global ranks of a position's tensor-parallel group",
    "harness.runtime.layers:tp_expert_outputs": "an MoE layer's experts under TP: partial outputs summed over TP, then "
                                                "gate-weighted",
    "harness.runtime.layers:sp_gates": "an MoE layer's gate weights of every TP rank's rows under sequence parallelism "
                                       "(backward: reduce-scattered)",
    "harness.parallel.vocab_parallel:mask_padding": "the padded vocabulary's logits set to -inf before the loss",
    "harness.parallel.vocab_parallel:vocab_range": "the token ids a TP rank's shard of the embedding and head keeps",
    "harness.parallel.vocab_parallel:lookup": "the embedding rows of a micro-batch's tokens from the TP ranks' "
                                              "vocabulary shards (masked, summed over TP)",
    "harness.parallel.vocab_parallel:head_input": "the vocab-parallel LM head's input (its gradient summed over TP)",
    "harness.parallel.vocab_parallel:cross_entropy": "per-token cross-entropy from each TP rank's logits of its "
                                                     "vocabulary range",
    "harness.runtime.chunked_loss:chunks": "the chunks of tokens the chunked loss head walks",
    "harness.runtime.chunked_loss:upstream": "each token's upstream gradient of its loss in the chunked head's "
                                             "backward",
    "harness.parallel.vocab_parallel:combine_lse": "the chunked head's log-sum-exp over the whole vocabulary from "
                                                   "each TP rank's over its columns",
    "harness.parallel.sequence_parallel:scatter": "a block stack's entry: this TP rank's token rows (backward: every "
                                                  "rank's rows' gradients gathered)",
    "harness.parallel.sequence_parallel:gather": "a block stack's exit: every TP rank's rows (backward: this rank's rows "
                                                 "of the replicated gradient)",
    "harness.parallel.sequence_parallel:all_gather_rows": "a column-parallel matrix's input rows gathered over TP "
                                                          "(backward: reduce-scattered)",
    "harness.parallel.sequence_parallel:reduce_scatter_rows": "a row-parallel matrix's partial sums reduce-scattered "
                                                              "by rows over TP",
    "harness.parallel.sequence_parallel:in_region": "which replicated parameters see only a TP rank's rows (marked "
                                                    "for the TP sum of their gradients)",
    "harness.parallel.sequence_parallel:reduce_grads": "the TP sum of the marked parameters' gradients after the "
                                                       "backward",
    "harness.parallel.sequence_parallel:sum_loss": "an MoE router's z-loss of a TP rank's rows summed over TP "
                                                   "(backward: as it is)",
    "harness.train.replay:sp_rows": "a TP rank's rows of its CP rank's replay rows under sequence parallelism",
    "harness.parallel.ulysses:replicate_kv": "the a2a CP exchange's copies of each K/V head (GQA, kv_heads < cp)",
    "harness.parallel.ssm_cp:pack_order": "the pack position of each row the SSM's CP exchange gathers (zig-zag inverse)",
}
"""Every seam a fault may use: ``"module:function"`` -> what it decides."""


class SeamError(RuntimeError):
    """A seam that does not exist, is not registered, or is already replaced."""


def resolve(seam: str):
    """(module, attribute name, current value) of a registered seam."""
    if seam not in SEAMS:
        raise SeamError(f"{seam!r} is not a registered seam; seams are {', '.join(sorted(SEAMS))}")
    module_name, _, attr = seam.partition(":")
    module = importlib.import_module(module_name)
    if not callable(getattr(module, attr, None)):
        raise SeamError(f"seam {seam!r}: {module_name} has no function {attr!r}")
    return module, attr, getattr(module, attr)


@contextmanager
def replaced(seam: str, make: Callable[[Callable], Callable], *, label: str = "fault") -> Iterator[Callable]:
    """Install ``make(original)`` at ``seam`` for the ``with`` block; yields the replacement."""
    module, attr, original = resolve(seam)
    if getattr(original, "__harness_fault__", None):
        raise SeamError(f"seam {seam!r} is already replaced by {original.__harness_fault__!r}")
    replacement = make(original)
    try:
        replacement.__harness_fault__ = label
    except AttributeError:  # a builtin or bound method: wrap it so that the marker can be set
        inner = replacement

        def replacement(*args, **kwargs):
            return inner(*args, **kwargs)

        replacement.__harness_fault__ = label
    setattr(module, attr, replacement)
    try:
        yield replacement
    finally:
        setattr(module, attr, original)
