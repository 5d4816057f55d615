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
import struct
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from harness.plan.errors import PlanInputError
from harness.plan.replay import align_routes

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


_PACKABLE = (list, tuple)


def _ints(x, what: str) -> np.ndarray:
    """``x`` as a 1-D integer array, not yet int64: the caller copies it into int64 rows (the copy
    casts). numpy's dtype discovery is the type check: a float, bool-only, nested or string sample is
    refused, never truncated."""
    try:
        a = np.asarray(x)
    except (TypeError, ValueError) as e:  # ragged nesting, objects numpy cannot read
        raise BatchInputError(f"{what} must be a 1-D sequence of token ids, got {type(x).__name__} that numpy "
                              f"cannot read as one ({e})") from None
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise BatchInputError(f"{what} must be a 1-D sequence of token ids, got {type(x).__name__} of shape {a.shape}")
    return a


def _token_ids(x, kind: str, i: int):
    """``x`` itself when ``_packed`` may write it (a list or tuple: its items are checked as they are
    written), else ``_ints(x)``, so that the lengths taken next are those of a 1-D array. A list that
    starts with a bool goes to numpy, which refuses ``[True, False]`` (bool dtype) as it always did."""
    if type(x) in _PACKABLE and not (x and type(x[0]) is bool):
        return x
    return _ints(x, f"{kind} {i}")


def _packed(flat: np.ndarray, code: str, start: int, values) -> bool:
    """Write a list or tuple to ``flat[start : start + len(values)]`` through ``struct.pack_into``
    (``code`` "q": int64, "f": float32); False, with the slice possibly half written, when ``values``
    is not a list or tuple or struct refuses an item.

    Why: ``np.asarray`` walks a Python list twice (dtype discovery, then conversion) and the result
    is copied again into the batch, ~16 ns a token; struct converts each item once straight into the
    output's memory, ~5-8 ns. It is as strict: "q" takes only integers (``__index__``: a float, None,
    a string or a nested list is refused), "f" only real numbers. The caller re-reads refused values
    with numpy, which raises the typed error naming the sample, or returns what numpy accepts (an id
    beyond int64's range, a string "1.5" as a float), so results and errors stay numpy's."""
    if type(values) not in _PACKABLE:
        return False
    n = len(values)
    if n:
        try:
            struct.pack_into(f"{n}{code}", flat, start * flat.itemsize, *values)  # the array is the buffer
        except (struct.error, TypeError, OverflowError):
            return False
    return True


def _write_ids(flat: np.ndarray, start: int, ids, kind: str, i: int) -> None:
    """``flat[start : start + len(ids)] = ids``: packed, or read by numpy (``_ints``) when struct refuses."""
    if not _packed(flat, "q", start, ids):
        flat[start:start + len(ids)] = _ints(ids, f"{kind} {i}")


def _left_padded_rows(p: list, r: list, r_lens: list[int], width: int, pad_token_id) -> np.ndarray:
    """int64 ``[B, width]``: row i is pad tokens, prompt i, response i (right-aligned).

    Each token is written once, in place; the old builder converted each sample, concatenated them,
    built three index arrays of the batch's size and scattered element by element. With pad 0 the
    array comes from ``np.zeros`` (pages the kernel zeroes on first write: one pass, not two)."""
    shape = (len(p), width)
    seq = np.zeros(shape, np.int64) if pad_token_id == 0 else np.full(shape, pad_token_id, np.int64)
    flat = seq.reshape(-1)
    for i, (prompt, response, n_response) in enumerate(zip(p, r, r_lens)):
        mid = (i + 1) * width - n_response
        _write_ids(flat, mid - len(prompt), prompt, "prompt", i)
        _write_ids(flat, mid, response, "response", i)
    return seq


def _windows(template: np.ndarray, lengths, width: int) -> np.ndarray:
    """``out[i] = template[lengths[i] : lengths[i] + width]`` (``template`` has ``2 * width`` items) as
    one contiguous, writable ``[B, width]`` array.

    Every left-padded mask and ramp of the layout is such a window (template: ``width`` zeros, then
    ones or ``arange``; row i starts at ``lengths[i]``, so its first ``width - lengths[i]`` columns fall
    on the zeros): gathering rows of a strided window view is one row-wise memcpy pass, where
    broadcasting a comparison into a bool array and casting it makes two and a batch-sized temporary."""
    starts = np.asarray(lengths, np.int64)
    if starts.size and not 0 <= starts.min() <= starts.max() <= width:
        raise BatchInputError(f"lengths must lie in [0, {width}], got {starts.min()} .. {starts.max()}")
    return sliding_window_view(template, width)[starts]


def left_padded_ones(lengths, width: int, dtype=np.int64) -> np.ndarray:
    """``[B, width]``: row i is 0 on its first ``width - lengths[i]`` columns, then 1 (the attention mask
    for total lengths, the action mask for response lengths).

    >>> left_padded_ones([2, 0, 3], 3).tolist()
    [[0, 1, 1], [0, 0, 0], [1, 1, 1]]
    """
    template = np.zeros(2 * width, dtype)
    template[width:] = 1
    return _windows(template, lengths, width)


def left_padded_positions(lengths, width: int) -> np.ndarray:
    """int64 ``[B, width]``: 0 on row i's left padding, then ``0 .. lengths[i] - 1``: the values of
    ``(cumsum(mask, 1) - 1).clamp(min=0) * mask`` for a left-padded mask, in one pass instead of four.

    >>> left_padded_positions([2, 0, 3], 3).tolist()
    [[0, 0, 1], [0, 0, 0], [0, 1, 2]]
    """
    template = np.zeros(2 * width, np.int64)
    template[width:] = np.arange(width)
    return _windows(template, lengths, width)


def _floats(v, r: int, what: str, i: int) -> np.ndarray:
    """numpy's reading of sample i's per-token values, which must be ``r`` of them."""
    try:
        a = np.asarray(v, dtype=np.float32)
    except (TypeError, ValueError, OverflowError) as e:
        raise BatchInputError(f"{what} of sample {i} is not a list of numbers ({e}); give one value per "
                              f"response token") from None
    if a.ndim != 1 or len(a) != r:
        raise BatchInputError(f"{what} of sample {i} has {a.size} values for a response of {r} tokens; "
                              f"give one value per response token")
    return a


def _right_aligned(values, lengths: list[int], width: int, what: str, scalar_ok: bool = False) -> np.ndarray:
    """Row i holds ``values[i]`` (length r_i; a scalar goes to the last column) in its last r_i columns.
    Lists of the right length are packed in place (``_packed``); anything else is read by numpy."""
    out = np.zeros((len(values), width), dtype=np.float32)
    flat = out.reshape(-1)
    for i, (v, r) in enumerate(zip(values, lengths)):
        end = (i + 1) * width
        if type(v) in _PACKABLE and len(v) == r and _packed(flat, "f", end - r, v):
            continue
        if scalar_ok and isinstance(v, numbers.Real):
            if r == 0:
                raise BatchInputError(f"sample {i} has a scalar {what} but an empty response: nowhere to put it")
            flat[end - 1] = float(v)
            continue
        flat[end - r:end] = _floats(v, r, what, i)
    return out


def build_batch(prompts, responses, *, rewards=None, loss_masks=None, rollout_logprobs=None, routes=None,
                pad_token_id: int = 0, max_seq_len: int | None = None) -> StepBatch:
    """The unified layout (module doc). Inputs are never modified; lists, tuples and numpy arrays work.
    ``rewards=None`` gives zeros; ``loss_masks=None`` gives ones on every response token.

    Cost: each token is converted and written once, in place (``_left_padded_rows``), and each mask
    is a gather of template windows (``_windows``): no per-token index arrays, no temporaries, so the
    time per token stays flat as the batch (and its width) grows; ``bench padding`` measures it."""
    if len(prompts) != len(responses) or not len(prompts):
        raise BatchInputError(f"need as many prompts as responses and at least one: got {len(prompts)} prompts and "
                              f"{len(responses)} responses")
    B = len(prompts)
    p = [_token_ids(x, "prompt", i) for i, x in enumerate(prompts)]
    r = [_token_ids(x, "response", i) for i, x in enumerate(responses)]
    p_lens, r_lens = [len(a) for a in p], [len(a) for a in r]
    rl = np.array(r_lens, np.int64)
    total = np.array(p_lens, np.int64) + rl
    W, R = int(total.max()), int(rl.max())
    seq = _left_padded_rows(p, r, r_lens, W, pad_token_id)
    if max_seq_len is not None and W > max_seq_len:
        log.warning("longest sequence in the batch (%d tokens) exceeds max_seq_len=%d; nothing is truncated "
                    "(check the generator's limits)", W, max_seq_len)
    attn = left_padded_ones(total, W)
    act = left_padded_ones(rl, R)
    for name, v in (("rewards", rewards), ("loss_masks", loss_masks), ("rollout_logprobs", rollout_logprobs)):
        if v is not None and len(v) and len(v) != B:
            raise BatchInputError(f"{name} has {len(v)} entries for {B} samples")
    rew = np.zeros((B, R), np.float32) if rewards is None else _right_aligned(rewards, r_lens, R, "reward", scalar_ok=True)
    lm = left_padded_ones(rl, R, np.float32) if loss_masks is None else _right_aligned(loss_masks, r_lens, R, "loss mask")
    lp = None if rollout_logprobs is None or not len(rollout_logprobs) else \
        _right_aligned(rollout_logprobs, r_lens, R, "rollout logprob")
    if routes is not None and len(routes):
        routes = align_routes(routes, p_lens, r_lens)
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
