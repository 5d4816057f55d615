"""``batch_tensors`` is ``build_batch`` as tensors, and its ``position_ids``
are the ``cumsum(attention_mask) - 1`` of the spec, computed without the cumsum."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.bench.padding import stepwise_batch
from harness.plan.stepwise import BatchInputError, build_batch
from harness.runtime.stepwise import batch_tensors

ids = st.lists(st.integers(0, 2**40), max_size=9)
samples = st.lists(st.tuples(ids, ids, st.sampled_from([list, tuple, np.array])), min_size=1, max_size=6)


def assert_same(prompts, responses, **kw):
    b, t = build_batch(prompts, responses, **kw), batch_tensors(prompts, responses, **kw)
    assert set(t) == set(vars(b)) | {"position_ids"}
    for k, v in vars(b).items():
        if v is None:
            assert t[k] is None
            continue
        assert t[k].dtype == torch.from_numpy(v).dtype and torch.equal(t[k], torch.from_numpy(v)), k
    attn = t["attention_mask"]
    assert t["position_ids"].dtype == torch.int64
    assert torch.equal(t["position_ids"], (attn.cumsum(1) - 1).clamp_min(0) * attn)   # the spec's formula


@settings(max_examples=60, deadline=None)
@given(samples, st.booleans())
def test_torch_path_equals_numpy_path(batch, with_lists):
    prompts, responses = [kind(p) for p, _, kind in batch], [kind(r) for _, r, kind in batch]
    kw = {}
    if with_lists:
        kw = {"rewards": [[0.5] * len(r) for r in responses], "rollout_logprobs": [[-1.0] * len(r) for r in responses]}
    assert_same(prompts, responses, **kw)


def test_benchmark_batch():
    prompts, responses = stepwise_batch(32, seed=2)
    assert_same(prompts, responses, pad_token_id=3)


def test_torch_path_raises_the_same_typed_errors():
    with pytest.raises(BatchInputError, match="response 1 must be a 1-D sequence of token ids"):
        batch_tensors([[1], [2]], [[3], [4.5]])
    with pytest.raises(BatchInputError, match="reward of sample 0 has 1 values for a response of 2 tokens"):
        batch_tensors([[1]], [[3, 4]], rewards=[[1.0]])
