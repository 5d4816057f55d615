"""The harness's own runtime behind the stack protocol (``harness.stack.protocol``): its first implementation.

``HarnessStack`` trains ``harness.runtime.model.TinyLM`` with ``harness.train.step.train_step`` - the step
``converge`` verifies and ``bench step`` times - on the schedule the request gives (planned by the harness, or
by anyone). One pipeline stage, no expert parallelism: the DP x CP domain is the whole world (``converge``
covers pipelines and expert parallelism with the same step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.parallel.grad_reduce import GradBuffer
from harness.parallel.groups import DynamicGroups, ParallelLayout
from harness.plan import token_bucket as token_bucket_mod
from harness.runtime.model import MODELS, TinyLM
from harness.stack.protocol import StackContext, StackError, StepReport, StepRequest
from harness.train import pipeline, step
from harness.train.config import TrainConfig
from harness.train.layouts import LayoutConfig
from harness.train.probes import StepProbe, whole_grads
from harness.train.trainer import samples_of


class _Grads:
    """Records the reduced gradients before clipping (the probes' hook of ``train_step``)."""

    def __init__(self, want: bool):
        self.want, self.grads = want, None

    def after_reduce(self, step_index, model, grad_norm, tp=None) -> None:
        if self.want:
            self.grads = whole_grads(model, tp)

    def after_clip(self, step_index, model, tp=None) -> None:
        pass

    def after_update(self, step_index, model, tp=None) -> None:
        pass


class HarnessStack:
    """``harness.runtime.model`` models on ``harness.train.step`` (see the module doc)."""

    name = "harness"

    def __init__(self, ctx: StackContext, *, model: str = "tiny-gpt", lr: float = 3e-3, grad_clip: float = 1.0,
                 exchange: str = "gather", token_bucket: int | str = "auto"):
        """``token_bucket``: the thd / dcp micro-batches padded to a multiple of this many tokens per rank, or
        ``auto`` (64 on CUDA when it divides the schedule's ``max_seqlen_per_rank``, off on the CPU), as ``converge``
        and ``bench step`` pad (``harness.plan.token_bucket``). ``verify`` hands its one-rank reference run the same
        options, so there the reference pads too (no CP: the padding only closes each pack); ``converge``'s reference,
        which never pads, is the one that judges the padding itself."""
        try:
            token_bucket_mod.check(token_bucket)
        except ValueError as e:
            raise StackError(f"{e} (--option token_bucket=auto|N)") from None
        if model not in MODELS:
            raise StackError(f"unknown model {model!r}; choose from {', '.join(sorted(MODELS))}")
        if MODELS[model].vocab < ctx.vocab:
            raise StackError(f"model {model!r} has a vocabulary of {MODELS[model].vocab}, the corpus uses "
                             f"{ctx.vocab} token ids; use a corpus vocabulary <= {MODELS[model].vocab}")
        self.ctx, self.model_name, self.lr, self.grad_clip, self.exchange = ctx, model, lr, grad_clip, exchange
        self.token_bucket = token_bucket
        self.device = torch.device("cuda", torch.cuda.current_device()) if ctx.device == "cuda" else torch.device("cpu")
        self.playout = ParallelLayout(dp=ctx.world, cp=1, pp=1)
        self.stage = pipeline.Stage.of(MODELS[model].layers, 1, 1, 0)
        self.pipe = TrainConfig(model=model).pipeline_config()
        self.groups = None

    def build(self, seed: int) -> None:
        if self.groups is not None:
            self.groups.destroy()
        self.groups = DynamicGroups(self.playout, self.ctx.rank)
        torch.manual_seed(seed)
        self.model = TinyLM(MODELS[self.model_name]).to(self.device)
        self.params = list(self.model.parameters())
        self.grads = GradBuffer(self.params, self.device)
        self.opt = step.make_optimizer(self.params, lr=self.lr)
        self.run = step.Run(self.groups, self.pipe, self.stage)

    def sharpen(self, scale: float) -> None:
        """Multiply the query and key rows of every attention layer's ``qkv`` projection by ``scale``
        (``harness.stack.protocol``: the sharp step 1)."""
        sharpen_queries_and_keys(self.model, scale)

    def step(self, request: StepRequest) -> StepReport:
        sched, N = request.schedule, self.ctx.world
        me = self.playout.position(self.ctx.rank)
        lengths = [len(x) - 1 for x in request.batch]
        lcfg = LayoutConfig(n_ranks=N, max_seqlen_per_rank=sched.max_seqlen_per_rank, static_cp=1)
        local = samples_of(request.batch, {g: g % N for g in range(len(lengths))}, me, self.device,
                           self.model.c.mtp_depth)
        probe = StepProbe() if "token_losses" in request.want else None
        grads = _Grads("gradients" in request.want)
        planned = lambda: ((sched, request.padding, request.fixed_length), 0.0)  # noqa: E731
        multiple = token_bucket_mod.resolve(self.token_bucket, self.ctx.device, sched.max_seqlen_per_rank)
        r = step.train_step(self.model, self.run, request.layout, lengths, local, lcfg, None, device=self.device,
                            opt=self.opt, params=self.params, grads=self.grads, dtype=self.ctx.dtype,
                            exchange=self.exchange, grad_clip=self.grad_clip, probe=probe, probes=grads,
                            step_index=request.step, hooks=step.StepHooks(planned=planned, token_multiple=multiple))
        ce = r.sums["ce"].reshape(1).clone()
        dist.all_reduce(ce)
        denom = float(r.denominator)
        report = StepReport(loss=float(ce[0]) / denom, grad_norm=float(r.grad_norm), tokens=int(round(denom)),
                            extra={"processed_tokens": int(r.processed)})  # this rank's, padding included
        if grads.want:
            report.gradients = grads.grads
        if probe is not None:
            got = probe.result()
            report.token_losses = list(zip(got["seq"], got["pos"], got["ce"]))
        if "cp_groups" in request.want:
            report.cp_groups = {m: tuple(self.playout.position(r_) for r_ in _ranks(g, self.ctx.rank))
                                for m, g in r.extra["cp_groups"]}
        return report

    def close(self) -> None:
        if self.groups is not None:
            self.groups.destroy()
            self.groups = None


def sharpen_queries_and_keys(model: TinyLM, scale: float) -> int:
    """Scale the query and key rows of every ``qkv`` projection of ``model`` (dense blocks, hybrid attention layers,
    MTP blocks) by ``scale``, in place; returns how many projections it scaled."""
    c = model.c
    rows = (c.heads + c.kv_heads) * (c.hidden // c.heads)
    n = 0
    with torch.no_grad():
        for m in model.modules():
            qkv = getattr(m, "qkv", None)
            if isinstance(qkv, torch.nn.Linear):
                qkv.weight[:rows] *= scale
                if qkv.bias is not None:
                    qkv.bias[:rows] *= scale
                n += 1
    return n


def _ranks(group, rank: int) -> list[int]:
    """The global ranks of ``group`` (a one-rank group: this rank)."""
    if group is None:
        return [rank]
    return sorted(dist.get_process_group_ranks(group))


def make(ctx: StackContext, **options) -> HarnessStack:
    """The factory ``dcp-harness verify harness`` uses (options: ``model``, ``lr``, ``grad_clip``, ``exchange``,
    ``token_bucket``)."""
    return HarnessStack(ctx, **options)
