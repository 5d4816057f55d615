"""The unified step-wise layout: properties, the upstream cases, the edge cases of spec B.4."""

from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.plan.stepwise import BatchInputError, build_batch, response_values, two_segment_width

samples = st.lists(st.tuples(st.lists(st.integers(1, 99), max_size=12), st.lists(st.integers(1, 99), max_size=12)),
                   min_size=1, max_size=8)


@given(samples)
def test_layout_properties(batch):
    prompts, responses = [p for p, _ in batch], [r for _, r in batch]
    rewards = [[float(i)] * len(r) for i, r in enumerate(responses)]
    masks = [[1] * len(r) for r in responses]
    before = copy.deepcopy((prompts, responses, rewards, masks))
    b = build_batch(prompts, responses, rewards=rewards, loss_masks=masks)
    W = max(len(p) + len(r) for p, r in batch)
    R = max(len(r) for r in responses)
    assert b.sequences.shape == (len(batch), W) and b.action_mask.shape == (len(batch), R)
    for i, (p, r) in enumerate(batch):
        n = len(p) + len(r)
        assert b.sequences[i, W - n:].tolist() == p + r                        # every real token, in order
        assert (b.sequences[i, :W - n] == 0).all() and b.attention_mask[i].sum() == n
        assert b.attention_mask[i, W - n:].all()                                # no right padding
        assert b.action_mask[i].sum() == len(r) and b.action_mask[i, R - len(r):].all()   # right-aligned
        assert (b.rewards[i] == b.action_mask[i] * i).all() and (b.loss_masks[i] == b.action_mask[i]).all()
        if r:  # the model's last-R window holds the response in its last r_i columns
            assert b.sequences[i, W - R:][R - len(r):].tolist() == r
    assert (prompts, responses, rewards, masks) == before                       # inputs untouched


def test_upstream_cases_in_our_words():
    b = build_batch([[1, 2], [3, 4, 5, 6]], [[10, 11, 12], [20, 21]])
    assert b.sequences.tolist() == [[0, 1, 2, 10, 11, 12], [3, 4, 5, 6, 20, 21]]
    assert b.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1], [1] * 6] and b.action_mask.tolist() == [[1, 1, 1], [0, 1, 1]]
    b = build_batch([[1, 2, 3], [4, 5]], [[10], [20, 21, 22]], rewards=[[1.0], [0.0, 0.0, 0.0]],
                    loss_masks=[[1], [1, 0, 1]], rollout_logprobs=[[-0.1], [-0.2, -0.3, -0.4]])
    assert b.action_mask[0].tolist() == [0, 0, 1] and b.rewards[0].tolist() == [0, 0, 1]
    assert b.loss_masks[1].tolist() == [1, 0, 1] and b.rollout_logprobs[0].tolist() == pytest.approx([0, 0, -0.1])
    anti = build_batch([[1] * 10, [2] * 90], [[3] * 90, [4] * 10])           # step-wise anti-correlation
    assert anti.sequences.shape == (2, 100) and two_segment_width([10, 90], [90, 10]) == 180
    assert anti.action_mask[1].tolist() == [0] * 80 + [1] * 10


def test_scalar_rewards_sit_on_the_last_response_token():
    b = build_batch([[1], [2]], [[5, 6, 7], [8]], rewards=[2.5, -1.0])
    assert b.rewards.tolist() == [[0, 0, 2.5], [0, 0, -1.0]]
    with pytest.raises(BatchInputError, match="sample 1 has a scalar reward but an empty response"):
        build_batch([[1], [2]], [[5], []], rewards=[1.0, 1.0])


def test_empty_responses_and_none_rewards():
    b = build_batch([[1, 2], [3]], [[], [9]])
    assert b.action_mask.tolist() == [[0], [1]] and b.rewards.tolist() == [[0], [0]]   # rewards=None -> zeros
    assert b.loss_masks.tolist() == [[0], [1]]
    allempty = build_batch([[1], [2, 3]], [[], []])
    assert allempty.action_mask.shape == (2, 0) and allempty.rewards.shape == (2, 0)


@pytest.mark.parametrize("kw, match", [
    (dict(rewards=[[1.0, 2.0, 3.0], [1.0]]), "reward of sample 1 has 1 values for a response of 5 tokens"),
    (dict(loss_masks=[[1, 1, 1], [1] * 4]), "loss mask of sample 1 has 4 values for a response of 5 tokens"),
    (dict(rollout_logprobs=[[0.0] * 3]), "rollout_logprobs has 1 entries for 2 samples"),
])
def test_per_token_lists_must_match_their_response(kw, match):
    with pytest.raises(BatchInputError, match=match):
        build_batch([[1], [2]], [[5, 6, 7], [8, 9, 10, 11, 12]], **kw)


def test_bad_batches():
    with pytest.raises(BatchInputError, match="0 prompts and 0 responses"):
        build_batch([], [])
    with pytest.raises(BatchInputError, match="2 prompts and 1 responses"):
        build_batch([[1], [2]], [[3]])
    with pytest.raises(BatchInputError, match="prompt 0 must be a 1-D sequence of token ids"):
        build_batch([[1.5]], [[3]])


def test_numpy_inputs_are_concatenated_not_added():
    """Upstream joined prompt and response with ``+``: numpy arrays would be added element-wise."""
    b = build_batch([np.array([1, 2])], [np.array([10, 20])])
    assert b.sequences.tolist() == [[1, 2, 10, 20]]


def test_warns_but_does_not_truncate(caplog):
    with caplog.at_level(logging.WARNING, logger="harness.stepwise"):
        b = build_batch([[1] * 50, [2] * 10], [[3] * 10, [4] * 50], max_seq_len=30)
    assert b.sequences.shape == (2, 60) and "exceeds max_seq_len=30" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="harness.stepwise"):
        build_batch([[1]], [[2]], max_seq_len=30)
    assert caplog.text == ""


def test_response_values_avoid_the_minus_zero_slice():
    row = [0.0, 0.0, 1.5, 2.5]
    assert response_values(row, 2) == [1.5, 2.5] and response_values(row, 0) == [] and row[-0:] == row


def test_routes_travel_aligned():
    b = build_batch([[1, 2], [3, 4, 5, 6]], [[7, 8, 9], [10, 11]],
                    routes=[np.ones((5, 2, 2), int), np.full((6, 2, 2), 300)])
    assert b.routes.shape == (2, 6, 2, 2) and b.routes.dtype == np.int16
    assert b.routes[0, 0].tolist() == [[0, 1], [0, 1]]        # padding replays the distinct experts 0 .. K-1
    assert (b.routes[0, 1:] == 1).all()                          # starts at the first real token
    assert ((b.routes[:, :, 0, 0] != 0) == (b.attention_mask == 1)).all()
