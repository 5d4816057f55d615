"""Re-creations of SkyRL router-replay and step-wise bugs (PR #1273 -> #1335, #1281)."""

from __future__ import annotations

import numpy as np

from harness.plan.generator_output import GeneratorOutputError, as_flag


def make_stage_offset_off_by_one(original):
    """Routes of a later PP stage read one layer too early: the stage's layer offset is off by one
    (SkyRL ``_get_current_pp_stage_layer_range``; the offset and the count of dense layers on a stage
    decide which rows each router replays)."""
    def route_columns(stage_ranges, routers):
        starts = [next(a for a, n in stage_ranges if a <= layer < a + n) for layer in routers]
        return [col - 1 if a > 0 else col for col, a in zip(original(stage_ranges, routers), starts, strict=True)]
    return route_columns


def make_vpp_contiguous_offset(original):
    """Under the interleaved pipeline a stage's routers replay the routes of the layers a stage *without* virtual
    chunks would build: the i-th router the stage builds (construction order, chunk after chunk) takes the column of
    layer ``offset + i``, ``offset`` the stage's first layer times its chunk count (SkyRL: replay targets assigned to
    ``RouterReplay`` instances in construction order from ``get_transformer_layer_offset(pp_rank)``, which knows no
    ``vp_stage``; spec A.4). Without VPP it is the right column, which is why only a VPP run can catch it."""
    def route_columns(stage_ranges, routers):
        offset = stage_ranges[0][0] * len(stage_ranges)
        built = [layer for a, n in stage_ranges for layer in range(a, a + n)]
        return [offset + built.index(layer) for layer in routers]
    return route_columns


def make_sp_rows_strided(original):
    """Under sequence parallelism a TP rank's replay rows taken as every tp-th row of its CP rank's rows instead of
    its consecutive ``T / tp`` block (the block the stack scatters to it): the same shape, so no check of shapes
    notices, and most tokens replay another token's experts (miles PR #3146: replay rows flattened in another token
    order than the router's, "matching tensor shapes do not detect this"; SkyRL's batch-major flatten, spec A.8)."""
    def sp_rows(rows, tp, tp_rank):
        if not 0 <= tp_rank < tp:
            return original(rows, tp, tp_rank)
        return rows[tp_rank::tp]
    return sp_rows


def make_swapped_cp_halves(original):
    """Replayed rows of a CP rank taken as [back, front] per sequence instead of TE's [front, back]
    (chunk 2cp - 1 - r before chunk r): SkyRL's CP slicing before PR #1335 got the halves of the
    load-balanced split wrong, so every token replays another token's experts."""
    def thd_routes(samples, cu_seqlens_padded, cp_size=1, cp_rank=0):
        rows = original(samples, cu_seqlens_padded, cp_size, cp_rank)
        if cp_size == 1:
            return rows
        parts, offset = [], 0
        for a, b in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:]):
            half = (b - a) // (2 * cp_size)
            front, back = rows[offset:offset + half], rows[offset + half:offset + 2 * half]
            parts += [back, front]
            offset += 2 * half
        return np.concatenate(parts) if parts else rows
    return thd_routes


def make_no_contiguity_rule(original):
    """Step-wise validation without the rules that trajectories are contiguous and closed by
    ``is_last_step`` (SkyRL before PR #1281): the cumsum advantage broadcast then hands steps of an
    interleaved batch (A0, B0, A1*, B1*) another trajectory's advantage, silently."""
    def check_step_wise_fields(out, n):
        for field in ("is_last_step", "trajectory_ids"):
            if out.get(field) is None:
                raise GeneratorOutputError(f"step_wise=True but `{field}` is missing from the generator output")
        last = [as_flag(x, f"is_last_step[{i}]") for i, x in enumerate(out["is_last_step"])]
        if not last[-1]:
            raise GeneratorOutputError("is_last_step[-1] must be True")
    return check_step_wise_fields
