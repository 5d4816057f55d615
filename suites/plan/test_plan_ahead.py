"""``harness.plan.ahead.PlanAhead``: schedules computed in a planner process are the inline ones,
in submission order; failures come back as typed errors, never as a hang."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from harness.plan import CostModel
from harness.plan.ahead import PlanAhead, PlanAheadError
from harness.plan.errors import PlanInputError, SequenceTooLongError
from harness.train.layouts import LayoutConfig, plan

PLAN = "harness.train.layouts:plan"


def chatty(x):
    """Prints to stdout (the planner's protocol pipe, were it not redirected) and returns."""
    print("a stray print " * 100)
    return [x] * 3


def slow(seconds):
    time.sleep(seconds)
    return seconds


def suicide():
    os.kill(os.getpid(), signal.SIGKILL)


def unpicklable_error():
    class Local(Exception):
        pass

    raise Local("made inside a function, so it cannot be pickled")


def _batches():
    rng = np.random.default_rng(7)
    cost = CostModel(quadratic=4.4e-10, linear=1.2e-6, per_microbatch=0.024, cp_block=0.010)
    for n in (2, 4, 8):
        cfg = LayoutConfig(n_ranks=n, max_seqlen_per_rank=2048, static_cp=n)
        for _ in range(4):
            lengths = np.clip(rng.lognormal(np.log(1024) - 1.125, 1.5, size=8 * n), 128, 2048 * n).astype(int).tolist()
            for layout, c in (("dcp", cost), ("dcp", None), ("thd", None)):
                yield layout, lengths, cfg, c


def test_plans_equal_inline_plans_in_submission_order():
    cases = list(_batches())
    with PlanAhead(PLAN) as ahead:
        ahead.submit(*cases[0])
        for k, case in enumerate(cases):
            (sched, padding, fixed), seconds = ahead.result()
            if k + 1 < len(cases):
                ahead.submit(*cases[k + 1])  # one ahead, as a training loop uses it
            want = plan(*case)
            assert sched.to_dict() == want[0].to_dict() and (padding, fixed) == want[1:]
            assert seconds > 0
        assert ahead.pending == 0


def test_many_queued_calls_and_large_results_do_not_block_either_side():
    big = list(range(200_000))  # ~1 MB per frame each way: far over a pipe's buffer
    with PlanAhead(f"{__name__}:chatty") as ahead:
        for _ in range(5):
            ahead.submit(big)
        for _ in range(5):
            out, _ = ahead.result(timeout=60)
            assert out == [big] * 3


def test_an_error_in_the_planner_is_raised_with_its_type_and_message_and_the_planner_goes_on():
    cfg = LayoutConfig(n_ranks=4, max_seqlen_per_rank=2048, static_cp=4)
    with PlanAhead(PLAN) as ahead:
        ahead.submit("dcp", [9000, 100], cfg, None)
        ahead.submit("dcp", [3000, 100], cfg, None)
        with pytest.raises(SequenceTooLongError, match="9000 tokens"):
            ahead.result()
        assert ahead.result()[0][0].microbatches  # the next call still answers
    with PlanAhead(f"{__name__}:unpicklable_error") as ahead:
        ahead.submit()
        with pytest.raises(PlanAheadError, match="Local: made inside a function"):
            ahead.result()


def test_a_dead_planner_raises_instead_of_hanging():
    ahead = PlanAhead(f"{__name__}:suicide")
    ahead.submit()
    t = time.monotonic()
    with pytest.raises(PlanAheadError, match="exited with code -9"):
        ahead.result(timeout=60)
    assert time.monotonic() - t < 30
    with pytest.raises(PlanAheadError, match="is gone|exited"):
        ahead.submit()
        ahead.result(timeout=5)
    ahead.close()
    ahead.close()  # idempotent


def test_a_slow_planner_times_out_with_the_fix_named_and_is_not_used_again():
    with PlanAhead(f"{__name__}:slow") as ahead:
        ahead.submit(5.0)
        with pytest.raises(PlanAheadError, match=r"within 0.3 s; raise PlanAhead\(timeout=...\)"):
            ahead.result(timeout=0.3)
        # the late answer belongs to the timed-out call: it must never be handed to a later one
        with pytest.raises(PlanAheadError, match="refuses further use"):
            ahead.result(timeout=10)
        with pytest.raises(PlanAheadError, match="refuses further use"):
            ahead.submit(0.0)


@pytest.mark.parametrize("spec, msg", [("harness.train.layouts.plan", "'module:name'"),
                                       ("harness.nope:plan", "cannot import"),
                                       ("harness.train.layouts:nope", "cannot import"),
                                       ("harness.train.layouts:LAYOUTS", "not callable")])
def test_bad_function_specs_are_refused_before_a_process_starts(spec, msg):
    with pytest.raises(PlanInputError, match=msg):
        PlanAhead(spec)


def test_misuse_is_named():
    ahead = PlanAhead(PLAN)
    with pytest.raises(PlanAheadError, match="submit\\(\\) first"):
        ahead.result()
    ahead.close()
    with pytest.raises(PlanAheadError, match="after close"):
        ahead.submit("thd", [1], None)
