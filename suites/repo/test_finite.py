"""Non-finite values fail every comparison (``harness.finite``), and the checks built on it say where."""

from __future__ import annotations

import math

import pytest

from harness import golden
from harness.faults.checks import _per_step, step1_gradients, token_loss
from harness.finite import nonfinite_message, target, within, worst, worst_of

NAN, INF = math.nan, math.inf


def test_worst_and_within_never_pass_over_a_nan():
    assert max([0.1, NAN, 0.2]) == 0.2                      # the trap: max() skips a NaN that is not first
    assert math.isnan(worst([0.1, NAN, 0.2])) and worst([]) == 0.0 and worst([1.0, INF]) == INF
    assert not within(NAN, 1.0) and not within(INF, 1.0) and not within(-INF, 1.0, ">=") and not within("1", 2.0)
    assert within(0.5, 1.0) and within(2.0, 1.0, ">=") and not within(True, 2.0)
    assert worst_of([("a", 1.0), ("b", NAN), ("c", 3.0)], key=lambda x: x[1])[0] == "b"
    assert worst_of([("a", 1.0), ("b", NAN)], key=lambda x: x[1], high_is_bad=False)[0] == "b"
    assert worst_of([("a", 1.0), ("c", 3.0)], key=lambda x: x[1], high_is_bad=False)[0] == "a"
    with pytest.raises(ValueError, match="comparison '=='"):
        within(1.0, 1.0, "==")


def test_messages_name_the_step_and_the_value():
    assert nonfinite_message([1.0, 2.0]) is None
    assert nonfinite_message([1.0, 2.0, NAN], "loss", "dcp") == "step 3: dcp loss is nan"
    assert nonfinite_message([-INF], "gradient norm") == "step 1: gradient norm is -inf"
    assert nonfinite_message([1.0, None], "loss") == "step 2: loss is None"
    t = target("speedup >= 1.2", NAN, 1.2, ">=")
    assert t["pass"] is False and "not a finite number" in t["why"]


def test_golden_compare_flags_non_finite_numbers_under_any_rule():
    approx = {"kind": "approx", "atol": 1e9}
    assert golden.compare([1.0, INF], [1.0, INF], approx) == ["data[1]: value inf is not a finite number"]
    assert golden.compare([1.0, 2.0], [1.0, NAN], {"kind": "exact"}) == ["data[1]: value nan is not a finite number"]


@pytest.mark.parametrize("rule, policy, match", [
    ({"kind": "approx", "atol": 1e9}, {"kind": "approx", "atol": 1e-5}, r"atol 1e\+09 > 1e-05"),
    ({"kind": "approx", "atol": 1e-6}, None, r"atol 1e-06 > 0"),       # a test that asks for exact
    ({"kind": "approx", "atol": "x"}, None, r"rule atol 'x' must be a finite number >= 0"),
    ({"kind": "approx", "atol": -1.0}, None, r"rule atol -1.0 must be a finite number >= 0"),
    ({"kind": "approx", "tol": 1}, None, r"takes only \['atol', 'kind', 'rtol'\], got \['tol'\]"),
    ({"kind": "exact", "atol": 0}, None, r"takes only \['kind'\]"),
    ("exact", None, r"rule kind 'exact' must be one of"),
])
def test_a_golden_rule_may_only_tighten_the_harness_policy(rule, policy, match):
    with pytest.raises(golden.GoldenError, match=match):
        golden.checked_rule(rule, policy, "g.json")


def test_a_tighter_or_equal_golden_rule_is_kept():
    policy = {"kind": "approx", "atol": 1e-5, "rtol": 0.0}
    for rule in ({"kind": "exact"}, {"kind": "approx", "atol": 1e-5, "rtol": 0.0}, {"kind": "approx", "atol": 0}):
        assert golden.checked_rule(rule, policy, "g.json") == rule


def _ranks(grads=None, ce=None, norms=None, layout="dcp"):
    probe = {"grads": grads or {}, "grad_norms": norms or [],
             "sequences": [{"seq": [0, 0], "pos": [0, 1], "ce": ce or [1.0, 1.0], "lengths": {"0": 2}}]}
    return [{"probes": {layout: probe}}]


def test_fault_checks_alarm_on_a_nan_that_is_not_first():
    ref = _ranks({"w": [1.0, 1.0], "b": [2.0]}, norms=[1.0, 1.0, 1.0], layout="bshd")
    got = _ranks({"w": [1.0, 1.0], "b": [NAN]}, norms=[1.0, NAN, 1.0])
    a = step1_gradients(ref, got, "dcp")
    assert a is not None and "of b on rank 0 differs from bshd by nan" in a.message
    a = _per_step("grad-norm", [1.0, 1.0, 1.0], [1.0, NAN, 1.0], True)
    assert a is not None and a.message == "step 2: this run's gradient norm is nan" and a.where == {"step": 2}
    a = _per_step("loss-curve", [1.0, INF], [1.0, 1.0], False)
    assert a is not None and a.message == "step 2: bshd's loss is inf"
    assert _per_step("loss-curve", [1.0, 1.0], [1.0], False).message == "1 steps against bshd's 2"
    seqs = _ranks(ce=[1.0, NAN])
    assert token_loss(_ranks(layout="bshd"), seqs, "dcp") is not None
