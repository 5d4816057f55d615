"""Attention as one opaque operator, so that ``torch.compile`` can take a whole chain of blocks.

``torch.compile`` cannot trace CP attention (collectives, host-side plans, ATen flash ops with
data-dependent lengths), so the compiled segments of ``harness.runtime.model`` stop at every
attention: a model of L layers makes L + 1 compiled calls forward and as many backward, and on an
H200 each call costs ~0.25 ms of host time in wrappers. ``opaque_attention(q, k, v)`` hides the
attention of the current micro-batch (whatever its exchange and backend) behind a custom operator
(``dcp_harness::attention``) whose fake implementation only states the output's shape, so a whole
chain of blocks compiles into one graph (``TinyLM.compile_blocks(scope="chain")``): one compiled
call forward and one backward per micro-batch.

How the operator runs the real attention: its forward calls the attention callable installed with
``attending(attention)`` on detached copies of q / k / v *with autograd re-enabled* (a custom
operator's implementation runs below the autograd dispatch keys; the forward restores the dispatch
state of the code that installed the attention, autocast included, and the backward a thread's default
state, so the attention records and runs its own autograd graph exactly as in eager mode) and keeps that graph under an integer key, which it returns as a CPU scalar tensor next to the
output. The backward operator receives the key (saved for backward like any tensor), takes the graph
back and runs ``torch.autograd.grad`` on it: the same kernels, collectives and rounding as the eager
attention, in the same order. A graph whose key tensor dies without a backward (inference, an
exception) is dropped with it (a weak reference's callback), so nothing leaks; ``pending()`` counts
the graphs kept.

The attention callable is read when the forward runs, not when it is traced, so one compiled graph
serves every micro-batch: CP-1 and CP blocks, gather and ring exchanges alike. Backwards may come
in any order (pipeline schedules): each takes its own graph by key.

Host overhead (``dcp-harness bench opaque``, ``harness.bench.microbatch.opaque_overhead``): the
operators are defined with ``torch.library.Library`` and their implementations registered as
``CompositeExplicitAutograd`` kernels, which the dispatcher calls as they are.
``torch.library.custom_op`` wrapped every call in several us of Python (a device-type lookup, an
aliasing check, a ``torch._dynamo`` disable wrapper, and for the backward operator an autograd
wrapper): ~29 of the ~91 us per layer that a compiled chain paid on a 2-core CPU (now ~64 us;
``reports/recorded/README.md``, "bench opaque"). The forward's autograd formula is still
``torch.library.register_autograd`` (public; a hand-written ``Autograd`` kernel would save ~3 us more
per layer but needs private redispatch APIs). The backward operator has no autograd kernel:
``create_graph=True`` goes through ``_FirstOrderOnly``, which refuses a double backward by name. The
wrapper's aliasing check (outputs must not share memory with inputs: compiled graphs reuse buffers on
that promise) is now ``_fresh`` (~2-5 us per layer). Private torch APIs:
``torch._C._ForceDispatchKeyGuard`` and ``torch._C._dispatch_tls_local_{include,exclude}_set``
(present in torch 2.11 and 2.13; a torch upgrade must re-run ``suites/runtime/test_opaque.py``); the
``torch.library`` calls above are public (since torch 2.4).
"""

from __future__ import annotations

import itertools
import threading
import weakref
from contextlib import contextmanager

import torch


def _dispatch_state() -> tuple:
    """The calling thread's local dispatch key sets (autocast's state among them)."""
    return torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set()


def _default_dispatch_state() -> tuple:
    """The dispatch key sets a thread starts with: eager code outside any autocast or mode. Read in a new thread,
    so it does not depend on the state of the code that imports this module (e.g. a bf16 step's autocast)."""
    box: list = []
    reader = threading.Thread(target=lambda: box.append(_dispatch_state()), name="dcp-harness-dispatch-state")
    reader.start()
    reader.join()
    return box[0]


_BACKWARD_DISPATCH = _default_dispatch_state()
"""The backward's dispatch state: as eager autograd runs a backward called outside autocast."""

_GRAPHS: dict[int, tuple] = {}
_KEYS = itertools.count()
_CURRENT: list = [None]
_FORWARDS = [0]


class OpaqueAttentionError(RuntimeError):
    """``opaque_attention`` used wrongly (no attention installed, a graph used twice, a double
    backward, an attention whose output or gradient shares memory with its inputs)."""


@contextmanager
def attending(attention):
    """Install ``attention`` (a callable ``(q, k, v) -> out`` with autograd) for the opaque operator
    while the block runs; the previous one is restored after it. The operator's forward runs it in the dispatch
    state of this call (inside a bf16 step's autocast: under autocast, as the eager forward would); its backward
    runs in a thread's default state (as eager autograd runs a backward called outside autocast)."""
    if not callable(attention):
        raise TypeError(f"attention must be callable (q, k, v) -> out, got {attention!r}")
    before, _CURRENT[0] = _CURRENT[0], (attention, _dispatch_state())  # the caller's state: its autocast too
    try:
        yield
    finally:
        _CURRENT[0] = before


def pending() -> int:
    """How many forward graphs wait for their backward."""
    return len(_GRAPHS)


def forward_calls() -> int:
    """How many times the operator's forward has run in this process."""
    return _FORWARDS[0]


def _fresh(op: str, outputs: tuple, inputs: tuple, *, copy: bool = False) -> tuple:
    """``outputs``, none sharing memory with ``inputs`` or another output (an operator's schema
    promises fresh outputs; compiled graphs reuse buffers on that promise). An aliased output is
    refused by name, or with ``copy`` (the backward's gradients, which autograd may hand out as views
    of one buffer, e.g. of a stacked K/V) replaced by a copy."""
    seen = {t.untyped_storage().data_ptr() for t in inputs}
    fresh = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen and ptr:  # 0: an empty storage, nothing to share
            if not copy:
                raise OpaqueAttentionError(f"{op}: the attention returned a tensor that shares memory with an "
                                           "input or another output (e.g. an input passed straight through); "
                                           "return a copy")
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        fresh.append(t)
    return tuple(fresh)


def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _CURRENT[0] is None:
        raise OpaqueAttentionError("opaque_attention ran outside `attending(attention)`: install the "
                                   "micro-batch's attention around the compiled call")
    attention, dispatch = _CURRENT[0]
    with torch._C._ForceDispatchKeyGuard(*dispatch), torch.enable_grad():
        leaves = (q.detach().requires_grad_(), k.detach().requires_grad_(), v.detach().requires_grad_())
        out = attention(*leaves)
    result = _fresh("opaque_attention", (out.detach().contiguous(),), (q, k, v))  # refused: nothing kept
    _FORWARDS[0] += 1
    key = next(_KEYS)
    tag = torch.full((), key, dtype=torch.int64)  # torch.tensor(key) costs ~1 us more
    if out.requires_grad:  # the weak reference dies with the entry; its callback drops the entry with the tag
        _GRAPHS[key] = (out, leaves, weakref.ref(tag, lambda _, key=key: _GRAPHS.pop(key, None)))
    return result + (tag,)


def _backward(grad_out: torch.Tensor, tag: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    entry = _GRAPHS.pop(int(tag), None)
    if entry is None:
        raise OpaqueAttentionError(f"no forward graph under key {int(tag)}: its backward already ran "
                                   "(retain_graph is not supported through opaque_attention), or its key tensor "
                                   "died: a saved_tensors_hooks pack that copies saved tensors (CPU offloading) "
                                   "frees the graph; keep opaque_attention outside such hooks")
    out, leaves, _ = entry
    with torch._C._ForceDispatchKeyGuard(*_BACKWARD_DISPATCH):
        dq, dk, dv = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return _fresh("opaque_attention backward", (torch.zeros_like(q) if dq is None else dq.contiguous(),
                                                torch.zeros_like(k) if dk is None else dk.contiguous(),
                                                torch.zeros_like(v) if dv is None else dv.contiguous()),
                  (grad_out, q, k, v), copy=True)


_LIB = torch.library.Library("dcp_harness", "FRAGMENT")
_LIB.define("attention(Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor)", tags=(torch.Tag.pt2_compliant_tag,))
_LIB.define("attention_backward(Tensor grad_out, Tensor tag, Tensor q, Tensor k, Tensor v) -> (Tensor, Tensor, Tensor)",
            tags=(torch.Tag.pt2_compliant_tag,))
_LIB.impl("attention", _forward, "CompositeExplicitAutograd")  # every device; called as is, no wrapper
_LIB.impl("attention_backward", _backward, "CompositeExplicitAutograd")
_ATTENTION = torch.ops.dcp_harness.attention.default
_ATTENTION_BACKWARD = torch.ops.dcp_harness.attention_backward.default


@torch.library.register_fake("dcp_harness::attention", lib=_LIB)
def _(q, k, v):
    return q.new_empty(q.shape), torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.register_fake("dcp_harness::attention_backward", lib=_LIB)
def _(grad_out, tag, q, k, v):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


class _FirstOrderOnly(torch.autograd.Function):
    """The backward operator where its gradients need a graph (``create_graph=True``): they get one
    whose backward refuses by name (the operator itself has no autograd kernel: a Python one costs
    ~4 us on every call, and the dispatcher's fallback would only warn)."""

    @staticmethod
    def forward(ctx, grad_out, tag, q, k, v):
        return _ATTENTION_BACKWARD(grad_out, tag, q, k, v)

    @staticmethod
    def backward(ctx, *grads):
        raise OpaqueAttentionError("a backward through opaque_attention's gradients (create_graph=True, "
                                   "double backward) is not supported")


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output[1])


def _autograd(ctx, grad_out, _grad_tag):
    q, k, v, tag = ctx.saved_tensors
    if torch.is_grad_enabled():  # create_graph=True
        return _FirstOrderOnly.apply(grad_out.contiguous(), tag, q, k, v)
    return _ATTENTION_BACKWARD(grad_out.contiguous(), tag, q, k, v)


torch.library.register_autograd("dcp_harness::attention", _autograd, setup_context=_setup_context, lib=_LIB)


def opaque_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The installed attention of ``q``, ``k``, ``v`` (``[T, H, D]``), as one operator that
    ``torch.compile`` does not trace."""
    return _ATTENTION(q, k, v)[0]
