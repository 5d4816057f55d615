"""``validate_generator_output``: the checks of spec C on a generator's output dict, in upstream's
order (which check fires first matters), as ``GeneratorOutputError`` (a ``ValueError``).

Flags (``is_last_step``) may be Python bools, numpy ``bool_``, 0/1 ints or torch scalars: they are
normalised with ``as_flag`` (upstream compared with ``is True``, so a valid batch of numpy booleans
failed, and a malformed one slipped through the "trajectory continues" check). Anything else (2,
"yes", None) is an error. Trajectory ids are compared by ``to_string()`` when they have one, else
``str()``.

>>> out = {"response_ids": [[1], [2], [3]], "prompt_token_ids": [[9], [9], [8]], "loss_masks": [[1], [1], [1]],
...        "rewards": [[0.0], [1.0], [0.5]], "is_last_step": [False, True, True], "trajectory_ids": ["a", "a", "b"]}
>>> validate_generator_output(2, out, step_wise=True)
>>> out["trajectory_ids"] = ["a", "b", "a"]; out["is_last_step"] = [False, False, True]
>>> validate_generator_output(2, out, step_wise=True)
Traceback (most recent call last):
...
harness.plan.generator_output.GeneratorOutputError: Non-contiguous trajectory at index 2: trajectory 'a' appeared earlier, then another trajectory, then again here; step-wise training needs all steps of a trajectory to be adjacent
"""

from __future__ import annotations

import logging
import numbers

from harness.plan.errors import PlanInputError

log = logging.getLogger("harness.stepwise")
PER_SAMPLE_KEYS = ("response_ids", "loss_masks", "rewards", "rollout_logprobs", "stop_reasons",
                   "trajectory_ids", "rollout_expert_indices", "is_last_step")


class GeneratorOutputError(PlanInputError):
    """The generator's output breaks a rule of step-wise (or plain) training."""


def as_flag(x, where: str) -> bool:
    """A boolean from bool / numpy bool / 0-1 int / one-element tensor; anything else is an error."""
    if hasattr(x, "item") and not isinstance(x, (bool, numbers.Number)):
        size = x.numel() if hasattr(x, "numel") else getattr(x, "size", 1)
        if size != 1:
            raise GeneratorOutputError(f"{where} must be a boolean, got an array of shape {tuple(x.shape)}")
        x = x.item()
    if isinstance(x, bool) or type(x).__name__ == "bool_":
        return bool(x)
    if isinstance(x, numbers.Integral) and int(x) in (0, 1):
        return bool(int(x))
    raise GeneratorOutputError(f"{where} must be a boolean (True/False, 0/1), got {x!r}")


def _key(tid) -> str:
    return tid.to_string() if hasattr(tid, "to_string") else str(tid)


def check_step_wise_fields(out: dict, n: int) -> None:
    """The step-wise rules (spec C.2): flags and trajectory ids present and as long as the batch, the
    last sample a final step, every trajectory's steps adjacent and closed by ``is_last_step``. The
    advantage broadcast (``harness.plan.stepwise.trajectory_ordinals``) is correct only on batches that
    pass; ``harness.faults`` replaces this function to re-create the batches that did not."""
    for field in ("is_last_step", "trajectory_ids"):
        if out.get(field) is None:
            raise GeneratorOutputError(f"step_wise=True but `{field}` is missing from the generator output")
    last = [as_flag(x, f"is_last_step[{i}]") for i, x in enumerate(out["is_last_step"])]
    keys = [_key(t) for t in out["trajectory_ids"]]
    if len(last) != n:
        raise GeneratorOutputError(f"is_last_step length ({len(last)}) must equal response_ids length ({n})")
    if len(keys) != n:
        raise GeneratorOutputError(f"trajectory_ids length ({len(keys)}) must equal response_ids length ({n})")
    if not last[-1]:
        raise GeneratorOutputError("is_last_step[-1] must be True (the last sample must be the final step of a trajectory)")
    closed: set[str] = set()
    for i in range(n):
        if i and keys[i] != keys[i - 1]:
            closed.add(keys[i - 1])
            if keys[i] in closed:
                raise GeneratorOutputError(
                    f"Non-contiguous trajectory at index {i}: trajectory '{keys[i]}' appeared earlier, then another "
                    f"trajectory, then again here; step-wise training needs all steps of a trajectory to be adjacent")
    for i in range(n - 1):
        if keys[i] != keys[i + 1] and not last[i]:
            raise GeneratorOutputError(f"Trajectory boundary at index {i} ('{keys[i]}' -> '{keys[i + 1]}') but "
                                       f"is_last_step[{i}] is False; it must be True where a trajectory ends")
        if keys[i] == keys[i + 1] and last[i]:
            raise GeneratorOutputError(f"is_last_step[{i}] is True but trajectory '{keys[i]}' continues at index "
                                       f"{i + 1}; it must be True only at a trajectory's final step")


def validate_generator_output(num_prompts: int, out: dict, step_wise: bool = False) -> None:
    """Raise ``GeneratorOutputError`` for the first broken rule (order of spec C.1)."""
    if not isinstance(num_prompts, int):
        raise GeneratorOutputError(f"num_prompts must be an int, got {type(num_prompts).__name__}")
    responses = out.get("response_ids") or []
    n = len(responses)
    if n == 0:
        raise GeneratorOutputError("No outputs generated: response_ids is empty")
    if not step_wise and num_prompts != n:
        raise GeneratorOutputError(f"Mismatch between prompts ({num_prompts}) and responses ({n})")
    if n != len(out.get("prompt_token_ids") or []):
        raise GeneratorOutputError(f"Mismatch between responses ({n}) and prompt_token_ids "
                                   f"({len(out.get('prompt_token_ids') or [])})")
    for key in PER_SAMPLE_KEYS:
        v = out.get(key)
        if isinstance(v, list) and len(v) != n:
            raise GeneratorOutputError(f"Generator output {key} length must be equal to response_ids length, "
                                       f"got {len(v)} and {n}")
    rewards, lps = out.get("rewards") or [], out.get("rollout_logprobs")
    masks = out.get("loss_masks") or []
    for i in range(n):
        r = len(responses[i])
        if len(masks[i]) != r:
            raise GeneratorOutputError(f"Response ids and loss masks must have the same length, for sample {i} got "
                                       f"{r} and {len(masks[i])}")
        if rewards and isinstance(rewards[i], (list, tuple)) and len(rewards[i]) != r:
            raise GeneratorOutputError(f"Token rewards must match the response length, for sample {i} got "
                                       f"{len(rewards[i])} and {r}")
        if lps and len(lps[i]) != r:
            raise GeneratorOutputError(f"Rollout logprobs must match the response length, for sample {i} got "
                                       f"{len(lps[i])} and {r}")
    if masks and all(not any(m) for m in masks):
        log.warning("All outputs are loss masked, which may lead to NaN loss; check the generator's loss masks")
    kinds = {isinstance(x, (list, tuple)) for x in rewards}
    if len(kinds) > 1:
        raise GeneratorOutputError("rewards must be all per-token lists (List[List[float]]) or all scalars (List[float])")
    if step_wise:
        check_step_wise_fields(out, n)
