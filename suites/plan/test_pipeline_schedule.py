"""Pipeline schedules (``harness.plan.pipeline_schedule``): Megatron's orders, every pass exactly once,
activation lifetimes of 1F1B, no deadlock for any stage count, chunk count and micro-batch count, and
typed errors for what cannot run."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness.plan.pipeline_schedule import PipelineScheduleError, replay, stage_actions


def _plans(kind, pp, M, vpp=1):
    return [stage_actions(kind, pp=pp, stage=s, num_microbatches=M, vpp=vpp) for s in range(pp)]


@given(st.sampled_from(["afab", "1f1b", "interleaved"]), st.integers(1, 5), st.integers(1, 4), st.integers(1, 12))
def test_every_pass_runs_once_and_the_stages_never_deadlock(kind, pp, vpp, m):
    if kind == "interleaved":
        pp, vpp, m = max(pp, 2), max(vpp, 2), m * max(pp, 2)  # needs pp >= 2 and M a multiple of the group (pp)
    else:
        vpp = 1
    plans = _plans(kind, pp, m, vpp)
    for plan in plans:
        assert sorted((a.kind, a.microbatch, a.chunk) for a in plan) == sorted(
            (k, mb, v) for k in "FB" for mb in range(m) for v in range(vpp))
    order = replay(plans, pp, vpp)
    assert len(order) == 2 * m * vpp * pp


@given(st.integers(2, 6), st.integers(1, 16))
def test_1f1b_keeps_at_most_pp_minus_stage_activations_alive(pp, m):
    for s, plan in enumerate(_plans("1f1b", pp, m)):
        alive = peak = 0
        for a in plan:
            alive += 1 if a.kind == "F" else -1
            peak = max(peak, alive)
        assert peak == min(pp - s, m)  # warm-up forwards + the one in flight
        first_b = next(i for i, a in enumerate(plan) if a.kind == "B")
        warm = min(pp - s - 1, m)
        assert first_b == (warm + 1 if m > warm else warm)  # the first backward follows one steady forward


def test_megatron_orders_by_hand():
    """Stage 0 of 4 with 6 micro-batches: 3 warm-up forwards, steady 1F1B, 3 cool-down backwards;
    interleaved (pp 2, vpp 2, group 2): chunk 0 on micro-batches 0-1, chunk 1 on 0-1, then 2-3."""
    s = [str(a) for a in stage_actions("1f1b", pp=4, stage=0, num_microbatches=6)]
    assert s == ["F0", "F1", "F2", "F3", "B0", "F4", "B1", "F5", "B2", "B3", "B4", "B5"]
    s = [str(a) for a in stage_actions("interleaved", pp=2, stage=0, num_microbatches=4, vpp=2)]
    assert s[:5] == ["F0.0", "F1.0", "F0.1", "F1.1", "F2.0"]  # warm-up (2 - 0 - 1) * 2 + (2 - 1) * 2 = 4
    assert s[5] == "B0.1" and s[-2:] == ["B2.0", "B3.0"]
    assert [str(a) for a in stage_actions("afab", pp=3, stage=2, num_microbatches=2)] == ["F0", "F1", "B0", "B1"]


@pytest.mark.parametrize("kwargs, match", [
    ({"kind": "zero-bubble", "pp": 2, "num_microbatches": 4}, "unknown pipeline schedule 'zero-bubble'"),
    ({"kind": "interleaved", "pp": 2, "num_microbatches": 3, "vpp": 2}, r"multiple of microbatch_group_size_per_vp_stage=2, got 3"),
    ({"kind": "interleaved", "pp": 1, "num_microbatches": 4, "vpp": 2}, "needs pipeline parallelism"),
    ({"kind": "1f1b", "pp": 2, "num_microbatches": 4, "vpp": 2}, "use 'interleaved' exactly when vpp > 1"),
    ({"kind": "1f1b", "pp": 2, "num_microbatches": 0}, "micro-batches must be >= 1"),
    ({"kind": "1f1b", "pp": 0, "num_microbatches": 2}, "pipeline_model_parallel_size must be a positive int"),
])
def test_what_cannot_run_is_a_typed_error(kwargs, match):
    kind = kwargs.pop("kind")
    with pytest.raises(PipelineScheduleError, match=match):
        stage_actions(kind, stage=0, **kwargs)


def test_a_deadlocking_order_is_reported():
    from harness.plan.pipeline_schedule import Action

    plans = [[Action("B", 0), Action("F", 0)], [Action("F", 0), Action("B", 0)]]  # stage 0 backward first
    with pytest.raises(PipelineScheduleError, match="deadlock"):
        replay(plans, 2)
