"""RL step-wise batches: the unified left-padded layout, right-aligned response tensors, and the
advantage broadcast from each trajectory's last step (numpy, no torch).

Layout (``build_batch``), for prompts p_i and responses r_i:

* ``sequences [B, W]``, ``W = max(p_i + r_i)``: all padding on the left, then prompt, then response;
  ``attention_mask`` 1 on real tokens. (The old two-segment layout used ``max p + max r``: with
  step-wise samples, whose prompts grow as responses shrink, that nearly doubles the width.)
* response tensors ``[B, R]``, ``R = max r_i``, right-aligned so that the model's last-R window holds
  sample i's response in its last r_i columns: ``action_mask``, ``rewards`` (per-token lists, or a
  scalar placed on the last response token), ``loss_masks``, ``rollout_logprobs``.

>>> b = build_batch([[1, 2], [3, 4, 5, 6]], [[10, 11, 12], [20, 21]], rewards=[1.0, [0, 2]],
...                 loss_masks=[[1, 1, 1], [1, 1]])
>>> b.sequences.tolist(), b.action_mask.tolist()
([[0, 1, 2, 10, 11, 12], [3, 4, 5, 6, 20, 21]], [[1, 1, 1], [0, 1, 1]])
>>> b.rewards.tolist()
[[0.0, 0.0, 1.0], [0.0, 0.0, 2.0]]
>>> response_values([5.0, 6.0, 7.0], 0), response_values([5.0, 6.0, 7.0], 2)
([], [6.0, 7.0])
"""

from __future__ import annotations

import logging
import numbers
from dataclasses import dataclass

import numpy as np

from harness.plan.errors import PlanInputError

log = logging.getLogger("harness.stepwise")


class BatchInputError(PlanInputError):
    """Prompts / responses / per-token lists that cannot form a batch."""


@dataclass(frozen=True)
class StepBatch:
    """dtypes: ``sequences``, ``attention_mask``, ``action_mask`` int64; ``rewards``, ``loss_masks``,
    ``rollout_logprobs`` float32; ``routes`` uint8 / int16 / int32 (``harness.plan.replay``)."""

    sequences: np.ndarray
    attention_mask: np.ndarray
    action_mask: np.ndarray
    rewards: np.ndarray
    loss_masks: np.ndarray
    rollout_logprobs: np.ndarray | None
    routes: np.ndarray | None

    @property
    def padded_tokens(self) -> int:
        return int(self.attention_mask.size - self.attention_mask.sum())


def _ints(x, what: str) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise BatchInputError(f"{what} must be a 1-D sequence of token ids, got {type(x).__name__} of shape {a.shape}")
    return a.astype(np.int64, copy=False)


def _right_aligned(values: list, lengths: np.ndarray, width: int, what: str, scalar_ok: bool = False) -> np.ndarray:
    """Row i holds ``values[i]`` (length r_i; a scalar goes to the last column) in its last r_i columns."""
    out = np.zeros((len(values), width), dtype=np.float32)
    for i, (v, r) in enumerate(zip(values, lengths)):
        if scalar_ok and isinstance(v, numbers.Real):
            if r == 0:
                raise BatchInputError(f"sample {i} has a scalar {what} but an empty response: nowhere to put it")
            out[i, width - 1] = float(v)
            continue
        v = np.asarray(v, dtype=np.float32)
        if v.ndim != 1 or len(v) != r:
            raise BatchInputError(f"{what} of sample {i} has {v.size} values for a response of {r} tokens; "
                                  f"give one value per response token")
        if r:
            out[i, width - r:] = v
    return out


def build_batch(prompts, responses, *, rewards=None, loss_masks=None, rollout_logprobs=None, routes=None,
                pad_token_id: int = 0, max_seq_len: int | None = None) -> StepBatch:
    """The unified layout (module doc). Inputs are never modified; lists, tuples and numpy arrays work.
    ``rewards=None`` gives zeros; ``loss_masks=None`` gives ones on every response token."""
    if len(prompts) != len(responses) or not len(prompts):
        raise BatchInputError(f"need as many prompts as responses and at least one: got {len(prompts)} prompts and "
                              f"{len(responses)} responses")
    B = len(prompts)
    p = [_ints(x, f"prompt {i}") for i, x in enumerate(prompts)]
    r = [_ints(x, f"response {i}") for i, x in enumerate(responses)]
    pl, rl = np.fromiter(map(len, p), np.int64, B), np.fromiter(map(len, r), np.int64, B)
    total = pl + rl
    W, R = int(total.max()), int(rl.max())
    if max_seq_len is not None and W > max_seq_len:
        log.warning("longest sequence in the batch (%d tokens) exceeds max_seq_len=%d; nothing is truncated "
                    "(check the generator's limits)", W, max_seq_len)
    flat = np.concatenate([np.concatenate([a, b]) for a, b in zip(p, r)]) if B else np.zeros(0, np.int64)
    row = np.repeat(np.arange(B), total)
    col = np.arange(flat.size) - np.repeat(np.cumsum(total) - total, total) + np.repeat(W - total, total)
    seq = np.full((B, W), pad_token_id, dtype=np.int64)
    seq[row, col] = flat
    attn = (np.arange(W)[None, :] >= (W - total)[:, None]).astype(np.int64)
    act = (np.arange(R)[None, :] >= (R - rl)[:, None]).astype(np.int64)
    for name, v in (("rewards", rewards), ("loss_masks", loss_masks), ("rollout_logprobs", rollout_logprobs)):
        if v is not None and len(v) and len(v) != B:
            raise BatchInputError(f"{name} has {len(v)} entries for {B} samples")
    rew = np.zeros((B, R), np.float32) if rewards is None else _right_aligned(rewards, rl, R, "reward", scalar_ok=True)
    lm = act.astype(np.float32) if loss_masks is None else _right_aligned(loss_masks, rl, R, "loss mask")
    lp = None if rollout_logprobs is None or not len(rollout_logprobs) else \
        _right_aligned(rollout_logprobs, rl, R, "rollout logprob")
    if routes is not None and len(routes):
        from harness.plan.replay import align_routes

        routes = align_routes(routes, pl.tolist(), rl.tolist())
    else:
        routes = None
    return StepBatch(seq, attn, act, rew, lm, lp, routes)


def response_values(row, valid_len: int) -> list:
    """The last ``valid_len`` values of a right-aligned response row. ``row[-0:]`` would be the whole
    row, so an empty response gives an empty list explicitly."""
    if valid_len < 0:
        raise BatchInputError(f"valid_len must be >= 0, got {valid_len}")
    return list(row[len(row) - valid_len:]) if valid_len else []


def two_segment_width(prompt_lens, response_lens) -> int:
    """Width of the old layout: ``max prompt + max response`` (right-padded prompts, then responses)."""
    return int(max(prompt_lens)) + int(max(response_lens))


def trajectory_ordinals(is_last_step) -> np.ndarray:
    """Upstream's cumsum trick: row i belongs to trajectory ``sum(is_last_step[:i])``. Correct only when
    every trajectory's steps are contiguous and end with ``is_last_step`` (``validate_generator_output``)."""
    last = np.asarray([bool(x) for x in is_last_step])
    return np.cumsum(np.concatenate([[False], last[:-1]]).astype(np.int64))


def broadcast_step_advantages(last_step_values, is_last_step, response_mask) -> np.ndarray:
    """Each trajectory's scalar (advantage or return, one per ``is_last_step`` row, in order) on every
    step of that trajectory, masked by each step's *own* right-aligned response mask."""
    ords = trajectory_ordinals(is_last_step)
    vals = np.asarray(last_step_values, dtype=np.float32)
    n_traj = int(ords[-1]) + 1 if len(ords) else 0
    if n_traj != len(vals):
        raise BatchInputError(f"{n_traj} trajectories by is_last_step but {len(vals)} last-step values: "
                              f"is_last_step is likely malformed")
    return vals[ords][:, None] * np.asarray(response_mask, dtype=np.float32)


def grpo_advantages(rewards, groups, *, std_normalize: bool = False, eps: float = 1e-6) -> np.ndarray:
    """Outcome advantages per trajectory: reward minus its group's mean (optionally / group std)."""
    rewards, groups = np.asarray(rewards, dtype=np.float64), list(groups)
    out = np.zeros_like(rewards)
    for g in dict.fromkeys(groups):
        idx = np.array([i for i, x in enumerate(groups) if x == g])
        centred = rewards[idx] - rewards[idx].mean()
        out[idx] = centred / (rewards[idx].std() + eps) if std_normalize and len(idx) > 1 else centred
    return out.astype(np.float32)
