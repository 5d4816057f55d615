"""One rank's side of a ``bench step`` job: its context, one timed training step and one profiled step.

A timed step is ``harness.train.step.train_step`` - the step ``converge`` and the fault catalogue verify - with
the benchmark's hooks: the schedule planned ahead, phase marks, the overlapped gradient reducer, the compile
scope of the last micro-batch. Calibration (``calibrate.calibrate_cost``) times single micro-batches through the
same passes (``microbatch_runner``). torch and the runtime are imported inside the functions: the CLI imports
this package without them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.bench.host_lead import leads_ms
from harness.bench.step.config import Arm, StepBenchConfig, arm_cost
from harness.heartbeat import Heartbeat
from harness.io import atomic_write_bytes
from harness.plan import CostModel
from harness.train.layouts import LayoutConfig, plan


@dataclass
class RankContext:
    """What one rank's steps share: the config, this rank's model and its gradient buffer, the process groups
    and the step's ``Run``, the scheduler's cost model (replaced by each run's calibration) and the batches."""

    cfg: StepBenchConfig
    rank: int
    world: int
    device: object
    model: object
    params: list
    grads: object  # a harness.parallel.grad_reduce.GradBuffer: every p.grad a view of grads.flat
    initial: list
    groups: object
    everyone: object
    cost: CostModel
    run: object = None  # the step's harness.train.step.Run (one stage, no expert parallelism)
    reducer: object = None  # a BucketedGradReducer (grad_reduce="overlap"), else None
    batches: list = field(default_factory=list)  # (lengths, clipped, local samples)
    shards: tuple | None = None  # expert parallelism: (this rank's expert parameters, their DP x CP group)
    heartbeat: Heartbeat = field(default_factory=lambda: Heartbeat(None, 0))  # progress for the launcher's watchdog

    @property
    def flat(self):
        return self.grads.flat


def sync(device) -> None:
    """Wait for the device (CUDA) to finish its queued work; a no-op on CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepMarks:
    """Phase boundaries of one step: CUDA events on the current stream (read only after the step's
    closing synchronisation, so timing adds no synchronisation), the host clock on CPU. On CUDA also each pass's
    start (``pass_started``) and the host clock beside every event: how far the host ran ahead of its GPU
    (``harness.bench.host_lead``)."""

    def __init__(self, device):
        """Started on an idle device (after the closing synchronisation of the step before, outside the timed window):
        the origin's one event synchronisation then returns at once."""
        self.cuda = device.type == "cuda"
        self.points: list = []
        self.host: list[float] = []
        self.passes: list[tuple[str, float, object]] = []  # (kind, host clock, event) at each pass's start
        self.mark()
        if self.cuda:  # one origin for both clocks: the host's read once the GPU has reached the first event
            self.points[0].synchronize()
            self.host[0] = time.perf_counter()

    def _event(self):
        import torch

        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e

    def mark(self) -> None:
        t = time.perf_counter()
        self.host.append(t)
        self.points.append(self._event() if self.cuda else t)

    def pass_started(self, action) -> None:
        if self.cuda:
            self.passes.append((action.kind, time.perf_counter(), self._event()))

    def cumulative_ms(self) -> list[float]:
        """Milliseconds from the step's start to each later mark."""
        if self.cuda:
            return [self.points[0].elapsed_time(e) for e in self.points[1:]]
        return [1e3 * (t - self.points[0]) for t in self.points[1:]]

    def leads(self) -> dict | None:
        """The host's lead over the GPU at each pass's start and at the step's last mark, and each pass's time on
        the host and on the GPU but the last's (to the next pass's start; ``harness.bench.host_lead``); None on CPU."""
        if not self.cuda:
            return None
        t0, e0 = self.host[0], self.points[0]
        host = [1e3 * (t - t0) for _, t, _ in self.passes] + [1e3 * (self.host[-1] - t0)]
        dev = [e0.elapsed_time(e) for _, _, e in self.passes] + [e0.elapsed_time(self.points[-1])]
        lead = leads_ms(host, dev)
        passes = len(self.passes)  # each pass's time: from its start to the next pass's, on either clock
        return {"kinds": [k for k, _, _ in self.passes], "leads": lead[:-1], "end": lead[-1],
                "host_ms": [host[i + 1] - host[i] for i in range(passes - 1)],
                "device_ms": [dev[i + 1] - dev[i] for i in range(passes - 1)]}


def local_samples(lengths: list[int], index: int, me: int, n: int, vocab: int, seed: int, device) -> dict:
    """The samples of global batch ``index`` this rank loads (sequence ``g`` on rank ``g % n``, a DP
    shard), with random tokens seeded by (seed, batch, sequence): the same on every run and arm."""
    import numpy as np
    import torch

    out = {}
    for g, L in enumerate(lengths):
        if g % n == me:
            toks = np.random.default_rng((seed, index, g)).integers(0, vocab, size=L + 1)
            t = torch.as_tensor(toks, dtype=torch.int64, device=device)
            out[g] = {"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(L, dtype=torch.int64, device=device),
                      "position_ids": torch.arange(L, dtype=torch.int64, device=device)}
    return out


def layout_cfg(ctx: RankContext, arm: Arm):
    """The scheduler's view of ``arm`` on this world (``harness.train.layouts.plan``)."""
    return LayoutConfig(n_ranks=ctx.world, max_seqlen_per_rank=ctx.cfg.max_seqlen_per_rank,
                        static_cp=ctx.cfg.static_cp or ctx.world, scheduler=arm.scheduler, dcp_padding=arm.padding,
                        execution=arm.execution, expert_parallel=ctx.cfg.expert_parallel)


def use_scope(ctx: RankContext, arm: Arm | None = None, scope: str | None = None) -> str | None:
    """Compile the model's blocks as ``scope`` (default: ``arm``'s, else the config's); returns the
    scope now in use (None when the config runs eager)."""
    cfg = ctx.cfg
    if not cfg.compile_backend():
        return None
    scope = scope or (arm.scope if arm else None) or cfg.compile_scope()
    ctx.model.compile_blocks(cfg.compile_backend(), cfg.compile_mode(), scope)
    return scope


def train_step(ctx: RankContext, arm: Arm, lengths: list[int], local: dict, opt, planned=None, marks=None) -> dict:
    """One training step (``harness.train.step.train_step``); returns host-side figures (no device
    synchronisation inside). ``planned``: None = plan inline; else a callable returning ``(plan(...)'s result,
    seconds it took)`` - the plan computed ahead by a ``PlanAhead`` process (waiting for it, if it is behind,
    is inside the step). ``marks``: the step's clock (a ``StepMarks`` started before the timed window; a new one by
    default)."""
    # lazy: imports torch; the CLI imports this module without it
    from harness.train.step import StepHooks
    from harness.train.step import train_step as step  # lazy: torch, as above

    marks = StepMarks(ctx.device) if marks is None else marks
    chain = use_scope(ctx, arm) == "chain"
    # a chain's backward hands every gradient over at its very end: the last micro-batch runs the segments so
    # that the overlapped reducer has buckets to launch during it
    last = (lambda: use_scope(ctx, scope="segments")) if chain and ctx.reducer is not None else None
    hooks = StepHooks(planned=planned, mark=marks.mark, reducer=ctx.reducer, before_last=last,
                      token_multiple=ctx.cfg.token_bucket_of(arm), on_pass=marks.pass_started)
    r = step(ctx.model, ctx.run, arm.layout, lengths, local, layout_cfg(ctx, arm), arm_cost(ctx.cfg, arm, ctx.cost),
             device=ctx.device,
             opt=opt, params=ctx.params, grads=ctx.grads, dtype=ctx.cfg.dtype,
             exchange=arm.exchange or ctx.cfg.cp_exchange, grad_clip=1.0, hooks=hooks, weights=arm.weights or "cached",
             **({"shards": ctx.shards} if ctx.shards else {}))
    return {"plan_s": r.plan_s, "plan_wait_s": r.wait_s, "schedule": r.schedule, "local_tokens": r.local_tokens,
            "marks": marks}


def profiled_step(ctx: RankContext, arm: Arm, lengths, local, opt, keep_trace: Path | None,
                  device_only: bool = False) -> dict:
    """One step under ``torch.profiler``, as a timed step runs it; returns its time breakdown
    (``harness.bench.trace.breakdown``) and keeps the Chrome trace in ``keep_trace`` (gzipped).

    ``device_only`` (CUDA): record the device's activity alone, without the host operators whose recording
    lengthens a host-bound step by half; the window is then the trace's span (first CUDA call to the last
    kernel's end, ``trace.span``), which leaves out host work before the first launch."""
    import gzip
    import os
    import tempfile

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    # looked up at each call, not at import: a test replaces harness.bench.trace.load_trace in one rank
    from harness.bench.trace import annotations, breakdown, load_trace, span

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    if device_only:
        acts = [ProfilerActivity.CUDA]
    planned = None
    if ctx.cfg.plan == "ahead":  # as in the timed steps: the schedule is ready when the step starts
        t = time.perf_counter()
        got = plan(arm.layout, lengths, layout_cfg(ctx, arm), arm_cost(ctx.cfg, arm, ctx.cost))
        done = (got, time.perf_counter() - t)
        planned = lambda: done  # noqa: E731
    dist.barrier(group=ctx.everyone)
    sync(ctx.device)
    with profile(activities=acts) as prof, record_function("dcp_harness_step"):
        train_step(ctx, arm, lengths, local, opt, planned=planned)
        sync(ctx.device)
    fd, path = tempfile.mkstemp(suffix=".json", prefix=f"dcp_step_r{ctx.rank}_")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        trace = load_trace(path)
        if keep_trace is not None:
            atomic_write_bytes(keep_trace, gzip.compress(Path(path).read_bytes(), mtime=0))
    finally:
        os.unlink(path)
    if device_only:
        return breakdown(trace, span(trace))
    windows = annotations(trace, "dcp_harness_step")
    if not windows:
        raise RuntimeError("the profiler trace has no dcp_harness_step annotation")
    return breakdown(trace, windows[-1])


def microbatch_runner(ctx: RankContext, mb, total: float, exchange: str = "gather"):
    """A closure running one micro-batch's forward and backward through the step's passes (gradients land in
    ``ctx.grads``): what calibration times is a micro-batch of a step."""
    import torch

    # lazy: imports torch; the CLI imports this module without it
    from harness.train import passes, pipeline
    from harness.train.step import cp_group_for  # lazy: torch, as above

    ops = passes.MicroBatchOps(ctx.model, ctx.groups, [mb], [cp_group_for(ctx.groups, mb)], ctx.device,
                               exchange, experts=ctx.run.experts).prepare()
    zero = torch.zeros((), device=ctx.device, dtype=torch.float64)
    sums = {"ce": zero.clone(), "aux": zero.clone(), "mtp": []}
    chunk = passes.model_passes(ctx.model, ctx.run.stage, ops, ctx.cfg.dtype, total, sums)
    actions = pipeline.single_stage_passes(1)

    def run() -> None:
        pipeline.run_passes(ctx.run.stage, actions, chunk, None)

    return run
