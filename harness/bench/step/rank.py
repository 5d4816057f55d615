"""One rank's side of a ``bench step`` job: its context, one micro-batch's forward + backward,
one timed training step and one profiled step.

The building blocks that calibration (``calibrate.calibrate_cost``) and the interleaved arms
(``job``) both run, so a calibrated micro-batch is exactly a micro-batch of a step. torch and the
distributed runtime are imported inside the functions: the CLI imports this package without them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.bench.step.config import Arm, StepBenchConfig
from harness.heartbeat import Heartbeat
from harness.plan import CostModel


@dataclass
class RankContext:
    """What one rank's steps share: the config, this rank's model and flat gradient buffer, the
    process groups, the scheduler's cost model (replaced by each run's calibration) and the batches."""

    cfg: StepBenchConfig
    rank: int
    world: int
    device: object
    model: object
    params: list
    flat: object
    initial: list
    groups: object
    everyone: object
    cost: CostModel
    reducer: object = None  # a BucketedGradReducer (grad_reduce="overlap"), else None
    batches: list = field(default_factory=list)  # (lengths, clipped, local samples)
    heartbeat: Heartbeat = field(default_factory=lambda: Heartbeat(None, 0))  # progress for the launcher's watchdog


def sync(device) -> None:
    """Wait for the device (CUDA) to finish its queued work; a no-op on CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Marks:
    """Phase boundaries of one step: CUDA events on the current stream (read only after the step's
    closing synchronisation, so timing adds no synchronisation), the host clock on CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.points: list = []
        self.mark()

    def mark(self) -> None:
        import torch

        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.points.append(e)
        else:
            self.points.append(time.perf_counter())

    def cumulative_ms(self) -> list[float]:
        """Milliseconds from the step's start to each later mark."""
        if self.cuda:
            return [self.points[0].elapsed_time(e) for e in self.points[1:]]
        return [1e3 * (t - self.points[0]) for t in self.points[1:]]


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
    from harness.train.layouts import LayoutConfig

    return LayoutConfig(n_ranks=ctx.world, max_seqlen_per_rank=ctx.cfg.max_seqlen_per_rank,
                        static_cp=ctx.cfg.static_cp or ctx.world, scheduler=arm.scheduler, dcp_padding=arm.padding)


def use_scope(ctx: RankContext, arm: Arm | None = None, scope: str | None = None) -> str | None:
    """Compile the model's blocks as ``scope`` (default: ``arm``'s, else the config's); returns the
    scope now in use (None when the config runs eager)."""
    cfg = ctx.cfg
    if not cfg.compile_backend():
        return None
    scope = scope or (arm.scope if arm else None) or cfg.compile_scope()
    ctx.model.compile_blocks(cfg.compile_backend(), cfg.compile_mode(), scope)
    return scope


def train_step(ctx: RankContext, arm: Arm, lengths: list[int], local: dict, opt, planned=None) -> dict:
    """One training step; returns host-side figures (no device synchronisation inside).
    ``planned``: None = plan inline; else a callable returning ``(plan(...)'s result, seconds it
    took)`` - the plan computed ahead by a ``PlanAhead`` process (waiting for it, if it is behind, is
    inside the step)."""
    import torch.distributed as dist

    from harness.parallel.reroute import build_microbatches, reroute
    from harness.train.layouts import plan

    marks = _Marks(ctx.device)
    t = time.perf_counter()
    if planned is None:
        sched, padding, fixed = plan(arm.layout, lengths, layout_cfg(ctx, arm), ctx.cost)
        plan_s = wait_s = time.perf_counter() - t
    else:
        (sched, padding, fixed), plan_s = planned()
        wait_s = time.perf_counter() - t
    me, n = ctx.rank, ctx.world
    owners = {g: g % n for g in range(len(lengths))}
    samples = reroute(local, owners, sched, me, group=ctx.everyone)
    mbs = build_microbatches(samples, sched, me, padding=padding, fixed_length=fixed,
                             token_multiple=ctx.cfg.token_bucket)
    total = float(sum(lengths))
    runners = [microbatch_runner(ctx, mb, total, arm.exchange or ctx.cfg.cp_exchange)
               for mb in mbs]  # every plan built before the first forward
    marks.mark()
    chain = use_scope(ctx, arm) == "chain"
    for k, run in enumerate(runners):
        if ctx.reducer is not None and k == len(runners) - 1:
            ctx.reducer.arm()  # the last backward all-reduces each bucket as soon as it is complete
            if chain:  # a chain's backward hands every gradient over at its very end: nothing to overlap
                use_scope(ctx, scope="segments")
        run()
    local_tokens = sum(mb.data["tokens"].numel() for mb in mbs)
    marks.mark()
    if ctx.reducer is not None:
        ctx.reducer.finish()
    else:
        dist.all_reduce(ctx.flat, group=ctx.everyone)
    ctx.flat.mul_((1.0 / (ctx.flat.norm() + 1e-6)).clamp(max=1.0))  # clip the global norm at 1.0
    marks.mark()
    opt.step()
    ctx.flat.zero_()
    marks.mark()
    return {"plan_s": plan_s, "plan_wait_s": wait_s, "schedule": sched, "local_tokens": local_tokens, "marks": marks}


def profiled_step(ctx: RankContext, arm: Arm, lengths, local, opt, keep_trace: Path | None) -> dict:
    """One step under ``torch.profiler``, as a timed step runs it; returns its time breakdown
    (``harness.bench.trace.breakdown``) and keeps the Chrome trace in ``keep_trace`` (gzipped)."""
    import gzip
    import os
    import tempfile

    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    # looked up at each call, not at import: a test replaces harness.bench.trace.load_trace in one rank
    from harness.bench.trace import annotations, breakdown, load_trace
    from harness.train.layouts import plan

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    planned = None
    if ctx.cfg.plan == "ahead":  # as in the timed steps: the schedule is ready when the step starts
        t = time.perf_counter()
        got = plan(arm.layout, lengths, layout_cfg(ctx, arm), ctx.cost)
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
            from harness.io import atomic_write_bytes

            atomic_write_bytes(keep_trace, gzip.compress(Path(path).read_bytes(), mtime=0))
    finally:
        os.unlink(path)
    windows = annotations(trace, "dcp_harness_step")
    if not windows:
        raise RuntimeError("the profiler trace has no dcp_harness_step annotation")
    return breakdown(trace, windows[-1])


def microbatch_runner(ctx: RankContext, mb, total: float, exchange: str = "gather"):
    """A closure running one micro-batch's forward and backward (gradients land in ``ctx.flat``)."""
    import torch

    from harness.parallel.cp_attention import CPAttentionPlan, cp_attention

    aplan = CPAttentionPlan.build(mb.cu_seqlens_padded, mb.local_cp_size, mb.cp_rank, ctx.device, exchange=exchange)
    group = ctx.groups.for_block(mb.block_start, mb.local_cp_size)
    autocast = torch.autocast(ctx.device.type, dtype=torch.bfloat16, enabled=ctx.cfg.dtype == "bfloat16")

    def run() -> None:
        with autocast:
            ce, _ = ctx.model.token_losses(mb.data["tokens"], mb.data["labels"], mb.data["loss_mask"],
                                           mb.data["position_ids"], lambda q, k, v: cp_attention(q, k, v, aplan, group))
        (ce / total).backward()

    return run
