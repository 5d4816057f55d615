"""Torch view of a step-wise batch: dtypes, position ids; and the padding benchmark's figures."""

from __future__ import annotations

import torch

from harness.bench.padding import run, stepwise_batch
from harness.runtime.stepwise import batch_tensors


def test_dtypes_and_position_ids():
    t = batch_tensors([[1, 2], [3, 4, 5, 6]], [[10, 11, 12], [20, 21]], rollout_logprobs=[[-1.0] * 3, [-2.0] * 2])
    assert t["sequences"].dtype == torch.int64 and t["rewards"].dtype == torch.float32
    assert t["rollout_logprobs"].dtype == torch.float32 and t["routes"] is None
    assert t["position_ids"].tolist() == [[0, 0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5]]


def test_step_wise_batches_are_anti_correlated_and_the_unified_layout_pads_less():
    prompts, responses = stepwise_batch(200, seed=1)
    assert len(prompts) == 200
    (row,) = run(batch_sizes=(200,), seeds=range(1))
    assert row["corr_prompt_response"] < -0.3 and row["padding_ratio"] > 1.3
    assert row["width_unified"] < row["width_two_segment"]
