"""One training step on one rank: the step ``converge`` and the fault catalogue verify and ``bench step`` times.

``train_step`` runs, in order: schedule the global batch (``harness.train.layouts``; with pipeline stages the
schedule is delivered to every stage and the stages are checked to agree), reroute every sequence from the
position that loaded it (DP shards: gid % N) to the ranks of its block, build THD micro-batches, audit each
micro-batch's process group, count the batch's loss tokens, build every micro-batch's CP operations, run the
passes of the rank's model chunks in its pipeline schedule (``harness.train.pipeline``; one stage: forward and
backward per micro-batch) with CP attention in the block's group, sum-reduce the gradients over the stage's
DP x CP ranks, clip by the norm over all stages, and step the optimiser - or, with the distributed optimiser
(``harness.parallel.dist_opt``), reduce-scatter them, clip and step this rank's 1/N and gather the parameters. Under
tensor parallelism (``Run.tp``) all of it runs per TP coordinate, the blocks take the TP collectives per call and the
norm sums the split parameters over the TP group (``harness.parallel.tensor_parallel``); with sequence parallelism
(``Run.sequence_parallel``) the sequences are padded so that every rank's token rows split evenly over its TP group,
and after the passes the split region's norm gradients are summed over it (``harness.parallel.sequence_parallel``).
In exact arithmetic every layout and every pipeline computes the same loss and update.

``StepHooks`` is what a benchmark adds without changing the maths: a schedule planned ahead by another process,
phase marks for timing, the overlapped bucketed gradient reducer (``harness.parallel.grad_reduce``) in place of
the all-reduce after the passes, a call before the last micro-batch (a compile-scope switch), a token multiple
for the micro-batches' lengths. The functions marked as seams are looked up when a step runs, so that
``harness.faults`` can replace one for the length of a run to re-create a real integration bug.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from harness.parallel import expert_parallel, sequence_parallel, tensor_parallel
from harness.parallel.audit import start_audit
from harness.parallel.dist_opt import DistributedOptimizer
from harness.parallel.grad_reduce import GradReduceError
from harness.parallel.groups import DynamicGroups
from harness.parallel.options import SequenceParallelError
from harness.parallel.reroute import SAMPLE_KEYS, ThdMicroBatch, build_microbatches, mtp_keys, reroute
from harness.plan import Schedule, ScheduleError
from harness.runtime import weight_cache
from harness.train import layouts, passes, pipeline, shared_embedding
from harness.train.layouts import LayoutConfig


# ---------------------------------------------------------------------------------------- seams
def stage_cost(cost, stage: int):
    """The cost model a stage plans with: the run's one model, the same on every stage (a seam:
    ``harness.faults`` re-creates stages that plan with costs of their own)."""
    return cost


def cp_group_for(groups: DynamicGroups, mb: ThdMicroBatch):
    """The process group of the micro-batch's own CP block (looked up per micro-batch, never kept)."""
    return groups.for_block(mb.block_start, mb.local_cp_size)


def make_optimizer(params, *, lr: float, weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """The optimiser of a run: AdamW with fp32 state, betas (0.9, 0.95); fused on CUDA (one kernel per step)
    (a seam)."""
    fused = {"fused": True} if params and params[0].device.type == "cuda" else {}
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, betas=(0.9, 0.95), **fused)


def make_distributed_optimizer(buffers, group, *, lr: float, weight_decay: float = 0.0, local=(),
                               tp=None) -> DistributedOptimizer:
    """The distributed optimiser (``harness.parallel.dist_opt``) over this rank's pieces of ``buffers`` (a
    ``ShardedBuffers``) in ``group`` (the stage's DP x CP ranks of one TP coordinate) and its ``local`` parameters
    (experts it owns): ``make_optimizer``'s AdamW, looked up when it is made (a fault of that seam applies here too).
    ``tp``: the run's tensor parallelism (its norm counts split parameters over the TP group)."""
    return DistributedOptimizer(buffers, group, lambda ps: make_optimizer(ps, lr=lr, weight_decay=weight_decay),
                                local=local, tp=tp)


def loss_denominator(mbs: list[ThdMicroBatch], group):
    """Tokens of the global batch: every rank counts the real tokens of *its slices* (CP ranks hold
    disjoint parts of a sequence) and the counts are summed over the DP x CP ranks (a 0-d fp64 tensor on the
    device: nothing waits for it)."""
    dev = mbs[0].data["loss_mask"].device if mbs else torch.device("cpu")
    count = torch.zeros(1, dtype=torch.float64, device=dev)
    for mb in mbs:
        count += mb.data["loss_mask"].sum().double()
    dist.all_reduce(count, group=group)
    return count[0]


def all_reduce_flat(model, group, replicated=None) -> torch.Tensor:
    """SUM-all-reduce every gradient of ``model`` (of the parameters whose name ``replicated`` accepts,
    default all) over ``group`` as one buffer - in place when the gradients are consecutive views of one
    (``harness.parallel.grad_reduce.GradBuffer``), else through a copy; returns the reduced gradient norm
    (a 0-d tensor on the device: nothing waits for it)."""
    grads = [p.grad for n, p in model.named_parameters() if p.grad is not None and (replicated is None or replicated(n))]
    span = _consecutive(grads)
    if span is not None:
        dist.all_reduce(span, group=group)
        return torch.linalg.vector_norm(span, dtype=torch.float64)
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return torch.linalg.vector_norm(flat, dtype=torch.float64)


def _consecutive(grads: list[torch.Tensor]) -> torch.Tensor | None:
    """The one flat tensor that ``grads`` (contiguous views of one storage, each right after the one before)
    tile exactly, or None."""
    if not grads or any(not g.is_contiguous() for g in grads):
        return None
    base, size = grads[0], grads[0].element_size()
    end = base.data_ptr()
    for g in grads:
        if g.data_ptr() != end or g.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
            return None
        end += g.numel() * size
    start = (base.data_ptr() - base.untyped_storage().data_ptr()) // size
    whole = torch.empty(0, dtype=base.dtype, device=base.device).set_(base.untyped_storage())
    return whole[start:start + sum(g.numel() for g in grads)]


def reduce_gradients(model, groups: DynamicGroups, lcfg: LayoutConfig):
    """SUM-all-reduce every gradient over the DP x CP ranks (the loss is already divided by the global
    token count); returns the reduced gradient norm. Expert parallelism: an expert's gradient is already
    whole on its owner (``harness.parallel.expert_parallel``) and stays as it is; the norm adds the shards'
    squares summed over the domain."""
    group = groups.group(lcfg.n_ranks)
    if not lcfg.expert_parallel:
        return all_reduce_flat(model, group)
    norm = all_reduce_flat(model, group, replicated=lambda n: not expert_parallel.is_expert_param(n))
    shards = [p for n, p in model.named_parameters() if expert_parallel.is_expert_param(n)]
    return (norm ** 2 + expert_parallel.shard_square_norm(shards, group).to(norm)) ** 0.5


def stage_square_norm(params, tp=None, shards=None) -> torch.Tensor:
    """The squared gradient norm (fp64, 0-d) of a stage's ``params``: ``tp``'s split parameters' squares summed over the
    TP group, the replicated ones counted once (``tensor_parallel.square_norm``); ``shards`` (expert parallelism's
    parameters, their DP x CP group): summed over that group, and under TP (each expert's FFN split) over TP too."""
    sharded = {id(p) for p in shards[0]} if shards is not None else set()
    rest = [p for p in params if id(p) not in sharded]
    if tp is not None:
        sq = tensor_parallel.square_norm(rest, tp)
    else:
        mine = [p.grad for p in rest if p.grad is not None]
        sq = torch.stack([g.detach().double().norm() ** 2 for g in mine]).sum() if mine else \
            torch.zeros((), dtype=torch.float64)
    if shards is not None:
        sq = sq + expert_square_norm(shards, tp).to(sq)
    return sq


def expert_square_norm(shards, tp=None) -> torch.Tensor:
    """The experts' squared gradient norm: their shards' squares summed over their DP x CP group and, under tensor
    parallelism (each expert's FFN split), over the TP group too (a seam: ``harness.faults`` re-creates Megatron's
    undercount of the experts with EP and TP, PR #5916)."""
    experts = expert_parallel.shard_square_norm(shards[0], shards[1])
    if tp is not None and tp.size > 1:
        dist.all_reduce(experts, group=tp.group)
    return experts


def clip_gradients(params, max_norm: float, pipeline_group, shards=None, tp=None) -> None:
    """Clip by the gradient norm of the whole model: with pipeline stages, the stages' squared norms
    are summed over the rank's pipeline (every stage holds different parameters). ``shards``: (the
    expert-parallel parameters among ``params``, the DP x CP group they are sharded over) - their
    squared norms are summed over that group first. ``tp``: the run's tensor parallelism - the split parameters'
    squares summed over the TP group, the replicated ones counted once (``tensor_parallel.square_norm``)."""
    grads = [p.grad for p in params if p.grad is not None]
    if pipeline_group is None and shards is None and tp is None:
        torch.nn.utils.clip_grad_norm_(params, max_norm, foreach=True)
        return
    sq = stage_square_norm(params, tp, shards)
    if pipeline_group is not None:
        dist.all_reduce(sq, group=pipeline_group)
    coef = min(1.0, max_norm / (float(sq.sqrt()) + 1e-6))
    for g in grads:
        g.mul_(coef)


def _global_norm(grad_norm, pipeline_group, device):
    """The whole model's gradient norm (what a run reports) from this stage's: the stages' squares summed over
    the rank's pipeline (a seam: ``harness.faults`` re-creates a pipeline that reports each stage's own norm)."""
    if pipeline_group is None:
        return grad_norm
    t = torch.as_tensor(grad_norm, dtype=torch.float64, device=device).reshape(1) ** 2
    dist.all_reduce(t, group=pipeline_group)
    return t.sqrt()[0]


def new_groups(groups: DynamicGroups) -> DynamicGroups:
    """The groups a layout's run uses: the ones just created (a seam: ``harness.faults`` re-creates a
    registry that kept the groups of an earlier, destroyed generation)."""
    return groups


# ------------------------------------------------------------------------------------- schedule
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


# ----------------------------------------------------------------------------------------- step
@dataclass
class Run:
    """What every step of a rank shares: groups, pipeline config, its stage and point-to-point links."""

    groups: DynamicGroups
    pipe: object
    stage: pipeline.Stage
    p2p: pipeline.P2P | None = None
    experts: expert_parallel.ExpertShard | None = None
    """The experts this rank owns under expert parallelism (None: every expert, replicated)."""
    sequence_parallel: bool = False
    """Split the block stack's token rows over the TP group too (``harness.parallel.sequence_parallel``; tp > 1)."""
    vocab_multiple: int = 1
    """The split vocabulary is padded to a multiple of this times tp (``TensorParallel.vocab_multiple``)."""
    tp: tensor_parallel.TensorParallel | None = field(init=False)
    """This rank's tensor parallelism (its TP coordinate and the groups' TP group), or None at tp = 1."""

    def __post_init__(self):
        lay, rank = self.groups.layout, self.groups.rank
        if self.sequence_parallel and lay.tp == 1:
            raise SequenceParallelError("sequence parallelism splits token rows over the TP group, and this layout "
                                        "has tp=1: use tp > 1 or turn sequence parallelism off")
        self.tp = tensor_parallel.TensorParallel(lay.tp, lay.tp_rank(rank), self.groups.tp_group,
                                                 self.sequence_parallel, self.vocab_multiple) if lay.tp > 1 else None

    def actions(self, num_microbatches: int):
        if self.pipe.pp == 1:
            return pipeline.single_stage_passes(num_microbatches)
        return pipeline.actions_for(self.pipe, self.stage.stage, num_microbatches)


@dataclass
class StepHooks:
    """What a benchmark adds to the step without changing its maths (every field optional)."""

    planned: Callable[[], tuple] | None = None
    """Returns ``((schedule, padding, fixed length), seconds it took)``: the schedule planned ahead (PP = 1)."""
    mark: Callable[[], None] | None = None
    """Called at each phase boundary (``harness.bench.step.config.PHASES``): after scheduling, rerouting and
    building the micro-batches and their CP operations; after their forwards and backwards; after the gradient
    reduction left after the last backward plus clipping; after the optimiser."""
    reducer: object | None = None
    """A ``BucketedGradReducer``: armed before the last micro-batch, finished in place of ``reduce_gradients``."""
    before_last: Callable[[], None] | None = None
    """Called before the last micro-batch's passes (after arming the reducer)."""
    token_multiple: int = 0
    """Pad each micro-batch to a multiple of this many tokens (``build_microbatches``; 0: no padding)."""
    on_pass: Callable[[object], None] | None = None
    """Called as each pass (a micro-batch's forward or backward: ``pipeline.run_passes``' actions) starts."""
    routes: object | None = None
    """A ``harness.train.routes.StepRoutes`` recording the MoE routes of this rank's micro-batches (not reduced)."""


@dataclass
class StepResult:
    sums: dict
    """Detached sums on this rank: ``ce`` (LM cross-entropy, last stage), ``aux``, ``mtp`` (per depth)."""
    processed: int
    """Tokens (padding included) this rank's first stage processed."""
    local_tokens: int
    """Tokens (padding included) of this rank's micro-batches."""
    num_microbatches: int
    usage: dict
    """``cp_usage`` of the schedule."""
    denominator: object
    """The global batch's loss tokens (a 0-d tensor, or a float)."""
    timeline: pipeline.Timeline
    grad_norm: object
    """The whole model's reduced gradient norm before clipping (a 0-d tensor or a float); None with a reducer
    hook and the replicated optimiser (the bucketed all-reduce reports none; the distributed optimiser does)."""
    schedule: Schedule
    plan_s: float
    wait_s: float
    """Seconds the plan took, and seconds the step waited for it (the same when planned inline)."""
    extra: dict = field(default_factory=dict)
    """``cp_groups``: (micro-batch index, the process group it ran in) of each of this rank's micro-batches."""


def train_step(model, run: Run, layout: str, lengths: list[int], local: dict, lcfg: LayoutConfig, cost, *,
               device, opt, params, grads, dtype: str = "float32", exchange: str = "gather", grad_clip: float = 1.0,
               shards=None, probe=None, probes=None, step_index: int = 0, hooks: StepHooks | None = None,
               weights: str = "cached") -> StepResult:
    """One training step of ``layout`` on this rank (see the module doc). ``local``: the samples this position
    loaded (gid -> tensors, ``SAMPLE_KEYS``); ``params``: the parameters this rank steps (its stage's), whose
    gradients ``grads`` (a ``GradBuffer``) holds; ``shards``: expert-parallel (params, group) for clipping;
    ``probe`` / ``probes``: what the fault catalogue's checks record (``harness.train.probes``); ``weights``: how
    the micro-batches' layers take their matrix weights (``harness.runtime.weight_cache.MODES``: ``cached``, a
    compute-dtype copy made once this step and gradients added into ``.grad`` in place; ``fused``, the copies and the
    weight-gradient GEMM accumulating into ``.grad`` itself; ``per-call``, autocast's cast at every call and autograd's
    accumulation: ``cached`` and ``per-call`` give the same numbers)."""
    hooks = hooks or StepHooks()
    weight_cache.check_mode(weights)  # before any work: a bad mode is one clear error
    check_reducer(opt, hooks.reducer)
    if hooks.reducer is not None and shared_embedding.shares(model, run.stage):
        raise GradReduceError("a reducer hook reduces gradients during the backward, before the pipeline's last stage "
                              "hands its embedding replica's gradient to the first stage (multi-token prediction under "
                              "pp > 1): drop the hook (the step reduces after the backward) or run pp = 1")
    if hooks.reducer is not None and run.tp is not None and run.tp.sequence_parallel:
        raise GradReduceError("a reducer hook reduces gradients during the backward, before sequence parallelism sums "
                              "the split region's norm gradients over the TP group: drop the hook (the step reduces "
                              "after the backward) or turn sequence parallelism off")
    groups = run.groups
    t = time.perf_counter()
    if hooks.planned is None:
        sched, padding, fixed = _schedule(layout, lengths, lcfg, cost, run)
        plan_s = wait_s = time.perf_counter() - t
    else:
        (sched, padding, fixed), plan_s = hooks.planned()
        sched = layouts.deliver(sched)  # what every rank runs, validated, as when planned inline
        wait_s = time.perf_counter() - t
    N, me = lcfg.n_ranks, groups.layout.position(groups.rank)
    everyone = groups.group(N)
    owners = {g: g % N for g in range(len(lengths))}
    depth = model.c.mtp_depth
    samples = reroute(local, owners, sched, me, group=everyone, keys=SAMPLE_KEYS + mtp_keys(depth))
    sp = run.tp is not None and run.tp.sequence_parallel
    mbs = build_microbatches(samples, sched, me, padding=padding, fixed_length=fixed,
                             token_multiple=hooks.token_multiple, tp_size=run.tp.size if sp else 1,
                             sequence_parallel=sp)
    cp_groups = [cp_group_for(groups, mb) for mb in mbs]
    audited = start_audit(groups, mbs, cp_groups, everyone)  # checked before the first CP collective, below
    total = loss_denominator(mbs, everyone)
    scale = torch.as_tensor(total, device=device).float()  # the loss divisor, as a Python float divides: in fp32
    zero = lambda: torch.zeros((), device=device, dtype=torch.float64)  # noqa: E731
    sums = {"ce": zero(), "aux": zero(), "mtp": [zero() for _ in range(depth)]}
    if run.experts is not None:  # every rank joins every micro-batch's all-to-alls: the same count everywhere
        expert_parallel.check_lockstep(len(mbs), everyone, device)
    ops = passes.MicroBatchOps(model, groups, mbs, cp_groups, device, exchange, experts=run.experts,
                               tp=run.tp).prepare()
    mtp_scales = passes.mtp_loss_scales(model.c, mbs, everyone, lcfg.static_cp)
    chunk_passes = passes.model_passes(model, run.stage, ops, dtype, scale, sums, probe, mtp_scales, hooks.routes)
    audited()
    _mark(hooks)
    before_last = None
    if hooks.reducer is not None or hooks.before_last is not None:
        def before_last():
            if hooks.reducer is not None:
                hooks.reducer.arm()  # the last backward all-reduces each bucket as soon as it is complete
            if hooks.before_last is not None:
                hooks.before_last()
    with weight_cache.cached_weights(weights):
        timeline = pipeline.run_passes(run.stage, run.actions(len(mbs)), chunk_passes, run.p2p,
                                       before_last=before_last, on_pass=hooks.on_pass)
    timeline.cp_sizes = [mb.local_cp_size for mb in mbs]
    if sp or (run.tp is not None and run.tp.size > 1 and tensor_parallel.has_partial(params)):
        # the row-split region's norms saw this rank's rows, an SSM mixer's B / C parameters this rank's heads: their
        # gradients summed over the TP group
        sequence_parallel.reduce_grads(params, run.tp)
    _mark(hooks)
    shared = shared_embedding.shares(model, run.stage)
    early = shared and shared_embedding.before_reduction()
    if early:  # the last stage's MTP lookups' gradient joins the table's owner, before the domain's reduction
        shared_embedding.gather_grad(model, run.stage, groups.pipeline)
    if isinstance(opt, DistributedOptimizer):
        grad_norm = _sharded_reduce_and_clip(opt, hooks, groups, grad_clip, model, probes, step_index, run.tp)
    else:
        if hooks.reducer is not None:
            hooks.reducer.finish()
            grad_norm = None
        else:
            grad_norm = reduce_gradients(model, groups, lcfg)
            if run.tp is not None:  # the shards' squares summed over the TP group, the replicated ones counted once
                grad_norm = stage_square_norm(params, run.tp, shards).sqrt()
            grad_norm = _global_norm(grad_norm, groups.pipeline, device)
        if probes is not None:
            probes.after_reduce(step_index, model, float(grad_norm), tp=run.tp)
        if grad_clip:
            clip_gradients(params, grad_clip, groups.pipeline, **({"shards": shards} if shards else {}),
                           **({"tp": run.tp} if run.tp is not None else {}))
        if probes is not None:
            probes.after_clip(step_index, model, tp=run.tp)
    if shared and not early:  # (only a fault orders it so)
        shared_embedding.gather_grad(model, run.stage, groups.pipeline)
    _mark(hooks)
    opt.step()
    grads.zero_()
    if shared:  # the replica on the last stage takes the updated table
        shared_embedding.refresh(model, run.stage, groups.pipeline, groups.layout.pipeline_ranks(groups.rank)[0])
    _mark(hooks)
    if probes is not None:
        probes.after_update(step_index, model, tp=run.tp)
    local_tokens = sum(mb.data["tokens"].numel() for mb in mbs)
    return StepResult(sums, local_tokens if run.stage.first else 0, local_tokens, sched.num_microbatches,
                      cp_usage(sched), total, timeline, grad_norm, sched, plan_s, wait_s,
                      {"cp_groups": [(mb.index, g) for mb, g in zip(mbs, cp_groups)]})


def check_reducer(opt, reducer) -> None:
    """A reducer hook fits the optimiser: a reduce-scattering one (``scatter``) leaves only each rank's pieces summed,
    which only the distributed optimiser reads; an all-reducing one would sum the distributed optimiser's whole buffer
    for nothing. Raises ``GradReduceError`` naming the fix."""
    if reducer is None:
        return
    sharded = isinstance(opt, DistributedOptimizer)
    if bool(getattr(reducer, "scatter", False)) != sharded:
        raise GradReduceError(
            f"the gradient reducer {'reduce-scatters' if not sharded else 'all-reduces'} but the optimiser is "
            f"{'replicated' if not sharded else 'distributed'}: build BucketedGradReducer(..., scatter={sharded}"
            + (", buckets=buffers.buckets" if sharded else "") + ") for it")


def _sharded_reduce_and_clip(opt: DistributedOptimizer, hooks: StepHooks, groups, grad_clip, model, probes,
                             step_index: int, tp=None):
    """The distributed optimiser's side of a step before its update: each bucket reduce-scattered (by the hooks'
    reducer in scatter mode, overlapped with the last backward, or here), the whole model's norm from the pieces,
    the pieces clipped. Probes read every summed gradient: the pieces are gathered for them (not otherwise)."""
    if hooks.reducer is not None:
        hooks.reducer.finish()
    else:
        opt.reduce_scatter()
    norm = opt.grad_norm(groups.pipeline)
    if probes is not None:
        opt.gather_grads()
        probes.after_reduce(step_index, model, float(norm), tp=tp)
    if grad_clip:
        opt.clip_(grad_clip, norm)
    if probes is not None:
        opt.gather_grads()
        probes.after_clip(step_index, model, tp=tp)
    return norm


def _mark(hooks: StepHooks) -> None:
    if hooks.mark is not None:
        hooks.mark()
