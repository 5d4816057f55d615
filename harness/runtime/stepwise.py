"""Torch tensors of a step-wise batch (``harness.plan.stepwise.build_batch``).

dtypes: ``sequences``, ``attention_mask``, ``action_mask``: int64; ``rewards``, ``loss_masks``,
``rollout_logprobs``: float32; ``routes``: uint8 / int16 / int32 (cast to int64 before ``gather``);
``position_ids`` = ``cumsum(attention_mask) - 1`` with 0 on padding.
"""

from __future__ import annotations

import torch

from harness.plan.stepwise import build_batch, left_padded_positions


def batch_tensors(prompts, responses, *, device="cpu", **kw) -> dict[str, torch.Tensor | None]:
    """``build_batch``'s arrays as tensors, plus ``position_ids``.

    On the CPU the tensors share the numpy arrays' memory (``torch.as_tensor`` of an ndarray does not
    copy). ``position_ids`` come from each sample's length (``build_batch`` has just checked that every
    prompt and response is 1-D, so ``len`` is its token count) as windows of a ramp
    (``left_padded_positions``): the torch chain ``cumsum - 1, clamp, * mask`` made four passes over
    ``[B, W]`` int64 and took longer than building the whole batch."""
    b = build_batch(prompts, responses, **kw)
    out = {k: None if v is None else torch.as_tensor(v, device=device) for k, v in vars(b).items()}
    lengths = [len(p) + len(r) for p, r in zip(prompts, responses)]
    out["position_ids"] = torch.as_tensor(left_padded_positions(lengths, b.sequences.shape[1]), device=device)
    return out
