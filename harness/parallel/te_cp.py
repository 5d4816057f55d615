"""TransformerEngine's CP attention as a K/V exchange of the harness (``te:p2p``, ``te:all_gather``, ``te:a2a``).

TE's ``DotProductAttention`` in THD (``attn_mask_type="padding_causal"``) takes this rank's zig-zag slice of a
pack - the harness's slicing is TE's rule (``harness.plan.thd.zigzag_index_array`` equals
``transformer_engine_torch.thd_get_partitioned_indices``) - with the pack's full ``cu_seqlens`` and runs the
exchange itself in the process group it was last handed (``set_context_parallel_group``). TE keeps that group in
the module between calls, so a dynamic-CP runtime must hand it the micro-batch's group on every call, and hand it
no group for a one-rank block: ``te_cp_attention`` does both and then reads the group back from the module
(``check_module_group``): a micro-batch never runs on a stale group (TE's own CP tests use one static group).

TE is optional (``pip install "transformer-engine[pytorch]==2.20.2"``, CUDA only); ``require_te`` names what to
install when it is missing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.parallel.audit import GroupAuditError
from harness.parallel.options import COMM_TYPES, INSTALL, TEUnavailableError, comm_type, require_te  # noqa: F401
from harness.runtime.te_env import prefer_torch_cudnn

_MODULES: dict[tuple, object] = {}
_STREAMS: dict[int, torch.cuda.Stream] = {}


def te_module(heads: int, kv_heads: int, head_dim: int, scale, device):
    """One ``DotProductAttention`` per shape and device (THD, causal within each sequence), kept across calls -
    as a model keeps its attention modules, so the CP group it holds must be reset per call."""
    key = (heads, kv_heads, head_dim, scale, str(device))
    if key not in _MODULES:
        prefer_torch_cudnn()  # before TE's first import: TE then loads the cuDNN torch runs
        import transformer_engine.pytorch as te  # lazy: an optional CUDA package

        _MODULES[key] = te.DotProductAttention(heads, head_dim, num_gqa_groups=kv_heads, qkv_format="thd",
                                               attn_mask_type="padding_causal", softmax_scale=scale)
    return _MODULES[key]


def _stream(device) -> torch.cuda.Stream:
    index = torch.device(device).index or 0
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=device)
    return _STREAMS[index]


def check_module_group(module, group, rank: int, microbatch: int = -1) -> None:
    """``GroupAuditError`` unless ``module`` holds ``group`` (None: no CP group) right now."""
    held = getattr(module, "cp_group", None)
    if held is group:
        return
    got = dist.get_process_group_ranks(held) if held is not None else [rank]
    want = dist.get_process_group_ranks(group) if group is not None else [rank]
    raise GroupAuditError(rank, microbatch, got, want)


def te_cp_attention(q_TH, k_TH, v_TH, cu_seqlens_padded, cp_size: int, group, kind: str, *, scale=None,
                    microbatch: int = -1):
    """This rank's attention output for its zig-zag slice (``[T_local, H, D]``), run by TE with ``kind``
    (``COMM_TYPES``) in ``group`` (the block's; ignored at ``cp_size == 1``). ``cu_seqlens_padded``: the whole
    pack's boundaries (each sequence padded to a multiple of 2 x cp_size; the padding is causal after its
    sequence's real tokens, so no real token sees it)."""
    module = te_module(q_TH.shape[1], k_TH.shape[1], q_TH.shape[2], scale, q_TH.device)
    if cp_size > 1:
        module.set_context_parallel_group(group, dist.get_process_group_ranks(group), _stream(q_TH.device),
                                          cp_comm_type=kind)
    else:  # a one-rank block: the group an earlier micro-batch handed over must not survive
        module.set_context_parallel_group(None, None, None)
        group = None
    check_module_group(module, group, dist.get_rank() if dist.is_initialized() else 0, microbatch)
    cu = torch.as_tensor([int(x) for x in cu_seqlens_padded], dtype=torch.int32, device=q_TH.device)
    longest = int(max(int(b) - int(a) for a, b in zip(cu_seqlens_padded[:-1], cu_seqlens_padded[1:])))
    out = module(q_TH, k_TH, v_TH, cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=longest, max_seqlen_kv=longest)
    return out.view(q_TH.shape[0], q_TH.shape[1], -1)  # TE returns THD as [T, H x D]
