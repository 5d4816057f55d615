"""Advantage broadcast from each trajectory's last step, masked by each step's own response mask."""

from __future__ import annotations

import numpy as np
import pytest

from harness.plan.generator_output import GeneratorOutputError, validate_generator_output
from harness.plan.stepwise import BatchInputError, broadcast_step_advantages, grpo_advantages, trajectory_ordinals


def test_upstream_regression_each_step_keeps_its_own_mask():
    """Trajectories A (2 steps, reward 2) and B (2 steps, reward 0) in one GRPO group, no std."""
    mask = np.array([[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1], [0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1]])
    last = [False, True, False, True]
    adv = grpo_advantages([2.0, 0.0], ["q", "q"])
    out = broadcast_step_advantages(adv, last, mask)
    assert out.tolist() == [[0, 0, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1], [0, 0, 0, -1, -1, -1], [0, 0, 0, 0, -1, -1]]


def test_ordinals_and_malformed_flags():
    assert trajectory_ordinals([False, False, True, False, True]).tolist() == [0, 0, 0, 1, 1]
    with pytest.raises(BatchInputError, match="2 trajectories by is_last_step but 3 last-step values"):
        broadcast_step_advantages([1, 2, 3], [False, True, False, True], np.ones((4, 1)))


def test_pad_rows_are_one_step_trajectories():
    """Batch padding appends rows with is_last_step True and loss mask 0: each is its own trajectory."""
    mask = np.array([[1, 1], [1, 1], [0, 0], [0, 0]])
    out = broadcast_step_advantages([3.0, 0.0, 0.0], [False, True, True, True], mask)
    assert out.tolist() == [[3, 3], [3, 3], [0, 0], [0, 0]]


def test_interleaved_steps_get_the_wrong_advantage_and_validation_rejects_them_first():
    """Rows A0, B0, A1*, B1*: the cumsum trick hands B0 trajectory A's advantage, silently (the
    trajectory count still matches); validate_generator_output stops the batch at index 2."""
    last = [False, False, True, True]
    adv_a, adv_b = 5.0, -5.0
    out = broadcast_step_advantages([adv_a, adv_b], last, np.ones((4, 1)))
    assert out[:, 0].tolist() == [adv_a, adv_a, adv_a, adv_b]  # B0 got A's advantage: misassigned
    gen = {"prompt_token_ids": [[1]] * 4, "response_ids": [[2]] * 4, "loss_masks": [[1]] * 4,
           "rewards": [[0.0]] * 4, "is_last_step": last, "trajectory_ids": ["A", "B", "A", "B"]}
    with pytest.raises(GeneratorOutputError, match="Non-contiguous trajectory at index 2"):
        validate_generator_output(2, gen, step_wise=True)


def test_grpo_groups():
    assert grpo_advantages([1.0, 3.0, 10.0], ["a", "a", "b"]).tolist() == [-1.0, 1.0, 0.0]
    np.testing.assert_allclose(grpo_advantages([1.0, 3.0], ["a", "a"], std_normalize=True), [-1.0, 1.0], atol=1e-5)
