"""The step's weight copies: each matrix weight cast to the compute dtype once per training step, its gradient
added into the fp32 ``.grad`` in place.

Under bf16 autocast with fp32 master weights, every micro-batch's ``F.linear`` casts each weight fp32 -> bf16
again, and autograd hands each weight gradient back as bf16 -> fp32 cast plus an add into ``.grad``: per
micro-batch and weight element ~24 bytes of elementwise traffic beside the GEMMs (on one H100, gpt-12l-h2048 at
32,768 tokens a step: a third to a half of its weight-gradient time, ``reports/recorded/wgrad_accumulation.h100.log``).
Inside ``cached_weights()`` (``harness.train.step.train_step`` opens it around a step's micro-batches) the
layers take their matrix weights through ``weight(w)``:

- the weight is copied into a persistent buffer of the compute dtype (autocast's dtype, else the weight's own)
  once per step - at its first use in the step, and again only if the weight changed in place since
  (``refresh``);
- the layer computes with that copy; its gradient, in the compute dtype, is added into the weight's fp32
  ``.grad`` in place (``accumulate``: one mixed-dtype add, no cast kernel, no temporary; on CUDA a Triton kernel
  that casts in registers, ``harness.runtime.grad_add``). The weight's own
  ``AccumulateGrad`` node still runs after it (with no gradient to add) and fires the weight's post-accumulate-grad
  hooks once per use, as without the copy: the overlapped gradient reducer counts on them.

The numbers are those of the per-call path bit for bit: autocast's cast is the same rounding, and
``grad += g_bf16`` adds the bf16 value in fp32 exactly as ``grad += g_bf16.float()`` does (fp32 runs copy and add
fp32). Where one weight is used twice in one micro-batch (the LM head under multi-token prediction) each use
adds its own gradient, where autograd would sum the two first: fp32 rounding of the order only.

In the ``fused`` mode ``weight(w)`` gives the copy with the weight's fp32 ``.grad`` (a ``FusedWeight``) and the
layers' ``linear(x, weight(w))`` runs ``harness.runtime.fused_linear``: the weight-gradient GEMM adds into ``.grad``
itself, and the copy's backward adds nothing (within bf16 rounding of the other modes, not bit for bit).

Outside ``cached_weights()`` ``weight(w)`` is ``w``: single-process references, evaluation, benchmarks of the
model alone. ``refresh`` and ``accumulate`` are seams: the fault catalogue re-creates a copy that is never
refreshed and an accumulation that keeps one micro-batch's gradient.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NamedTuple

import torch
import torch.nn.functional as F

from harness.runtime import fused_linear
from harness.runtime.grad_add import add_into
from harness.runtime.options import WEIGHT_MODES as MODES  # noqa: F401 - re-exported


class WeightCacheError(RuntimeError):
    """The step's weight copies were used in a way they do not support (named in the message)."""


class FusedWeight(NamedTuple):
    """What ``weight()`` gives in the ``fused`` mode: the step's copy and the weight's fp32 gradient, for ``linear``."""
    copy: torch.Tensor
    main_grad: torch.Tensor


class _State:
    def __init__(self):
        self.active = False
        self.fused = False
        self.buffers: dict = {}
        """(id(weight), dtype) -> (weakref to the weight, buffer): persistent across steps (stable addresses)."""
        self.fresh: dict = {}
        """(id(weight), dtype) -> the weight's version counter when this step copied it."""
        self.steps = 0
        """Steps opened so far in this process (``step_number``)."""
        self.grads: dict = {}
        """id(weight) -> (weakref to the weight, an alias of its ``.grad`` with a version counter of its own)."""


_STATE = _State()


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"weight mode must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


@contextmanager
def cached_weights(mode: str = "cached") -> Iterator[None]:
    """One training step's weight copies (``MODES``; ``per-call``: none): ``weight(w)`` inside gives the step's copy
    of ``w`` (made at its first use in the block). Not re-entrant: a step inside a step is refused."""
    if check_mode(mode) == "per-call":
        yield
        return
    if _STATE.active:
        raise WeightCacheError("cached_weights() is already open: one training step at a time (a step inside a "
                               "step would share its copies)")
    if mode == "fused":
        fused_linear.native_wgrad.prepare()  # which accumulation the step's fused linears call, decided per process
    _STATE.active, _STATE.fresh, _STATE.fused = True, {}, mode == "fused"
    _STATE.steps += 1
    try:
        yield
    finally:
        _STATE.active, _STATE.fresh, _STATE.fused = False, {}, False


def active() -> bool:
    return _STATE.active


def step_number() -> int:
    """The number of the step ``cached_weights()`` opened last in this process (1, 2, ...; 0 before any)."""
    return _STATE.steps


def compute_dtype(w: torch.Tensor) -> torch.dtype:
    """The dtype a layer computes with ``w`` in: autocast's on ``w``'s device when it is on and ``w`` is fp32
    (autocast casts fp32 operands only), else ``w``'s own."""
    kind = w.device.type
    if w.dtype == torch.float32 and torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return w.dtype


def refresh(w: torch.Tensor, buf: torch.Tensor, first: bool) -> None:
    """Copy ``w`` into its compute-dtype buffer ``buf`` (``first``: the buffer was just allocated)."""
    with torch.no_grad():
        buf.copy_(w)


def accumulate(w: torch.Tensor, g: torch.Tensor) -> None:
    """Add one use's gradient ``g`` (the compute dtype) into ``w.grad`` in place, as ``AccumulateGrad`` does."""
    if w.grad is None:
        w.grad = g.to(dtype=w.dtype, memory_format=torch.contiguous_format, copy=True)
    else:
        add_into(w.grad, g)  # w.grad.add_(g), vectorised on CUDA (harness.runtime.grad_add)


class _StepCopy(torch.autograd.Function):
    """Forward: the step's copy of ``w`` (an alias of its buffer). Backward: the gradient into ``w.grad``."""

    @staticmethod
    def forward(ctx, w, buf):
        ctx.weight, ctx.fused = w, _STATE.fused
        return buf.view_as(buf)

    @staticmethod
    def backward(ctx, g):
        if torch.is_grad_enabled():
            raise WeightCacheError("a step's weight copies do not support a differentiable backward "
                                   "(create_graph=True); run that model outside cached_weights()")
        if ctx.fused:  # the GEMM already added into .grad; g is its placeholder (harness.runtime.fused_linear)
            return None, None
        accumulate(ctx.weight, g)
        return None, None  # autograd's AccumulateGrad of the weight still runs next: its post-accumulate hooks fire


def weight(w: torch.Tensor) -> torch.Tensor:
    """What a layer computes with for weight ``w``: inside ``cached_weights()``, for a leaf matrix weight that takes
    a gradient, the step's copy in the compute dtype (its gradient added into ``w.grad``); else ``w`` itself.

    Call it where the layer uses the weight, not earlier: the copy's backward node is ordered by when it was made
    (autograd runs the ready node made last first; a leaf's own accumulation runs at once), so a copy made long
    before its use hands its gradient over late, and the overlapped reducer's buckets wait for it."""
    if not _STATE.active or w.dim() != 2 or not w.requires_grad or w.grad_fn is not None or not torch.is_grad_enabled():
        return w  # a leaf weight only: a tensor computed in the graph (a copy already among them) passes through
    dtype = compute_dtype(w)
    key = (id(w), dtype)
    held = _STATE.buffers.get(key)
    first = held is None or held[0]() is not w
    if first:
        if held is not None:  # a weight freed since; its id was reused
            del _STATE.buffers[key]
        buf = torch.empty_like(w, dtype=dtype, memory_format=torch.contiguous_format)
        _STATE.buffers[key] = (weakref.ref(w, _forget(_STATE.buffers, key)), buf)
    else:
        buf = held[1]
    if first or _STATE.fresh.get(key) != w._version:
        refresh(w, buf, first)
        _STATE.fresh[key] = w._version
    copy = _StepCopy.apply(w, buf)
    if _STATE.fused:
        if w.grad is None:
            w.grad = torch.zeros_like(w, memory_format=torch.contiguous_format)
        return FusedWeight(copy, _grad_alias(w))
    return copy


def _grad_alias(w: torch.Tensor) -> torch.Tensor:
    """``w.grad`` as a tensor of the same memory with a version counter of its own, for the fused operator.

    A compiled graph saves the operator's ``main_grad`` input for its backward and checks there that its version is
    unchanged. ``.grad`` is often a view of one flat buffer (``harness.parallel.grad_reduce.GradBuffer``), and views
    share their base's version counter: every other gradient's in-place add and every bucket's all-reduce between a
    micro-batch's forward and its backward would move it ("modified by an inplace operation", seen on the first
    compiled step). The alias (``set_`` onto the same storage) is moved only by writes through itself."""
    g = w.grad
    held = _STATE.grads.get(id(w))
    if held is not None and held[0]() is w:
        a = held[1]
        if (a.data_ptr(), a.shape, a.stride(), a.dtype) == (g.data_ptr(), g.shape, g.stride(), g.dtype):
            return a  # the alias holds its storage: the same address is the same live gradient
    a = torch.empty(0, dtype=g.dtype, device=g.device).set_(g.untyped_storage(), g.storage_offset(), g.shape,
                                                            g.stride())
    _STATE.grads[id(w)] = (weakref.ref(w, _forget(_STATE.grads, id(w))), a)  # dropped with the weight (its storage too)
    return a


def linear(x: torch.Tensor, w) -> torch.Tensor:
    """``F.linear(x, w)`` for what ``weight()`` gave: a tensor, or in the ``fused`` mode a ``FusedWeight`` (the input
    cast to the copy's dtype, as autocast would, and ``harness.runtime.fused_linear``'s operator)."""
    if isinstance(w, FusedWeight):
        return fused_linear.linear_wgrad(x.to(w.copy.dtype), w.copy, w.main_grad)
    return F.linear(x, w)


def _forget(table: dict, key):
    """A weak reference's callback: drop ``table[key]`` (a ``(weakref, value)`` entry) once its weight is gone - not an
    entry a new weight, reusing the id, has taken since."""
    def drop(_ref):
        held = table.get(key)
        if held is not None and held[0]() is None:
            del table[key]
    return drop


def held_bytes() -> int:
    """Bytes the persistent copies hold (every weight of every model seen inside ``cached_weights()``)."""
    return sum(buf.numel() * buf.element_size() for _, buf in _STATE.buffers.values())


def release() -> None:
    """Drop every persistent copy (e.g. between models in one process); the next step copies afresh."""
    if _STATE.active:
        raise WeightCacheError("release() inside cached_weights(): the step still computes with its copies")
    _STATE.buffers.clear()
    _STATE.grads.clear()
