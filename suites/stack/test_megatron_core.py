"""``dcp-harness verify megatron-core`` where it cannot run: one line naming what to install or pass, exit 2,
before any rank starts; the stack's options are checked by name. The stack itself runs on GPUs (megatron-core
0.19 + TransformerEngine; ``reports/recorded/verify_megatron_core.h200x4.log``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.stack.megatron_core import WORKAROUNDS, _workarounds, preflight
from harness.stack.protocol import StackError

pytestmark = pytest.mark.usefixtures("shared_zygote")  # CLI jobs fork their ranks from one zygote

ROOT = Path(__file__).resolve().parents[2]


def test_verify_megatron_core_names_what_is_missing_in_one_line():
    r = subprocess.run([sys.executable, "-m", "harness", "verify", "megatron-core", "--world", "2"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert "megatron-core" in lines[0] and ("pip install" in lines[0] or "--device cuda" in lines[0]), lines[0]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="the Python-version line is for Python < 3.12")
def test_old_python_is_named_with_its_version():
    with pytest.raises(StackError, match=r"Python >= 3.12; this is Python 3\.\d+"):
        preflight("cuda", 2)


def test_workarounds_are_checked_by_name():
    assert _workarounds(None) == () and _workarounds("none") == ()
    assert _workarounds("all") == tuple(WORKAROUNDS)
    assert _workarounds("rope-cp-group") == ("rope-cp-group",)
    with pytest.raises(StackError, match="unknown megatron-core workaround 'rope'"):
        _workarounds("rope")


def test_schedules_become_megatron_cores_sample_id_groups_with_a_full_group_last():
    """``hybrid_groups`` (CPU): for the harness's ``balanced`` schedules and megatron-core's own (the installed
    scheduler's), every sequence is listed on exactly the ranks of its block, in its micro-batch's group, each rank's
    order kept; the last group gives every rank work; a schedule without such a group is one line."""
    from harness.data.corpus import CorpusConfig, batch_lengths
    from harness.plan import Block, Schedule
    from harness.stack.megatron_core import hybrid_groups
    from harness.stack.protocol import StackError
    from harness.train.layouts import LayoutConfig, plan
    from harness.upstream import megatron as upstream

    corpus = CorpusConfig()
    schedulers = ["balanced"] + (["megatron-core"] if upstream.available() else [])
    for scheduler in schedulers:
        for world in (2, 4):
            for step in range(3):
                lengths = batch_lengths(corpus, step)
                cfg = LayoutConfig(n_ranks=world, max_seqlen_per_rank=512, static_cp=world, scheduler=scheduler)
                sched = plan("dcp", lengths, cfg)[0]
                groups, where = hybrid_groups(sched.layout, world)
                assert all(groups[-1]), (scheduler, world, step)
                assert sorted(where) == list(range(len(lengths)))
                for m, mb in enumerate(sched.layout):
                    for b in mb:
                        for g in b.gids:
                            holders = [(j, r) for j, grp in enumerate(groups) for r in range(world) if g in grp[r]]
                            assert sorted(r for _, r in holders) == list(b.ranks), (scheduler, g)
                            assert len({j for j, _ in holders}) == 1 and where[g] == m
                kept = [[g for grp in groups for g in grp[r]] for r in range(world)]
                assert all(sorted(k) == sorted(g for mb in sched.layout for b in mb if r in b.ranks for g in b.gids)
                           for r, k in enumerate(kept))
    # a full micro-batch first, then one that leaves rank 1 idle: the full one moves last
    tail = Schedule.from_blocks([[Block(0, 2, (0,))], [Block(0, 1, (1,))]], lengths=[20, 10], n_ranks=2,
                                max_seqlen_per_rank=16, algorithm="megatron-core")
    assert hybrid_groups(tail.layout, 2) == ([[[1], []], [[0], [0]]], {0: 0, 1: 1})
    lone = Schedule.from_blocks([[Block(0, 1, (0,))], [Block(1, 1, (1,))]], lengths=[10, 10], n_ranks=2,
                                max_seqlen_per_rank=16)
    with pytest.raises(StackError, match="needs a micro-batch that gives every rank work"):
        hybrid_groups(lone.layout, 2)
    assert hybrid_groups(lone.layout, 2, hybrid=False)[0] == [[[0], []], [[], [1]]]


def test_the_max_seqlen_handed_to_te_is_the_sub_samples_own_a_power_of_two_or_a_fixed_bound():
    from harness.stack.megatron_core import seqlen_bound
    from harness.stack.protocol import StackError

    assert [seqlen_bound(p, "own") for p in (8, 100, 4097)] == [8, 100, 4097]
    assert [seqlen_bound(p, "pow2") for p in (8, 9, 100, 4096, 4097)] == [8, 16, 128, 4096, 8192]
    assert seqlen_bound(100, 8192) == 8192
    with pytest.raises(StackError, match="exceeds max_seqlen=64; raise it or use pow2"):
        seqlen_bound(100, 64)


def test_the_stack_benchmark_profiles_a_call_into_where_its_time_went():
    """``harness.bench.stack_step.profile_call`` (CPU: host operators): a matmul-heavy call is mostly linear and the
    parts add up to the wall time."""
    import torch

    from harness.bench.stack_step import profile_call

    a = torch.randn(256, 256)
    out = profile_call(lambda: [a @ a for _ in range(20)], "cpu")
    assert out["source"] == "host" and out["linear"] > 0
    total = sum(out[k] for k in ("attention", "linear", "other", "communication", "idle"))
    assert total == pytest.approx(out["wall"], rel=1e-6)


def test_the_stack_benchmark_reads_a_cost_per_sequence_and_a_rate_from_its_calibration_steps():
    """``fit_stack_cost`` recovers the fixed cost per step, the cost per sequence and rank and the FLOP rate of
    step times made by that model; ``stack_cost`` prices a 1K-token sequence at its FLOPs / rate + the per-sequence
    cost; a long step no slower than a short one leaves the rate unresolved (the overheads are all there is)."""
    from harness.bench.stack_calibrate import CALIBRATION_COUNT, calibration_batches, fit_stack_cost, stack_cost
    from harness.plan.cost import gpt_benchmark_cost

    flops = gpt_benchmark_cost()
    batches = calibration_batches(4, 2048)
    assert batches == {"one_short": [256] * 4, "more_short": [256] * (4 * CALIBRATION_COUNT), "one_long": [2048] * 4}
    fixed, per_seq, rate = 0.05, 0.2, 3e14
    f = {L: flops.seq_cost(L, 1) for L in (256, 2048)}
    times = {"one_short": fixed + per_seq + f[256] / rate,
             "more_short": fixed + CALIBRATION_COUNT * (per_seq + f[256] / rate),
             "one_long": fixed + per_seq + f[2048] / rate}
    fit = fit_stack_cost(times, flops, 2048)
    assert fit["per_sequence_s"] == pytest.approx(per_seq) and fit["flops_per_s"] == pytest.approx(rate)
    assert fit["fixed_s"] == pytest.approx(fixed)
    cost = stack_cost(flops, fit, 989.0)
    assert cost.per_sequence == pytest.approx(per_seq)
    assert cost.seq_cost(1024, 1) == pytest.approx(per_seq + flops.seq_cost(1024, 1) / rate)
    assert cost.seq_cost(4096, 2) == pytest.approx(per_seq + flops.seq_cost(4096, 2) / rate)
    flat = fit_stack_cost({**times, "one_long": times["one_short"]}, flops, 2048)
    assert flat["flops_per_s"] is None and flat["per_sequence_s"] == pytest.approx(per_seq + f[256] / rate)
    assert stack_cost(flops, flat, 989.0).linear == pytest.approx(flops.linear / (0.5 * 989e12))
    for bad in (float("nan"), float("inf"), 0.0, -1.0, None):
        with pytest.raises(ValueError, match="'more_short' took"):
            fit_stack_cost({**times, "more_short": bad}, flops, 2048)


def test_the_stack_knows_each_padded_length_on_the_host_and_checks_megatron_cores_once_a_step():
    """The forward reads a sequence's padded length from the harness's own record (no synchronisation per sequence);
    ``check_padded`` compares every one with megatron-core's ``cu_seqlens_padded[-1]`` once after the step and names
    the first that differs."""
    import torch

    from harness.stack.megatron_core import check_padded, padded_length

    assert [padded_length(n, cp) for n, cp in ((37, 1), (37, 2), (37, 4), (48, 4), (1, 8))] == [37, 40, 40, 48, 16]
    check_padded([])
    check_padded([(0, 40, torch.tensor([0, 40], dtype=torch.int32)[-1]), (3, 37, torch.tensor(37))])
    with pytest.raises(RuntimeError, match="sequence 3: megatron-core's cu_seqlens_padded ends at 36, the harness "
                                           "padded it to 37"):
        check_padded([(0, 40, torch.tensor(40)), (3, 37, torch.tensor(36))])


def test_the_stack_calibration_changes_every_shape_from_step_to_step(tmp_path, monkeypatch):
    """``calibration_time`` (one gloo rank, a stack that records what it is asked, on a clock the stack advances):
    after the untimed step every step gives each sequence a length the step before did not, at most 30 tokens
    short, every sequence at CP 1; the time is the median of the timed steps."""
    from types import SimpleNamespace

    import torch.distributed as dist

    from harness.bench import stack_calibrate
    from harness.bench.step.config import StepBenchConfig

    now = [0.0]
    monkeypatch.setattr(stack_calibrate, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    class Recording:
        def __init__(self):
            self.steps = []

        def step(self, req):
            self.steps.append(([len(b) - 1 for b in req.batch], {b.size for mb in req.schedule.layout for b in mb}))
            now[0] += 0.01 * len(self.steps)  # 10, 20, 30, 40 ms: the timed ones' median is 30 ms

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        stack = Recording()
        took = stack_calibrate.calibration_time(stack, [256] * 3, 1, StepBenchConfig(max_seqlen_per_rank=2048), 100,
                                                "cpu", reps=3)
    finally:
        dist.destroy_process_group()
    assert len(stack.steps) == 4 and all(sizes == {1} for _, sizes in stack.steps)
    assert took == pytest.approx(0.03)
    for (before, _), (after, _) in zip(stack.steps, stack.steps[1:]):
        assert all(a != b for a, b in zip(after, before)) and all(226 <= x <= 256 for x in after)


def test_the_stack_benchmark_packs_balanced_by_the_batch_and_megatron_cores_arm_as_upstream():
    """``bench step --stack megatron-core``'s schedules: ``balanced`` may hold any number of sequences per rank in a
    group (megatron-core runs each as its own pass; ``max_seqlen_per_rank`` bounds each sequence), is valid on its
    own terms and, under a per-sequence cost, no slower than upstream's scheduler's shape (its parity,
    ``megatron-dev``) under the synchronous model; the static arm keeps the plain capacity."""
    from dataclasses import replace

    from harness.bench.stack_step import _schedule
    from harness.plan import check_schedule, gpt_benchmark_cost, schedule, simulate

    flops = gpt_benchmark_cost()
    cost = replace(flops, per_sequence=40 * flops.seq_cost(1024, 1))
    lengths = [5000, 3000, 2500, 1800, 1200, 900, 700, 600, 500, 400, 300, 300, 200, 150, 128, 128] * 3
    sched, _, _ = _schedule("balanced", lengths, 4, 2048, cost)
    assert sched.capacity == sum(lengths) and sched.max_seqlen_per_rank == 2048 and not check_schedule(sched)
    assert all(b.size >= 2 for mb in sched.layout for b in mb if any(lengths[g] > 2048 for g in b.gids))
    dev = schedule(lengths, n_ranks=4, max_seqlen_per_rank=2048, algorithm="megatron-dev")
    assert simulate(sched, cost, execution="synchronous").step_time <= \
        simulate(dev, cost, execution="synchronous").step_time
    static, _, _ = _schedule("static", lengths, 4, 2048, cost)
    assert static.microbatch_tokens_per_rank is None and static.capacity == 2048


def test_a_stack_of_sequence_passes_gets_balanced_packed_by_the_batch_in_verify_and_the_benchmark():
    """``verify`` and ``bench step --stack`` plan a stack's batches through ``for_stack``: megatron-core
    (``sequence_passes``) gets ``balanced``'s micro-batches packed by the batch's tokens - the schedule its benchmark
    measures is the one verify checks -; any other stack or scheduler plans as configured; a non-bool declaration is
    refused naming it."""
    from harness.stack.megatron_core import MegatronCoreStack
    from harness.stack.protocol import sequence_passes
    from harness.train.layouts import LayoutConfig, for_stack

    assert MegatronCoreStack.sequence_passes is True and MegatronCoreStack.execution == "synchronous"
    cfg = LayoutConfig(n_ranks=4, max_seqlen_per_rank=2048, static_cp=4)
    lengths = [5000, 3000, 900, 700, 128]
    assert for_stack(cfg, lengths, True).microbatch_tokens_per_rank == sum(lengths)
    assert for_stack(cfg, [100], True).microbatch_tokens_per_rank == 2048  # never below max_seqlen_per_rank
    assert for_stack(cfg, lengths, False) is cfg
    dev = LayoutConfig(n_ranks=4, max_seqlen_per_rank=2048, static_cp=4, scheduler="megatron-dev")
    assert for_stack(dev, lengths, True) is dev

    class Plain:
        name = "plain"

    class Odd:
        name, sequence_passes = "odd", "yes"

    assert sequence_passes(Plain()) is False
    with pytest.raises(StackError, match=r"stack 'odd': sequence_passes must be a bool .* got 'yes'"):
        sequence_passes(Odd())
    # a declared execution model is scheduled for, unless the run has its own (a pipeline, expert parallelism)
    from harness.plan.execution import resolve_execution
    from harness.stack.protocol import declared_execution

    assert resolve_execution(for_stack(cfg, lengths, True, "synchronous").execution).kind == "synchronous"
    piped = LayoutConfig(n_ranks=4, max_seqlen_per_rank=2048, static_cp=4, execution="synchronous")
    assert for_stack(piped, lengths, False, "independent") is piped
    assert declared_execution(Plain()) is None

    class Wrong:
        name, execution = "wrong", "lockstep"

    with pytest.raises(StackError, match=r"stack 'wrong': execution must be one of independent, synchronous .* "
                                         r"got 'lockstep'"):
        declared_execution(Wrong())


def test_sharpen_scales_the_query_and_key_rows_of_each_query_group_and_leaves_the_values():
    """megatron-core's fused QKV rows are query groups of [its query heads, one key head, one value head]
    (``SelfAttention.get_query_key_value_tensors``); the GPU suite checks the tensors TE's attention receives."""
    import torch

    from harness.stack.megatron_core import scale_grouped_qkv
    from harness.stack.protocol import StackError

    groups, per, hn, h = 2, 3, 4, 8
    for shape in [(groups * (per + 2) * hn, h), (groups * (per + 2) * hn,)]:  # weight, bias
        t = torch.randn(shape)
        before = t.clone()
        scale_grouped_qkv(t, groups, per, hn, 16.0)
        split = lambda x: x.view(groups, (per + 2) * hn, -1).split([per * hn, hn, hn], dim=1)  # noqa: E731
        (q, k, v), (q0, k0, v0) = split(t), split(before)
        assert torch.equal(q, 16 * q0) and torch.equal(k, 16 * k0) and torch.equal(v, v0)
    with pytest.raises(StackError, match="QKV layout changed"):
        scale_grouped_qkv(torch.zeros(groups * (per + 2) * hn + 1, h), groups, per, hn, 2.0)
