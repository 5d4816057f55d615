"""``out[g] = sum of src[s] over the s with index[s] == g``, in fp32: the K/V gradients of gathered keys.

CP attention's gather exchange (``harness.parallel.collectives``) hands each local query chunk its key prefix,
picked from the all-gathered K/V by one index with repeats (a key seen by two chunks appears twice). The
backward must sum each gathered row's gradients in fp32 before the reduce-scatter. Done with ATen that is a
zero fill of the fp32 buffer, a cast of the whole bf16 gradient to fp32 and an atomic ``index_add_`` - and,
with K and V as two views of one stacked tensor, two zero-filled buffers and an add for autograd's select
backward: on the step benchmark's shapes (~9K selected rows of 2048 values, K and V) ~1.3 GB of memory traffic
a layer.

``sum_rows`` does it in one pass on CUDA (one Triton kernel for K and V, a program per output row, part and column
block): it reads each selected row once, adds its sources in fp32 in ascending order and writes every output row
once (zeros where no chunk sees the row). ``RowSources`` is the index inverted (for each output row its source rows,
ascending: a CSR table), made on the host once per micro-batch with the plan (~0.2 ms for 20K rows on a 2-core CPU)
and reused by every layer.

Measured (``reports/recorded/kv_grad_sum.h200x2.log``): the exchange's forward and backward alone on one H200, a CP-4
plan of an 8K-token pack, 0.52 against 1.15 ms; in ``bench step`` on 2 x H200 the profiled "other" kernels fall 74.0 ->
59.6 ms a step (dcp:balanced) and 100.0 -> 70.8 ms (static CP).

The numbers are ``out.zero_(); out.index_add_(0, index, src.float())`` bit for bit wherever that is deterministic:
the sum starts at zero and adds the sources in ascending order, as the CPU's ``index_add_`` does; on CUDA
``index_add_`` adds in whatever order its atomics land, which for at most two sources a row (CP attention's case)
is the same fp32 sum, and for more is not reproducible - the kernel always is. Anywhere else (CPU, no Triton,
inside a ``torch.compile`` trace, a layout the kernel does not take) ``sum_rows`` runs the kernel's algorithm with
ATen ops (each row's j-th source added to it, slot after slot: the same order, the same bits), so the CPU suites
exercise the inverted index the kernel reads; without ``RowSources`` it is the zero fill and ``index_add_``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

BLOCK = 1024
"""Output values per Triton program (4 warps)."""

_kernel = None  # the compiled Triton function, once made; False: Triton is not importable here


@dataclass(frozen=True)
class RowSources:
    """``index`` inverted: the source rows of each of ``rows`` output rows, ascending, as CSR - ``ptr`` (``rows + 1``
    offsets) into ``order`` (the source rows): two views of one int64 tensor, so that they reach the device in one
    copy. ``most``: the most sources of one row (the kernel's unrolled loop; a new value compiles a new kernel)."""

    rows: int
    ptr: torch.Tensor
    order: torch.Tensor
    most: int

    @classmethod
    def build(cls, index, rows: int, device) -> RowSources:
        index = np.asarray(index, dtype=np.int64)
        if index.ndim != 1 or (index.size and (index.min() < 0 or index.max() >= rows)):
            raise ValueError(f"RowSources: index must be 1-D with values in [0, {rows}); got shape {index.shape} and "
                             f"range [{index.min(initial=0)}, {index.max(initial=0)}]")
        counts = np.bincount(index, minlength=rows)
        ptr = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(counts, out=ptr[1:])
        order = np.argsort(index, kind="stable")  # sources of one row, ascending
        table = torch.as_tensor(np.concatenate([ptr, order]), device=device)
        return cls(int(rows), table[: rows + 1], table[rows + 1:], int(counts.max(initial=0)))


def _make_kernel():
    """The Triton kernel, made on first use (None where Triton cannot be imported)."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None

    @triton.jit
    def row_sum_kernel(out_ptr, a_ptr, b_ptr, ptr_ptr, order_ptr, width, blocks, MOST: tl.constexpr,
                       BLOCK: tl.constexpr):
        # out [rows, 2 or 1, width] contiguous; program (row, part * blocks + block): part 0 sums a, part 1 b
        row = tl.program_id(0).to(tl.int64)
        part = tl.program_id(1) // blocks
        cols = (tl.program_id(1) % blocks) * BLOCK + tl.arange(0, BLOCK)
        keep = cols < width
        if part == 0:
            src_ptr = a_ptr
        else:
            src_ptr = b_ptr
        start = tl.load(ptr_ptr + row)
        end = tl.load(ptr_ptr + row + 1)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(MOST):  # the row's sources, ascending; slots past its count add nothing
            has = start + j < end
            s = tl.load(order_ptr + start + j, mask=has, other=0)
            add = tl.load(src_ptr + s * width + cols, mask=keep & has, other=0.0).to(tl.float32)
            acc = tl.where(has, acc + add, acc)
        tl.store(out_ptr + (row * (tl.num_programs(1) // blocks) + part) * width + cols, acc, mask=keep)

    return row_sum_kernel


def uses_kernel(srcs, sources: RowSources | None, out: torch.Tensor) -> bool:
    """Whether ``sum_rows(srcs, index, sources, out)`` runs the Triton kernel (else ATen ops)."""
    global _kernel
    if sources is None or len(srcs) not in (1, 2) or not (out.is_cuda and out.dtype == torch.float32
                                                          and out.is_contiguous() and out.numel() > 0):
        return False
    first = srcs[0]
    if not (first.dtype in (torch.bfloat16, torch.float16, torch.float32) and first.shape[0] > 0
            and out.shape[2:] == first.shape[1:] and sources.rows == out.shape[0] and sources.ptr.device == out.device):
        return False
    if not all(s.device == out.device and s.dtype == first.dtype and s.shape == first.shape and s.is_contiguous()
               for s in srcs):
        return False
    if torch.compiler.is_compiling() or out.device.index != torch.cuda.current_device():
        return False  # Triton launches on the current device's current stream
    if _kernel is None:
        _kernel = _make_kernel() or False
    return _kernel is not False


def _sum_by_sources(src: torch.Tensor, sources: RowSources, out: torch.Tensor) -> None:
    """The kernel's sum with ATen ops, slot by slot: every row's j-th source added to it (rows distinct, so each add
    is one fp32 addition in a fixed order); for the CPU and wherever the kernel does not run."""
    out.zero_()
    counts = sources.ptr[1:] - sources.ptr[:-1]
    for j in range(sources.most):
        rows = torch.nonzero(counts > j).squeeze(1)
        picked = src.index_select(0, sources.order.index_select(0, sources.ptr.index_select(0, rows) + j))
        out.index_add_(0, rows, picked.to(out.dtype))


def sum_rows(srcs, index: torch.Tensor, sources: RowSources | None, out: torch.Tensor) -> None:
    """For each source tensor ``srcs[p]`` (rows of one shape), write ``out[g, p] = sum(float(srcs[p][s]) for s in
    ascending order if index[s] == g)`` (0 where none) in place. ``sources``: ``RowSources.build(index,
    out.shape[0])`` (the kernel on CUDA, its slot-by-slot ATen form elsewhere), or None (ATen's zero fill and
    ``index_add_``)."""
    if len(srcs) != out.shape[1] or any(s.shape[0] != index.shape[0] for s in srcs):
        raise ValueError(f"sum_rows: {len(srcs)} sources of {[s.shape[0] for s in srcs]} rows for an output of "
                         f"{out.shape[1]} parts and an index of {index.shape[0]}")
    if sources is not None and (sources.rows != out.shape[0] or sources.order.shape[0] != index.shape[0]):
        raise ValueError(f"sum_rows: RowSources of {sources.rows} rows and {sources.order.shape[0]} sources for an "
                         f"output of {out.shape[0]} rows and an index of {index.shape[0]}: build them from this index")
    if uses_kernel(srcs, sources, out):
        width = math.prod(srcs[0].shape[1:])
        blocks = (width + BLOCK - 1) // BLOCK
        _kernel[(out.shape[0], len(srcs) * blocks)](out, srcs[0], srcs[-1], sources.ptr, sources.order, width,
                                                    blocks, MOST=max(sources.most, 1), BLOCK=BLOCK, num_warps=4)
        return
    for p, src in enumerate(srcs):
        part = out[:, p]
        if sources is None:
            part.zero_()
            part.index_add_(0, index, src.to(out.dtype))
        else:
            _sum_by_sources(src, sources, part)
