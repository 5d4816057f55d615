"""The ``bench-step`` torchrun job (``measure``): build each rank's model and batches, then per run
calibrate the cost model and time every arm, interleaved step by step.

``harness.jobs.entry`` starts it as ``harness.bench.step:measure`` (re-exported by the package).
Rank 0's result carries the slowest-rank times and the schedules' figures that
``summarise.summarize`` turns into the report; the other ranks' carry their own breakdowns.
"""

from __future__ import annotations

import gc
import re
import statistics
import time
from pathlib import Path

from harness.bench import host
from harness.bench.compiles import compile_events
from harness.bench.host_lead import summarize_rank as summarize_leads
from harness.bench.step.calibrate import calibrate_cost
from harness.bench.step.config import PHASES, Arm, StepBenchConfig, arm_cost, cost_model_from
from harness.bench.step.rank import (
    RankContext,
    StepMarks,
    layout_cfg,
    local_samples,
    profiled_step,
    sync,
    train_step,
    use_scope,
)
from harness.bench.step.workload import global_batch_lengths, model_cost
from harness.heartbeat import Heartbeat
from harness.parallel.groups import DynamicGroups, ParallelLayout
from harness.plan import CostModel
from harness.plan.ahead import PlanAhead
from harness.plan.bounds import lower_bound, simulate


def measure(rank: int, world: int, cfg_dict: dict) -> dict:
    """The ``bench-step`` torchrun job: every arm on every rank (see the package doc)."""
    import torch

    cfg = StepBenchConfig.from_dict(cfg_dict)
    cfg.validate(world)
    heartbeat = Heartbeat.from_cfg(cfg_dict, rank)
    heartbeat.beat(force=True, phase="building the model")
    ctx = _context(cfg, rank, world)
    ctx.heartbeat = heartbeat
    if cfg.trace_dir and rank == 0:
        Path(cfg.trace_dir).mkdir(parents=True, exist_ok=True)
    probed = host.probe(ctx.device)  # before the runs: what this rank's host pays per call (``harness.bench.host``)
    out = {"rank": rank, "runs": _runs(ctx), "host": probed}
    if rank == 0:
        out["batches"] = [{"lengths": b[0], "clipped": b[1]} for b in ctx.batches[cfg.warmup:]]
        out["device_name"] = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else "cpu"
        out["parameters"] = sum(p.numel() for p in ctx.params)
        out["torch"] = torch.__version__
        out["compile"] = cfg.compile_label()
    return out


def _context(cfg: StepBenchConfig, rank: int, world: int) -> RankContext:
    """This rank's model (gradients in views of one flat fp32 buffer), process groups, gradient
    reducer and the global batches' samples it loads."""
    import torch

    # lazy: imports torch; the CLI imports this module without it
    from harness.parallel import expert_parallel
    from harness.parallel.dist_opt import ShardedBuffers
    from harness.parallel.grad_reduce import BucketedGradReducer, GradBuffer
    from harness.runtime.model import TinyLM  # lazy: torch, as above
    from harness.train import pipeline  # lazy: torch, as above
    from harness.train.step import Run  # lazy: torch, as above

    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    mcfg = cfg.model_config()
    model = TinyLM(mcfg, device=device)
    groups = DynamicGroups(ParallelLayout(dp=world, cp=1), rank)
    everyone = groups.group(world)
    shard = shards = None
    if cfg.expert_parallel:  # the same initial model everywhere; each rank keeps its experts
        shard = expert_parallel.ExpertShard(mcfg.experts, world, rank)
        expert_parallel.shard_experts(model, shard)
        shards = ([p for n, p in model.named_parameters() if expert_parallel.is_expert_param(n)], everyone)
    model.compile_blocks(cfg.compile_backend(), cfg.compile_mode(), cfg.compile_scope())
    params = [p for p in model.parameters()]
    expert = {id(p) for p in shards[0]} if shards else set()
    # gradients accumulate in place into views of one flat buffer: the replicated parameters first, then the experts
    first = lambda p: id(p) not in expert  # noqa: E731
    sharded = cfg.optimizer == "distributed"
    grads = ShardedBuffers(params, world, device, first=first) if sharded else GradBuffer(params, device, first=first)
    replicated = [p for p in params if id(p) not in expert]
    reducer = None
    if cfg.grad_reduce == "overlap":  # expert gradients are whole on their owner: never all-reduced
        if sharded:  # each rank's pieces of the padded buckets, for the distributed optimiser
            reducer = BucketedGradReducer(replicated, grads.flat[:grads.end], everyone, buckets=grads.buckets, scatter=True)
        else:
            reducer = BucketedGradReducer(replicated, grads.flat[:sum(p.numel() for p in replicated)], everyone)
    run = Run(groups, pipeline.PipelineConfig(), pipeline.Stage.of(mcfg.layers, 1, 1, 0), experts=shard)
    ctx = RankContext(cfg, rank, world, device, model, params, grads, [p.detach().clone() for p in params], groups,
                      everyone, model_cost(cfg), run, reducer, shards=shards)
    for i in range(cfg.warmup + cfg.iters):
        lengths, clipped = global_batch_lengths(cfg, world, i)
        ctx.batches.append((lengths, clipped, local_samples(lengths, i, rank, world, mcfg.vocab, cfg.seed, device)))
    return ctx


def _runs(ctx: RankContext) -> list[dict]:
    """Every run (``cfg.runs``), with Python's collector as ``cfg.gc`` says and restored after."""
    cfg = ctx.cfg
    arm_list = cfg.arm_list()
    was_enabled = gc.isenabled()
    if cfg.gc == "manual":
        gc.disable()
    runs = []
    try:
        for run in range(cfg.runs):
            if cfg.gc == "manual":
                gc.collect()
            runs.append(_one_run(ctx, arm_list, run))
    finally:
        if was_enabled:
            gc.enable()
    return runs


def _one_run(ctx: RankContext, arm_list: list[Arm], run: int) -> dict:
    """One repetition: (re-)calibrate the cost model, then every arm's steps (``_run_arms``)."""
    cfg, rank = ctx.cfg, ctx.rank
    calibration = None
    if cfg.cost_model:
        ctx.cost = cost_model_from(cfg.cost_model)
    elif cfg.calibrate:
        calibration = calibrate_cost(ctx)
        ctx.cost = calibration["cost"]
        if rank == 0:
            c = ctx.cost
            print(f"bench step: run {run + 1}/{cfg.runs}: calibrated cost (s): ({c.quadratic:.3e} L^2 + "
                  f"{c.linear:.3e} L + {c.constant:.3e}) / cp per sequence, K/V exchange {c.cp_comm:.3e} per token, "
                  f"{1e3 * c.per_microbatch:.2f} ms per micro-batch + {1e3 * c.cp_block:.2f} ms per CP block; worst fit error "
                  f"{100 * calibration['max_rel_error']:.1f}%", flush=True)
            slow = calibration.get("rank_slowdown")
            if slow:
                print(f"bench step: run {run + 1}/{cfg.runs}: each rank's time on the CP-1 shapes over the fastest "
                      f"rank's: {', '.join(f'{r}: {x:.3f}' for r, x in enumerate(slow))}", flush=True)
    if rank == 0:
        print(f"bench step: run {run + 1}/{cfg.runs}: arms {', '.join(a.label for a in arm_list)} interleaved "
              f"({cfg.warmup} warm-up + {cfg.iters} measured steps each)"
              + (f", then {cfg.profile_iters} profiled steps per arm" if run == cfg.runs - 1 and cfg.profile_iters else ""),
              flush=True)
    out = {"arms": _run_arms(ctx, arm_list, run)}
    if rank == 0:
        out["cost_model"] = ctx.cost.to_dict()
        out["calibration"] = None if calibration is None else {k: v for k, v in calibration.items() if k != "cost"}
    return out


def weights_digest(ws) -> list[float]:
    """A fingerprint of a list of weight tensors (fp64 sums of w and w^2 and of w times its flat
    position): equal weights give equal digests; a swapped, stale or shared copy almost surely not."""
    import torch

    acc = torch.zeros(3, dtype=torch.float64, device=ws[0].device)
    for i, w in enumerate(ws):
        x = w.detach().reshape(-1).double()
        pos = torch.arange(1, x.numel() + 1, dtype=torch.float64, device=x.device) * (i + 1) / x.numel()
        acc += torch.stack([x.sum(), x.square().sum(), (x * pos).sum()])
    return acc.tolist()


def _run_arms(ctx: RankContext, arms: list[Arm], run: int = 0) -> dict:
    """Every arm's timed steps, interleaved: step ``i`` runs each arm once, the arm order rotating
    with ``i``, so drift of the machine over the run (clocks, host jitter, profiler residue) hits
    every arm alike (arms run one after the other are slower the later they run). Each arm keeps its own weights (swapped into the model outside the timed
    window) and AdamW state, from the same initial weights. Then each arm's profiled steps."""
    import torch

    dev = ctx.device
    weights = {a.label: [p0.clone() for p0 in ctx.initial] for a in arms}
    opts = {a.label: _optimizer(ctx) for a in arms}  # the step's own optimiser, per arm
    rec = _timed_steps(ctx, arms, weights, opts)
    if ctx.rank == 0:
        print("bench step: " + ", ".join(f"{a.label} median {1e3 * statistics.median(rec[a.label]['times']):.1f} ms"
                                        for a in arms) + " (this rank)", flush=True)
    out = {arm.label: _arm_result(ctx, arm, rec[arm.label], weights[arm.label], opts[arm.label], run)
           for arm in arms}
    opts.clear()
    weights.clear()
    use_scope(ctx)  # the next run's calibration runs the config's scope
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return out


def _optimizer(ctx: RankContext):
    """An arm's optimiser (the step's: ``harness.train.step``), replicated or distributed over every rank."""
    # lazy: imports torch; the CLI imports this module without it
    from harness.train.step import make_distributed_optimizer, make_optimizer

    if ctx.cfg.optimizer == "distributed":
        local = ctx.shards[0] if ctx.shards else ()
        return make_distributed_optimizer(ctx.grads, ctx.everyone, lr=ctx.cfg.lr, local=local)
    return make_optimizer(ctx.params, lr=ctx.cfg.lr)


def _load(ctx: RankContext, ws: list) -> None:
    """Swap an arm's weights into the model (and clear the gradient buffer) before its step."""
    import torch

    with torch.no_grad():
        for p, w in zip(ctx.params, ws):
            p.copy_(w)
        ctx.flat.zero_()


def _keep(ctx: RankContext, ws: list) -> None:
    """Save the model's weights back into the arm's copy after its step."""
    import torch

    with torch.no_grad():
        for p, w in zip(ctx.params, ws):
            w.copy_(p)


class _Ahead:
    """``plan="ahead"``: a ``PlanAhead`` process plans timed step ``j + 1`` while step ``j`` runs."""

    def __init__(self, ctx: RankContext, order: list):
        self.ctx, self.order = ctx, order
        self.planner = PlanAhead("harness.train.layouts:plan")

    def submit(self, j: int) -> None:
        if j < len(self.order):
            i, arm, _ = self.order[j]
            self.planner.submit(arm.layout, self.ctx.batches[i][0], layout_cfg(self.ctx, arm),
                                arm_cost(self.ctx.cfg, arm, self.ctx.cost))

    def planned_for(self, j: int):
        """What ``train_step`` calls for step ``j``'s plan: it waits for the planner, then hands it step ``j + 1``."""
        def get():
            got = self.planner.result()
            self.submit(j + 1)  # the planner works on the next step while this one runs
            return got
        return get

    def close(self) -> None:
        self.planner.close()


def _timed_steps(ctx: RankContext, arms: list[Arm], weights: dict, opts: dict) -> dict:
    """Every arm's warm-up and measured steps in rotating order; returns, per arm, the measured
    steps' host times, plan times, tokens, phase marks and rotation slots (and rank 0 the schedules' figures), and on
    CUDA its peak memory: the most allocated during its own steps (warm-up included), read after each of them from a
    peak reset before it - every arm's weights and optimizer state are resident throughout, so arms differ by what
    their steps add."""
    import torch
    import torch.distributed as dist

    cfg, dev = ctx.cfg, ctx.device
    rec = {a.label: {"times": [], "plan_ms": [], "plan_wait_ms": [], "tokens": [], "figures": [], "marks": [],
                     "slots": [], "leads": [], "compiles": [], "peak_gb": None} for a in arms}
    # the timed steps in order: step i runs every arm once, the arm order rotating with i
    order = [(i, arms[(i + k) % len(arms)], k) for i in range(len(ctx.batches)) for k in range(len(arms))]
    ahead = _Ahead(ctx, order) if cfg.plan == "ahead" else None
    if ahead is not None:
        ahead.submit(0)
    try:
        for j, (i, arm, k) in enumerate(order):
            ctx.heartbeat.beat(arm=arm.label, step=i + 1, of=len(ctx.batches))
            lengths, _, local = ctx.batches[i]
            _load(ctx, weights[arm.label])
            if cfg.gc == "manual":  # between steps, outside the timed window, on every rank alike
                gc.collect(1)
            dist.barrier(group=ctx.everyone)
            sync(dev)
            if dev.type == "cuda":  # this arm's step alone (host-only calls, outside the timed window)
                torch.cuda.reset_peak_memory_stats(dev)
            marks = StepMarks(dev)  # before the timed window: its origin waits for the idle GPU
            compiled = compile_events()
            t0 = time.perf_counter()
            planned = None if ahead is None else ahead.planned_for(j)
            r = train_step(ctx, arm, lengths, local, opts[arm.label], planned=planned, marks=marks)
            sync(dev)
            dt = time.perf_counter() - t0
            compiled = compile_events() - compiled
            if dev.type == "cuda":
                gb = torch.cuda.max_memory_allocated(dev) / 2**30
                rec[arm.label]["peak_gb"] = max(gb, rec[arm.label]["peak_gb"] or 0.0)
            _keep(ctx, weights[arm.label])
            if i >= cfg.warmup:
                x = rec[arm.label]
                x["times"].append(dt)
                x["plan_ms"].append(r["plan_s"] * 1e3)
                x["plan_wait_ms"].append(r["plan_wait_s"] * 1e3)
                x["tokens"].append(r["local_tokens"])
                x["marks"].append(r["marks"].cumulative_ms())
                leads = r["marks"].leads()
                if leads is not None:
                    x["leads"].append(leads)
                x["slots"].append(k)  # its place in this step's rotation
                x["compiles"].append(compiled)  # a compiling step times the compiler (``harness.bench.compiles``)
                if ctx.rank == 0:
                    x["figures"].append(_schedule_figures(r["schedule"], arm_cost(ctx.cfg, arm, ctx.cost)))
    finally:
        if ahead is not None:
            ahead.close()
    return rec


def _arm_result(ctx: RankContext, arm: Arm, x: dict, ws: list, opt, run: int) -> dict:
    """One arm's figures over every rank (the slowest rank's step times and phase boundaries, the
    tokens processed), its weights' digest, then its profiled steps' breakdown."""
    import torch
    import torch.distributed as dist

    dev = ctx.device
    t = torch.tensor(x["times"], dtype=torch.float64, device=dev)
    slowest = t.clone()
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=ctx.everyone)
    tok = torch.tensor(x["tokens"], dtype=torch.float64, device=dev)
    dist.all_reduce(tok, group=ctx.everyone)
    # when the last rank passed each phase boundary (ms from the step's start), step by step
    last = torch.tensor(x["marks"], dtype=torch.float64, device=dev).reshape(len(x["marks"]), len(PHASES))
    dist.all_reduce(last, op=dist.ReduceOp.MAX, group=ctx.everyone)
    compiles = torch.tensor(x["compiles"], dtype=torch.float64, device=dev)  # any rank's compiling makes a step's time
    dist.all_reduce(compiles, op=dist.ReduceOp.MAX, group=ctx.everyone)
    digest = weights_digest(ws)  # after the timed steps, before the profiled ones
    _load(ctx, ws)
    parts, device_parts, error = _profile(ctx, arm, opt, run)
    out = {"rank": ctx.rank, "times_s": x["times"], "step_s": slowest.tolist(),
           "processed_tokens": tok.tolist(), "plan_ms": x["plan_ms"], "plan_wait_ms": x["plan_wait_ms"],
           "phase_marks_ms": last.tolist(), "own_phase_marks_ms": x["marks"],
           "breakdown": parts, "breakdown_device": device_parts,
           "breakdown_error": error, "peak_memory_gb": x["peak_gb"], "weights_digest": digest,
           "slots": x["slots"], "host_lead": summarize_leads(x["leads"]),
           "compiles": [int(c) for c in compiles.tolist()]}
    if ctx.rank == 0:
        out["schedules"] = x["figures"]
    return out


def _profile(ctx: RankContext, arm: Arm, opt, run: int) -> tuple[list[dict], list[dict], str | None]:
    """The arm's profiled steps' breakdowns, on CUDA the breakdown of one more step profiled without host
    activity (``profiled_step(device_only=True)``), and why they are missing (None when none failed).

    Only the last run profiles: a torch.profiler session leaves host overhead behind in the
    process (the schedule phase grows run after run), so it would slow every later run."""
    import torch
    import torch.distributed as dist

    cfg, dev = ctx.cfg, ctx.device
    parts, error = [], None
    for j in range(cfg.profile_iters if run == cfg.runs - 1 else 0):
        lengths, _, local = ctx.batches[cfg.warmup + j]
        suffix = f"_run{run + 1}" if cfg.runs > 1 else ""
        kept = (Path(cfg.trace_dir) / f"trace_{re.sub(r'[^A-Za-z0-9._-]', '_', arm.label)}_rank0{suffix}.json.gz"
                if cfg.trace_dir and ctx.rank == 0 and j == 0 else None)
        if cfg.gc == "manual":
            gc.collect(1)
        try:
            parts.append(profiled_step(ctx, arm, lengths, local, opt, kept))
        except Exception as e:  # the breakdown is diagnostic: report why it is missing, keep the timings
            error = f"{type(e).__name__}: {e}"
        # every rank stops profiling together (a rank that leaves alone would desynchronise the collectives)
        ok = torch.tensor([0.0 if error else 1.0], dtype=torch.float64, device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ctx.everyone)
        if ok.item() == 0.0:
            return [], [], error or "another rank's profiled step failed"
    device_parts = []
    if parts and dev.type == "cuda":
        lengths, _, local = ctx.batches[cfg.warmup]
        try:
            device_parts.append(profiled_step(ctx, arm, lengths, local, opt, None, device_only=True))
        except Exception as e:  # diagnostic, as above
            error = f"device-only profile: {type(e).__name__}: {e}"
        ok = torch.tensor([0.0 if error else 1.0], dtype=torch.float64, device=dev)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=ctx.everyone)
        if ok.item() == 0.0:
            return parts, [], error or "another rank's device-only profiled step failed"
    return parts, device_parts, error


def _schedule_figures(sched, cost: CostModel) -> dict:
    hist: dict[str, int] = {}
    for s in sched.cp_size_of().values():
        hist[str(s)] = hist.get(str(s), 0) + 1
    lengths = list(sched.lengths.values())
    sim = simulate(sched, cost)
    return {"microbatches": sched.num_microbatches, "cp_histogram": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))),
            "predicted": sim.step_time,
            # each rank's modelled end of micro-batches (busy + waiting: under a barrier every rank ends together)
            "rank_ends": [b + w for b, w in zip(sim.busy, sim.waiting)],
            "lower_bound": lower_bound(lengths, n_ranks=sched.n_ranks, max_seqlen_per_rank=sched.max_seqlen_per_rank,
                                       cost=cost)}
