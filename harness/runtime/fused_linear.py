"""A linear layer whose weight gradient is accumulated by the GEMM itself into the weight's fp32 gradient
(Megatron's ``gradient_accumulation_fusion``; TransformerEngine's ``fuse_wgrad_accumulation``).

``linear_wgrad(x, w, main_grad)`` is ``F.linear(x, w)`` (``w``: the step's compute-dtype copy of a weight,
``harness.runtime.weight_cache``); its backward returns the input's gradient ``go @ w`` and adds ``go^T @ x`` into
``main_grad`` (the weight's fp32 ``.grad``) in place: on CUDA one GEMM with ``torch.addmm(main_grad, go^T, x,
out_dtype=torch.float32, out=main_grad)`` - no bf16 weight gradient, no cast, no separate add (on one H100 this
model's weight-gradient work fell 20-46%, ``reports/recorded/wgrad_accumulation.h100.log``); elsewhere the product is
computed in ``main_grad``'s dtype and added. For ``w`` it returns a zero broadcast to its shape, which the step
copy's backward ignores: it keeps autograd running the weight's own accumulation node, which fires the weight's
post-accumulate hooks (the overlapped gradient reducer counts on them; Megatron returns a dummy gradient for the
same reason).

Both are ``torch.library`` operators, so a compiled graph calls them as they are: the accumulation runs inside the
compiled backward, where the chain's graph cannot see it (it cannot fuse the GEMM's epilogue into the product
either, which Inductor does not do for extern GEMMs anyway). On CUDA the accumulation's kernel is C++ where it builds
(``harness.runtime.native_wgrad``: the same GEMM without the Python kernel's host time per call). The sum is rounded once in fp32, where autograd rounds
each micro-batch's product to bf16 first: the fused step is not bit for bit the per-call one (within bf16
rounding; fp32 runs differ in the order of fp32 additions only). ``gemm_accumulate`` is the seam where the fault
catalogue re-creates a GEMM that overwrites instead of accumulating.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from harness.runtime import native_wgrad

_FUSED_OUT_DTYPE: dict = {}
"""(device type, input dtype) -> whether ``torch.addmm(..., out_dtype=fp32, out=...)`` ran there (probed once)."""


def gemm_accumulate(main_grad: Tensor, go_TO: Tensor, x_TI: Tensor) -> None:
    """``main_grad += go^T @ x`` in place (``O x I``), accumulated in ``main_grad``'s precision."""
    key = (main_grad.device.type, go_TO.dtype)
    known = _FUSED_OUT_DTYPE.get(key)
    if go_TO.dtype != main_grad.dtype and known is not False:
        try:
            torch.addmm(main_grad, go_TO.t(), x_TI, out_dtype=main_grad.dtype, out=main_grad)
            _FUSED_OUT_DTYPE[key] = True
            return
        except (RuntimeError, TypeError):
            if known:  # it ran here before: this is a real error, not a missing mixed-dtype GEMM
                raise
            _FUSED_OUT_DTYPE[key] = False  # no mixed-dtype GEMM here (older torch, or the CPU): compute, then add
    main_grad.addmm_(go_TO.t().to(main_grad.dtype), x_TI.to(main_grad.dtype))


_GEMM_ACCUMULATE = gemm_accumulate


def _linear(x: Tensor, w: Tensor, main_grad: Tensor) -> Tensor:
    return F.linear(x, w)


def _accumulate(main_grad: Tensor, go: Tensor, x: Tensor) -> None:
    gemm_accumulate(main_grad, go.reshape(-1, go.shape[-1]), x.reshape(-1, x.shape[-1]))


# Defined with ``torch.library.Library`` and ``CompositeExplicitAutograd`` kernels, which the dispatcher calls as they
# are: ``torch.library.custom_op``'s Python wrappers cost ~270 us a linear (forward and backward, 2-core CPU), which
# made a host-bound step of 16 micro-batches 1.44x slower on an H100 (``reports/recorded/weight_copies.h100.log``).
_LIB = torch.library.Library("dcp_harness", "FRAGMENT")
_LIB.define("linear_wgrad(Tensor x, Tensor w, Tensor main_grad) -> Tensor", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("accumulate_wgrad(Tensor(a!) main_grad, Tensor go, Tensor x) -> ()", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("linear_wgrad_native(Tensor x, Tensor w, Tensor main_grad) -> Tensor",
            tags=(torch.Tag.pt2_compliant_tag,))
_LIB.impl("linear_wgrad", _linear, "CompositeExplicitAutograd")
_LIB.impl("linear_wgrad_native", _linear, "CompositeExplicitAutograd")
_LIB.impl("accumulate_wgrad", _accumulate, "CompositeExplicitAutograd")
_LINEAR = torch.ops.dcp_harness.linear_wgrad.default
_LINEAR_NATIVE = torch.ops.dcp_harness.linear_wgrad_native.default
"""The same linear whose backward accumulates with ``native_wgrad``'s C++ operator: a forward operator of its own, so
that a compiled graph (and the compile caches, across processes) records which accumulation its backward calls."""
_ACCUMULATE = torch.ops.dcp_harness.accumulate_wgrad.default


@torch.library.register_fake("dcp_harness::linear_wgrad", lib=_LIB)
def _linear_fake(x, w, main_grad):
    return x.new_empty((*x.shape[:-1], w.shape[0]))


torch.library.register_fake("dcp_harness::linear_wgrad_native", _linear_fake, lib=_LIB)


@torch.library.register_fake("dcp_harness::accumulate_wgrad", lib=_LIB)
def _accumulate_fake(main_grad, go, x):
    return None


def _setup_context(ctx, inputs, output):
    x, w, main_grad = inputs
    ctx.save_for_backward(x, w)
    ctx.main_grad = main_grad  # not saved: other micro-batches add into it before this backward runs (its version moves)


def _backward(ctx, go, accumulate=None):
    x, w = ctx.saved_tensors
    (accumulate or _ACCUMULATE)(ctx.main_grad, go, x)
    # the weight's "gradient": a zero broadcast to its shape (no memory), so that autograd still runs the step copy's
    # node and then the weight's own accumulation node, which fires its post-accumulate hooks (a compiled graph
    # drops the edge of an input whose gradient is always None); the copy's node adds nothing in this mode
    dummy = w.new_zeros(()).expand(w.shape) if ctx.needs_input_grad[1] else None
    return (go @ w if ctx.needs_input_grad[0] else None), dummy, None


def _backward_native(ctx, go):
    return _backward(ctx, go, native_wgrad.load())


torch.library.register_autograd("dcp_harness::linear_wgrad", _backward, setup_context=_setup_context, lib=_LIB)
torch.library.register_autograd("dcp_harness::linear_wgrad_native", _backward_native, setup_context=_setup_context,
                                lib=_LIB)


def linear_wgrad(x: Tensor, w: Tensor, main_grad: Tensor) -> Tensor:
    """``F.linear(x, w)``; its backward adds ``go^T @ x`` into ``main_grad`` (see the module doc): with the C++
    accumulation where ``native_wgrad.prepare()`` chose it for ``x``'s device, unless the fault seam
    ``gemm_accumulate`` is replaced (a planted fault always runs)."""
    if x.device.type in native_wgrad.DEVICES and gemm_accumulate is _GEMM_ACCUMULATE:
        return _LINEAR_NATIVE(x, w, main_grad)
    return _LINEAR(x, w, main_grad)
