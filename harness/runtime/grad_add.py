"""``dst += src`` for an fp32 gradient and a bf16 / fp16 one: the weight copies' accumulation (``weight_cache.accumulate``).

ATen's ``add_`` of mixed dtypes runs its dynamic-casting elementwise kernel (``unrolled_elementwise_kernel``):
~2.6 TB/s on an H200 for this add, where a load that casts in registers and stores vectorised reaches ~3.8 TB/s.
In the step benchmark's profile (gpt-12l-h2048, 8 micro-batches a step) these adds are the largest "other" kernel:
~21 ms of a ~240-ms step on 2 x H200, 392 calls. On CUDA, with Triton importable, ``add_into`` runs a Triton
kernel doing exactly ``dst + float(src)`` (one fp32 add per element, as ``add_`` with alpha 1 does: the same bits);
anywhere else - CPU, other dtypes, non-contiguous or differently shaped tensors, inside a ``torch.compile`` trace -
it is ``dst.add_(src)``; also where the current CUDA device is not ``dst``'s (Triton launches on the
current device's current stream).

Measured (``reports/recorded/grad_add.h200x2.log``): alone on one H200, the model's 50 weight gradients take 1.92 against
2.77 ms a micro-batch, the host ~16 against ~9 us a call. In ``bench step`` on 2 x H200 the profiled "other" kernels
fall ~7 ms a step (79.6 -> 72.6 ms, dcp:balanced); the step times, four jobs alternating the two versions, stayed within
their run-to-run spread (the 2-GPU step is host-bound at these shapes: the device idles ~55-85 ms a step).
"""

from __future__ import annotations

import torch

BLOCK = 4096
"""Elements per Triton program (8 warps): 4096 and 2048 were equal on an H200, 8192 slower."""

_SOURCES = (torch.bfloat16, torch.float16)
_kernel = None  # the compiled Triton function, once made; False: Triton is not importable here


def _make_kernel():
    """The Triton kernel, made on first use (None where Triton cannot be imported)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def add_into_kernel(dst_ptr, src_ptr, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        keep = offs < n
        acc = tl.load(dst_ptr + offs, mask=keep)
        add = tl.load(src_ptr + offs, mask=keep).to(tl.float32)
        tl.store(dst_ptr + offs, acc + add, mask=keep)

    return add_into_kernel


def uses_kernel(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``add_into(dst, src)`` runs the Triton kernel (else ATen's ``add_``)."""
    global _kernel
    if not (dst.is_cuda and dst.dtype == torch.float32 and src.dtype in _SOURCES and src.device == dst.device
            and dst.shape == src.shape and dst.is_contiguous() and src.is_contiguous() and dst.numel() > 0):
        return False
    if torch.compiler.is_compiling() or dst.device.index != torch.cuda.current_device():
        return False  # Triton launches on the current device's current stream
    if _kernel is None:
        _kernel = _make_kernel() or False
    return _kernel is not False


def add_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst += src`` in place, ``dst`` fp32 and ``src`` of the compute dtype: the same result as ``dst.add_(src)``."""
    if not uses_kernel(dst, src):
        dst.add_(src)
        return
    n = dst.numel()
    _kernel[((n + BLOCK - 1) // BLOCK,)](dst, src, n, BLOCK=BLOCK, num_warps=8)
