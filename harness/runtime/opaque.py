"""Attention as one opaque operator, so that ``torch.compile`` can take a whole chain of blocks.

``torch.compile`` cannot trace CP attention (collectives, host-side plans, ATen flash ops with
data-dependent lengths), so the compiled segments of ``harness.runtime.model`` stop at every
attention: a model of L layers makes L + 1 compiled calls forward and as many backward, and on an
H200 each call costs ~0.25 ms of host time in wrappers. ``opaque_attention(q, k, v)`` hides the
attention of the current micro-batch (whatever its exchange and backend) behind a custom operator
(``torch.library.custom_op``) whose fake implementation only states the output's shape, so a whole
chain of blocks compiles into one graph (``TinyLM.compile_blocks(scope="chain")``): one compiled
call forward and one backward per micro-batch.

How the operator runs the real attention: its forward calls the attention callable installed with
``attending(attention)`` on detached copies of q / k / v *with autograd re-enabled* (a custom
operator's implementation runs below the autograd dispatch keys; the forward restores the dispatch
state the process had at import, so the attention records its own autograd graph exactly as in eager
mode) and keeps that graph under an integer key, which it returns as a CPU scalar tensor next to the
output. The backward operator receives the key (saved for backward like any tensor), takes the graph
back and runs ``torch.autograd.grad`` on it: the same kernels, collectives and rounding as the eager
attention, in the same order. A graph whose key tensor dies without a backward (inference, an
exception) is dropped with it (``weakref.finalize``), so nothing leaks; ``pending()`` counts the
graphs kept.

The attention callable is read when the forward runs, not when it is traced, so one compiled graph
serves every micro-batch: CP-1 and CP blocks, gather and ring exchanges alike. Backwards may come
in any order (pipeline schedules): each takes its own graph by key.
"""

from __future__ import annotations

import itertools
import weakref
from contextlib import contextmanager

import torch

_EAGER_DISPATCH = (torch._C._dispatch_tls_local_include_set(), torch._C._dispatch_tls_local_exclude_set())
"""The thread-local dispatch key sets of ordinary eager code (taken at import)."""

_GRAPHS: dict[int, tuple] = {}
_KEYS = itertools.count()
_CURRENT: list = [None]
_FORWARDS = [0]


class OpaqueAttentionError(RuntimeError):
    """``opaque_attention`` used wrongly (no attention installed, a graph used twice)."""


@contextmanager
def attending(attention):
    """Install ``attention`` (a callable ``(q, k, v) -> out`` with autograd) for the opaque operator
    while the block runs; the previous one is restored after it."""
    if not callable(attention):
        raise TypeError(f"attention must be callable (q, k, v) -> out, got {attention!r}")
    before, _CURRENT[0] = _CURRENT[0], attention
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


@torch.library.custom_op("dcp_harness::attention", mutates_args=())
def _forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    attention = _CURRENT[0]
    if attention is None:
        raise OpaqueAttentionError("opaque_attention ran outside `attending(attention)`: install the "
                                   "micro-batch's attention around the compiled call")
    with torch._C._ForceDispatchKeyGuard(*_EAGER_DISPATCH), torch.enable_grad():
        leaves = tuple(t.detach().requires_grad_() for t in (q, k, v))
        out = attention(*leaves)
    _FORWARDS[0] += 1
    key = next(_KEYS)
    tag = torch.tensor(key, dtype=torch.int64)
    if out.requires_grad:
        _GRAPHS[key] = (out, leaves)
        weakref.finalize(tag, _GRAPHS.pop, key, None)
    return out.detach().contiguous(), tag


@_forward.register_fake
def _(q, k, v):
    return q.new_empty(q.shape), torch.empty((), dtype=torch.int64, device="cpu")


@torch.library.custom_op("dcp_harness::attention_backward", mutates_args=())
def _backward(grad_out: torch.Tensor, tag: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    entry = _GRAPHS.pop(int(tag), None)
    if entry is None:
        raise OpaqueAttentionError(f"no forward graph under key {int(tag)}: its backward already ran "
                                   "(retain_graph is not supported through opaque_attention) or it was freed")
    out, leaves = entry
    with torch._C._ForceDispatchKeyGuard(*_EAGER_DISPATCH):
        grads = torch.autograd.grad(out, leaves, grad_out, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g.contiguous() for g, x in zip(grads, (q, k, v)))


@_backward.register_fake
def _(grad_out, tag, q, k, v):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs, output[1])


def _autograd(ctx, grad_out, _grad_tag):
    q, k, v, tag = ctx.saved_tensors
    return _backward(grad_out.contiguous(), tag, q, k, v)


_forward.register_autograd(_autograd, setup_context=_setup_context)


def opaque_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The installed attention of ``q``, ``k``, ``v`` (``[T, H, D]``), as one operator that
    ``torch.compile`` does not trace."""
    return _forward(q, k, v)[0]
