"""The training step of each layout, run on every rank (``train(rank, world, cfg)``).

For each layout in turn: the same initial model (seeded), the same AdamW, the same global batches
(``harness.data.corpus``). A step: schedule the batch (``harness.train.layouts``; with pipeline stages the
schedule is delivered to every stage and the stages are checked to agree), reroute every sequence from
the position that loaded it (DP shards: gid % N) to the ranks of its block, build THD micro-batches,
run the passes of the rank's model chunks in its pipeline schedule (``harness.train.pipeline``; one
stage: forward and backward per micro-batch) with CP attention in the block's group, add
``(sum of token losses + aux) / tokens of the global batch``, all-reduce the gradients (sum over the
stage's DP x CP ranks), clip by the norm over all stages, step. In exact arithmetic every layout and
every pipeline computes the same loss and update.

Rank 0 prints one progress line per step and appends the step's metrics to ``cfg["metrics_path"]``
(JSONL) as it goes.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from harness.data.corpus import global_batch
from harness.heartbeat import Heartbeat
from harness.parallel import expert_parallel
from harness.parallel.audit import GroupAuditError, audit_groups
from harness.parallel.groups import DynamicGroups, ParallelLayout, live_groups
from harness.parallel.reroute import SAMPLE_KEYS, ThdMicroBatch, build_microbatches, mtp_keys, reroute
from harness.plan import Schedule, ScheduleError
from harness.plan.pipeline_schedule import PipelineScheduleError
from harness.runtime.model import MODELS, TinyLM
from harness.train import layouts, passes, pipeline
from harness.train.config import TrainConfig, longest_sequence, model_cost
from harness.train.layouts import LayoutConfig, static_cp_for
from harness.train.probes import Probes

__all__ = ["TrainConfig", "longest_sequence", "model_cost", "train", "train_layout"]


def _samples(batch, owners, me, device, mtp_depth: int = 0) -> dict:
    """The samples this position loads: tokens, next-token labels, mask, positions, and for multi-token
    prediction depth k the tokens ``t_{i+k}``, labels ``t_{i+k+1}`` and mask, shifted per sequence."""
    out = {}
    for g, x in enumerate(batch):
        if owners[g] == me:
            t = torch.as_tensor(x, dtype=torch.int64, device=device)
            L = t.numel() - 1
            out[g] = {"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(L, dtype=torch.int64, device=device),
                      "position_ids": torch.arange(L, dtype=torch.int64, device=device)}
            for k in range(1, mtp_depth + 1):
                n = max(L - k, 0)
                cols = torch.zeros(3, L, dtype=torch.int64, device=device)
                cols[1].fill_(-100)
                cols[0, :n], cols[1, :n], cols[2, :n] = t[k:k + n], t[k + 1:k + 1 + n], 1
                out[g].update({f"mtp_tokens_{k}": cols[0], f"mtp_labels_{k}": cols[1], f"mtp_mask_{k}": cols[2]})
    return out


# ---------------------------------------------------------------------------------------- seams
# The steps below are module-level functions that ``_step`` looks up when it runs, so that
# ``harness.faults`` can replace one for the length of a run (``harness.faults.seam.replaced``) to
# re-create a real integration bug; nothing else changes them.

def stage_cost(cost, stage: int):
    """The cost model a stage plans with: the run's one model, the same on every stage (a seam:
    ``harness.faults`` re-creates stages that plan with costs of their own)."""
    return cost


def cp_group_for(groups: DynamicGroups, mb: ThdMicroBatch):
    """The process group of the micro-batch's own CP block (looked up per micro-batch, never kept)."""
    return groups.for_block(mb.block_start, mb.local_cp_size)


def make_optimizer(params, cfg: TrainConfig) -> torch.optim.Optimizer:
    """The optimiser of a layout's run: AdamW with fp32 state (a seam)."""
    return torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))


def loss_denominator(mbs: list[ThdMicroBatch], group) -> float:
    """Tokens of the global batch: every rank counts the real tokens of *its slices* (CP ranks hold
    disjoint parts of a sequence) and the counts are summed over the DP x CP ranks."""
    dev = mbs[0].data["loss_mask"].device if mbs else torch.device("cpu")
    count = torch.zeros(1, dtype=torch.float64, device=dev)
    for mb in mbs:
        count += mb.data["loss_mask"].sum().double()
    dist.all_reduce(count, group=group)
    return float(count)


def all_reduce_flat(model, group, replicated=None) -> float:
    """SUM-all-reduce every gradient of ``model`` (of the parameters whose name ``replicated`` accepts,
    default all) over ``group`` in one flat buffer; returns the reduced gradient norm."""
    grads = [p.grad for n, p in model.named_parameters() if p.grad is not None and (replicated is None or replicated(n))]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return float(flat.double().norm())


def reduce_gradients(model, groups: DynamicGroups, lcfg: LayoutConfig) -> float:
    """SUM-all-reduce every gradient over the DP x CP ranks (the loss is already divided by the global
    token count); returns the reduced gradient norm. Expert parallelism: an expert's gradient is already
    whole on its owner (``harness.parallel.expert_parallel``) and stays as it is; the norm adds the shards'
    squares summed over the domain."""
    group = groups.group(lcfg.n_ranks)
    if not lcfg.expert_parallel:
        return all_reduce_flat(model, group)
    norm = all_reduce_flat(model, group, replicated=lambda n: not expert_parallel.is_expert_param(n))
    shards = [p for n, p in model.named_parameters() if expert_parallel.is_expert_param(n)]
    return (norm ** 2 + float(expert_parallel.shard_square_norm(shards, group))) ** 0.5


# ------------------------------------------------------------------------------------------ step

def _schedule(layout, lengths, lcfg, cost, run) -> tuple:
    """(schedule every stage runs, padding mode, fixed length): planned and delivered on one stage
    (``broadcast``) or every stage (``compute``), then checked to agree across the pipeline."""
    pipe, stage = run.pipe, run.stage.stage
    if pipe.pp == 1 or pipe.delivery == "compute":
        sched, padding, fixed = layouts.plan(layout, lengths, lcfg, stage_cost(cost, stage))
        sched = layouts.deliver(sched)
        if pipe.pp == 1:
            return sched, padding, fixed
        sched = pipeline.stage_view(sched, stage)
    else:
        sched, padding, fixed = _planned_on_first_stage(layout, lengths, lcfg, cost, run)
    pipeline.agree_schedule(sched, stage, run.groups.pipeline, pipe.pp)
    return sched, padding, fixed


def _planned_on_first_stage(layout, lengths, lcfg, cost, run) -> tuple:
    """``broadcast`` delivery: the first stage plans and validates; the plan - or the error that
    stopped it, so that no later stage waits for a schedule that never comes - goes down each pipeline."""
    stage, group = run.stage.stage, run.groups.pipeline
    src = run.groups.layout.pipeline_ranks(run.groups.rank)[0]
    box: list = [None]
    if stage == 0:
        try:
            sched, padding, fixed = layouts.plan(layout, lengths, lcfg, stage_cost(cost, stage))
            box = [("ok", layouts.deliver(sched), padding, fixed)]
        except Exception as e:  # noqa: BLE001 - re-raised on every stage below
            box = [("error", e)]
    box = [None if box[0] is None else (box[0][0], _portable(box[0]))]
    dist.broadcast_object_list(box, src=src, group=group)
    kind, payload = box[0]
    if kind == "error":
        raise _restored(payload)
    sched, padding, fixed = payload
    return pipeline.stage_view(Schedule.from_dict(sched), stage), padding, fixed


def _portable(item) -> tuple:
    """A picklable form of the first stage's outcome (exceptions with custom constructors do not
    survive pickling as themselves)."""
    if item[0] == "ok":
        return item[1].to_dict(), item[2], item[3]
    e = item[1]
    if isinstance(e, ScheduleError):
        return ("ScheduleError", (e.invariant, e.microbatch, e.ranks, e.detail))
    return (type(e).__name__, str(e))


def _restored(payload) -> Exception:
    name, args = payload
    if name == "ScheduleError":
        return ScheduleError(*args)
    return RuntimeError(f"the first pipeline stage could not plan this global batch: {name}: {args}")


def _step(model, run, batch, layout, lcfg, cfg, cost, device, probe=None):
    """Forward/backward of one global batch on this rank's stage; returns (CE sum of the last stage,
    aux sum, processed tokens, #mb, CP usage (``cp_usage``), loss denominator, pass timeline)."""
    groups = run.groups
    lengths = [len(x) - 1 for x in batch]
    sched, padding, fixed = _schedule(layout, lengths, lcfg, cost, run)
    N, me = lcfg.n_ranks, groups.layout.position(groups.rank)
    everyone = groups.group(N)
    owners = {g: g % N for g in range(len(batch))}
    depth = model.c.mtp_depth
    samples = reroute(_samples(batch, owners, me, device, depth), owners, sched, me, group=everyone,
                      keys=SAMPLE_KEYS + mtp_keys(depth))
    mbs = build_microbatches(samples, sched, me, padding=padding, fixed_length=fixed)
    cp_groups = [cp_group_for(groups, mb) for mb in mbs]
    audit_groups(groups, mbs, cp_groups, everyone)
    total = loss_denominator(mbs, everyone)
    zero = lambda: torch.zeros((), device=device, dtype=torch.float64)  # noqa: E731
    sums = {"ce": zero(), "aux": zero(), "mtp": [zero() for _ in range(depth)]}
    if run.experts is not None:  # every rank joins every micro-batch's all-to-alls: the same count everywhere
        expert_parallel.check_lockstep(len(mbs), everyone, device)
    ops = passes.MicroBatchOps(model, groups, mbs, cp_groups, device, cfg.cp_exchange, experts=run.experts)
    mtp_scales = passes.mtp_loss_scales(model.c, mbs, everyone, lcfg.static_cp)
    chunk_passes = passes.model_passes(model, run.stage, ops, cfg, total, sums, probe, mtp_scales)
    timeline = pipeline.run_passes(run.stage, run.actions(len(mbs)), chunk_passes, run.p2p)
    timeline.cp_sizes = [mb.local_cp_size for mb in mbs]
    processed = sum(mb.data["tokens"].numel() for mb in mbs) if run.stage.first else 0
    return sums, processed, sched.num_microbatches, cp_usage(sched), total, timeline


def cp_usage(sched: Schedule) -> dict:
    """What CP did in one step, read off the schedule the ranks ran: ``cp_histogram`` (sequences per
    CP size), ``cp_groups`` (CP groups formed per size over the micro-batches: every block that holds
    a sequence counts once) and ``microbatches_cp_gt1`` (micro-batches with a CP group of > 1 rank)."""
    seqs: dict[int, int] = {}
    for s in sched.cp_size_of().values():
        seqs[s] = seqs.get(s, 0) + 1
    blocks = [[b.size for b in mb if b.gids] for mb in sched.layout]
    groups: dict[int, int] = {}
    for s in (s for mb in blocks for s in mb):
        groups[s] = groups.get(s, 0) + 1
    return {"cp_histogram": {str(k): v for k, v in sorted(seqs.items())},
            "cp_groups": {str(k): v for k, v in sorted(groups.items())},
            "microbatches_cp_gt1": sum(any(s > 1 for s in mb) for mb in blocks)}


def clip_gradients(params, max_norm: float, pipeline_group, shards=None) -> None:
    """Clip by the gradient norm of the whole model: with pipeline stages, the stages' squared norms
    are summed over the rank's pipeline (every stage holds different parameters). ``shards``: (the
    expert-parallel parameters among ``params``, the DP x CP group they are sharded over) - their
    squared norms are summed over that group first."""
    grads = [p.grad for p in params if p.grad is not None]
    if pipeline_group is None and shards is None:
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        return
    sharded = {id(p) for p in shards[0]} if shards is not None else set()
    mine = [p.grad for p in params if p.grad is not None and id(p) not in sharded]
    sq = torch.stack([g.detach().double().norm() ** 2 for g in mine]).sum() if mine else torch.zeros((), dtype=torch.float64)
    if shards is not None:
        sq = sq + expert_parallel.shard_square_norm(shards[0], shards[1])
    if pipeline_group is not None:
        dist.all_reduce(sq, group=pipeline_group)
    coef = min(1.0, max_norm / (float(sq.sqrt()) + 1e-6))
    for g in grads:
        g.mul_(coef)


def _global_norm(grad_norm: float, pipeline_group, device) -> float:
    """The whole model's gradient norm (what a run reports) from this stage's: the stages' squares summed over
    the rank's pipeline (a seam: ``harness.faults`` re-creates a pipeline that reports each stage's own norm)."""
    if pipeline_group is None:
        return grad_norm
    t = torch.tensor([grad_norm ** 2], dtype=torch.float64, device=device)
    dist.all_reduce(t, group=pipeline_group)
    return float(t.sqrt())


def new_groups(groups: DynamicGroups) -> DynamicGroups:
    """The groups a layout's run uses: the ones just created (a seam: ``harness.faults`` re-creates a
    registry that kept the groups of an earlier, destroyed generation)."""
    return groups


@dataclass
class _Run:
    """What every step of a rank shares: groups, pipeline config, its stage and point-to-point links."""

    groups: DynamicGroups
    pipe: object
    stage: pipeline.Stage
    p2p: pipeline.P2P | None
    experts: expert_parallel.ExpertShard | None = None
    """The experts this rank owns under expert parallelism (None: every expert, replicated)."""

    def actions(self, num_microbatches: int):
        if self.pipe.pp == 1:
            return pipeline.single_stage_passes(num_microbatches)
        return pipeline.actions_for(self.pipe, self.stage.stage, num_microbatches)


def train_layout(layout: str, rank: int, world: int, cfg: TrainConfig, run: _Run, lcfg, device, log,
                 probes=None, heartbeat: Heartbeat | None = None) -> list[dict]:
    torch.manual_seed(cfg.corpus.seed)
    model = TinyLM(MODELS[cfg.model]).to(device)
    shards = None
    if run.experts is not None:  # the same initial model everywhere; each rank keeps its experts
        expert_parallel.shard_experts(model, run.experts)
        shards = ([p for n, p in model.named_parameters() if run.stage.owns(n) and expert_parallel.is_expert_param(n)],
                  run.groups.group(run.experts.size))
    params = [p for n, p in model.named_parameters() if run.stage.owns(n)]
    opt = make_optimizer(params, cfg)
    cost, rows = model_cost(cfg), []
    heartbeat = heartbeat or Heartbeat(None, rank)
    for step in range(cfg.steps):
        heartbeat.beat(layout=layout, step=step + 1, of=cfg.steps)
        t0 = time.perf_counter()
        batch = global_batch(cfg.corpus, step)
        probe = probes.step(step, batch) if probes is not None else None
        try:
            sums, processed, nmb, usage, denom, timeline = _step(model, run, batch, layout, lcfg, cfg, cost, device,
                                                                probe)
        except (ScheduleError, GroupAuditError, pipeline.ScheduleAgreementError, PipelineScheduleError,
                expert_parallel.DispatchAuditError, expert_parallel.LockstepError) as e:  # raised alike on every rank
            e.step, e.layout = step, layout
            raise
        grad_norm = _global_norm(reduce_gradients(model, run.groups, lcfg), run.groups.pipeline, device)
        if probes is not None:
            probes.after_reduce(step, model, grad_norm)
        if cfg.grad_clip:
            clip_gradients(params, cfg.grad_clip, run.groups.pipeline, **({"shards": shards} if shards else {}))
        if probes is not None:
            probes.after_clip(step, model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if probes is not None:
            probes.after_update(step, model)
        stats = torch.tensor([float(sums["ce"]), float(sums["aux"]), float(processed)] + [float(x) for x in sums["mtp"]],
                             dtype=torch.float64, device=device)
        dist.all_reduce(stats)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        total = float(sum(len(x) - 1 for x in batch))
        row = {"layout": layout, "step": step, "loss": float(stats[0]) / denom, "aux_loss": float(stats[1]) / denom,
               "grad_norm": grad_norm, "tokens": int(total), "processed_tokens": int(stats[2]),
               "padding_fraction": 1.0 - total / float(stats[2]), "step_time": float(elapsed),
               "tokens_per_s": total / float(elapsed), "microbatches": nmb, **usage}
        if sums["mtp"]:  # multi-token prediction: each depth's loss, apart from the LM loss
            row["mtp_loss"] = [float(x) / denom for x in stats[3:]]
        if cfg.pp > 1 and step == 0:
            row["timeline"] = _gather_timeline(timeline, run, device)
        rows.append(row)
        if rank == 0:
            log(row, cfg.steps)
    return rows


def _gather_timeline(timeline, run: _Run, device) -> list[dict] | None:
    """Every rank's passes of one step (for the report's pipeline picture), on rank 0."""
    mine = {"rank": run.groups.rank, "stage": run.stage.stage, "position": run.groups.layout.position(run.groups.rank),
            "chunks": run.stage.chunks, "cp_sizes": timeline.cp_sizes,
            "events": [list(e) for e in timeline.events]}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


def execution_line(cfg: TrainConfig, world: int) -> str:
    """The line a run prints: the execution model its schedules are made for, and why."""
    ex, why = cfg.execution_model(world)
    return f"execution model: {ex.describe()} ({why})"


def train(rank: int, world: int, cfg_dict: dict) -> dict:
    """Run every layout of ``cfg_dict`` (a ``TrainConfig`` as a dict, plus ``metrics_path``)."""
    cfg = TrainConfig.from_dict(cfg_dict)
    cfg.validate(world)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    torch.use_deterministic_algorithms(cfg.device == "cpu", warn_only=True)
    longest = longest_sequence(cfg)
    pipe, n = cfg.pipeline_config(), cfg.domain(world)
    lcfg = LayoutConfig(n_ranks=n, max_seqlen_per_rank=cfg.max_seqlen_per_rank,
                        static_cp=static_cp_for(longest, n, cfg.max_seqlen_per_rank),
                        micro_batch_size=cfg.micro_batch_size, scheduler=cfg.scheduler, dcp_padding=cfg.dcp_padding,
                        vpp_group=pipe.vpp_group, execution=cfg.execution_model(world)[0],
                        expert_parallel=cfg.expert_parallel)
    if rank == 0:
        print(execution_line(cfg, world), flush=True)
    playout = ParallelLayout(dp=n, cp=1, pp=cfg.pp)
    stage = pipeline.Stage.of(MODELS[cfg.model].layers, cfg.pp, cfg.vpp, playout.stage(rank))
    p2p = pipeline.P2P(playout, rank, stage.num_chunks) if cfg.pp > 1 else None
    path = cfg_dict.get("metrics_path")

    def log(row, steps):
        print(f"[{row['layout']:4s}] step {row['step'] + 1:>4d}/{steps}  loss {row['loss']:.6f}  grad_norm "
              f"{row['grad_norm']:.4f}  {row['tokens_per_s']:9.0f} tok/s  padding {row['padding_fraction']:6.1%}  "
              f"micro-batches {row['microbatches']}", flush=True)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps({k: v for k, v in row.items() if k != "timeline"}) + "\n")

    probes = {layout: Probes(stage=stage.stage, sharded=cfg.expert_parallel) for layout in cfg.layouts} \
        if cfg.probes else {}
    shard = expert_parallel.ExpertShard(MODELS[cfg.model].experts, n, playout.position(rank)) \
        if cfg.expert_parallel else None
    heartbeat = Heartbeat.from_cfg(cfg_dict, rank)
    out = {}
    for layout in cfg.layouts:  # groups created and destroyed around each layout (a re-initialisation)
        groups = DynamicGroups(playout, rank)
        try:
            out[layout] = train_layout(layout, rank, world, cfg, _Run(new_groups(groups), pipe, stage, p2p, shard), lcfg,
                                       device, log, probes.get(layout), heartbeat)
            # every rank past its last collective on these groups before any rank destroys them (gloo
            # aborts a process whose group is torn down under a peer's pending operation)
            dist.barrier()
        finally:
            groups.destroy()
    result = {"rank": rank, "static_cp": lcfg.static_cp, "longest": longest, "stage": stage.stage,
              "live_groups": live_groups(),
              "layouts": out if rank == 0 else {}}
    if cfg.probes:
        keep = cfg_dict.get("probe_dir")  # a JSON-reporting job: the large records go to files there
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
        result["probes"] = {layout: p.save(Path(keep) / f"{layout}.rank{rank}.npz") if keep else p.result()
                            for layout, p in probes.items()}
    return result
