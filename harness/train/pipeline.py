"""Pipeline parallelism of the training runtime: one implementation for every pipeline the harness runs.

The world is ``pp`` stages of a DP x CP domain each (Megatron's rank order, PP slowest:
``harness.parallel.groups.ParallelLayout``). Stage s builds the model chunks ``c = v * pp + s``
(``harness.plan.pipeline.layer_ranges``; the embedding lives on chunk 0, the head and loss on the last
chunk). Every stage runs the same micro-batches with the same CP blocks: a rank at position p of stage
s holds the same zig-zag slice as position p of every other stage, so activations ``[T_local, E]``
(fp32) go from (s, p) to (s + 1, p) and gradients come back, point to point, with one tag per
(micro-batch, chunk boundary, direction). Sends are asynchronous and receives wait, and each stage runs
its passes in the order of ``harness.plan.pipeline_schedule.stage_actions`` (AFAB, 1F1B, interleaved),
which ``replay`` proves free of deadlock for these rules.

Per global batch the dynamic-CP schedule reaches every stage (computed once on the first stage and sent
down each pipeline, or computed by every stage: ``harness.train.trainer``) and ``agree_schedule`` checks
that all stages hold the same blocks: a stage that differs stops every rank with ``ScheduleAgreementError``
naming the stage, the micro-batch and the field, before any activation moves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from harness.plan.layout import Block, Schedule
from harness.plan.pipeline import stage_layers
from harness.plan.pipeline_schedule import KINDS, chunk_index, chunk_location, stage_actions
from harness.train.pipeline_config import DELIVERIES, PipelineConfig, PipelineConfigError, split


class ScheduleAgreementError(RuntimeError):
    """The stages of a pipeline hold different schedules of one global batch."""

    def __init__(self, stage: int, microbatch: int | None, field_name: str, got, want):
        self.stage, self.microbatch, self.field, self.got, self.want = stage, microbatch, field_name, got, want
        where = "" if microbatch is None else f", micro-batch {microbatch}"
        super().__init__(f"schedule agreement: stage {stage}{where}: {field_name} is {got}, the first stage's is "
                         f"{want}; every stage must run the first stage's schedule (local_cp_size and blocks "
                         f"delivered, not recomputed differently)")


@dataclass
class Stage:
    """One rank's share of the pipeline: its stage, the global layers of each of its virtual chunks."""

    pp: int
    vpp: int
    stage: int
    chunks: list[list[int]]

    @classmethod
    def of(cls, num_layers: int, pp: int, vpp: int, stage: int) -> Stage:
        ranges = split(num_layers, pp, vpp)[stage]
        return cls(pp, vpp, stage, [stage_layers([r]) for r in ranges])

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vpp

    def index(self, v: int) -> int:
        return chunk_index(self.stage, v, self.pp)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.pp - 1

    def owns(self, name: str) -> bool:
        """Whether parameter ``name`` of a ``TinyLM`` is built (and trained) on this stage."""
        if name.startswith("embed."):
            return self.first
        if name.startswith(("norm.", "head.", "mtp.")):  # the LM head and the multi-token prediction blocks
            return self.last
        layer = int(name.split(".")[1])
        return any(layer in c for c in self.chunks)


def pre_process(stage: Stage, v: int) -> bool:
    """Whether virtual chunk ``v`` of ``stage`` embeds the micro-batch's tokens: model chunk 0 only (Megatron's
    ``pre_process = is_pipeline_first_stage(ignore_virtual=False, vp_stage=v)``); every other chunk runs on the
    activation it received. A seam: ``harness.faults`` re-creates a first stage whose every virtual chunk embeds."""
    return stage.index(v) == 0


# ------------------------------------------------------------------------------------ schedule
def schedule_rows(sched: Schedule) -> list[list[tuple[int, int, tuple[int, ...]]]]:
    """The blocks (start, local_cp_size, gids) of every micro-batch: what the stages must share."""
    return [[(b.start, b.size, tuple(b.gids)) for b in mb] for mb in sched.layout]


def stage_view(sched: Schedule, stage: int) -> Schedule:
    """The schedule as a stage runs it (a seam: ``harness.faults`` re-creates a later stage that did not
    receive ``local_cp_size``)."""
    return sched


def agree_schedule(sched: Schedule, stage: int, pipeline_group, pp: int) -> None:
    """Every stage compares its blocks with the first stage's; all raise the same error on a mismatch."""
    rows = [None] * pp
    dist.all_gather_object(rows, (stage, schedule_rows(sched)), group=pipeline_group)
    ref = dict(rows)[0]
    for s, mine in sorted(rows):
        if s == 0:
            continue
        if len(mine) != len(ref):
            raise ScheduleAgreementError(s, None, "the number of micro-batches", len(mine), len(ref))
        for m, (a, b) in enumerate(zip(mine, ref)):
            if a != b:
                raise _first_difference(s, m, a, b)


def _first_difference(stage: int, m: int, mine, ref) -> ScheduleAgreementError:
    sizes = {start: size for start, size, _ in mine}
    for start, size, _ in ref:
        if sizes.get(start) != size:
            return ScheduleAgreementError(stage, m, f"local_cp_size at position {start}", sizes.get(start), size)
    for (_, _, g1), (start, _, g2) in zip(mine, ref):
        if g1 != g2:
            return ScheduleAgreementError(stage, m, f"the sequences of the block at position {start}", list(g1),
                                          list(g2))
    return ScheduleAgreementError(stage, m, "blocks", mine, ref)


# --------------------------------------------------------------------------------------- passes
@dataclass
class ChunkPasses:
    """What the executor calls for one micro-batch ``m`` on virtual chunk ``v``:
    ``forward(v, m, x)`` -> (output, aux): x None on model chunk 0 (it embeds); on the last chunk the
    output is the summed cross-entropy. ``num_tokens(m)``: the rows of micro-batch m a chunk hands the next (the
    rank's local tokens; with sequence parallelism its TP rank's share of them).
    ``total``: the loss denominator."""

    forward: Callable
    num_tokens: Callable[[int], int]
    total: float
    hidden: int
    device: object


@dataclass
class Timeline:
    """Per pass: (kind, micro-batch, virtual chunk, start, ready, end) in seconds since the step's
    start: the pass began at ``start``, its input (activation or gradient) had arrived at ``ready``
    (the wait in between is pipeline bubble), it finished at ``end``."""

    events: list[tuple[str, int, int, float, float, float]] = field(default_factory=list)
    cp_sizes: list[int] = field(default_factory=list)  # local_cp_size of each micro-batch on this rank


class P2P:
    """Point-to-point activations and gradients between the ranks of one pipeline (one position)."""

    def __init__(self, layout, rank: int, num_chunks: int):
        self.layout, self.rank, self.C = layout, rank, num_chunks
        self.pending: list = []

    def _peer(self, c: int) -> int:
        s, _ = chunk_location(c, self.layout.pp)
        return self.layout.rank_of(self.layout.position(self.rank), self.layout.tp_rank(self.rank), s)

    def _tag(self, m: int, boundary: int, direction: int) -> int:
        return (m * self.C + boundary) * 2 + direction

    def send(self, t: torch.Tensor, *, to_chunk: int, m: int, boundary: int, direction: int) -> None:
        self.pending.append(dist.isend(t.contiguous(), self._peer(to_chunk), tag=self._tag(m, boundary, direction)))

    def recv(self, shape, *, from_chunk: int, m: int, boundary: int, direction: int, device) -> torch.Tensor:
        t = torch.empty(shape, dtype=torch.float32, device=device)
        dist.recv(t, self._peer(from_chunk), tag=self._tag(m, boundary, direction))
        return t

    def finish(self) -> None:
        for w in self.pending:
            w.wait()
        self.pending.clear()


def run_passes(stage: Stage, actions, passes: ChunkPasses, p2p: P2P | None, on_loss=None,
               before_last=None, on_pass=None) -> Timeline:
    """Run this rank's passes in order; returns their timeline. ``on_loss(m, ce, aux)``: called on the
    last chunk's forward (before its backward). Aux losses of every chunk join the backward.
    ``before_last()``: called once, before the first pass of the last micro-batch. ``on_pass(action)``: called
    as each pass starts, before anything of it is launched (a benchmark's clock)."""
    last, live, tl, t0 = stage.num_chunks - 1, {}, Timeline(), time.perf_counter()
    final = max((a.microbatch for a in actions), default=-1) if before_last is not None else None
    for a in actions:
        if final is not None and a.microbatch == final:
            before_last()
            final = None
        if on_pass is not None:
            on_pass(a)
        c, start = stage.index(a.chunk), time.perf_counter()
        if a.kind == "F":
            x = None
            if c > 0:
                x = p2p.recv((passes.num_tokens(a.microbatch), passes.hidden), from_chunk=c - 1, m=a.microbatch,
                             boundary=c - 1, direction=0, device=passes.device).requires_grad_()
            ready = time.perf_counter()
            y, aux = passes.forward(a.chunk, a.microbatch, x)
            if c == last:
                if on_loss is not None:
                    on_loss(a.microbatch, y, aux)
            else:
                p2p.send(y.detach().float(), to_chunk=c + 1, m=a.microbatch, boundary=c, direction=0)
            live[(a.microbatch, a.chunk)] = (x, y, aux)
        else:
            x, y, aux = live.pop((a.microbatch, a.chunk))
            ready = time.perf_counter()
            if c == last:
                ((y + aux) / passes.total).backward()
            else:
                g = p2p.recv(tuple(y.shape), from_chunk=c + 1, m=a.microbatch, boundary=c, direction=1,
                             device=passes.device)
                ready = time.perf_counter()
                outs, grads = [y], [g.to(y.dtype)]
                if aux.requires_grad:
                    outs.append(aux / passes.total)
                    grads.append(torch.ones((), device=aux.device, dtype=aux.dtype))
                torch.autograd.backward(outs, grads)
            if c > 0:
                gx = x.grad if x.grad is not None else torch.zeros_like(x)
                p2p.send(gx.float(), to_chunk=c - 1, m=a.microbatch, boundary=c - 1, direction=1)
        tl.events.append((a.kind, a.microbatch, a.chunk, start - t0, ready - t0, time.perf_counter() - t0))
    if p2p is not None:
        p2p.finish()
    return tl


def actions_for(cfg: PipelineConfig, stage: int, num_microbatches: int):
    return stage_actions(cfg.kind, pp=cfg.pp, stage=stage, num_microbatches=num_microbatches, vpp=cfg.vpp,
                         group=cfg.vpp_group)


def single_stage_passes(num_microbatches: int):
    """PP = 1: forward then backward, micro-batch after micro-batch (1F1B on one stage)."""
    return stage_actions("1f1b", pp=1, stage=0, num_microbatches=num_microbatches)


def block_of(blocks, position: int) -> Block:
    (b,) = [b for b in blocks if b.start <= position < b.start + b.size]
    return b


__all__ = ["KINDS", "DELIVERIES", "PipelineConfig", "PipelineConfigError", "ScheduleAgreementError", "Stage",
           "ChunkPasses", "P2P", "Timeline", "run_passes", "actions_for", "agree_schedule",
           "stage_view", "schedule_rows", "split", "pre_process", "single_stage_passes", "block_of"]
