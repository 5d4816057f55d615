"""Execution models of ``harness.plan.execution``: the default is today's model, the pipeline simulator
follows its three rules pass by pass, never beats the lower bound, and sees the micro-batch order."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.plan import (
    INDEPENDENT,
    SYNCHRONOUS,
    Block,
    CostModel,
    Execution,
    ExecutionError,
    PlanInputError,
    Schedule,
    VPPAlignmentError,
    lower_bound,
    quality,
    schedule,
    schedule_lower_bound,
    shares_from_layers,
    simulate,
    stats,
    with_microbatch_order,
)
from harness.plan.pipeline_schedule import PipelineScheduleError, chunk_index
from harness.testing import batches

LIN = CostModel(quadratic=0.0, linear=1.0)
COSTS = [CostModel.megatron(),
         CostModel(quadratic=1.0, linear=300.0, cp_comm=40.0, per_microbatch=5e4, cp_block=2e5, name="overheads"),
         CostModel(quadratic=1.0, linear=300.0, cp_comm=40.0, per_sequence=3e5, name="per-sequence overhead")]
PIPELINES = [Execution.pipeline(pp, schedule=k) for pp in (1, 2, 4) for k in ("afab", "1f1b")]
PIPELINES += [Execution.pipeline(pp, vpp=2) for pp in (2, 4)]


def _one_rank(lengths, cost=LIN) -> Schedule:
    return Schedule.from_blocks([[Block(0, 1, (g,))] for g in range(len(lengths))], lengths=list(lengths),
                                n_ranks=1, max_seqlen_per_rank=max(lengths), cost=cost)


def _reference_independent(s: Schedule, cost: CostModel) -> tuple[float, list[float], list[float]]:
    """The step-time model as it was before execution models existed (kept verbatim)."""
    n = s.n_ranks
    free, busy, wait = [0.0] * n, [0.0] * n, [0.0] * n
    for mb in s.layout:
        for b in mb:
            lo, hi = b.start, b.start + b.size
            start = max(free[lo:hi])
            dur = s.block_cost(b, cost)
            for r in range(lo, hi):
                wait[r] += start - free[r]
                busy[r] += dur
                free[r] = start + dur
    return max(free, default=0.0), busy, wait


def _scheduled(batch, ex: Execution, cost: CostModel) -> Schedule | None:
    try:
        return schedule(batch.lengths, cost=cost, **dict(batch.kwargs(), vpp_group=ex.vpp_group))
    except VPPAlignmentError:
        return None


# ----------------------------------------------------------------------------------- the default
@settings(max_examples=150)
@given(batch=batches(max_log_ranks=4, max_sequences=32))
def test_the_default_execution_is_the_model_of_before(batch):
    for cost in COSTS:
        try:
            s = schedule(batch.lengths, cost=cost, **batch.kwargs())
        except VPPAlignmentError:
            return
        step, busy, wait = _reference_independent(s, cost)
        for sim in (simulate(s, cost), simulate(s, cost, INDEPENDENT), simulate(s, cost, execution=Execution())):
            assert (sim.step_time, sim.busy, sim.waiting) == (step, busy, wait)
            assert sim.stages == 1 and sim.passes == ()
        # one stage running forward then backward of each micro-batch is the same model
        one = simulate(s, cost, Execution.pipeline(1))
        assert one.step_time == pytest.approx(step, rel=1e-12, abs=1e-9)
        assert one.busy == pytest.approx(busy, rel=1e-12, abs=1e-9)


def test_default_lower_bound_quality_and_stats_are_unchanged():
    s = schedule([5000, 3000, 900, 700, 40], n_ranks=4, max_seqlen_per_rank=2048)
    lb = lower_bound(list(s.lengths.items()), n_ranks=4, max_seqlen_per_rank=2048)
    assert lb == lower_bound(list(s.lengths.items()), n_ranks=4, max_seqlen_per_rank=2048, execution=INDEPENDENT)
    assert quality(s) == quality(s, execution=INDEPENDENT) == simulate(s).step_time / lb
    st_ = stats(s)
    assert (st_.execution, st_.lower_bound, st_.step_time) == ("independent", lb, simulate(s).step_time)
    assert st_.bubble_fraction == pytest.approx(simulate(s).bubble_fraction)


# ----------------------------------------------------------------------------------- hand-checked
def test_worked_example_1f1b_and_afab():
    """Micro-batches of 6 and 12 tokens, cost L, pp 2: F0 = 1, B0 = 2, F1 = 2, B1 = 4 per stage."""
    s = _one_rank([6, 12])
    f1b = simulate(s, execution=Execution.pipeline(2))
    assert (f1b.step_time, f1b.busy, f1b.waiting) == (14.0, [9.0, 9.0], [5.0, 1.0])
    assert f1b.bubble_fraction == pytest.approx(1 - 18 / 28)
    stage1 = [(str(p), p.start, p.end) for p in f1b.passes if p.stage == 1]
    assert stage1 == [("F0", 1.0, 2.0), ("B0", 2.0, 4.0), ("F1", 4.0, 6.0), ("B1", 6.0, 10.0)]
    afab = simulate(s, execution=Execution.pipeline(2, schedule="afab"))
    assert (afab.step_time, afab.bubble_fraction) == (15.0, pytest.approx(0.4))


def test_micro_batch_order_changes_the_pipeline_step():
    """12, 6, 6 tokens: the long micro-batch first holds up the fill (18); in the middle, 16. Without a
    pipeline one rank takes 24 whatever the order."""
    s = _one_rank([12, 6, 6])
    moved = with_microbatch_order(s, [1, 0, 2])
    assert simulate(s, execution=Execution.pipeline(2)).step_time == 18.0
    assert simulate(moved, execution=Execution.pipeline(2)).step_time == 16.0
    assert simulate(s).step_time == simulate(moved).step_time == 24.0
    assert quality(moved, execution=Execution.pipeline(2)) < quality(s, execution=Execution.pipeline(2))


def test_a_cp_block_waits_for_its_slowest_rank_in_every_stage():
    """Micro-batch 0: rank 0 runs 6 tokens, rank 1 runs 12; micro-batch 1 is a CP-2 block of 12 tokens
    (6 per rank). pp 2, AFAB: stage 0's F1 starts when rank 1 ends F0 (at 2), on both ranks."""
    s = Schedule.from_blocks([[Block(0, 1, (0,)), Block(1, 1, (1,))], [Block(0, 2, (2,))]],
                             lengths=[6, 12, 12], n_ranks=2, max_seqlen_per_rank=12, cost=LIN)
    sim = simulate(s, execution=Execution.pipeline(2, schedule="afab"))
    f1 = [p for p in sim.passes if (p.stage, p.kind, p.microbatch) == (0, "F", 1)]
    assert [(p.start_position, p.size, p.start, p.end) for p in f1] == [(0, 2, 2.0, 3.0)]
    assert sim.waiting[0] >= 1.0  # rank 0 of stage 0 idled from 1 to 2 for its partner
    assert len(sim.busy) == 4 and sum(sim.busy) == pytest.approx(sum(simulate(s).busy))


def test_synchronous_waits_for_the_slowest_rank_of_every_micro_batch():
    s = Schedule.from_blocks([[Block(0, 1, (0,)), Block(1, 1, (1,))], [Block(0, 1, (2,)), Block(1, 1, (3,))]],
                             lengths=[10, 2, 3, 7], n_ranks=2, max_seqlen_per_rank=10, cost=LIN)
    assert simulate(s).step_time == 13.0  # rank 0: 10 + 3
    sync = simulate(s, execution=SYNCHRONOUS)
    assert (sync.step_time, sync.busy, sync.waiting) == (17.0, [13.0, 9.0], [4.0, 8.0])
    assert sync.step_time == stats(s).sync_makespan
    assert stats(s, execution=SYNCHRONOUS).step_time == 17.0


def test_uneven_chunk_shares_weigh_the_passes():
    """Stage 1 holds 3/4 of the model: one 8-token micro-batch takes F 2/3 + 2 then B 4 + 4/3 (= 8 in all)."""
    s = _one_rank([8])
    sim = simulate(s, execution=Execution.pipeline(2, chunk_shares=shares_from_layers([[1], [3]])))
    assert [(p.stage, str(p), round(p.end - p.start, 6)) for p in sim.passes] == [
        (0, "F0", round(2 / 3, 6)), (1, "F0", 2.0), (1, "B0", 4.0), (0, "B0", round(4 / 3, 6))]
    assert sim.step_time == pytest.approx(8.0)
    assert Execution.pipeline(2, chunk_shares=(1, 3)).stage_share(1) == 0.75


# ----------------------------------------------------------------------------- rules and the bound
def _check_rules(s: Schedule, ex: Execution, cost: CostModel, sim) -> None:
    """Every pass starts exactly when the latest of (a) its ranks' previous pass, (b) its input, ends
    (rule (c): a block's ranks start together), and lasts its share of the block's cost."""
    shares, last, pp = ex.shares(), ex.num_chunks - 1, ex.pp
    ends, free = {}, {}
    for p in sim.passes:
        c = chunk_index(p.stage, p.chunk, pp)
        block = next(b for b in s.layout[p.microbatch] if b.start == p.start_position)
        phase = ex.forward_share if p.kind == "F" else 1 - ex.forward_share
        ulp = 1e-12 * max(1.0, abs(p.end))  # a duration read off absolute times keeps their rounding
        assert p.end - p.start == pytest.approx(s.block_cost(block, cost) * shares[c] * phase, rel=1e-9,
                                                abs=max(1e-9, ulp))
        need = (("F", p.microbatch, c - 1) if c > 0 else None) if p.kind == "F" else \
            ("F", p.microbatch, c) if c == last else ("B", p.microbatch, c + 1)
        ready = max([ends[need + (p.start_position,)] if need else 0.0]
                    + [free.get((p.stage, r), 0.0) for r in block.ranks])
        assert p.start == pytest.approx(ready, rel=1e-12, abs=max(1e-9, ulp))
        ends[(p.kind, p.microbatch, c, p.start_position)] = p.end
        for r in block.ranks:
            free[(p.stage, r)] = p.end
    assert sim.step_time == max(p.end for p in sim.passes)


@settings(max_examples=120, deadline=None)
@given(batch=batches(max_log_ranks=3, max_sequences=24, vpp=False),
       forward_share=st.sampled_from([1 / 3, 0.5, 0.2]),
       shares=st.one_of(st.none(), st.lists(st.integers(0, 4), min_size=8, max_size=8)))
def test_pipeline_simulation_follows_its_rules_and_never_beats_the_lower_bound(batch, forward_share, shares):
    for cost in COSTS:
        for base in PIPELINES:
            chunk = None if shares is None else tuple(shares[:base.num_chunks])
            if chunk is not None and sum(chunk) == 0:
                chunk = None
            ex = dataclasses.replace(base, forward_share=forward_share, chunk_shares=chunk)
            s = _scheduled(batch, ex, cost)
            if s is None:
                continue
            sim = simulate(s, cost, ex)
            lb = lower_bound(batch.lengths, cost=cost, n_ranks=batch.n_ranks,
                             max_seqlen_per_rank=batch.max_seqlen_per_rank, min_cp_size=batch.min_cp_size,
                             vpp_group=ex.vpp_group, execution=ex)
            assert sim.step_time >= lb * (1 - 1e-9), (ex, sim.step_time, lb)
            assert lb >= lower_bound(batch.lengths, cost=cost, n_ranks=batch.n_ranks,
                                     max_seqlen_per_rank=batch.max_seqlen_per_rank, min_cp_size=batch.min_cp_size,
                                     vpp_group=ex.vpp_group) * max(ex.stage_share(k) for k in range(ex.pp)) * (1 - 1e-9)
            if not s.layout:
                assert sim.step_time == 0.0
                continue
            assert len(sim.busy) == ex.pp * s.n_ranks and 0.0 <= sim.bubble_fraction < 1.0
            assert sum(sim.busy) == pytest.approx(sum(simulate(s, cost).busy), rel=1e-9)  # work is conserved
            _check_rules(s, ex, cost, sim)


@settings(max_examples=80, deadline=None)
@given(batch=batches(max_log_ranks=3, max_sequences=24, vpp=False))
def test_synchronous_never_beats_the_lower_bound_nor_the_independent_model(batch):
    s = schedule(batch.lengths, **batch.kwargs())
    lb = schedule_lower_bound(s, execution=SYNCHRONOUS)
    sync, indep = simulate(s, execution=SYNCHRONOUS), simulate(s)
    assert sync.step_time >= indep.step_time * (1 - 1e-12) and sync.step_time >= lb * (1 - 1e-9)


def test_interleaved_bound_counts_the_micro_batch_group():
    """An interleaved pipeline needs a multiple of its group: with a per-micro-batch cost, the bound
    charges the rounded-up count, as ``vpp_group=`` does."""
    c = CostModel(quadratic=0.0, linear=1.0, per_microbatch=10.0)
    kw = dict(n_ranks=1, max_seqlen_per_rank=100, cost=c)
    ex = Execution.pipeline(2, vpp=2, group=3)
    # 100 tokens fit one micro-batch, the group makes it 3: stage share 1/2 of (100 + 3 x 10) + 1/4 of the
    # smallest block (10 + 10)
    assert lower_bound([10] * 10, **kw, execution=ex) == lower_bound([10] * 10, **kw, vpp_group=3, execution=ex) == 70
    assert lower_bound([10] * 10, **kw, vpp_group=1, execution=ex) == 60


# ----------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize("make, error, match", [
    (lambda: Execution(kind="moe"), ExecutionError, r"unknown execution kind 'moe'; choose from independent"),
    (lambda: Execution(pp=2), ExecutionError, r"pp=2, vpp=1 .*kind 'pipeline'.*Execution.pipeline\(2"),
    (lambda: Execution.pipeline(1, vpp=2), ExecutionError, r"vpp=2 needs pipeline stages: use pp >= 2, or vpp=1"),
    (lambda: Execution.pipeline(2, schedule="gpipe"), ExecutionError, r"unknown pipeline schedule 'gpipe'"),
    (lambda: Execution.pipeline(2, vpp=2, schedule="afab"), ExecutionError, r"'afab' has no virtual chunks"),
    (lambda: Execution.pipeline(2, schedule="interleaved"), ExecutionError, r"needs vpp >= 2"),
    (lambda: Execution.pipeline(2, group=2), ExecutionError, r"group=2 .*with vpp > 1, or group=None"),
    (lambda: Execution.pipeline(0), ExecutionError, r"Execution.pp must be a positive int, got 0"),
    (lambda: Execution.pipeline(2, forward_share=1.0), ExecutionError, r"forward_share .*got 1.0"),
    (lambda: Execution.pipeline(2, chunk_shares=(1, 2, 3)), ExecutionError, r"chunk_shares must be 2 finite"),
    (lambda: Execution.pipeline(2, chunk_shares=(0, 0)), ExecutionError, r"sum to 0"),
    (lambda: simulate(_one_rank([5]), execution="pipeline"), ExecutionError,
     r"execution 'pipeline' needs its stage count: pass Execution.pipeline\(pp"),
    (lambda: simulate(_one_rank([5]), execution="moe"), ExecutionError, r"unknown execution model 'moe'; choose one"),
    (lambda: lower_bound([5], n_ranks=1, max_seqlen_per_rank=5, execution=2), ExecutionError, r"got 2"),
    (lambda: with_microbatch_order(_one_rank([5, 6]), [0, 0]), ExecutionError, r"not a permutation"),
    (lambda: simulate(_one_rank([5, 6, 7]), execution=Execution.pipeline(2, vpp=2)), PipelineScheduleError,
     r"multiple of microbatch_group_size_per_vp_stage=2, got 3; align the schedule \(schedule\(\.\.\., vpp_group=2"),
])
def test_bad_execution_input_is_a_typed_error_naming_the_fix(make, error, match):
    with pytest.raises(error, match=match) as e:
        make()
    assert isinstance(e.value, PlanInputError) and isinstance(e.value, ValueError)


def test_executions_are_frozen_values():
    ex = Execution.pipeline(4, vpp=2)
    assert ex == Execution(kind="pipeline", pp=4, vpp=2) and hash(ex) == hash(Execution(kind="pipeline", pp=4, vpp=2))
    assert (ex.pipeline_kind, ex.vpp_group, ex.num_chunks, ex.describe()) == ("interleaved", 4, 8,
                                                                               "pipeline pp 4 x vpp 2, interleaved")
    assert ex.share_before(3) == pytest.approx(3 / 8) and ex.stage_share(0) == pytest.approx(1 / 4)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ex.pp = 2  # type: ignore[misc]


# a calibrated cost (seconds) of a launch-bound machine: per micro-batch and per sequence overheads dwarf the
# tokens' terms, so a tall row may fit nothing under a candidate height
OVERHEAD_BOUND = CostModel(quadratic=0.0, linear=0.0, constant=2.39e-3, cp_comm=1.5e-4, per_microbatch=0.0447,
                           cp_block=0.0, name="calibrated, launch-bound")


def test_synchronous_balanced_on_a_launch_bound_cost_model():
    """A global batch of ``bench step --ep``'s CPU smoke run: under a cost whose per-micro-batch overhead passes a
    tall row's candidate height, the synchronous ``balanced`` tried to fill a row holding no block (an empty heap,
    ``IndexError``); it now skips that height and returns a valid schedule."""
    lengths = [9, 488, 21, 22, 8, 26, 142, 33, 447, 56, 8, 512, 81, 124, 134, 8, 131, 86, 93, 20, 82, 434, 52, 272, 67,
               25, 8, 9, 62, 19, 28, 87, 206, 71, 33, 60, 25, 60, 8]
    for ex in (INDEPENDENT, SYNCHRONOUS):
        s = schedule(lengths, n_ranks=4, max_seqlen_per_rank=128, algorithm="balanced", cost=OVERHEAD_BOUND,
                     execution=ex)
        assert s.execution == ex


@settings(max_examples=80, deadline=None)
@given(batch=batches(max_log_ranks=4, max_sequences=48, vpp=False),
       overhead=st.sampled_from([0.0, 1e-3, 0.05, 1.0]), constant=st.sampled_from([0.0, 2e-3, 0.5]),
       per_sequence=st.sampled_from([0.0, 0.04]))
def test_balanced_schedules_whatever_the_overheads_weigh(batch, overhead, constant, per_sequence):
    """Both execution models give a valid schedule (``schedule`` validates it) for cost models from token-bound
    to overhead-bound."""
    cost = CostModel(quadratic=1e-9, linear=1e-6, constant=constant, cp_comm=1e-7, per_microbatch=overhead,
                     cp_block=overhead / 2, per_sequence=per_sequence, name="swept")
    for ex in (INDEPENDENT, SYNCHRONOUS):
        schedule(batch.lengths, cost=cost, execution=ex, **batch.kwargs())
