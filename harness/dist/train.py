"""The training step of each layout, run on every rank (``train(rank, world, cfg)``).

For each layout in turn: the same initial model (seeded), the same AdamW, the same global batches
(``harness.corpus``). A step: schedule the batch (``harness.dist.layouts``), reroute every sequence
from the position that loaded it (DP shards: gid % N) to the ranks of its block, build THD
micro-batches, run forward/backward per micro-batch with CP attention in the block's group, add
``(sum of token losses + aux) / tokens of the global batch``, all-reduce the gradients (sum over the
DP x CP ranks), clip, step. In exact arithmetic every layout computes the same loss and update.

Rank 0 prints one progress line per step and appends the step's metrics to ``cfg["metrics_path"]``
(JSONL) as it goes.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from harness.corpus import CorpusConfig, global_batch
from harness.dist import layouts
from harness.dist.audit import GroupAuditError, audit_groups
from harness.dist.cp_attention import CPAttentionPlan, cp_attention
from harness.dist.groups import DynamicGroups, ParallelLayout
from harness.dist.layouts import LAYOUTS, LayoutConfig, LayoutError, static_cp_for
from harness.dist.probes import Probes
from harness.dist.reroute import ThdMicroBatch, build_microbatches, reroute
from harness.dist.watchdog import Heartbeat
from harness.plan import CostModel, ScheduleError
from harness.runtime.model import MODELS, TinyLM


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = "tiny-gpt"
    """A key of ``harness.runtime.model.MODELS``."""
    layouts: tuple[str, ...] = LAYOUTS
    steps: int = 50
    lr: float = 3e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_seqlen_per_rank: int = 256
    micro_batch_size: int = 1
    scheduler: str = "balanced"
    dcp_padding: str = "local"
    dtype: str = "float32"
    """``float32``, or ``bfloat16`` (autocast; fp32 master weights)."""
    device: str = "cpu"
    cp_exchange: str = "gather"
    """How CP blocks exchange K/V (``harness.dist.cp_attention.EXCHANGES``): ``gather``, ``ring`` or
    ``auto``; the attention is the same either way, so the goldens apply to all."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    probes: bool = False
    """Record what the fault catalogue's checks read (``harness.dist.probes``) on every rank and
    return it with the rows."""

    def validate(self, world: int) -> None:
        if self.model not in MODELS:
            raise LayoutError(f"unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        bad = [x for x in self.layouts if x not in LAYOUTS]
        if bad or not self.layouts:
            raise LayoutError(f"unknown layout(s) {bad or self.layouts!r}; choose from {', '.join(LAYOUTS)}")
        if world < 1 or world & (world - 1):
            raise LayoutError(f"world size {world} is not a power of two: dynamic CP groups need one (use 1, 2, 4, 8)")
        if self.dtype not in ("float32", "bfloat16"):
            raise LayoutError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.steps < 1:
            raise LayoutError(f"steps must be >= 1, got {self.steps}")
        from harness.dist.cp_attention import EXCHANGES
        from harness.plan import ALGORITHMS

        if self.cp_exchange not in EXCHANGES:
            raise LayoutError(f"cp_exchange must be one of {', '.join(EXCHANGES)}, got {self.cp_exchange!r}")
        if self.scheduler not in ALGORITHMS:
            raise LayoutError(f"unknown scheduler {self.scheduler!r} for the dcp layout; choose from "
                              f"{', '.join(sorted(ALGORITHMS))}")
        if self.dcp_padding not in ("local", "domain"):
            raise LayoutError(f"dcp_padding must be 'local' or 'domain', got {self.dcp_padding!r}")
        if self.device not in ("cpu", "cuda"):
            raise LayoutError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.max_seqlen_per_rank < 1 or self.micro_batch_size < 1:
            raise LayoutError(f"max_seqlen_per_rank and micro_batch_size must be >= 1, got "
                              f"{self.max_seqlen_per_rank} and {self.micro_batch_size}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        d = dict(d)
        d["corpus"] = CorpusConfig(**d.get("corpus", {}))
        d["layouts"] = tuple(d.get("layouts", LAYOUTS))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def longest_sequence(cfg: TrainConfig) -> int:
    return max(len(x) - 1 for s in range(cfg.steps) for x in global_batch(cfg.corpus, s))


def model_cost(cfg: TrainConfig) -> CostModel:
    return MODELS[cfg.model].training_cost(name=cfg.model)


def _samples(batch, owners, me, device) -> dict:
    out = {}
    for g, x in enumerate(batch):
        if owners[g] == me:
            t = torch.as_tensor(x, dtype=torch.int64, device=device)
            L = t.numel() - 1
            out[g] = {"tokens": t[:-1], "labels": t[1:], "loss_mask": torch.ones(L, dtype=torch.int64, device=device),
                      "position_ids": torch.arange(L, dtype=torch.int64, device=device)}
    return out


# ---------------------------------------------------------------------------------------- seams
# The steps below are module-level functions that ``_step`` looks up when it runs, so that
# ``harness.faults`` can replace one for the length of a run (``harness.faults.seam.replaced``) to
# re-create a real integration bug; nothing else changes them.

def rope_positions(mb: ThdMicroBatch) -> torch.Tensor:
    """RoPE position ids of the rank's slice: each token's position in *its sequence* (carried from
    the sample through padding and the zig-zag slice), not its place in the rank's buffer."""
    return mb.data["position_ids"]


def labels_for(mb: ThdMicroBatch) -> torch.Tensor:
    """Next-token labels of the rank's slice, shifted per sequence *before* the CP split."""
    return mb.data["labels"]


def attention_plan(mb: ThdMicroBatch, device, exchange: str) -> CPAttentionPlan:
    """The CP attention plan of a micro-batch: its sequences' boundaries (``cu_seqlens_padded``)."""
    return CPAttentionPlan.build(mb.cu_seqlens_padded, mb.local_cp_size, mb.cp_rank, device, exchange=exchange)


def cp_group_for(groups: DynamicGroups, mb: ThdMicroBatch):
    """The process group of the micro-batch's own CP block (looked up per micro-batch, never kept)."""
    return groups.for_block(mb.block_start, mb.local_cp_size)


def loss_denominator(mbs: list[ThdMicroBatch], group) -> float:
    """Tokens of the global batch: every rank counts the real tokens of *its slices* (CP ranks hold
    disjoint parts of a sequence) and the counts are summed over the DP x CP ranks."""
    dev = mbs[0].data["loss_mask"].device if mbs else torch.device("cpu")
    count = torch.zeros(1, dtype=torch.float64, device=dev)
    for mb in mbs:
        count += mb.data["loss_mask"].sum().double()
    dist.all_reduce(count, group=group)
    return float(count)


def all_reduce_flat(model, group) -> float:
    """SUM-all-reduce every gradient of ``model`` over ``group`` in one flat buffer; returns the
    reduced gradient norm."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset:offset + g.numel()].view_as(g))
        offset += g.numel()
    return float(flat.double().norm())


def reduce_gradients(model, groups: DynamicGroups, lcfg: LayoutConfig) -> float:
    """SUM-all-reduce every gradient over the DP x CP ranks (the loss is already divided by the global
    token count); returns the reduced gradient norm."""
    return all_reduce_flat(model, groups.group(lcfg.n_ranks))


# ------------------------------------------------------------------------------------------ step

def _step(model, groups, batch, layout, lcfg, cfg, cost, device, probe=None):
    """Forward/backward of one global batch; returns (loss sum, aux sum, processed tokens, #mb, cp hist,
    loss denominator).
    ``probe``: a ``harness.dist.probes.StepProbe`` that records per-sequence losses and token counts."""
    lengths = [len(x) - 1 for x in batch]
    sched, padding, fixed = layouts.plan(layout, lengths, lcfg, cost)
    sched = layouts.deliver(sched)
    N, me = lcfg.n_ranks, groups.layout.position(groups.rank)
    everyone = groups.group(N)
    owners = {g: g % N for g in range(len(batch))}
    samples = reroute(_samples(batch, owners, me, device), owners, sched, me, group=everyone)
    mbs = build_microbatches(samples, sched, me, padding=padding, fixed_length=fixed)
    cp_groups = [cp_group_for(groups, mb) for mb in mbs]
    audit_groups(groups, mbs, cp_groups, everyone)
    total = loss_denominator(mbs, everyone)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    aux_sum = torch.zeros((), device=device, dtype=torch.float64)
    processed = 0
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16")
    for mb, group in zip(mbs, cp_groups):
        aplan = attention_plan(mb, device, cfg.cp_exchange)
        attention = lambda q, k, v, p=aplan, g=group: cp_attention(q, k, v, p, g)  # noqa: E731
        with autocast:
            out = model.token_losses(mb.data["tokens"], labels_for(mb), mb.data["loss_mask"], rope_positions(mb),
                                     attention, per_token=probe is not None)
        ce, aux = out[0], out[1]
        if probe is not None:
            probe.add(mb, out[2])
        ((ce + aux) / total).backward()
        loss_sum += ce.detach().double()
        aux_sum += aux.detach().double()
        processed += mb.data["tokens"].numel()
    hist: dict[int, int] = {}
    for s in sched.cp_size_of().values():
        hist[s] = hist.get(s, 0) + 1
    return loss_sum, aux_sum, processed, sched.num_microbatches, hist, total


def train_layout(layout: str, rank: int, world: int, cfg: TrainConfig, groups, lcfg, device, log,
                 probes=None, heartbeat: Heartbeat | None = None) -> list[dict]:
    torch.manual_seed(cfg.corpus.seed)
    model = TinyLM(MODELS[cfg.model]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    cost, everyone, rows = model_cost(cfg), groups.group(lcfg.n_ranks), []
    heartbeat = heartbeat or Heartbeat(None, rank)
    for step in range(cfg.steps):
        heartbeat.beat(layout=layout, step=step + 1, of=cfg.steps)
        t0 = time.perf_counter()
        batch = global_batch(cfg.corpus, step)
        probe = probes.step(step, batch) if probes is not None else None
        try:
            loss_sum, aux_sum, processed, nmb, hist, denom = _step(model, groups, batch, layout, lcfg, cfg, cost,
                                                                   device, probe)
        except (ScheduleError, GroupAuditError) as e:  # raised alike on every rank: say where
            e.step, e.layout = step, layout
            raise
        total = float(sum(len(x) - 1 for x in batch))
        grad_norm = reduce_gradients(model, groups, lcfg)
        if probes is not None:
            probes.after_reduce(step, model, grad_norm)
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if probes is not None:
            probes.after_update(step, model)
        stats = torch.tensor([float(loss_sum), float(aux_sum), float(processed)], dtype=torch.float64, device=device)
        dist.all_reduce(stats, group=everyone)
        elapsed = torch.tensor([time.perf_counter() - t0], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=everyone)
        row = {"layout": layout, "step": step, "loss": float(stats[0]) / denom, "aux_loss": float(stats[1]) / denom,
               "grad_norm": grad_norm, "tokens": int(total), "processed_tokens": int(stats[2]),
               "padding_fraction": 1.0 - total / float(stats[2]), "step_time": float(elapsed),
               "tokens_per_s": total / float(elapsed), "microbatches": nmb,
               "cp_histogram": {str(k): v for k, v in sorted(hist.items())}}
        rows.append(row)
        if rank == 0:
            log(row, cfg.steps)
    return rows


def train(rank: int, world: int, cfg_dict: dict) -> dict:
    """Run every layout of ``cfg_dict`` (a ``TrainConfig`` as a dict, plus ``metrics_path``)."""
    cfg = TrainConfig.from_dict(cfg_dict)
    cfg.validate(world)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.device == "cuda" else torch.device("cpu")
    torch.use_deterministic_algorithms(cfg.device == "cpu", warn_only=True)
    longest = longest_sequence(cfg)
    lcfg = LayoutConfig(n_ranks=world, max_seqlen_per_rank=cfg.max_seqlen_per_rank,
                        static_cp=static_cp_for(longest, world, cfg.max_seqlen_per_rank),
                        micro_batch_size=cfg.micro_batch_size, scheduler=cfg.scheduler, dcp_padding=cfg.dcp_padding)
    groups = DynamicGroups(ParallelLayout(dp=world, cp=1), rank)
    path = cfg_dict.get("metrics_path")

    def log(row, steps):
        print(f"[{row['layout']:4s}] step {row['step'] + 1:>4d}/{steps}  loss {row['loss']:.6f}  grad_norm "
              f"{row['grad_norm']:.4f}  {row['tokens_per_s']:9.0f} tok/s  padding {row['padding_fraction']:6.1%}  "
              f"micro-batches {row['microbatches']}", flush=True)
        if path:
            with open(path, "a") as f:
                f.write(json.dumps(row) + "\n")

    probes = {layout: Probes() for layout in cfg.layouts} if cfg.probes else {}
    heartbeat = Heartbeat.from_cfg(cfg_dict, rank)
    out = {layout: train_layout(layout, rank, world, cfg, groups, lcfg, device, log, probes.get(layout), heartbeat)
           for layout in cfg.layouts}
    result = {"rank": rank, "static_cp": lcfg.static_cp, "longest": longest, "layouts": out if rank == 0 else {}}
    if cfg.probes:
        result["probes"] = {layout: p.result() for layout, p in probes.items()}
    return result
