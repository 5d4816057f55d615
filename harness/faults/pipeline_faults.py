"""Re-creations of pipeline-parallel bugs (``harness.train.pipeline`` and the pipeline's gradient handling in
``harness.train.trainer``): code every layout runs under PP or VPP, and no run on one stage.

Each ``make_*`` takes the seam's original function and returns the faulty one. Under a fault the layouts
(bshd, thd, dcp) still agree with each other - they share the pipeline - so only a reference without a
pipeline (``harness.apps.reference``) or the clean bshd run of a fault scenario tells.
"""

from __future__ import annotations


# ---------------------------------------------------------------------------------------- PP
def make_stage_layers_without_offset(original):
    """Every stage numbers its layers from 0: the stage's layer offset is never added, so stage s runs (and
    trains) layers ``0 .. n - 1`` again instead of its own (transformers PR #24381: converting to Megatron under
    PP gave both stages ``layers.0 + layers.1``). One stage: the offset is 0, nothing changes."""
    def split(num_layers, pp, vpp=1):
        out = []
        for chunks in original(num_layers, pp, vpp):
            start, local = 0, []
            for _, n in chunks:
                local.append((start, n))
                start += n
            out.append(local)
        return out
    return split


def make_grads_reduced_twice(original):
    """The stage's gradients all-reduced (summed) twice over its DP x CP ranks (PaddlePaddle PR #30437: the
    pipeline's gradients were all-reduce-summed multiple times): every gradient is N times too large on N
    ranks, exact on one."""
    def reduce_gradients(model, groups, lcfg):
        original(model, groups, lcfg)
        return original(model, groups, lcfg)
    return reduce_gradients


def make_grad_norm_of_own_stage(original):
    """The reported gradient norm is the stage's own: the stages' squared norms are never summed over the
    pipeline (torchtitan issue #596 / PR #649: with PP, each stage's norm is incomplete). Training is unchanged
    (clipping computes its own norm), the logged norm is not the model's."""
    def _global_norm(grad_norm, pipeline_group, device):
        return grad_norm
    return _global_norm


# --------------------------------------------------------------------------------------- VPP
def make_vpp_chunks_stage_major(original):
    """Virtual chunk v of stage s holds the layers of model chunk ``s * vpp + v`` (a stage-major offset, as
    without VPP) instead of ``v * pp + s``: the chunks run in the interleaved order, so the model applies its
    layers out of order (Megatron-LM issue #1584 / PR #1583: ``get_transformer_layer_offset`` under VPP gave
    every rank but the first a wrong offset). Without VPP, nothing changes."""
    def split(num_layers, pp, vpp=1):
        ranges = original(num_layers, pp, vpp)
        if vpp == 1:
            return ranges
        model_chunks = [ranges[c % pp][c // pp] for c in range(pp * vpp)]  # model chunk c = v * pp + s
        return [[model_chunks[s * vpp + v] for v in range(vpp)] for s in range(pp)]
    return split


def make_every_virtual_chunk_embeds(original):
    """Every virtual chunk of the first stage embeds the micro-batch's tokens, as if it were the model's first
    chunk (``is_pipeline_first_stage(ignore_virtual=True)``: the stage, not the chunk, decides; AMD Primus PR
    #277: the first / last pipeline ranks' virtual stages were all treated as first / last in ``get_batch``):
    the activation a later chunk receives is dropped, and the layers before it get no gradient."""
    def pre_process(stage, v):
        return stage.first
    return pre_process
