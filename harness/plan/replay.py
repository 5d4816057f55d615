"""Router replay (R3) index math and configuration checks (numpy, no torch).

Routes are integer arrays ``[tokens, layers, top_k]`` of expert ids per token and layer (vLLM's
``routed_experts``: every transformer layer, zero rows for dense layers; the last sampled token has
no route, so the captured prefix may be shorter than the sequence).

Positions without a captured route (left padding, the uncaptured suffix, THD padding) get
``padding_rows``: the K *distinct* experts 0 .. K-1 in every layer, as SkyRL does since its router
padding fix. A row of zeros would make a replayed top-k pick expert 0 K times (a dropless dispatcher
then sends fewer than tokens x K assignments); the padding itself stays out of the loss (loss mask 0).

* ``align_routes``: per-sample routes -> ``[B, max_total, L, K]`` aligned with left-padded sequences
  (routes start at the first real token; missing trailing rows and padding get ``padding_rows``); extra
  rows are an error (upstream truncated them silently); the dtype shrinks to uint8 / int16 when the
  ids fit.
* ``thd_routes``: the rows one CP rank's router sees for a THD micro-batch: each sample's real rows,
  padded to its padded length with ``padding_rows``, then TransformerEngine's zig-zag slice (the same index rule as the
  tokens, ``harness.plan.thd``). ``packed_routes`` applies Megatron's packing rule (pad each sample to
  ``tp * cp * 2``, or ``tp`` without CP), the CP slice, then the sequence-parallel TP split (``sp_rows``: a TP
  rank's ``T / tp`` consecutive rows, what its router routes under sequence parallelism).
* ``unpacked_routes``: the non-packed path, flattened *sequence-major* (``s * b + i``) as Megatron's
  router sees ``[s, b, h]`` tokens (upstream flattened batch-major: wrong for micro-batches > 1).

Worked example (spec A.6: lengths [5, 9, 3], tp 1, cp 2, align 4, padded [8, 12, 4]):

>>> import numpy as np
>>> mask = np.array([[1] * 5 + [0] * 4, [1] * 9, [1] * 3 + [0] * 6])
>>> ids = np.zeros((3, 9, 1, 1), int); ids[0, :5, 0, 0] = range(10, 15); ids[1, :, 0, 0] = range(20, 29)
>>> ids[2, :3, 0, 0] = range(30, 33)
>>> packed_routes(ids, mask, cp=2, cp_rank=0)[:, 0, 0].tolist()
[10, 11, 0, 0, 20, 21, 22, 0, 0, 0, 30, 0]
>>> packed_routes(ids, mask, cp=2, cp_rank=1)[:, 0, 0].tolist()
[12, 13, 14, 0, 23, 24, 25, 26, 27, 28, 31, 32]
"""

from __future__ import annotations

import numpy as np

from harness.plan.errors import PlanInputError
from harness.plan.thd import pack, zigzag_index_array


class ReplayConfigError(PlanInputError):
    """Router-replay options that cannot work together."""


def narrow_dtype(x: np.ndarray) -> np.ndarray:
    """uint8 when every id < 2**8, int16 when < 2**15, else int32 (upstream #1378)."""
    top = int(x.max(initial=0))
    return x.astype(np.uint8 if top < 2**8 else np.int16 if top < 2**15 else np.int32)


def padding_rows(shape: tuple[int, ...], dtype=np.int64) -> np.ndarray:
    """An array of ``shape`` (``[..., K]``) whose every last-axis row is ``0 .. K-1``: distinct experts
    for positions that have no captured route.

    >>> padding_rows((2, 1, 3)).tolist()
    [[[0, 1, 2]], [[0, 1, 2]]]
    """
    return np.broadcast_to(np.arange(shape[-1], dtype=dtype), shape).copy()


def align_routes(routes, prompt_lens: list[int], response_lens: list[int]) -> np.ndarray | None:
    """Per-sample routes (lists or arrays ``[T_i, L, K]``, None/empty allowed) -> ``[B, max_total, L, K]``."""
    if not routes:
        return None
    if not len(routes) == len(prompt_lens) == len(response_lens):
        raise PlanInputError(f"{len(routes)} route samples for {len(prompt_lens)} prompts and "
                             f"{len(response_lens)} responses")
    arrays = [None if r is None or len(r) == 0 else np.asarray(r) for r in routes]
    shapes = {a.shape[1:] for a in arrays if a is not None}
    if not shapes:
        return None
    if len(shapes) > 1 or any(a.ndim != 3 for a in arrays if a is not None):
        raise PlanInputError(f"route samples disagree on [layers, top_k]: {sorted(shapes)}")
    (L, K), = shapes
    total = [p + r for p, r in zip(prompt_lens, response_lens)]
    width = max(total)
    out = padding_rows((len(routes), width, L, K))
    for i, a in enumerate(arrays):
        if a is None:
            continue
        if len(a) > total[i]:
            raise PlanInputError(f"sample {i} has {len(a)} route rows for {total[i]} tokens (prompt {prompt_lens[i]} + "
                                 f"response {response_lens[i]}); routes must not outnumber tokens")
        left = width - total[i]
        out[i, left:left + len(a)] = a
    return narrow_dtype(out)


def thd_routes(samples: list[np.ndarray], cu_seqlens_padded, cp_size: int = 1, cp_rank: int = 0) -> np.ndarray:
    """Rows of a THD micro-batch for one CP rank: sample i's real rows (``[n_i, L, K]``) padded with
    ``padding_rows`` to its padded length ``cu[i+1] - cu[i]``, packed, then zig-zag sliced."""
    cu = list(cu_seqlens_padded)
    if len(samples) != len(cu) - 1:
        raise PlanInputError(f"{len(samples)} samples for {len(cu) - 1} packed sequences")
    L, K = samples[0].shape[1:] if samples else (0, 0)
    full = padding_rows((cu[-1], L, K), dtype=samples[0].dtype if samples else np.int64)
    for i, s in enumerate(samples):
        if len(s) > cu[i + 1] - cu[i]:
            raise PlanInputError(f"sample {i} has {len(s)} rows, its padded length is {cu[i + 1] - cu[i]}")
        full[cu[i]:cu[i] + len(s)] = s
    return full[zigzag_index_array(cu, cp_size, cp_rank)]


def packed_routes(routes: np.ndarray, attention_mask: np.ndarray, *, tp: int = 1, cp: int = 1, cp_rank: int = 0,
                  tp_rank: int = 0) -> np.ndarray:
    """``[B, S, L, K]`` + mask -> the ``[T_local, L, K]`` rows of one (cp_rank, tp_rank) router, packed
    like Megatron's ``preprocess_packed_seqs`` with sequence parallelism."""
    if not (0 <= cp_rank < cp and 0 <= tp_rank < tp):
        raise PlanInputError(f"cp_rank={cp_rank} / tp_rank={tp_rank} outside cp={cp} / tp={tp}")
    align = tp * cp * 2 if cp > 1 else tp
    mask = np.asarray(attention_mask).astype(bool)
    samples = [np.asarray(routes)[i][mask[i]] for i in range(mask.shape[0])]
    p = pack([len(s) for s in samples], align)
    return sp_rows(thd_routes(samples, p.cu_seqlens_padded, cp, cp_rank), tp, tp_rank)


def sp_rows(rows: np.ndarray, tp: int, tp_rank: int):
    """TP rank ``tp_rank``'s rows of a CP rank's packed rows under sequence parallelism: the ``T / tp`` consecutive
    rows its router routes (``harness.runtime.layers.MoE``: the rows the block stack scatters to it). Only with
    sequence parallelism: without it every TP rank routes every row (SkyRL splits unconditionally - a wrong split when
    sequence parallelism is off). A seam (``harness.faults``)."""
    if not 0 <= tp_rank < tp:
        raise PlanInputError(f"tp_rank={tp_rank} outside tp={tp}")
    if len(rows) % tp:
        raise PlanInputError(f"{len(rows)} packed rows do not split over tp={tp} ranks: pad every sequence to a "
                             f"multiple of tp x its CP divisor (padding_divisor(..., sequence_parallel=True))")
    chunk = len(rows) // tp
    return rows[tp_rank * chunk:(tp_rank + 1) * chunk]


def unpacked_routes(routes: np.ndarray, attention_mask: np.ndarray, *, tp: int = 1, tp_rank: int = 0) -> np.ndarray:
    """Non-packed path: real rows first per sample (``[b, S_eff]``, S_eff rounded to tp), the TP split
    along the sequence, flattened in the router's ``[s, b]`` order."""
    mask = np.asarray(attention_mask).astype(bool)
    n = mask.sum(1)
    width = -(-int(n.max()) // tp) * tp
    b, L, K = mask.shape[0], routes.shape[2], routes.shape[3]
    out = padding_rows((b, width, L, K), dtype=routes.dtype)
    for i in range(b):
        out[i, :n[i]] = routes[i][mask[i]]
    chunk = width // tp
    part = out[:, tp_rank * chunk:(tp_rank + 1) * chunk]
    return part.transpose(1, 0, 2, 3).reshape(-1, L, K)  # sequence-major: row s * b + i


def validate_replay_config(*, enable_replay: bool, return_routes: bool, cp_size: int = 1, sample_packing: bool = True,
                           step_wise: bool = False, vpp_size: int | None = None,
                           transformer_config_kwargs: dict | None = None) -> bool:
    """Check router-replay options (upstream rules, spec A.2) and return the *effective* replay flag.

    ``transformer_config_kwargs`` may set ``moe_enable_routing_replay`` too: it is resolved first, so it
    can neither skip these checks nor silently switch replay off; disagreeing with ``enable_replay`` is
    an error. ``moe_router_fusion`` (bypasses replay) and VPP > 1 (interleaved chunks reorder the
    replay) are refused."""
    kw = dict(transformer_config_kwargs or {})
    effective = enable_replay
    if "moe_enable_routing_replay" in kw:
        if bool(kw["moe_enable_routing_replay"]) != enable_replay:
            raise ReplayConfigError(
                f"moe_enable_routing_replay={enable_replay} but transformer_config_kwargs sets it to "
                f"{kw['moe_enable_routing_replay']}; set it in one place (the kwargs override would otherwise "
                f"{'silently disable replay' if enable_replay else 'skip the replay checks'})")
        effective = bool(kw["moe_enable_routing_replay"])
    if effective and not return_routes:
        raise ReplayConfigError("router replay needs the rollout's routes: set enable_return_routed_experts=True")
    if return_routes and not effective:
        raise ReplayConfigError("enable_return_routed_experts=True without moe_enable_routing_replay: the routes "
                                "would be collected and ignored; enable replay or stop returning routes")
    if cp_size > 1 and not sample_packing:
        raise ReplayConfigError(f"context parallel (cp_size={cp_size}) needs sample packing: set use_sample_packing=True")
    if step_wise and return_routes:
        raise ReplayConfigError("step-wise trajectories do not support returned routes (enable_return_routed_experts)")
    vpp = kw.get("virtual_pipeline_model_parallel_size", vpp_size)
    if effective and vpp is not None and vpp > 1:
        raise ReplayConfigError(f"router replay is refused with virtual_pipeline_model_parallel_size={vpp}: the "
                                f"interleaved schedule visits chunks out of layer order and upstream's replay targets "
                                f"follow construction order; use vpp 1, or a store keyed by global layer "
                                f"(harness.runtime.replay.ReplayStore, which runs under VPP)")
    if effective and kw.get("moe_router_fusion"):
        raise ReplayConfigError("moe_router_fusion bypasses router replay: disable it")
    return effective
