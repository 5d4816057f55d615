"""validate_generator_output: accepts every valid step-wise output, rejects each class of invalid
one with its message, in upstream's order; numpy / torch / int flags are normalised."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from harness.plan.generator_output import GeneratorOutputError, validate_generator_output


class TID:
    def __init__(self, instance, rep=0):
        self.instance, self.rep = instance, rep

    def to_string(self):
        return f"{self.instance}_{self.rep}"


def make(steps=(2, 3), contiguous=True):
    rows = [(t, s, s == n - 1) for t, n in enumerate(steps) for s in range(n)]
    if not contiguous:
        rows.sort(key=lambda x: (x[1], x[0]))
    out = {"prompt_token_ids": [], "response_ids": [], "loss_masks": [], "rewards": [], "is_last_step": [],
           "trajectory_ids": [], "rollout_logprobs": None, "stop_reasons": []}
    for t, s, last in rows:
        out["prompt_token_ids"].append(list(range(3 + s)))
        out["response_ids"].append([7, 8, 9])
        out["loss_masks"].append([1, 1, 1])
        out["rewards"].append([0.0, 0.0, float(t + 1) if last else 0.0])
        out["is_last_step"].append(last)
        out["trajectory_ids"].append(TID(str(t)))
        out["stop_reasons"].append("complete")
    return out


@given(st.lists(st.integers(1, 5), min_size=1, max_size=6), st.sampled_from(["py", "numpy", "int", "torch"]))
def test_every_valid_step_wise_output_passes(steps, flags):
    out = make(tuple(steps))
    conv = {"py": bool, "numpy": np.bool_, "int": int, "torch": torch.tensor}[flags]
    out["is_last_step"] = [conv(x) for x in out["is_last_step"]]
    validate_generator_output(len(steps), out, step_wise=True)


def expect(out, match, num_prompts=2, step_wise=True):
    with pytest.raises(GeneratorOutputError, match=match):
        validate_generator_output(num_prompts, out, step_wise=step_wise)


def test_missing_fields():
    out = make()
    del out["is_last_step"]
    expect(out, r"`is_last_step` is missing")
    out = make()
    out["trajectory_ids"] = None
    expect(out, r"`trajectory_ids` is missing")


def test_length_mismatches_fire_the_generic_check_first():
    out = make()
    out["is_last_step"] = out["is_last_step"][:-1]
    expect(out, "is_last_step length must be equal to response_ids length, got 4 and 5")
    out = make()
    out["trajectory_ids"] = out["trajectory_ids"][:-1]
    expect(out, "trajectory_ids length must be equal to response_ids length, got 4 and 5")


def test_last_element_and_all_false():
    out = make()
    out["is_last_step"][-1] = False
    expect(out, r"is_last_step\[-1\] must be True")
    out = make((3,))
    out["is_last_step"] = [False] * 3
    expect(out, r"is_last_step\[-1\] must be True", num_prompts=1)


def test_interleaved_steps_are_non_contiguous():
    expect(make((2, 2), contiguous=False), "Non-contiguous trajectory at index 2")
    out = make((1, 1, 2))  # a trajectory reappearing after a gap of several runs
    out["trajectory_ids"] = [TID("a"), TID("b"), TID("c"), TID("a")]
    out["is_last_step"] = [True, True, True, True]
    expect(out, "Non-contiguous trajectory at index 3: trajectory 'a_0'")


def test_boundaries_both_directions():
    out = make((2, 2))
    out["is_last_step"][1] = False
    expect(out, r"Trajectory boundary at index 1 \('0_0' -> '1_0'\) but is_last_step\[1\] is False")
    out = make((3,))
    out["is_last_step"] = [True, True, True]
    expect(out, r"is_last_step\[0\] is True but trajectory '0_0' continues", num_prompts=1)
    out = make((3,))
    out["is_last_step"] = [np.bool_(True), np.bool_(False), np.bool_(True)]
    expect(out, r"is_last_step\[0\] is True but trajectory", num_prompts=1)  # upstream's `is True` missed this


def test_flags_of_the_wrong_kind_are_errors():
    out = make()
    out["is_last_step"][0] = 2
    expect(out, r"is_last_step\[0\] must be a boolean .* got 2")


def test_plain_strings_as_trajectory_ids_and_single_sample():
    out = make((1,))
    out["trajectory_ids"] = ["only"]
    validate_generator_output(1, out, step_wise=True)


def test_num_prompts_is_only_checked_without_step_wise():
    validate_generator_output(2, make((2, 3)), step_wise=True)   # 5 samples from 2 prompts
    expect(make((2, 3)), r"Mismatch between prompts \(2\) and responses \(5\)", step_wise=False)


def test_per_sample_lengths_and_reward_kinds(caplog):
    out = make()
    out["loss_masks"][3] = [1]
    expect(out, "loss masks must have the same length, for sample 3 got 3 and 1")
    out = make()
    out["rewards"][1] = [1.0]
    expect(out, "Token rewards must match the response length, for sample 1 got 1 and 3")
    out = make()
    out["rewards"][0] = 1.0
    expect(out, r"all per-token lists \(List\[List\[float\]\]\) or all scalars")
    out = make()
    out["rollout_logprobs"] = [[0.0] * 3] * 4 + [[0.0]]
    expect(out, "Rollout logprobs must match the response length, for sample 4 got 1 and 3")
    expect({"response_ids": []}, "No outputs generated")
    out = make()
    out["prompt_token_ids"] = out["prompt_token_ids"][:4]
    expect(out, r"Mismatch between responses \(5\) and prompt_token_ids \(4\)")
    out = make()
    out["loss_masks"] = [[0, 0, 0]] * 5
    with caplog.at_level(logging.WARNING, logger="harness.stepwise"):
        validate_generator_output(2, out, step_wise=True)
    assert "All outputs are loss masked" in caplog.text
