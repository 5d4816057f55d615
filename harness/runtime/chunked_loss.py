"""The LM head and its cross-entropy over chunks of tokens (a "fused linear cross-entropy"): the logits are never
whole.

The plain head computes ``T x V`` logits, keeps them (and the softmax) in fp32 for the backward, and the loss
reads them: at 32K tokens a pack and a 128K vocabulary that is 16 GiB a micro-batch, more than the model's
activations. ``head_losses`` takes the head's input ``h`` (``T x E``), the head's weight (``V x E``, or the TP rank's
``V / tp`` rows) and the labels, and walks the tokens ``chunk`` rows at a time:

- **forward**: each chunk's logits (``chunk x V``, fp32) give their log-sum-exp and the target's logit, then are
  freed; only ``h``, the weight, the labels and one fp32 log-sum-exp per token are kept;
- **backward**: each chunk's logits are computed again (the price: the head's forward GEMM twice), their
  gradient ``(softmax - onehot) x upstream`` formed from the kept log-sum-exp, and at once multiplied into the
  input's gradient rows and added into the weight's gradient; peak memory is one chunk's ``chunk x V`` instead of
  ``T x V``.

The per-token upstream gradient is applied per token before the rows are summed into the weight's gradient (each
token's loss carries its own weight: padding 0, multi-token prediction's masked positions 0, the loss's scale).
Returning per-token losses keeps the caller's masking and normalisation exactly as with the plain head.

Under tensor parallelism the weight is the rank's vocabulary shard: each rank computes the log-sum-exp of its columns
and the target's logit where it owns the label, and ``combine`` - given by ``harness.parallel.vocab_parallel``, which
owns the collectives (this module is single-process) - makes them the whole vocabulary's (three all-reduces of ``T``
values whatever the chunk count); the padded vocabulary's columns are masked out as in the plain vocab-parallel loss.
The input's gradient is this rank's columns' share: the head's input enters through ``tensor_parallel``'s
``head_input``, whose backward sums it over TP.

In the step's ``fused`` weight mode (``harness.runtime.weight_cache``) the weight's gradient is added chunk by chunk
into the weight's fp32 ``.grad`` (its ``main_grad``), and the copy gets none, as ``fused_linear`` does. Otherwise it
is accumulated in fp32 over the chunks and returned in the weight's dtype (one rounding, not one per chunk).

``chunks`` and ``upstream`` are seams (``harness.faults``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ChunkedLossError(ValueError):
    """A chunked head was asked for something it cannot do (named in the message, with the fix)."""


def chunks(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """``[start, stop)`` of each chunk of ``chunk`` rows covering ``tokens`` rows, the last one shorter (a seam)."""
    return [(a, min(a + chunk, tokens)) for a in range(0, tokens, chunk)]


def upstream(grad: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """The upstream gradient of the chunk's tokens' losses (one value a token; a seam)."""
    return grad[start:stop]


def _logits(h: torch.Tensor, w: torch.Tensor, start: int, vocab: int | None) -> torch.Tensor:
    """One chunk's fp32 logits of the weight's rows, the padded vocabulary's columns (ids ``>= vocab``) at -inf."""
    logits = F.linear(h, w).float()
    if vocab is not None and start + logits.shape[-1] > vocab:
        logits[:, max(vocab - start, 0):] = float("-inf")  # max: a shard of padding only (a negative bound wraps)
    return logits


class _ChunkedHeadCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, main_grad, labels, chunk, start, vocab, combine):
        T = h.shape[0]
        lse = torch.empty(T, dtype=torch.float32, device=h.device)
        target = torch.zeros(T, dtype=torch.float32, device=h.device)
        width = w.shape[0]
        owned = (labels >= start) & (labels < start + width)
        idx = (labels - start).where(owned, 0)
        for a, b in chunks(T, chunk):
            logits = _logits(h[a:b], w, start, vocab)
            lse[a:b] = torch.logsumexp(logits, dim=-1)
            # where, not a product: a column at -inf (padding) times 0 would be NaN
            target[a:b] = logits.gather(1, idx[a:b].unsqueeze(1)).squeeze(1).where(owned[a:b], 0.0)
            del logits
        if combine is not None:  # a vocabulary shard: the whole vocabulary's log-sum-exp and target logit
            lse, target = combine(lse, target)
        ctx.save_for_backward(h, w, idx, owned, lse)
        ctx.main_grad, ctx.chunk, ctx.start, ctx.vocab = main_grad, chunk, start, vocab
        return lse - target

    @staticmethod
    def backward(ctx, grad):
        from harness.runtime.fused_linear import gemm_accumulate

        h, w, idx, owned, lse = ctx.saved_tensors
        main_grad = ctx.main_grad
        dh = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device) \
            if ctx.needs_input_grad[1] and main_grad is None else None
        for a, b in chunks(h.shape[0], ctx.chunk):
            g = (_logits(h[a:b], w, ctx.start, ctx.vocab) - lse[a:b].unsqueeze(1)).exp_()
            rows = torch.arange(b - a, device=g.device)
            g[rows, idx[a:b]] -= owned[a:b].to(g.dtype)
            g = g.mul_(upstream(grad, a, b).to(g.dtype).unsqueeze(1)).to(h.dtype)
            if dh is not None:
                dh[a:b] = g @ w
            if main_grad is not None:
                gemm_accumulate(main_grad, g, h[a:b])
            elif dw is not None:
                dw.addmm_(g.t().float(), h[a:b].float())
        if main_grad is not None:
            # the copy's "gradient": a zero broadcast to its shape, as fused_linear returns, so that autograd still
            # runs the weight's own accumulation node and its post-accumulate hooks
            dw = w.new_zeros(()).expand(w.shape) if ctx.needs_input_grad[1] else None
        else:
            dw = dw.to(w.dtype) if dw is not None else None
        return dh, dw, None, None, None, None, None, None


def head_losses(h: torch.Tensor, w, labels: torch.Tensor, chunk: int, vocab: int | None = None,
                start: int = 0, combine=None) -> torch.Tensor:
    """Each token's cross-entropy (fp32, ``T``) of the head ``w`` applied to ``h`` (``T x E``) against ``labels``
    (ids in ``[0, vocab)``; another id is an error), ``chunk`` tokens at a time. ``w``: the head's weight
    (``V x E``), or what ``weight_cache.weight`` gave (a ``FusedWeight``: the gradient goes into its ``main_grad``).
    For a vocabulary shard ``w`` holds ids ``[start, start + rows)`` of the padded vocabulary, ``vocab`` is the real
    vocabulary (columns from it on are padding) and ``combine(lse, target) -> (lse, target)`` turns each token's
    log-sum-exp over the shard's columns and its target logit (0 where another shard owns the label) into the whole
    vocabulary's, the same on every rank (``harness.parallel.vocab_parallel.chunked_cross_entropy``)."""
    from harness.runtime.weight_cache import FusedWeight

    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ChunkedLossError(f"chunk={chunk!r} must be an int >= 1 (tokens per chunk of the head's logits)")
    if h.dim() != 2 or labels.shape != h.shape[:1]:
        raise ChunkedLossError(f"h must be T x E and labels T: got h {tuple(h.shape)}, labels {tuple(labels.shape)}")
    if start and (vocab is None or combine is None):
        raise ChunkedLossError(f"start={start} names a vocabulary shard: give the real vocab and the combine of its "
                               "TP group (harness.parallel.vocab_parallel.chunked_cross_entropy does)")
    real = vocab if vocab is not None else (w.copy if isinstance(w, FusedWeight) else w).shape[0]
    # on the device, without a host sync: an id past the vocabulary would otherwise be a silent loss of lse alone
    torch._assert_async(((labels >= 0) & (labels < real)).all(),
                        f"labels must be token ids in [0, {real}): clamp or mask ignored ones (e.g. -100) first")
    main_grad = None
    if isinstance(w, FusedWeight):
        w, main_grad = w.copy, w.main_grad
        h = h.to(w.dtype)  # as fused_linear casts its input to the copy's dtype
    elif torch.is_autocast_enabled(h.device.type):
        dtype = torch.get_autocast_dtype(h.device.type)
        h, w = h.to(dtype), w.to(dtype)  # autocast's cast of F.linear's operands, made once for every chunk
    with torch.autocast(h.device.type, enabled=False):
        return _ChunkedHeadCE.apply(h, w, main_grad, labels, chunk, start, vocab, combine)
