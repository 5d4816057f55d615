"""The fault catalogue: real bugs of dynamic-CP, router-replay and step-wise stacks, re-created in
this harness, each with where it comes from, the layer it breaks, the seam it replaces and the check
that must catch it.

Adding a fault: write ``make_<name>(original) -> replacement`` next to the others (the replacement has
the seam's signature; keep its state in the closure), register its seam in ``harness.faults.seam.SEAMS``
if it is new, and append a ``Fault`` below with the cheapest check that catches it. The default suite
then runs it (``suites/faults``) and ``dcp-harness faults`` reports it.
"""

from __future__ import annotations

from harness.faults import balance_faults as bf
from harness.faults import chunked_loss_faults as clf
from harness.faults import ep_faults as ep
from harness.faults import model_faults as mf
from harness.faults import optim_faults as of
from harness.faults import pipeline_faults as pf
from harness.faults import rl_faults as rl
from harness.faults import schedule_faults as sf
from harness.faults import sp_faults as spf
from harness.faults import stack_faults as stf
from harness.faults import tp_faults as tpf
from harness.faults import train_faults as tf
from harness.faults import vocab_faults as vf
from harness.faults.checks import CHECKS
from harness.faults.fault import Fault
from harness.faults.seam import SEAMS
from harness.plan.errors import PlanInputError

LAYERS = ("plan", "reroute", "attention", "loss", "gradients", "optimizer", "groups", "pipeline", "model", "replay",
          "step-wise")
SCENARIOS = ("train", "train-small-batch", "train-pp", "train-pp-vpp", "train-mtp", "train-pp-mtp", "train-hybrid",
             "train-reinit",
             "train-ep", "train-fused", "train-dist-opt", "train-bucketed", "train-a2a", "train-bf16", "verify-bf16",
             "train-tp", "train-tp-moe", "train-tp-dist-opt", "train-sp", "train-ep-tp", "replay", "replay-sp", "plan",
             "stepwise")


class UnknownFaultError(PlanInputError):
    """A fault name that is not in the catalogue."""


MEGATRON = "https://github.com/NVIDIA/Megatron-LM/pull/"
VERL = "https://github.com/verl-project/verl/pull/"
SKYRL = "https://github.com/NovaSky-AI/SkyRL/pull/"
ROOM_CHECK = "Megatron-LM PR #2000 review, data_schedule_utils.py line 811 (a room check that always passes), "
"""The source of the packers' room faults: the review's mechanism, re-created where ``balanced`` packs."""

FAULTS: tuple[Fault, ...] = (
    Fault(name="rope-positions-per-rank", title="RoPE positions numbered per rank, not per sequence",
          source="Megatron-LM PR #3405: RoPE computed wrong position offsets with THD + dynamic CP (also #5243)",
          url=MEGATRON + "3405", layer="attention", seam="harness.train.passes:rope_positions",
          make=tf.make_rope_per_rank, check="step1-gradients", expect=r"step-1 gradient of .* differs"),
    Fault(name="labels-rolled-after-split", title="labels shifted after the CP split",
          source="verl PR #4250: labels rolled after CP selection, loss misaligned at chunk boundaries",
          url=VERL + "4250", layer="loss", seam="harness.train.passes:labels_for", make=tf.make_labels_after_split,
          check="step1-gradients", expect=r"step-1 gradient of .* differs"),
    Fault(name="loss-tokens-per-cp-rank", title="loss divided by tokens counted once per CP rank",
          source="verl PR #5869: token count for loss normalisation summed although CP ranks duplicate tokens "
                 "(also prime-rl PR #2562)",
          url=VERL + "5869", layer="loss", seam="harness.train.step:loss_denominator",
          make=tf.make_loss_tokens_per_cp_rank, check="step1-gradients", expect=r"step-1 gradient of .* differs"),
    Fault(name="loss-counts-padding", title="loss divided by the processed tokens, padding included",
          source="prime-rl PR #674: the padded tokens counted in the loss scale (also maxtext PR #366: normalise the "
                 "loss by unpadded tokens); here the zig-zag slices' and the token bucket's padding",
          url="https://github.com/PrimeIntellect-ai/prime-rl/pull/674", layer="loss",
          seam="harness.train.step:loss_denominator", make=tf.make_loss_counts_padding, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-bucketed"),
    Fault(name="padding-trained-on", title="padding labelled as loss tokens (loss mask 1, the pad id as label)",
          source="axolotl PR #2227: padding not labelled -100, the loss computed over the padding tokens too (also "
                 "TRL PR #1625: pad tokens copied into the labels unmasked); here the token bucket's and the zig-zag "
                 "slices' padding",
          url="https://github.com/axolotl-ai-cloud/axolotl/pull/2227", layer="loss",
          seam="harness.parallel.reroute:pad_value", make=tf.make_padding_trained_on, check="token-accounting",
          expect=r"not trained exactly once", scenario="train-bucketed"),
    Fault(name="adam-eps-underflow", title="AdamW's epsilon rounded to zero: 0 / 0 on rows without a gradient yet",
          source="optax issue #1754: Adam's eps underflows in float16, a zero-gradient step (an unused embedding "
                 "row) updates by 0 / 0 = NaN and silently poisons the rest of training (also apex issue #240)",
          url="https://github.com/google-deepmind/optax/issues/1754", layer="optimizer",
          seam="harness.train.step:make_optimizer", make=tf.make_adam_eps_underflow, check="grad-norm",
          expect=r"step [2-9]\d*: this run's gradient norm is nan"),
    Fault(name="grad-reduce-dp-only", title="gradients reduced over DP only, CP ranks left out",
          source="verl PR #6049 / #5993: the pure DP group used where DP x CP (with_context_parallel) belongs",
          url=VERL + "6049", layer="gradients", seam="harness.train.step:reduce_gradients",
          make=tf.make_grad_reduce_dp_only, check="replica-consistency", expect=r"parameters differ between ranks"),
    Fault(name="grad-reduce-wrong-scale", title="gradients averaged over DP x CP after a global-token loss",
          source="verl PR #4250: loss scale wrong with CP, gradient norm differs from the run without CP",
          url=VERL + "4250", layer="gradients", seam="harness.train.step:reduce_gradients",
          make=tf.make_grad_reduce_average, check="step1-gradients", expect=r"step-1 gradient of .* differs"),
    Fault(name="reroute-drops-sequence", title="a rerouted block loses its last sequence",
          source="Megatron-LM PR #6816: the rerouted batch the real dataloader produces was never tested",
          url=MEGATRON + "6816", layer="reroute", seam="harness.parallel.reroute:block_sequences",
          make=tf.make_drop_last_sequence, check="token-accounting", expect=r"not trained exactly once"),
    Fault(name="reroute-misorders-sequences", title="the ranks of a CP block pack its sequences in different orders",
          source="Megatron-LM PR #2000 spec invariant: a block's slots hold the same gids in the same order",
          url=MEGATRON + "2000", layer="reroute", seam="harness.parallel.reroute:block_sequences",
          make=tf.make_misorder_sequences, check="step1-gradients", expect=r"step-1 gradient of .* differs"),
    Fault(name="pack-without-cu-seqlens", title="attention over the pack as one sequence (cu_seqlens lost)",
          source="Megatron-LM PR #6816 bug 1: rerouted sub-samples without cu_seqlens / max_seqlen",
          url=MEGATRON + "6816", layer="attention", seam="harness.train.passes:attention_plan",
          make=tf.make_pack_without_cu_seqlens, check="step1-gradients", expect=r"step-1 gradient of .* differs"),
    Fault(name="zigzag-r-plus-cp", title="zig-zag chunks (r, r + cp) in the data, (r, 2cp - 1 - r) in attention",
          source="TransformerEngine thd_get_partitioned_indices: rank r holds chunks r and 2cp - 1 - r",
          url="https://github.com/NVIDIA/TransformerEngine/blob/main/transformer_engine/common/fused_attn/"
              "context_parallel.cu", layer="reroute", seam="harness.parallel.reroute:zigzag_index_array",
          make=tf.make_zigzag_r_plus_cp, check="step1-gradients", expect=r"step-1 gradient of .* differs"),
    Fault(name="key-grads-overwritten", title="a key's gradients from two query chunks overwritten, not summed",
          source="PyTorch issue #1528: indexing with repeated indices back-propagated only the last copy's gradient "
                 "(also pytensor PR #2242: duplicate-index increments as gather-add-scatter); here the gathered keys' "
                 "gradient rows before the reduce-scatter",
          url="https://github.com/pytorch/pytorch/issues/1528", layer="attention",
          seam="harness.runtime.row_sum:sum_rows", make=mf.make_key_grads_overwritten, check="step1-gradients",
          expect=r"step-1 gradient of .* differs"),
    Fault(name="stale-cp-group", title="the previous micro-batch's CP group kept",
          source="Megatron-LM PR #2000: attention.py did not restore the CP group after a dynamic-CP forward "
                 "(also PR #6821 / issue #5352: RoPE given the static CP group)",
          url=MEGATRON + "2000", layer="groups", seam="harness.train.step:cp_group_for", make=tf.make_stale_group,
          check="group-audit", expect=r"group audit: rank \d+, micro-batch \d+"),
    Fault(name="pr2000-negative-index-wrap", title="VPP block walk wraps to the last slot at i = -1",
          source="Megatron-LM PR #2000 review, data_schedule_utils.py line 921: `while sid0 in group[i] and i >= 0`",
          url=MEGATRON + "2000", layer="plan", seam="harness.plan.layout:blocks_from_slots",
          make=sf.make_negative_index_wrap, check="schedule-invariants", expect=r"invariant 'slot-count'"),
    Fault(name="pr2000-aliased-slots", title="slot lists built as [[]] * N and extended in place",
          source="Megatron-LM PR #2000 review, data_schedule_utils.py line 818: `[[]] * len(...)`",
          url=MEGATRON + "2000", layer="plan", seam="harness.train.layouts:sample_id_groups",
          make=sf.make_aliased_slots, check="schedule-invariants", expect=r"invariant 'block-shape'"),
    Fault(name="pr2000-inverted-empty-slot-assert", title="expansion room check always passes",
          source="Megatron-LM PR #2000 review, data_schedule_utils.py line 811: the empty-slot assertion is "
                 "inverted (vacuous)",
          url=MEGATRON + "2000", layer="plan", seam="harness.plan.megatron_pr2000:fill_free_ranks",
          make=sf.make_vacuous_room_check, check="schedule-invariants", expect=r"invariant 'slot-count'",
          scenario="plan"),
    Fault(name="levels-room-unchecked", title="the levels packer ignores a block's token room",
          source=ROOM_CHECK + "the same mechanism in balanced's rows by levels under the synchronous model (MoE with EP)",
          url=MEGATRON + "2000", layer="plan", seam="harness.plan.balanced.levels:_Pool",
          make=sf.make_levels_room_unchecked, check="schedule-invariants", expect=r"invariant 'capacity'",
          scenario="plan"),
    Fault(name="tall-room-unchecked", title="the tall micro-batch's packer ignores a block's token room",
          source=ROOM_CHECK + "the same mechanism in balanced's tall micro-batch under the synchronous model (MoE with EP)",
          url=MEGATRON + "2000", layer="plan", seam="harness.plan.balanced.tall:_tightest",
          make=sf.make_tall_room_unchecked, check="schedule-invariants", expect=r"invariant 'capacity'",
          scenario="plan"),
    Fault(name="tallest-at-cp-min", title="the synchronous lower bound prices the costliest sequence at its cp_min",
          source="Megatron-LM PR #2000: dcp_gpus_needed sizes every group at the fewest ranks that hold a sequence; "
                 "taken as the cheapest per-rank size in the tallest micro-batch's bound, it rises above schedules "
                 "that run the costliest sequence wider (quality below 1)",
          url=MEGATRON + "2000", layer="plan", seam="harness.plan.tallest:lowest_height",
          make=sf.make_tallest_at_cp_min, check="bound-soundness", expect=r"below the lower bound",
          scenario="plan"),
    Fault(name="per-sequence-cost-shared", title="balanced shares a sequence's fixed per-rank cost across its CP group",
          source="megatron-core 0.19.2 runs each hybrid-CP sequence as its own forward and backward on every rank of "
                 "its group (hybrid_cp_schedule.py:586-611); a cost model that divides that cost by the CP size "
                 "widened sequences and lost to megatron-core's own scheduler by 12-17% on 4 x H200",
          url="https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/pipeline_parallel/hybrid_cp_schedule.py",
          layer="plan", seam="harness.plan.balanced:Item",
          make=sf.make_per_sequence_cost_shared, check="prediction-agreement", expect=r"balanced predicts",
          scenario="plan"),
    Fault(name="capacity-narrows-sequences", title="a micro-batch's capacity taken for each sequence's bound",
          source="megatron-core 0.19.2's hybrid CP bounds each sub-sample by max_seqlen_per_dp_cp_rank, not a group "
                 "(its own scheduler overfills a rank); a scheduler given a larger group capacity that also sizes "
                 "each sequence's CP group by it runs a sequence on fewer ranks than its tokens need",
          url="https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/pipeline_parallel/hybrid_cp_schedule.py",
          layer="plan", seam="harness.plan.balanced:_items",
          make=sf.make_capacity_narrows_sequences, check="schedule-invariants", expect=r"invariant 'cp-min'",
          scenario="plan"),
    Fault(name="shelves-room-unchecked", title="the shelves top a block up past its token room",
          source=ROOM_CHECK + "the same mechanism in balanced's shelves (a wide block topped up with narrow sequences)",
          url=MEGATRON + "2000", layer="plan", seam="harness.plan.balanced.shelves:_pick",
          make=sf.make_shelves_room_unchecked, check="schedule-invariants", expect=r"invariant 'capacity'",
          scenario="plan"),
    Fault(name="capacity-blind-to-padding", title="the packers fit raw tokens; the runtime pads each to 2 x cp x tp",
          source="SkyRL PR #2108 (packing made alignment-aware; its review: the aligned footprint exceeds the advertised "
                 "bin capacity), re-created where balanced and dp-balanced pack under sequence parallelism",
          url=SKYRL + "2108", layer="plan", seam="harness.plan.padding:planned_tokens",
          make=sf.make_padding_unpriced, check="schedule-invariants", expect=r"invariant 'capacity'.*padded",
          scenario="plan"),
    Fault(name="fewer-sequences-than-ranks", title="CP silently off for a batch smaller than the domain",
          source="verl PR #5869: dynamic_cp_split_batch returned early when sequences < dp_size",
          url=VERL + "5869", layer="plan", seam="harness.train.layouts:deliver",
          make=tf.make_cp_inactive_for_small_batches, check="token-accounting", expect=r"\(4\.00x\)",
          scenario="train-small-batch"),
    Fault(name="pp-local-cp-size-not-propagated", title="later pipeline stages run without local_cp_size",
          source="Megatron-LM PR #2000: broadcast_to_pp_group and create_data_iterator propagate local_cp_size to "
                 "every PP / VPP stage",
          url=MEGATRON + "2000", layer="pipeline", seam="harness.train.pipeline:stage_view",
          make=tf.make_local_cp_size_not_propagated, check="schedule-agreement",
          expect=r"stage 1, micro-batch \d+: local_cp_size at position \d+ is 1", scenario="train-pp"),
    Fault(name="pp-stages-plan-differently", title="pipeline stages compute different schedules",
          source="Megatron-LM PR #4226: every PP stage builds its own schedule (broadcast_to_pp_group removed); "
                 "they must agree",
          url=MEGATRON + "4226", layer="pipeline", seam="harness.train.step:stage_cost",
          make=tf.make_stage_own_cost, check="schedule-agreement", expect=r"schedule agreement: stage 1",
          scenario="train-pp"),
    Fault(name="pr2000-vpp-wrap-interleaved", title="the block walk's wrap on VPP-aligned micro-batches",
          source="Megatron-LM PR #2000 review, line 921, under the interleaved schedule: the VPP alignment appends "
                 "domain-wide blocks, the micro-batches the wrap miscounts",
          url=MEGATRON + "2000", layer="pipeline", seam="harness.plan.layout:blocks_from_slots",
          make=sf.make_negative_index_wrap, check="schedule-invariants", expect=r"invariant 'slot-count'",
          scenario="train-pp-vpp"),
    Fault(name="vpp-group-not-passed", title="micro-batch count not a multiple of the VPP group",
          source="Megatron-LM PR #2000: under VPP the micro-batch count must be a multiple of "
                 "microbatch_group_size_per_vp_stage (align_sample_id_groups)",
          url=MEGATRON + "2000", layer="pipeline", seam="harness.train.layouts:schedule",
          make=tf.make_vpp_group_not_passed, check="pipeline-schedule",
          expect=r"multiple of microbatch_group_size_per_vp_stage=2", scenario="train-pp-vpp"),
    Fault(name="pp-clip-by-stage-norm", title="gradients clipped by each stage's own norm",
          source="Megatron-core clip_grad_norm: the norm is all-reduced over the model-parallel group (PP included) "
                 "before clipping",
          url="https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/optimizer/clip_grads.py",
          layer="pipeline", seam="harness.train.step:clip_gradients", make=tf.make_clip_by_stage_norm,
          check="clipped-gradients", expect=r"clipped step-1 gradient of .* differs", scenario="train-pp"),
    Fault(name="mtp-shift-after-split", title="multi-token prediction shifted after the CP split",
          source="Megatron-LM PR #2000 (MTP under dynamic CP) and verl PR #4250 (labels rolled after CP selection)",
          url=MEGATRON + "2000", layer="model", seam="harness.train.passes:mtp_columns",
          make=tf.make_mtp_shift_after_split, check="step1-gradients", expect=r"step-1 gradient of .* differs",
          scenario="train-mtp"),
    Fault(name="mtp-embedding-grad-dropped", title="the MTP stage's embedding gradient never reaches the table's owner",
          source="Megatron-Bridge PR #5380: the embedding group was the generic first + last stage, which left a "
                 "standalone MTP stage out (untied output), so its embedding lookups' gradient was never combined "
                 "with the first stage's and the live MTP embedding diverged",
          url="https://github.com/NVIDIA-NeMo/Megatron-Bridge/pull/5380", layer="pipeline",
          seam="harness.train.shared_embedding:gather_grad", make=tf.make_embedding_grad_dropped,
          check="step1-gradients", expect=r"step-1 gradient of embed\.weight on rank \d differs",
          scenario="train-pp-mtp"),
    Fault(name="mtp-embedding-grad-after-reduce", title="the MTP stage's embedding gradient combined after the "
                                                        "data-parallel reduction",
          source="Megatron-LM issue #844: with the distributed optimiser the shared embedding's gradients were "
                 "reduce-scattered over DP before the all-reduce between the first and last stage, which then added "
                 "partial results: the ranks' embeddings took different gradients",
          url="https://github.com/NVIDIA/Megatron-LM/issues/844", layer="pipeline",
          seam="harness.train.shared_embedding:before_reduction", make=tf.make_embedding_grad_after_reduce,
          check="step1-gradients", expect=r"step-1 gradient of embed\.weight on rank \d differs",
          scenario="train-pp-mtp"),
    Fault(name="mtp-embedding-replica-stale", title="the MTP stage's embedding replica never takes the update",
          source="Megatron-Bridge PR #5380: the MTP stage's copy of the embedding drifted from the first stage's "
                 "during training (a resumed run, which loads it as a replica of the first stage's, jumped in MTP "
                 "loss); Megatron-LM PR #5034: the MTP stage's duplicate of word_embeddings missed the tag the "
                 "first stage's copy has",
          url="https://github.com/NVIDIA-NeMo/Megatron-Bridge/pull/5380", layer="pipeline",
          seam="harness.train.shared_embedding:refresh", make=tf.make_embedding_replica_stale,
          check="shared-replica", expect=r"after step 1 the embedding on ranks \[2, 3\] differs from the first stage's",
          scenario="train-pp-mtp"),
    Fault(name="ssm-state-across-sequences", title="SSM scan state carried across a sequence boundary",
          source="Mamba kernels on packed sequences need seq_idx / cu_seqlens (Megatron-LM PR #2000: MambaMixer "
                 "under dynamic CP)",
          url=MEGATRON + "2000", layer="model", seam="harness.runtime.ssm:scan_layout",
          make=tf.make_scan_across_sequences, check="step1-gradients", expect=r"step-1 gradient of .* differs",
          scenario="train-hybrid"),
    Fault(name="module-keeps-cp-group", title="a CP-aware module keeps the previous micro-batch's group",
          source="Megatron-LM PR #2000: MambaMixer and MTP switch the CP group per micro-batch and must restore it",
          url=MEGATRON + "2000", layer="groups", seam="harness.runtime.layers:cp_ops", make=tf.make_module_keeps_group,
          check="group-audit", expect=r"a CP call ran with micro-batch 0's operations", scenario="train-hybrid"),
    Fault(name="destroyed-group-reused", title="a destroyed dynamic group used after re-initialisation",
          source="Megatron-LM PR #2000: _DYNAMIC_DP_CP_GROUPS not cleaned up in destroy_model_parallel",
          url=MEGATRON + "2000", layer="groups", seam="harness.train.step:new_groups",
          make=tf.make_destroyed_group_reused, check="group-audit", expect=r"is a destroyed group",
          scenario="train-reinit"),
    Fault(name="ep-dispatch-wrong-cp-slice", title="tokens dispatched to experts by the other CP chunk's routes",
          source="Megatron-LM PR #2000 (dynamic CP with MoE): each rank's tokens are its zig-zag CP slice, so the "
                 "token dispatcher must permute them by their own rows of the routing map",
          url=MEGATRON + "2000", layer="model", seam="harness.parallel.expert_parallel:dispatch_routes",
          make=ep.make_dispatch_other_chunk, check="step1-gradients", expect=r"step-1 gradient of .* differs",
          scenario="train-ep"),
    Fault(name="ep-expert-norm-local", title="each rank clips by its own experts' norm",
          source="ColossalAI issue #2192 (expert gradient norms not summed for clipping), DeepSpeed issue #8475 "
                 "(norms of ranks with different experts averaged), NeMo Automodel issue #3816 (a different global "
                 "norm on every EP group)",
          url="https://github.com/hpcaitech/ColossalAI/issues/2192", layer="gradients",
          seam="harness.train.step:expert_square_norm", make=ep.make_expert_norm_local,
          check="replica-consistency", expect=r"parameters differ between ranks", scenario="train-ep"),
    Fault(name="ep-tp-expert-norm-undercounted", title="with EP and TP the experts' norm misses the other TP shards",
          source="Megatron-LM PR #5916: with EP > 1 and TP > 1 the gradient norm omitted some experts' gradients, so "
                 "clipping applied less than expected",
          url="https://github.com/NVIDIA/Megatron-LM/pull/5916", layer="gradients",
          seam="harness.train.step:expert_square_norm", make=ep.make_expert_norm_not_summed_over_tp,
          check="replica-consistency", expect=r"parameters differ between ranks", scenario="train-ep-tp"),
    Fault(name="ep-expert-counts-off-by-one", title="per-expert token counts off by one expert between ranks",
          source="Megatron-core MoEAlltoAllTokenDispatcher: output splits come from the counts the other ranks "
                 "send (num_global_tokens_per_local_expert); they must match what each rank sends",
          url="https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/transformer/moe/token_dispatcher.py",
          layer="model", seam="harness.parallel.expert_parallel:announced_counts", make=ep.make_counts_off_by_one,
          check="expert-dispatch", expect=r"expert dispatch audit: MoE layer \d+: rank \d+ announces",
          scenario="train-ep"),
    # -- shared by every layout under PP / VPP / EP / MTP / the SSM mixer: the layouts agree with each other, only
    #    the clean bshd run here and converge's reference (one rank, no CP, PP, TP or EP) tell
    Fault(name="pp-stage-layers-without-offset", title="every pipeline stage runs layers 0 .. n - 1 (no layer offset)",
          source="transformers PR #24381: converting to Megatron under PP, the layer offset was not applied and both "
                 "stages held layers.0 + layers.1",
          url="https://github.com/huggingface/transformers/pull/24381", layer="pipeline",
          seam="harness.train.pipeline:split", make=pf.make_stage_layers_without_offset, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-pp"),
    Fault(name="pp-grads-reduced-twice", title="a stage's gradients all-reduced twice over its DP x CP ranks",
          source="PaddlePaddle PR #30437: the pipeline's gradients were all-reduce-summed multiple times",
          url="https://github.com/PaddlePaddle/Paddle/pull/30437", layer="gradients",
          seam="harness.train.step:reduce_gradients", make=pf.make_grads_reduced_twice, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-pp"),
    Fault(name="pp-grad-norm-own-stage", title="the reported gradient norm is each stage's own",
          source="torchtitan issue #596 / PR #649: under PP the gradient norm was computed per stage and never "
                 "reduced across the stages (incomplete norm)",
          url="https://github.com/pytorch/torchtitan/issues/596", layer="pipeline",
          seam="harness.train.step:_global_norm", make=pf.make_grad_norm_of_own_stage, check="grad-norm",
          expect=r"step \d+: [-+.\de]+ vs bshd", scenario="train-pp"),
    Fault(name="vpp-chunks-stage-major", title="virtual chunk v of stage s holds model chunk s * vpp + v's layers",
          source="Megatron-LM issue #1584 / PR #1583: get_transformer_layer_offset under VPP gave every rank but "
                 "the first a wrong layer offset",
          url="https://github.com/NVIDIA/Megatron-LM/issues/1584", layer="pipeline",
          seam="harness.train.pipeline:split", make=pf.make_vpp_chunks_stage_major, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-pp-vpp"),
    Fault(name="vpp-every-chunk-embeds", title="every virtual chunk of the first stage embeds the tokens",
          source="AMD Primus PR #277: the virtual stages of the first / last pipeline ranks were all treated as the "
                 "first / last stage in get_batch (is_pipeline_first_stage without vp_stage; also Megatron-Bridge "
                 "PR #123)",
          url="https://github.com/AMD-AGI/Primus/pull/277", layer="pipeline",
          seam="harness.train.pipeline:pre_process", make=pf.make_every_virtual_chunk_embeds, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-pp-vpp"),
    Fault(name="ep-expert-grads-all-reduced", title="expert gradients summed over the EP domain like replicated ones",
          source="Megatron-LM PR #5916: expert parameters reduced over a group in which they are not replicated "
                 "(unrelated experts' gradients mix)",
          url=MEGATRON + "5916", layer="gradients", seam="harness.train.step:reduce_gradients",
          make=ep.make_expert_grads_all_reduced, check="step1-gradients", expect=r"step-1 gradient of .* differs",
          scenario="train-ep"),
    Fault(name="ep-expert-grads-times-ep", title="expert gradients ep_size times too large",
          source="DeepSpeed PR #5259: with EP = 2 the MoE parameters' gradients were exactly 2x one GPU's (also "
                 "Megatron-LM PR #5956: expert gradients ep_size times too large)",
          url="https://github.com/deepspeedai/DeepSpeed/pull/5259", layer="gradients",
          seam="harness.train.step:reduce_gradients", make=ep.make_expert_grads_times_ep, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-ep"),
    Fault(name="mtp-loss-scale-per-cp", title="multi-token prediction loss weighted 1 / cp_size",
          source="Megatron-LM PR #3959 / issue #3943: MTPLossAutoScaler's scale divided by num_microbatches, which "
                 "carries the CP size (the MoE aux loss compensated it, MTP did not)",
          url=MEGATRON + "3959", layer="loss", seam="harness.train.passes:mtp_loss_scales",
          make=mf.make_mtp_loss_scale_per_cp, check="step1-gradients", expect=r"step-1 gradient of .* differs",
          scenario="train-mtp"),
    Fault(name="mtp-loss-local-counts", title="each rank normalises its MTP loss by its own target count",
          source="Megatron-LM issue #7452 (process_mtp_loss finding) / PR #7498: the MTP per-token loss normalised "
                 "with local token counts across CP / DP ranks",
          url="https://github.com/NVIDIA/Megatron-LM/issues/7452", layer="loss",
          seam="harness.train.passes:mtp_loss_scales", make=mf.make_mtp_loss_local_counts, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-mtp"),
    Fault(name="a2a-kv-heads-tiled", title="the all-to-all CP exchange's K/V head copies tiled, not interleaved (GQA)",
          source="DeepSpeed issue #8291 / PR #8316: the Ulysses split read the head count of another tensor and tore "
                 "the GQA groups apart (Q 6 / KV 3 over 2 ranks); prime-rl PR #3042: K/V heads copied with "
                 "repeat_interleave so that each copy lands on its query heads' rank",
          url="https://github.com/deepspeedai/DeepSpeed/issues/8291", layer="attention",
          seam="harness.parallel.ulysses:replicate_kv", make=mf.make_a2a_kv_heads_tiled, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-a2a"),
    Fault(name="ssm-exchange-contiguous-slices", title="the SSM's CP exchange reorders as if slices were contiguous",
          source="THUDM slime issue #1871: a CP reshuffle assumed another slice layout (zig-zag) than the data's "
                 "(contiguous) and silently scrambled the token order",
          url="https://github.com/THUDM/slime/issues/1871", layer="model", seam="harness.parallel.ssm_cp:pack_order",
          make=mf.make_ssm_exchange_contiguous, check="step1-gradients", expect=r"step-1 gradient of .* differs",
          scenario="train-hybrid"),
    Fault(name="te-padding-chunk-grads", title="a CP rank's padding-only chunk hands gradients to the real keys",
          source="TransformerEngine 2.20.2, found by dcp-harness verify megatron-core: THD p2p CP with "
                 "cu_seqlens_padded returns wrong, even non-finite, dK / dV at CP 4 when a rank's chunk of a sequence "
                 "is padding only (docs/upstream-findings.md; related: TransformerEngine issue #3331)",
          url="https://github.com/NVIDIA/TransformerEngine/issues/3331", layer="attention",
          seam="harness.train.passes:attention_call", make=mf.make_padding_chunk_grads, check="step1-gradients",
          expect=r"step-1 gradient of .* differs"),
    Fault(name="ssm-reset-at-cp-shards", title="the SSM conv and scan restart at every CP shard boundary",
          source="PrimeIntellect prime-rl PR #3003: under CP the causal conv derived seq_idx from shard-local "
                 "cu_seqlens, resetting mid-document at every CP shard boundary",
          url="https://github.com/PrimeIntellect-ai/prime-rl/pull/3003", layer="model",
          seam="harness.train.passes:ssm_sequences", make=mf.make_ssm_reset_at_cp_shards, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-hybrid"),
    Fault(name="weight-copy-never-refreshed", title="the step's low-precision weight copies are never refreshed",
          source="AMD-AGI Primus PR #983: the MegaMoE experts' fp8 weight caches were never dropped at the step "
                 "boundary (no version counter or address moved), so they contracted the weights training started "
                 "with for the whole run (TransformerEngine's is_first_microbatch caching has the same contract)",
          url="https://github.com/AMD-AGI/Primus/pull/983", layer="model",
          seam="harness.runtime.weight_cache:refresh", make=tf.make_weight_copy_never_refreshed, check="grad-norm",
          expect=r"step 2: [-+.\de]+ vs bshd"),
    Fault(name="wgrad-first-microbatch-only", title="only each step's first micro-batch adds its weight gradient",
          source="AMD-AGI Primus PR #1046: the weight-gradient add into main_grad was gated on a per-iteration "
                 "grad_added_to_main_grad flag, so with gradient accumulation only micro-batch 0's gradient arrived",
          url="https://github.com/AMD-AGI/Primus/pull/1046", layer="gradients",
          seam="harness.runtime.weight_cache:accumulate", make=tf.make_wgrad_first_microbatch_only,
          check="step1-gradients", expect=r"step-1 gradient of .* differs"),
    Fault(name="wgrad-gemm-overwrites", title="the fused weight-gradient GEMM overwrites the gradient instead of adding",
          source="TransformerEngine PR #2936: GroupedLinear's main_grad GEMM took the wrong one of accumulate and "
                 "overwrite (overwrite_main_grad ignored); re-created the other way round: beta = 0, each "
                 "micro-batch's product replaces the earlier ones",
          url="https://github.com/NVIDIA/TransformerEngine/pull/2936", layer="gradients",
          seam="harness.runtime.fused_linear:gemm_accumulate", make=tf.make_wgrad_gemm_overwrites,
          check="step1-gradients", expect=r"step-1 gradient of .* differs", scenario="train-fused"),
    Fault(name="fp32-step-in-bf16", title="the fp32 step 1 of a bf16 run keeps bf16",
          source="pytorch/pytorch #53635: on Ampere cards torch.matmul of fp32 matrices rounded like fp16 (TF32 on by "
                 "default), so an 'fp32' result was computed at lower precision; re-created in the harness's fp32 step "
                 "of bf16 runs (TrainConfig.fp32_probe): it keeps the run's dtype, and a step-1 bug hides in bf16's bands",
          url="https://github.com/pytorch/pytorch/issues/53635", layer="model",
          seam="harness.train.trainer:probe_config", make=tf.make_fp32_step_in_bf16,
          check="fp32-step1-gradients", expect=r"fp32 step-1 gradient of .* differs from bshd@fp32",
          scenario="train-bf16"),
    Fault(name="fp32-step-of-another-model", title="the fp32 step 1 starts from another seed's model and batch",
          source="ooples/AiDotNet PR #2038: the same seed initialised different weights on machines with other core "
                 "counts, so runs meant to start alike did not; re-created in the fp32 step of bf16 runs: every run's "
                 "fp32 step (the layouts' and the reference's alike) starts from seed + 1",
          url="https://github.com/ooples/AiDotNet/pull/2038", layer="model",
          seam="harness.train.trainer:probe_config", make=tf.make_fp32_step_of_another_model,
          check="fp32-step-consistency", expect=r"bf16 step-1 gradient of .* differs from dcp@fp32",
          scenario="train-bf16"),
    Fault(name="sharpen-a-copy", title="verify's sharp step scales a copy of the model: it trains the plain one",
          source="huggingface/transformers PR #43847: under DeepSpeed ZeRO-3 the custom weight initialisation ran on "
                 "partitioned placeholders, a silent no-op, so models trained from another initialisation than meant; "
                 "re-created in verify's sharp step 1: the harness stack's sharpen scales a copy, so the sharp lines "
                 "compare plain step 1s and pass a position bug that bf16's bands pass",
          url="https://github.com/huggingface/transformers/pull/43847", layer="model",
          seam="harness.stack.runtime:sharpen_queries_and_keys", make=stf.make_sharpen_a_copy,
          check="sharp-took-effect", expect=r"queries and keys x16 move its step-1 gradients by >= 0\.01",
          scenario="verify-bf16"),
    Fault(name="dist-opt-norm-of-local-shard", title="the distributed optimiser clips by its own shard's norm",
          source="Megatron-LM issue #580: with --use-distributed-optimizer the optimizer's param_groups are sharded "
                 "over data parallelism, so clip_grad_norm's gradients are no longer global",
          url="https://github.com/NVIDIA/Megatron-LM/issues/580", layer="optimizer",
          seam="harness.parallel.dist_opt:grad_square_norm", make=of.make_norm_of_local_shard,
          check="clipped-gradients", expect=r"clipped step-1 gradient of .* differs", scenario="train-dist-opt"),
    Fault(name="dist-opt-norm-max-of-shards", title="the shards' gradient norms combined by their maximum",
          source="fairscale PR #167 review: OSS clip_grad_norm took the max of the ranks' shard norms; the squares "
                 "must be summed over the shards",
          url="https://github.com/facebookresearch/fairscale/pull/167", layer="optimizer",
          seam="harness.parallel.dist_opt:grad_square_norm", make=of.make_norm_max_of_shards,
          check="clipped-gradients", expect=r"clipped step-1 gradient of .* differs", scenario="train-dist-opt"),
    Fault(name="dist-opt-bucket-not-gathered", title="one bucket of updated parameters is never gathered",
          source="Megatron-LM issue #950: with --overlap-param-gather a bucket's all-gather was not waited for before "
                 "the forward used it, which computed with the previous step's weights",
          url="https://github.com/NVIDIA/Megatron-LM/issues/950", layer="optimizer",
          seam="harness.parallel.dist_opt:gather_params", make=of.make_first_bucket_not_gathered,
          check="replica-consistency", expect=r"parameters differ between ranks", scenario="train-dist-opt"),
    *bf.BALANCE_FAULTS,
    *tpf.TP_FAULTS,
    *vf.VOCAB_FAULTS,
    *clf.CHUNKED_LOSS_FAULTS,
    *spf.SP_FAULTS,
    *spf.SP_MOE_FAULTS,
    Fault(name="replay-pp-offset-off-by-one", title="a PP stage replays the previous layer's routes",
          source="SkyRL PR #1335: _get_current_pp_stage_layer_range decides each stage's replay rows",
          url=SKYRL + "1335", layer="replay", seam="harness.train.replay:route_columns",
          make=rl.make_stage_offset_off_by_one, check="replay-routes", expect=r"tokens replayed other experts",
          scenario="replay"),
    Fault(name="replay-vpp-contiguous-offset", title="under VPP a stage replays the routes of contiguous layers",
          source="SkyRL: replay targets go to a stage's routers in construction order from a layer offset computed "
                 "without vp_stage (interleaved chunks hold non-contiguous layers; upstream refuses VPP, PR #2079)",
          url=SKYRL + "2079", layer="replay", seam="harness.train.replay:route_columns",
          make=rl.make_vpp_contiguous_offset, check="replay-routes", expect=r"tokens replayed other experts",
          scenario="replay"),
    Fault(name="replay-cp-halves-swapped", title="replayed CP rows taken as [back, front]",
          source="SkyRL PR #1335: CP route slicing must take TE's front and back halves (PR #1273 did not)",
          url=SKYRL + "1335", layer="replay", seam="harness.train.replay:thd_routes",
          make=rl.make_swapped_cp_halves, check="replay-routes", expect=r"tokens replayed other experts",
          scenario="replay"),
    Fault(name="replay-sp-rows-strided", title="a TP rank replays every tp-th row instead of its block of rows",
          source="miles PR #3146: routing replay rows flattened in another order than the router's tokens (matching "
                 "shapes did not detect it); under sequence parallelism a TP rank routes one consecutive block",
          url="https://github.com/radixark/miles/pull/3146", layer="replay", seam="harness.train.replay:sp_rows",
          make=rl.make_sp_rows_strided, check="replay-routes", expect=r"tokens replayed other experts",
          scenario="replay-sp"),
    Fault(name="stepwise-cumsum-interleaved", title="cumsum advantage broadcast on interleaved trajectories",
          source="SkyRL PR #1281: step-wise validation; the cumsum broadcast assumes contiguous trajectories",
          url=SKYRL + "1281", layer="step-wise", seam="harness.plan.generator_output:check_step_wise_fields",
          make=rl.make_no_contiguity_rule, check="stepwise-advantages", expect=r"another trajectory's advantage",
          scenario="stepwise"),
)
"""The catalogue, in report order."""

BY_NAME = {f.name: f for f in FAULTS}


def planted(name: str):
    """The context in which fault ``name`` is active (``converge --plant``: the job runs every layout, and its
    references, with the bug in place)."""
    return get(name).applied()


def get(name: str) -> Fault:
    if name not in BY_NAME:
        raise UnknownFaultError(f"unknown fault {name!r}; the catalogue has: {', '.join(BY_NAME)}")
    return BY_NAME[name]


def select(names=None) -> list[Fault]:
    """The faults named (all when ``names`` is empty or None), in catalogue order; unknown names are one
    ``UnknownFaultError`` listing them and the catalogue."""
    if not names:
        return list(FAULTS)
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        raise UnknownFaultError(f"unknown fault(s) {', '.join(map(repr, unknown))}; the catalogue has: "
                                f"{', '.join(BY_NAME)}")
    wanted = set(names)
    return [f for f in FAULTS if f.name in wanted]


def _self_check() -> None:
    for f in FAULTS:
        assert f.layer in LAYERS and f.check in CHECKS and f.seam in SEAMS and f.scenario in SCENARIOS, f.name


_self_check()
