"""Causal attention over THD chunks, with interchangeable backends.

Shapes (legend): ``T`` tokens, ``H`` query heads, ``Hkv`` key/value heads (GQA when smaller), ``D``
head dim. ``q_TQ`` holds a rank's local queries as the chunks of a ``ChunkPlan``; ``k_TK``/``v_TK``
hold the keys of the whole pack in any row order: ``DeviceChunks.key_index`` lists, chunk after
chunk, the rows of the keys each chunk may see (its sequence's prefix up to its last query), so the
causal mask is aligned bottom-right: the j-th query of a chunk sees the first ``k_len - q_len + j + 1``
of its keys.

Backends (``BACKENDS``):
- ``sdpa``: ``F.scaled_dot_product_attention`` with an explicit boolean mask per chunk; any device,
  fp32-exact; the CPU reference.
- ``flash``: PyTorch's bundled flash-attention kernel called as the ATen op
  ``aten._flash_attention_forward`` (CUDA): one call for all chunks, keys gathered into per-chunk
  prefixes; its backward is the op's own C++ autograd formula. The same kernels as ``varlen`` with
  ~0.3 ms less host time per layer (forward + backward): ``varlen_attn`` wraps them in Python custom
  ops with a Python autograd formula, and a launch-bound step pays that wrapper at every layer.
- ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (the same flash kernels, CUDA, public API).
- ``flash_attn``: ``flash_attn.flash_attn_varlen_func`` (optional extra, CUDA).
- ``te``: TransformerEngine ``DotProductAttention`` in THD format (optional extra, CUDA).
``auto`` = ``flash`` on CUDA (``varlen`` where a build lacks the ATen op), ``sdpa`` elsewhere.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from harness.plan.thd import ChunkPlan, whole_chunks
from harness.runtime.te_env import prefer_torch_cudnn


@dataclass(frozen=True)
class DeviceChunks:
    """A ``ChunkPlan`` moved to a device once (reused by every layer of a micro-batch)."""

    plan: ChunkPlan
    cu_q: torch.Tensor  # int32 [2n + 1]
    cu_k: torch.Tensor  # int32 [2n + 1]
    key_index: torch.Tensor | None  # int64 [sum(k_lens)]; None: the keys are the pack, in order
    max_q: int
    max_k: int

    @classmethod
    def build(cls, plan: ChunkPlan, device) -> DeviceChunks:
        as_i32 = lambda a: torch.as_tensor(np.asarray(a, dtype=np.int32), device=device)  # noqa: E731
        index = plan.key_index()
        identity = bool((index == np.arange(index.size)).all())
        return cls(plan, as_i32(plan.cu_q), as_i32(plan.cu_k),
                   None if identity else torch.as_tensor(index, dtype=torch.int64, device=device),
                   int(plan.q_lens.max(initial=0)), int(plan.k_lens.max(initial=0)))


def _sdpa(q_TQ, k_TK, v_TK, chunks: DeviceChunks, scale):
    outs, p, qpos, kpos = [], chunks.plan, 0, 0
    kp, vp = _gathered(k_TK, v_TK, chunks)
    gqa = kp.shape[1] != q_TQ.shape[1]
    for q_len, k_len in zip(p.q_lens.tolist(), p.k_lens.tolist()):
        kpos += k_len
        if q_len == 0:
            continue
        qi = q_TQ[qpos:qpos + q_len].transpose(0, 1)
        ki = kp[kpos - k_len:kpos].transpose(0, 1)
        vi = vp[kpos - k_len:kpos].transpose(0, 1)
        rows = torch.arange(q_len, device=q_TQ.device)[:, None] + (k_len - q_len)  # bottom-right causal
        mask = torch.arange(k_len, device=q_TQ.device)[None, :] <= rows
        o = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=gqa)
        outs.append(o.transpose(0, 1))
        qpos += q_len
    return torch.cat(outs) if outs else torch.zeros_like(q_TQ)


def _gathered(k_TK, v_TK, chunks: DeviceChunks):
    if chunks.key_index is None:
        return k_TK, v_TK
    return k_TK.index_select(0, chunks.key_index), v_TK.index_select(0, chunks.key_index)


def _varlen(q_TQ, k_TK, v_TK, chunks: DeviceChunks, scale):
    from torch.nn.attention.varlen import varlen_attn

    kp, vp = _gathered(k_TK, v_TK, chunks)
    kw = {}
    if kp.shape[1] != q_TQ.shape[1]:
        if "enable_gqa" in inspect.signature(varlen_attn).parameters:
            kw["enable_gqa"] = True
        else:  # older torch: expand K/V heads
            rep = q_TQ.shape[1] // kp.shape[1]
            kp, vp = kp.repeat_interleave(rep, dim=1), vp.repeat_interleave(rep, dim=1)
    return varlen_attn(q_TQ, kp, vp, chunks.cu_q, chunks.cu_k, chunks.max_q, chunks.max_k,
                       scale=scale, window_size=(-1, 0), **kw)


def _flash(q_TQ, k_TK, v_TK, chunks: DeviceChunks, scale):
    kp, vp = _gathered(k_TK, v_TK, chunks)
    # causal with window (-1, 0): bottom-right aligned, as the chunks' key prefixes need (flash >= 2.1)
    return torch.ops.aten._flash_attention_forward(q_TQ, kp, vp, chunks.cu_q, chunks.cu_k, chunks.max_q, chunks.max_k,
                                                   0.0, True, False, scale=scale, window_size_left=-1,
                                                   window_size_right=0)[0]


def _flash_attn(q_TQ, k_TK, v_TK, chunks: DeviceChunks, scale):
    from flash_attn import flash_attn_varlen_func  # bottom-right causal since flash-attn 2.1

    kp, vp = _gathered(k_TK, v_TK, chunks)
    return flash_attn_varlen_func(q_TQ, kp, vp, chunks.cu_q, chunks.cu_k, chunks.max_q, chunks.max_k,
                                  softmax_scale=scale, causal=True)


_TE_MODULES: dict = {}


def _te(q_TQ, k_TK, v_TK, chunks: DeviceChunks, scale):
    prefer_torch_cudnn()  # before TE's first import: TE then loads the cuDNN torch runs
    import transformer_engine.pytorch as te

    kp, vp = _gathered(k_TK, v_TK, chunks)
    H, D, Hkv = q_TQ.shape[1], q_TQ.shape[2], kp.shape[1]
    key = (H, D, Hkv, scale)
    if key not in _TE_MODULES:
        _TE_MODULES[key] = te.DotProductAttention(H, D, num_gqa_groups=Hkv, qkv_format="thd",
                                                  attn_mask_type="padding_causal_bottom_right",
                                                  softmax_scale=scale)
    o = _TE_MODULES[key](q_TQ, kp, vp, cu_seqlens_q=chunks.cu_q, cu_seqlens_kv=chunks.cu_k,
                         max_seqlen_q=chunks.max_q, max_seqlen_kv=chunks.max_k)
    return o.view(q_TQ.shape)


BACKENDS = {"sdpa": _sdpa, "flash": _flash, "varlen": _varlen, "flash_attn": _flash_attn, "te": _te}


def backend_available(name: str, device: torch.device | str) -> bool:
    return _available(name, str(torch.device(device).type))


@functools.cache
def _available(name: str, device_type: str) -> bool:
    device = torch.device(device_type)
    if name == "sdpa":
        return True
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    if name == "flash":
        return hasattr(torch.ops.aten, "_flash_attention_forward") and torch.backends.cuda.is_flash_attention_available()
    if name == "varlen":
        return importlib.util.find_spec("torch.nn.attention.varlen") is not None
    return importlib.util.find_spec({"flash_attn": "flash_attn", "te": "transformer_engine"}[name]) is not None


def resolve_backend(name: str, device, dtype=None) -> str:
    """``auto``: ``flash`` (else ``varlen``) on CUDA for half-precision inputs, ``sdpa`` on CPU and for fp32 / fp64
    inputs (``dtype``; the flash kernels take bf16 / fp16 only)."""
    if name == "auto":
        if torch.device(device).type != "cuda" or dtype in (torch.float32, torch.float64):
            name = "sdpa"
        else:
            name = "flash" if backend_available("flash", device) else "varlen"
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose one of auto, {', '.join(BACKENDS)}")
    if not backend_available(name, device):
        raise ValueError(f"attention backend {name!r} is not available on {device} "
                         f"(flash/varlen/flash_attn/te need CUDA, flash_attn/te their package installed)")
    return name


def chunk_attention(q_TQ, k_TK, v_TK, chunks: DeviceChunks, *, backend: str = "auto", scale=None,
                    keys_gathered: bool = False):
    """Attention of ``q_TQ`` (laid out as ``chunks``) against ``k_TK``/``v_TK``; differentiable.
    ``keys_gathered``: ``k_TK``/``v_TK`` already hold each chunk's keys, chunk after chunk (the
    caller applied ``chunks.key_index``, e.g. with fp32 gradient accumulation)."""
    if keys_gathered:
        chunks = DeviceChunks(chunks.plan, chunks.cu_q, chunks.cu_k, None, chunks.max_q, chunks.max_k)
    return BACKENDS[resolve_backend(backend, q_TQ.device, q_TQ.dtype)](q_TQ, k_TK, v_TK, chunks, scale)


def thd_attention(q_TH, k_TH, v_TH, cu_seqlens_padded, *, backend: str = "auto", scale=None):
    """Causal attention of a whole THD pack without CP (every sequence attends its own prefix)."""
    chunks = DeviceChunks.build(whole_chunks(cu_seqlens_padded), q_TH.device)
    return chunk_attention(q_TH, k_TH, v_TH, chunks, backend=backend, scale=scale)


# ---------------------------------------------------------------- split attention (for ring exchange)
# A ring CP exchange computes a query chunk's attention in parts, one per key block it receives, and
# merges the parts by their log-sum-exp; the backward recomputes each part's gradient from the merged
# output and log-sum-exp. That needs a forward returning the log-sum-exp and a backward taking it:
# the ATen flash ops on CUDA, and an exact fp32 reference (``sdpa``) anywhere.

LSE_BACKENDS = ("flash", "sdpa")
"""Backends with a log-sum-exp forward and a backward from (out, lse): what ``ring`` exchange uses."""


def resolve_lse_backend(name: str, device, dtype=None) -> str:
    """``auto`` -> ``flash`` on CUDA (when the ATen op exists), ``sdpa`` elsewhere; ``varlen`` ->
    ``flash`` (the same kernels); any other backend than ``LSE_BACKENDS`` is an error naming the choices."""
    if name == "auto":
        name = "flash" if torch.device(device).type == "cuda" and dtype not in (torch.float32, torch.float64) \
            and backend_available("flash", device) else "sdpa"
    elif name == "varlen" and backend_available("flash", device):
        name = "flash"  # varlen_attn wraps the same flash kernels; their ATen ops give the log-sum-exp
    if name not in LSE_BACKENDS:
        raise ValueError(f"attention backend {name!r} cannot run split attention (ring CP exchange needs the "
                         f"log-sum-exp); use one of auto, {', '.join(LSE_BACKENDS)}, or exchange='gather'")
    if not backend_available(name, device):
        raise ValueError(f"attention backend {name!r} is not available on {device}")
    return name


@dataclass(frozen=True)
class Segments:
    """Variable-length segments of one split-attention call: device offsets for the kernel and the
    host lengths the reference backend loops over."""

    cu_q: torch.Tensor  # int32 [n + 1]
    cu_k: torch.Tensor  # int32 [n + 1]
    q_lens: tuple[int, ...]
    k_lens: tuple[int, ...]
    max_q: int
    max_k: int

    @classmethod
    def build(cls, q_lens, k_lens, device) -> Segments:
        q_lens, k_lens = (np.asarray(x, dtype=np.int64) for x in (q_lens, k_lens))
        cu = lambda a: torch.as_tensor(np.concatenate([[0], np.cumsum(a)]).astype(np.int32), device=device)  # noqa: E731
        return cls(cu(q_lens), cu(k_lens), tuple(q_lens.tolist()), tuple(k_lens.tolist()),
                   int(q_lens.max(initial=0)), int(k_lens.max(initial=0)))


def _expand_kv(x, heads: int):
    return x if x.shape[1] == heads else x.repeat_interleave(heads // x.shape[1], dim=1)


def _ref_parts(q_TQ, k_TK, v_TK, seg: Segments, causal: bool, scale: float, acc):
    """Per non-empty segment of the reference: (q rows, key rows, q, k, v as [H, len, D] in ``acc``,
    masked scores [H, ql, kl]); K/V heads repeated for GQA, causal mask bottom-right aligned."""
    H, qp, kp = q_TQ.shape[1], 0, 0
    for ql, kl in zip(seg.q_lens, seg.k_lens):
        if ql and kl:
            qi = q_TQ[qp:qp + ql].to(acc).transpose(0, 1)
            ki = _expand_kv(k_TK[kp:kp + kl].to(acc), H).transpose(0, 1)
            vi = _expand_kv(v_TK[kp:kp + kl].to(acc), H).transpose(0, 1)
            s = (qi @ ki.transpose(1, 2)) * scale
            if causal:
                rows = torch.arange(ql, device=q_TQ.device)[:, None] + (kl - ql)
                s = s.masked_fill(torch.arange(kl, device=q_TQ.device)[None, :] > rows, float("-inf"))
            yield slice(qp, qp + ql), slice(kp, kp + kl), qi, ki, vi, s
        qp, kp = qp + ql, kp + kl


def attention_forward_lse(q_TQ, k_TK, v_TK, seg: Segments, *, causal: bool, backend: str, scale=None):
    """Attention of each query segment against its key segment, and its log-sum-exp: (out like
    ``q_TQ``, lse [H, Tq] in float32, float64 for float64 input). ``causal``: bottom-right aligned mask."""
    H, D = q_TQ.shape[1], q_TQ.shape[2]
    scale = scale if scale is not None else D ** -0.5
    acc = torch.promote_types(q_TQ.dtype, torch.float32)  # the reference computes in fp32 (fp64 for fp64 input)
    if backend == "flash":
        win = {"window_size_left": -1, "window_size_right": 0} if causal else {}
        out, lse, *_ = torch.ops.aten._flash_attention_forward(q_TQ, k_TK, v_TK, seg.cu_q, seg.cu_k, seg.max_q,
                                                               seg.max_k, 0.0, causal, False, scale=scale, **win)
        return out, lse
    out = torch.zeros(q_TQ.shape, dtype=acc, device=q_TQ.device)
    lse = torch.full((H, q_TQ.shape[0]), float("-inf"), dtype=acc, device=q_TQ.device)
    for qs, _, _, _, vi, s in _ref_parts(q_TQ, k_TK, v_TK, seg, causal, scale, acc):
        m = torch.logsumexp(s, dim=-1)  # [H, ql]
        out[qs] = (torch.exp(s - m[..., None]) @ vi).transpose(0, 1)
        lse[:, qs] = m
    return out.to(q_TQ.dtype), lse


def attention_backward_lse(dout_TQ, q_TQ, k_TK, v_TK, out_TQ, lse_HQ, seg: Segments, *, causal: bool, backend: str,
                           scale=None):
    """Gradients (dq, dk, dv) of one split-attention part, from the *merged* output and log-sum-exp
    of every part (the standard identity: softmax rows are exp(s - lse), and rowsum(dout * out) is
    the merged output's)."""
    H, D = q_TQ.shape[1], q_TQ.shape[2]
    scale = scale if scale is not None else D ** -0.5
    acc = torch.promote_types(q_TQ.dtype, torch.float32)  # the reference computes in fp32 (fp64 for fp64 input)
    if backend == "flash":
        win = {"window_size_left": -1, "window_size_right": 0} if causal else {}
        empty = torch.empty(0, dtype=torch.int64, device=q_TQ.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout_TQ, q_TQ, k_TK, v_TK, out_TQ, lse_HQ, seg.cu_q, seg.cu_k, seg.max_q, seg.max_k, 0.0, causal,
            empty, empty, scale=scale, **win)
        return dq, dk, dv
    dq = torch.zeros(q_TQ.shape, dtype=acc, device=q_TQ.device)
    dk = torch.zeros(k_TK.shape, dtype=acc, device=q_TQ.device)
    dv = torch.zeros(v_TK.shape, dtype=acc, device=q_TQ.device)
    Hkv = k_TK.shape[1]
    for qs, ks, qi, ki, vi, s in _ref_parts(q_TQ, k_TK, v_TK, seg, causal, scale, acc):
        oi = out_TQ[qs].to(acc).transpose(0, 1)
        gi = dout_TQ[qs].to(acc).transpose(0, 1)
        p = torch.exp(s - lse_HQ[:, qs, None])
        dvi = p.transpose(1, 2) @ gi
        ds = p * (gi @ vi.transpose(1, 2) - (gi * oi).sum(-1, keepdim=True))
        dq[qs] = ((ds @ ki) * scale).transpose(0, 1)
        dki = (ds.transpose(1, 2) @ qi) * scale
        kl = dki.shape[1]
        dk[ks] = dki.reshape(Hkv, H // Hkv, kl, D).sum(1).transpose(0, 1)
        dv[ks] = dvi.reshape(Hkv, H // Hkv, kl, D).sum(1).transpose(0, 1)
    return dq.to(q_TQ.dtype), dk.to(k_TK.dtype), dv.to(v_TK.dtype)
