"""Torch tensors of a step-wise batch (``harness.plan.stepwise.build_batch``).

dtypes: ``sequences``, ``attention_mask``, ``action_mask``: int64; ``rewards``, ``loss_masks``,
``rollout_logprobs``: float32; ``routes``: uint8 / int16 / int32 (cast to int64 before ``gather``);
``position_ids`` = ``cumsum(attention_mask) - 1`` with 0 on padding.
"""

from __future__ import annotations

import torch

from harness.plan.stepwise import build_batch


def batch_tensors(prompts, responses, *, device="cpu", **kw) -> dict[str, torch.Tensor | None]:
    b = build_batch(prompts, responses, **kw)
    out = {k: None if v is None else torch.as_tensor(v, device=device) for k, v in vars(b).items()}
    attn = out["attention_mask"]
    out["position_ids"] = (attn.cumsum(1) - 1).clamp_min(0) * attn
    return out
