"""Training runs of each layout on every rank (``train(rank, world, cfg)``): the loop around the step.

For each layout in turn: the same initial model (seeded), the same AdamW, the same global batches
(``harness.data.corpus``), each step ``harness.train.step.train_step`` (the one step the harness verifies and
benchmarks). The loss of a step is ``(sum of token losses + aux) / tokens of the global batch``; in exact
arithmetic every layout and every pipeline computes the same loss and update.

Rank 0 prints one progress line per step and appends the step's metrics to ``cfg["metrics_path"]``
(JSONL) as it goes.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from harness.data.corpus import global_batch
from harness.heartbeat import Heartbeat
from harness.io import strict_json
from harness.parallel import expert_parallel, tensor_parallel
from harness.parallel.audit import GroupAuditError, audit_tp_group
from harness.parallel.dist_opt import ShardedBuffers
from harness.parallel.grad_reduce import GradBuffer
from harness.parallel.groups import DynamicGroups, ParallelLayout, live_groups
from harness.plan import ScheduleError
from harness.plan.pipeline_schedule import PipelineScheduleError
from harness.runtime.model import MODELS, TinyLM
from harness.train import pipeline, step
from harness.train.config import PROBE_SUFFIX, TrainConfig, execution_line, longest_sequence, model_cost
from harness.train.probes import Probes
from harness.train.routes import RouteLog, StepRoutes

__all__ = ["TrainConfig", "longest_sequence", "model_cost", "train", "train_layout"]


def samples_of(batch, owners, me, device, mtp_depth: int = 0) -> dict:
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


def train_layout(layout: str, rank: int, world: int, cfg: TrainConfig, run: step.Run, lcfg, device, log,
                 probes=None, heartbeat: Heartbeat | None = None, routes: RouteLog | None = None) -> list[dict]:
    """Train ``layout`` for ``cfg.steps`` steps; rank 0's metrics rows. ``routes``: where an MoE model's routes of
    every step go (``harness.train.routes``; each row then carries ``route_digest`` and ``route_margin``)."""
    torch.manual_seed(cfg.corpus.seed)
    model = TinyLM(cfg.model_config()).to(device)
    if run.tp is not None:  # the same whole model everywhere; each rank keeps its heads' and FFN's shard
        tensor_parallel.shard_model(model, run.tp)
    shards = None
    if run.experts is not None:  # the same initial model everywhere; each rank keeps its experts
        expert_parallel.shard_experts(model, run.experts)
        shards = ([p for n, p in model.named_parameters() if run.stage.owns(n) and expert_parallel.is_expert_param(n)],
                  run.groups.group(run.experts.size))
    params = [p for n, p in model.named_parameters() if run.stage.owns(n)]
    expert = {id(p) for p in shards[0]} if shards else set()
    grads, opt = _optimizer(cfg, run, lcfg, params, expert, device)
    cost, rows = model_cost(cfg), []
    heartbeat = heartbeat or Heartbeat(None, rank)
    N, me = lcfg.n_ranks, run.groups.layout.position(run.groups.rank)
    for k in range(cfg.steps):
        heartbeat.beat(layout=layout, step=k + 1, of=cfg.steps)
        t0 = time.perf_counter()
        batch = global_batch(cfg.corpus, k)
        probe = probes.step(k, batch) if probes is not None else None
        if run.tp is not None and run.tp.rank:  # a position's TP ranks train the same tokens: the first records them
            probe = None
        local = samples_of(batch, {g: g % N for g in range(len(batch))}, me, device, model.c.mtp_depth)
        step_routes = StepRoutes(model.c.layers, len(batch), longest_sequence(cfg), device) \
            if routes is not None else None
        try:
            r = step.train_step(model, run, layout, [len(x) - 1 for x in batch], local, lcfg, cost, device=device,
                                opt=opt, params=params, grads=grads, dtype=cfg.dtype, exchange=cfg.cp_exchange,
                                grad_clip=cfg.grad_clip, shards=shards, probe=probe, probes=probes, step_index=k,
                                weights=cfg.weights, hooks=step.StepHooks(
                                    token_multiple=cfg.bucket(),
                                    # a position's TP ranks route the same tokens alike: the first records them;
                                    # with sequence parallelism each routes (and records) its own rows
                                    routes=None if run.tp is not None and run.tp.rank and not run.tp.sequence_parallel
                                    else step_routes))
        except (ScheduleError, GroupAuditError, pipeline.ScheduleAgreementError, PipelineScheduleError,
                expert_parallel.DispatchAuditError, expert_parallel.LockstepError) as e:  # raised alike on every rank
            e.step, e.layout = k, layout
            raise
        sums, denom = r.sums, float(r.denominator)
        stats = torch.stack([sums["ce"], sums["aux"], torch.tensor(float(r.processed), dtype=torch.float64,
                                                                   device=device), *sums["mtp"]])
        if run.tp is not None and run.tp.rank:  # every TP rank computed the same sums: count the first's
            stats.zero_()
        dist.all_reduce(stats)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        total = float(sum(len(x) - 1 for x in batch))
        row = {"layout": layout, "step": k, "loss": float(stats[0]) / denom, "aux_loss": float(stats[1]) / denom,
               "grad_norm": float(r.grad_norm), "tokens": int(total), "processed_tokens": int(stats[2]),
               "padding_fraction": 1.0 - total / float(stats[2]), "step_time": float(elapsed),
               "tokens_per_s": total / float(elapsed), "microbatches": r.num_microbatches, **r.usage}
        if step_routes is not None:  # every rank's routes summed: the step's whole picture on every rank
            step_routes.reduce()
            row["route_digest"], row["route_margin"] = step_routes.summary()
            if rank == 0:  # the one that reports keeps them
                routes.append(step_routes)
        if sums["mtp"]:  # multi-token prediction: each depth's loss, apart from the LM loss
            row["mtp_loss"] = [float(x) / denom for x in stats[3:]]
        if cfg.pp > 1 and k == 0:
            row["timeline"] = _gather_timeline(r.timeline, run, device)
        rows.append(row)
        if rank == 0:
            log(row, cfg.steps)
    return rows


def _optimizer(cfg: TrainConfig, run: step.Run, lcfg, params, expert: set, device):
    """(the gradient buffer, the optimiser) of a layout's run: the replicated parameters' gradients first, then the
    experts'; under ``optimizer="distributed"`` the replicated ones sharded over the stage's DP x CP ranks."""
    first = lambda p: id(p) not in expert  # noqa: E731
    if cfg.optimizer == "distributed":
        grads = ShardedBuffers(params, lcfg.n_ranks, device, first=first, bucket_elements=cfg.grad_bucket_elements)
        local = [p for p in params if id(p) in expert]
        return grads, step.make_distributed_optimizer(grads, run.groups.group(lcfg.n_ranks), lr=cfg.lr,
                                                      weight_decay=cfg.weight_decay, local=local, tp=run.tp)
    return GradBuffer(params, device, first=first), step.make_optimizer(params, lr=cfg.lr, weight_decay=cfg.weight_decay)


def _gather_timeline(timeline, run: step.Run, device) -> list[dict] | None:
    """Every rank's passes of one step (for the report's pipeline picture), on rank 0."""
    mine = {"rank": run.groups.rank, "stage": run.stage.stage, "position": run.groups.layout.position(run.groups.rank),
            "chunks": run.stage.chunks, "cp_sizes": timeline.cp_sizes,
            "events": [list(e) for e in timeline.events]}
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, mine)
    return out


@contextmanager
def _full_fp32():
    """fp32 maths as the CPU does it: no TF32 in CUDA matrix products or cuDNN for the fp32 probe step."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def probe_config(cfg: TrainConfig) -> TrainConfig:
    """The run of a bf16 layout's fp32 step 1 (``TrainConfig.fp32_probe``): the same model, corpus, seed and batch,
    in fp32, one step (a fault seam: ``harness.faults``)."""
    return replace(cfg, dtype="float32", steps=1)


def train(rank: int, world: int, cfg_dict: dict) -> dict:
    """Run every layout of ``cfg_dict`` (a ``TrainConfig`` as a dict, plus ``metrics_path``)."""
    cfg = TrainConfig.from_dict(cfg_dict)
    cfg.validate(world)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    torch.use_deterministic_algorithms(cfg.device == "cpu", warn_only=True)
    longest = longest_sequence(cfg)
    pipe, n = cfg.pipeline_config(), cfg.domain(world)
    lcfg = cfg.layout_config(world)
    if rank == 0:
        print(execution_line(cfg, world), flush=True)
    playout = ParallelLayout(dp=n, cp=1, tp=cfg.tp, pp=cfg.pp)
    stage = pipeline.Stage.of(MODELS[cfg.model].layers, cfg.pp, cfg.vpp, playout.stage(rank))
    p2p = pipeline.P2P(playout, rank, stage.num_chunks) if cfg.pp > 1 else None
    path = cfg_dict.get("metrics_path")

    def log(row, steps):
        print(f"[{row['layout']:4s}] step {row['step'] + 1:>4d}/{steps}  loss {row['loss']:.6f}  grad_norm "
              f"{row['grad_norm']:.4f}  {row['tokens_per_s']:9.0f} tok/s  padding {row['padding_fraction']:6.1%}  "
              f"micro-batches {row['microbatches']}", flush=True)
        if path:
            with open(path, "a") as f:
                f.write(strict_json({k: v for k, v in row.items() if k != "timeline"}) + "\n")

    probed = cfg.probes and cfg.probed_in_fp32()
    shared = MODELS[cfg.model].mtp_depth > 0 and cfg.pp > 1 and (stage.first or stage.last)  # the embedding's holders
    probes = {name: Probes(stage=stage.stage, sharded=cfg.expert_parallel, shared=shared)
              for layout in cfg.layouts for name in ((layout, layout + PROBE_SUFFIX) if probed else (layout,))} \
        if cfg.probes else {}
    shard = expert_parallel.ExpertShard(MODELS[cfg.model].experts, n, playout.position(rank)) \
        if cfg.expert_parallel else None
    heartbeat = Heartbeat.from_cfg(cfg_dict, rank)
    routes = {layout: RouteLog() for layout in cfg.layouts} if MODELS[cfg.model].experts > 0 else {}
    out = {}
    for layout in cfg.layouts:  # groups created and destroyed around each layout (a re-initialisation)
        groups = DynamicGroups(playout, rank)
        try:
            run = step.Run(step.new_groups(groups), pipe, stage, p2p, shard, sequence_parallel=cfg.sequence_parallel,
                           vocab_multiple=cfg.make_vocab_size_divisible_by)
            audit_tp_group(run.groups)  # before any collective on a TP group
            if probed:  # step 1 in fp32 from the same initial model, for the step-1 checks at fp32's tolerance
                with _full_fp32():
                    train_layout(layout, rank, world, probe_config(cfg), run, lcfg, device,
                                 lambda row, steps: None, probes[layout + PROBE_SUFFIX], heartbeat)
                dist.barrier()
            out[layout] = train_layout(layout, rank, world, cfg, run, lcfg, device, log, probes.get(layout), heartbeat,
                                       routes.get(layout))
            # every rank past its last collective on these groups before any rank destroys them (gloo
            # aborts a process whose group is torn down under a peer's pending operation)
            dist.barrier()
        finally:
            groups.destroy()
    result = {"rank": rank, "static_cp": lcfg.static_cp, "longest": longest, "stage": stage.stage,
              "live_groups": live_groups(),
              "layouts": out if rank == 0 else {}}
    if routes and rank == 0:
        result["routes"] = _routes_result(routes, cfg_dict.get("probe_dir"))
    if cfg.probes:
        keep = cfg_dict.get("probe_dir")  # a JSON-reporting job: the large records go to files there
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
        result["probes"] = {layout: p.save(Path(keep) / f"{layout}.rank{rank}.npz") if keep else p.portable()
                            for layout, p in probes.items()}
    return result


def _routes_result(routes: dict[str, RouteLog], keep: str | None) -> dict:
    """Each layout's route records (``harness.train.routes``): a ``.npz`` file in ``keep`` (a JSON-reporting job's
    probe folder), else the same file's bytes in base64 (a job whose ranks share no folder; ~12 bytes a cell and
    step, where nested lists would take ~5x that)."""
    import base64
    import io

    import numpy as np

    out = {}
    for layout, log in routes.items():
        arrays = log.arrays()
        if keep:
            Path(keep).mkdir(parents=True, exist_ok=True)
            path = Path(keep) / f"{layout}.routes.npz"
            np.savez(path, **arrays)
            out[layout] = {"file": str(path)}
        else:
            buf = io.BytesIO()
            np.savez(buf, **arrays)
            out[layout] = {"npz": base64.b64encode(buf.getvalue()).decode()}
    return out
