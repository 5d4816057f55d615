"""``build_batch``'s fast path (struct packing, template windows) against an obviously-correct loop, and
its typed errors on every kind of bad sample (the fast path must refuse what numpy refused)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.bench.padding import stepwise_batch
from harness.plan.stepwise import BatchInputError, build_batch, left_padded_ones, left_padded_positions


def _ids(x) -> list[int]:
    """A sample's token ids as numpy reads them (the old builder's ``np.asarray(x).astype(int64)``)."""
    return [int(v) for v in np.asarray(x).astype(np.int64)]


def _right(values, r: int, width: int, scalar_ok: bool) -> list[float]:
    if scalar_ok and np.ndim(values) == 0:
        return [0.0] * (width - 1) + [float(values)]
    return [0.0] * (width - r) + [float(v) for v in values]


def reference(prompts, responses, rewards=None, loss_masks=None, rollout_logprobs=None, pad=0) -> dict:
    """The unified layout, one cell at a time, in plain lists."""
    p, r = [_ids(x) for x in prompts], [_ids(x) for x in responses]
    W, R = max(len(a) + len(b) for a, b in zip(p, r)), max(len(b) for b in r)
    ref = {"sequences": [], "attention_mask": [], "action_mask": [], "position_ids": [],
           "rewards": [], "loss_masks": [], "rollout_logprobs": []}
    for i, (a, b) in enumerate(zip(p, r)):
        n = len(a) + len(b)
        ref["sequences"].append([pad] * (W - n) + a + b)
        ref["attention_mask"].append([0] * (W - n) + [1] * n)
        ref["position_ids"].append([0] * (W - n) + list(range(n)))
        ref["action_mask"].append([0] * (R - len(b)) + [1] * len(b))
        ref["rewards"].append([0.0] * R if rewards is None else _right(rewards[i], len(b), R, True))
        ref["loss_masks"].append([float(v) for v in ref["action_mask"][-1]] if loss_masks is None
                                 else _right(loss_masks[i], len(b), R, False))
        if rollout_logprobs is not None:
            ref["rollout_logprobs"].append(_right(rollout_logprobs[i], len(b), R, False))
    if rollout_logprobs is None:
        ref["rollout_logprobs"] = None
    return ref


def assert_matches(batch, ref: dict) -> None:
    for k in ("sequences", "attention_mask", "action_mask"):
        got = getattr(batch, k)
        assert got.dtype == np.int64 and got.flags.c_contiguous and got.flags.writeable, k
        assert got.tolist() == ref[k], k
    for k in ("rewards", "loss_masks", "rollout_logprobs"):
        got = getattr(batch, k)
        if ref[k] is None:
            assert got is None
            continue
        assert got.dtype == np.float32 and got.flags.c_contiguous and got.flags.writeable, k
        assert np.array_equal(got, np.array(ref[k], dtype=np.float32).reshape(got.shape)), k


token = st.integers(-2**62, 2**62)
small_token = st.integers(-2**31, 2**31 - 1)


@st.composite
def containers(draw, ints, min_size=0):
    """The same ids as a list, a tuple, or a numpy int32 / int64 / uint16 array."""
    kind = draw(st.sampled_from(["list", "tuple", "int32", "int64", "uint16"]))
    if kind == "uint16":
        values = draw(st.lists(st.integers(0, 2**16 - 1), min_size=min_size, max_size=9))
    else:
        values = draw(st.lists(small_token if kind == "int32" else ints, min_size=min_size, max_size=9))
    if kind in ("list", "tuple"):
        return values if kind == "list" else tuple(values)
    return np.array(values, dtype=kind)


@st.composite
def per_token(draw, r: int, scalar_ok: bool):
    value = st.floats(-1e6, 1e6, width=32) | st.integers(-3, 3)
    kind = draw(st.sampled_from(["list", "tuple", "array"] + (["scalar"] if scalar_ok and r else [])))
    if kind == "scalar":
        return draw(value)
    values = draw(st.lists(value, min_size=r, max_size=r))
    return {"list": values, "tuple": tuple(values), "array": np.array(values, dtype=np.float64)}[kind]


@st.composite
def batches(draw):
    n = draw(st.integers(1, 6))
    prompts = [draw(containers(token, min_size=draw(st.sampled_from([0, 1, 1, 2])))) for _ in range(n)]
    responses = [draw(containers(token)) for _ in range(n)]
    lens = [len(x) for x in responses]
    kw = {"pad_token_id": draw(st.sampled_from([0, 0, 7, -1]))}
    if draw(st.booleans()):
        kw["rewards"] = [draw(per_token(r, True)) for r in lens]
    if draw(st.booleans()):
        kw["loss_masks"] = [draw(per_token(r, False)) for r in lens]
    if draw(st.booleans()):
        kw["rollout_logprobs"] = [draw(per_token(r, False)) for r in lens]
    return prompts, responses, kw


@settings(max_examples=150, deadline=None)
@given(batches())
def test_fast_path_equals_the_reference(batch):
    prompts, responses, kw = batch
    before = copy.deepcopy((prompts, responses, kw))
    got = build_batch(prompts, responses, **kw)
    ref = reference(prompts, responses, kw.get("rewards"), kw.get("loss_masks"), kw.get("rollout_logprobs"),
                    kw["pad_token_id"])
    assert_matches(got, ref)
    assert left_padded_positions(got.attention_mask.sum(1), got.sequences.shape[1]).tolist() == ref["position_ids"]
    after = (prompts, responses, kw)
    assert repr(after) == repr(before)                                     # inputs untouched (arrays included)


@pytest.mark.parametrize("seed", [0, 1])
def test_benchmark_batches_equal_the_reference(seed):
    prompts, responses = stepwise_batch(24, seed)
    assert_matches(build_batch(prompts, responses), reference(prompts, responses))


def test_ids_numpy_would_accept_but_struct_refuses_read_as_numpy_reads_them():
    """Bool-led lists, ids beyond int64 (uint64 wraps, as ``astype`` did), numpy scalars, ranges."""
    prompts = [[True, 2], [2**63], [np.int32(5), 6], range(3), [np.uint64(2**64 - 1)]]
    responses = [[1], (), [False, 3], [4], []]
    assert_matches(build_batch(prompts, responses), reference(prompts, responses))


def test_values_struct_refuses_read_as_numpy_reads_them():
    """None is NaN and "1.5" is 1.5 for numpy's float32, as before the fast path."""
    b = build_batch([[1], [2]], [[5, 6], [8]], rollout_logprobs=[[0.5, None], ("1.5",)], loss_masks=[[1, True], [0]])
    assert np.isnan(b.rollout_logprobs[0, 1]) and b.rollout_logprobs[:, 0].tolist() == [0.5, 0.0]
    assert b.rollout_logprobs[1, 1] == 1.5 and b.loss_masks.tolist() == [[1.0, 1.0], [0.0, 0.0]]


def test_masks_and_positions_are_template_windows():
    assert left_padded_ones([0, 1, 3], 3, np.float32).tolist() == [[0, 0, 0], [0, 0, 1], [1, 1, 1]]
    assert left_padded_ones([0, 0], 0).shape == (2, 0)
    assert left_padded_positions([3, 1], 4).tolist() == [[0, 0, 1, 2], [0, 0, 0, 0]]
    for bad in ([-1, 2], [5]):
        with pytest.raises(BatchInputError, match="lengths must lie in \\[0, 4\\]"):
            left_padded_ones(bad, 4)


@pytest.mark.parametrize("prompts, responses, match", [
    ([[1], [1.5, 2]], [[3], [4]], "prompt 1 must be a 1-D sequence of token ids, got list of shape"),
    ([[1], [2, 2.0]], [[3], [4]], "prompt 1 must be a 1-D sequence of token ids"),          # integral float
    ([[1], [2]], [[3], (4, None)], "response 1 must be a 1-D sequence of token ids"),
    ([[1], [2]], [[3, "7"], [4]], "response 0 must be a 1-D sequence of token ids"),
    ([[[1, 2]], [2]], [[3], [4]], "prompt 0 must be a 1-D sequence of token ids, got list of shape \\(1, 2\\)"),
    ([[[1, 2], [3]], [2]], [[3], [4]], "prompt 0 must be a 1-D sequence of token ids, got list that numpy"),
    ([[True, False], [2]], [[3], [4]], "prompt 0 must be a 1-D sequence of token ids"),      # bool dtype
    ([[1], np.array([[1, 2]])], [[3], [4]], "prompt 1 must be a 1-D sequence of token ids, got ndarray of shape"),
    ([[1], np.array([1.0])], [[3], [4]], "prompt 1 must be a 1-D sequence of token ids"),
    ([[1], 5], [[3], [4]], "prompt 1 must be a 1-D sequence of token ids, got int of shape \\(\\)"),
    ([[1], "ab"], [[3], [4]], "prompt 1 must be a 1-D sequence of token ids, got str"),
    ([[1], [2]], [[3], [np.float32(4)]], "response 1 must be a 1-D sequence of token ids"),
    ([[1], [2**64]], [[3], [4]], "prompt 1 must be a 1-D sequence of token ids"),            # object dtype
])
def test_bad_token_ids_raise_typed_errors_naming_the_sample(prompts, responses, match):
    with pytest.raises(BatchInputError, match=match):
        build_batch(prompts, responses)


@pytest.mark.parametrize("kw, match", [
    (dict(rewards=[[1.0, 2.0], [1.0]]), "reward of sample 0 has 2 values for a response of 3 tokens"),
    (dict(rewards=[1.0, []]), "reward of sample 1 has 0 values for a response of 1 tokens"),
    (dict(loss_masks=[(1, 1, 1), [[1]]]), "loss mask of sample 1 has 1 values for a response of 1 tokens"),
    (dict(loss_masks=[[1, 1, "x"], [1]]), "loss mask of sample 0 is not a list of numbers"),
    (dict(rollout_logprobs=[np.zeros((3, 1)), [0.0]]), "rollout logprob of sample 0 has 3 values for a response of 3"),
    (dict(rewards=[[1.0] * 3, [1.0]], loss_masks=[[1] * 3]), "loss_masks has 1 entries for 2 samples"),
])
def test_bad_per_token_values_raise_typed_errors(kw, match):
    with pytest.raises(BatchInputError, match=match):
        build_batch([[1], [2]], [[5, 6, 7], [8]], **kw)


def test_a_scalar_reward_on_an_empty_response_still_refused():
    with pytest.raises(BatchInputError, match="sample 1 has a scalar reward but an empty response"):
        build_batch([[1], [2]], [[5], []], rewards=[1.0, 2.0])
