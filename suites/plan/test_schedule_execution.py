"""``schedule(..., execution=)``: the execution model reaches the schedule and its judges, ``balanced`` optimises
the model it is given and is never slower than megatron-dev under it, and bad models are typed errors."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.data.workloads import sample
from harness.plan import (
    INDEPENDENT,
    SYNCHRONOUS,
    CostModel,
    Execution,
    ExecutionError,
    PlanInputError,
    Schedule,
    UnknownExecutionError,
    VPPAlignmentError,
    check_schedule,
    gpt_benchmark_cost,
    quality,
    schedule,
    schedule_lower_bound,
    simulate,
    stats,
)
from harness.testing import batches

A = [8192, 4096, 3000, 2048, 1024, 1024, 512, 512, 256]  # spec vector A
GPT = gpt_benchmark_cost()
LIN = CostModel(quadratic=0.0, linear=1.0)


# ----------------------------------------------------------------------------------------------- plumbing
@pytest.mark.parametrize("given_as, want", [(None, INDEPENDENT), ("independent", INDEPENDENT),
                                            ("synchronous", SYNCHRONOUS), (" Synchronous ", SYNCHRONOUS),
                                            (SYNCHRONOUS, SYNCHRONOUS), (Execution.pipeline(2), Execution.pipeline(2))])
def test_the_schedule_records_its_execution_model(given_as, want):
    for algorithm in ("balanced", "megatron-dev", "megatron-pr2000", "dp-balanced"):
        s = schedule(A, n_ranks=8, max_seqlen_per_rank=2048, algorithm=algorithm, execution=given_as)
        assert s.execution == want
        assert Schedule.from_dict(s.to_dict()).execution == want


def test_simulate_quality_and_stats_default_to_the_schedules_model():
    lengths = sample("lognormal:mean=1024,sigma=1.5,min=128,max=8192", 128, seed=3)
    s = schedule(lengths, n_ranks=16, max_seqlen_per_rank=2048, cost=GPT, execution="synchronous")
    sync, ind = simulate(s, GPT, SYNCHRONOUS).step_time, simulate(s, GPT, INDEPENDENT).step_time
    assert ind < sync  # barriers only delay: this batch waits at some
    assert simulate(s).step_time == sync and simulate(s, execution="independent").step_time == ind
    assert quality(s) == quality(s, GPT, "synchronous") == sync / schedule_lower_bound(s, GPT, SYNCHRONOUS)
    assert stats(s).execution == "synchronous" and stats(s, execution=INDEPENDENT).step_time == ind
    old = Schedule.from_dict({k: v for k, v in s.to_dict().items() if k != "execution"})  # before the field
    assert old.execution == INDEPENDENT and simulate(old).step_time == ind


def test_megatron_algorithms_place_sequences_whatever_the_model():
    for algorithm in ("megatron-dev", "megatron-pr2000", "dp-balanced"):
        got = {ex: schedule(A, n_ranks=8, max_seqlen_per_rank=2048, algorithm=algorithm, execution=ex).microbatches
               for ex in ("independent", "synchronous")}
        assert got["independent"] == got["synchronous"]


def test_an_interleaved_pipeline_gives_the_default_vpp_group():
    ex = Execution.pipeline(2, vpp=2)
    s = schedule(A, n_ranks=8, max_seqlen_per_rank=2048, algorithm="megatron-dev", execution=ex)
    assert s.vpp_group == 2 and s.num_microbatches % 2 == 0
    assert schedule(A, n_ranks=8, max_seqlen_per_rank=2048, vpp_group=4, execution=ex).vpp_group == 4
    s = schedule(A, n_ranks=8, max_seqlen_per_rank=2048, execution=ex)  # balanced judges by the pipeline
    assert not check_schedule(s) and simulate(s).stages == 2


def test_balanced_optimises_the_model_it_is_given():
    """Eight sequences per rank of the benchmark's lognormal batch: the plan made for independent ranks lets
    micro-batches be imbalanced and pays for it at barriers; the one made for barriers is balanced per
    micro-batch. Each is the faster one under its own model."""
    lengths = sample("lognormal:mean=1024,sigma=1.5,min=128,max=8192", 512, seed=0)
    made = {ex: schedule(lengths, n_ranks=64, max_seqlen_per_rank=2048, cost=GPT, execution=ex)
            for ex in ("independent", "synchronous")}
    for ex in made:
        other = made["synchronous" if ex == "independent" else "independent"]
        assert simulate(made[ex], execution=ex).step_time <= simulate(other, execution=ex).step_time
    assert simulate(made["synchronous"]).step_time < 0.85 * simulate(made["independent"], execution=SYNCHRONOUS).step_time


def test_a_hand_example_under_barriers():
    """Two ranks, 8 tokens each, cost = tokens: 6 + 2 and 4 + 4 in one micro-batch meet the bound (8)."""
    for ex in ("independent", "synchronous"):
        s = schedule([6, 2, 4, 4], n_ranks=2, max_seqlen_per_rank=8, cost=LIN, execution=ex)
        assert s.microbatches == [[[0, 1], [2, 3]]] and simulate(s).step_time == 8.0 and quality(s) == 1.0


# ------------------------------------------------------------------------- never worse than megatron-dev
@settings(max_examples=60, deadline=None)
@given(batch=batches(max_log_ranks=5, max_sequences=48))
def test_balanced_is_never_slower_than_megatron_dev_under_either_model(batch):
    """By the simulated step under the cost ``balanced`` is given: megatron-dev's schedule is one of its
    candidates at these sizes, and the independent model stops early only within 1% of the lower bound.
    Valid and deterministic too."""
    lengths = sorted(batch.lengths)  # gid order: megatron-dev keeps the input order among equal lengths
    for cost in (GPT, CostModel.megatron()):
        for ex in ("independent", "synchronous"):
            try:
                dev = schedule(lengths, algorithm="megatron-dev", cost=cost, execution=ex, **batch.kwargs())
            except VPPAlignmentError:
                continue
            ours = schedule(lengths, cost=cost, execution=ex, **batch.kwargs())
            assert not check_schedule(ours)
            assert schedule(lengths, cost=cost, execution=ex, **batch.kwargs()).microbatches == ours.microbatches
            t, d = simulate(ours, cost).step_time, simulate(dev, cost).step_time
            assert t <= d * (1.01 if ex == "independent" else 1 + 1e-12), (ex, cost.name, t / d)


def _rows_schedule(rows, lengths, batch, cost):
    from harness.plan.layout import layout_from_sizes

    return Schedule(tuple(layout_from_sizes(r) for r in rows), dict(lengths), batch.n_ranks,
                    batch.max_seqlen_per_rank, batch.min_cp_size, batch.vpp_group, "level_rows", cost, SYNCHRONOUS)


@settings(max_examples=40, deadline=None)
@given(batch=batches(max_log_ranks=5, max_sequences=48), many=st.booleans())
def test_rows_by_levels_are_valid_deterministic_and_kept_only_when_better(batch, many):
    """``level_rows`` (every sequence at its cp_min, micro-batches by levels): valid, deterministic, and
    ``balanced`` under barriers is never slower than it, nor than ``lpt_rows`` at the least micro-batch count
    beyond ``SYNC_ENOUGH`` (it stops there only that close to the area bound, which bounds ``lpt_rows``)."""
    from harness.plan.balanced import SYNC_ENOUGH
    from harness.plan.balanced.items import Item
    from harness.plan.balanced.levels import level_rows
    from harness.plan.balanced.rows import lpt_rows
    from harness.plan.cost import cp_min

    pairs = sorted(batch.lengths)
    if many and pairs:  # many sequences per rank: where the levels end the search
        lens = sample("lognormal:mean=1024,sigma=1.5,min=128,max=8192", 12 * batch.n_ranks, seed=len(pairs))
        pairs = [(g, min(L, batch.n_ranks * batch.max_seqlen_per_rank)) for g, L in enumerate(lens)]
    for cost in (GPT, CostModel.megatron()):
        items = [Item(g, L, cp_min(L, batch.max_seqlen_per_rank, batch.min_cp_size), cost) for g, L in pairs]
        rows = level_rows(items, batch.n_ranks, batch.max_seqlen_per_rank, batch.min_cp_size, cost)
        if not items:
            continue
        assert rows is not None
        assert rows == level_rows(items, batch.n_ranks, batch.max_seqlen_per_rank, batch.min_cp_size, cost)
        mine = _rows_schedule(rows, pairs, batch, cost)
        assert not check_schedule(mine) or (batch.vpp_group and len(rows) % batch.vpp_group)
        kw = batch.kwargs()
        try:
            ours = schedule(pairs, cost=cost, execution="synchronous", **kw)
        except VPPAlignmentError:
            continue
        t = simulate(ours, cost).step_time
        if not batch.vpp_group or len(rows) % batch.vpp_group == 0:
            assert t <= simulate(mine, cost).step_time * (1 + 1e-12)
        step = batch.vpp_group or 1
        least = -(-sum(L for _, L in pairs) // (batch.n_ranks * batch.max_seqlen_per_rank))
        lpt = lpt_rows(items, batch.n_ranks, batch.max_seqlen_per_rank, batch.min_cp_size, -(-least // step) * step,
                       cost)
        if lpt is not None:
            assert t <= simulate(_rows_schedule(lpt, pairs, batch, cost), cost).step_time * (1 + SYNC_ENOUGH + 1e-12)


# ------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("execution, match", [
    ("pipeline", r"execution 'pipeline' needs its stage count: pass Execution.pipeline\(pp"),
    ("moe", r"unknown execution model 'moe'; choose one of 'independent', 'synchronous' or Execution.pipeline"),
    (3, r"execution must be an Execution or one of 'independent', 'synchronous', got 3 \(int\)"),
])
def test_bad_execution_models_are_typed_errors(execution, match):
    for call in (lambda: schedule(A, n_ranks=8, max_seqlen_per_rank=2048, execution=execution),
                 lambda: simulate(schedule(A, n_ranks=8, max_seqlen_per_rank=2048), execution=execution)):
        with pytest.raises(UnknownExecutionError, match=match) as e:
            call()
        assert isinstance(e.value, ExecutionError) and isinstance(e.value, PlanInputError)


def test_a_vpp_group_the_pipeline_cannot_use_is_a_typed_error():
    with pytest.raises(ExecutionError, match=r"vpp_group=3 is not a multiple of the micro-batch group 2 .*"
                                             r"pass vpp_group=2"):
        schedule(A, n_ranks=8, max_seqlen_per_rank=2048, vpp_group=3, execution=Execution.pipeline(2, vpp=2))
