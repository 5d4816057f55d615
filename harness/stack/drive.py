"""Drive a stack through the steps the checks need, on every rank of a job (``job(rank, world, cfg)``).

The stack is named by ``cfg["stack"]``: ``"harness"`` (``harness.stack.runtime``), ``"package.module:make"`` or
``"path/to/file.py:make"`` (a factory ``make(ctx, **cfg["options"])``). For each layout in ``cfg["layouts"]``
the stack builds its model from ``cfg["seed"]`` and trains ``cfg["steps"]`` global batches of the harness's corpus,
each laid out by the harness's schedule for that layout (the same on every rank: planning is deterministic); the
first step asks for gradients, token losses and CP groups, every later step for the CP groups. With
``cfg["sharp_scale"]`` > 0 and a stack that offers ``sharpen`` (``harness.stack.protocol``), each layout then runs
step 1 once more from a fresh model sharpened by that scale (the layout's ``"sharp"`` report; None when the stack
offers no ``sharpen``). Each step is reported to the launcher's watchdog (``harness.heartbeat``): a slow stack is
not taken for a stuck one. Each rank writes its reports to ``cfg["report_dir"]/rank{r}.pkl`` and returns the path
(``cfg["inline"]``: returns them, pickled, in the result).
"""

from __future__ import annotations

import base64
import importlib
import importlib.util
import pickle
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np

from harness.data.corpus import global_batch
from harness.heartbeat import Heartbeat
from harness.stack.protocol import (
    WANTS,
    StackContext,
    StackError,
    StepRequest,
    checked_report,
    checked_stack,
    declared_execution,
    sequence_passes,
    sharpens,
)
from harness.train import layouts
from harness.train.config import TrainConfig, longest_sequence, model_cost

BUILTIN = {"harness": "harness.stack.runtime:make", "megatron-core": "harness.stack.megatron_core:make"}
"""Stacks known by name (``dcp-harness verify harness``)."""


def load_factory(spec: str):
    """The factory a stack spec names: a ``BUILTIN`` name, ``module:function`` or ``file.py:function``."""
    spec = BUILTIN.get(spec, spec)
    where, sep, name = spec.rpartition(":")
    if not sep or not where or not name.isidentifier():
        raise StackError(f"stack {spec!r} is not 'path/to/file.py:function', 'package.module:function' or one of "
                         f"{', '.join(BUILTIN)}")
    if where.endswith(".py"):
        path = Path(where).resolve()
        if not path.is_file():
            raise StackError(f"stack file {where!r} does not exist; give the path of the file that defines {name}()")
        mod_name = f"_dcp_harness_stack_{path.stem}"
        module = sys.modules.get(mod_name)
        if module is None:
            spec_ = importlib.util.spec_from_file_location(mod_name, path)
            module = importlib.util.module_from_spec(spec_)
            sys.modules[mod_name] = module
            spec_.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as e:
            raise StackError(f"stack module {where!r} cannot be imported ({e}); install it or give a file path") from e
    fn = getattr(module, name, None)
    if not callable(fn):
        raise StackError(f"{where} has no function {name!r}; define {name}(ctx) returning a harness.stack.Stack")
    return fn


def reference_config(cfg: TrainConfig, layout: str) -> TrainConfig:
    """``cfg`` for the one-rank reference run: ``layout`` only, with room for the run's longest sequence at CP 1."""
    return replace(cfg, layouts=(layout,), max_seqlen_per_rank=max(cfg.max_seqlen_per_rank, longest_sequence(cfg)))


def load_reports(items: list) -> list[dict]:
    """Each rank's reports from ``job``'s results: the file it wrote, or carried in the result (``inline``)."""
    out = []
    for item in items:
        if isinstance(item, dict):
            out.append(pickle.loads(base64.b64decode(item["inline"])))  # noqa: S301 - this job's own ranks
            continue
        with open(item, "rb") as f:
            out.append(pickle.load(f))  # noqa: S301 - written by this job's own ranks just now
    return out


def _portable(report):
    """The report with tensors turned into numpy arrays and plain numbers (picklable without the stack)."""
    def arr(x):
        return x.detach().cpu().double().numpy() if hasattr(x, "detach") else np.asarray(x, dtype=np.float64)

    if report.gradients is not None:
        report.gradients = {str(n): arr(g) for n, g in report.gradients.items()}
    if report.token_losses is not None:
        report.token_losses = [(int(g), int(p), float(c)) for g, p, c in report.token_losses]
    if report.cp_groups is not None:
        report.cp_groups = {int(m): tuple(int(r) for r in v) for m, v in report.cp_groups.items()}
    return report


def _sharp_step(stack, seed: int, scale: float, first: StepRequest, beat):
    """Step 1 again (``first``: its request, same batch and schedule) from a fresh model sharpened by ``scale``."""
    beat.beat(force=True, layout=first.layout, phase=f"step 1 with queries and keys x{scale:g}")
    stack.build(seed)
    stack.sharpen(scale)
    req = StepRequest(step=0, layout=first.layout, batch=first.batch, schedule=first.schedule, padding=first.padding,
                      fixed_length=first.fixed_length, want=frozenset(WANTS))
    return _portable(checked_report(stack, stack.step(req), req))


def job(rank: int, world: int, cfg: dict) -> str | dict:
    """Every layout's steps on this rank (see the module doc)."""
    tcfg = TrainConfig.from_dict({k: v for k, v in cfg.items() if k in TrainConfig.__dataclass_fields__})
    lcfg, cost = tcfg.layout_config(world), model_cost(tcfg) if tcfg.model else None
    ctx = StackContext(rank=rank, world=world, device=cfg.get("device", "cpu"), dtype=tcfg.dtype,
                       vocab=tcfg.corpus.vocab)
    origin = f"stack {cfg['stack']!r}"
    stack = checked_stack(load_factory(cfg["stack"])(ctx, **cfg.get("options", {})), origin)
    passes = sequence_passes(stack)  # each sequence its own pass: balanced packs micro-batches by the batch
    execution = declared_execution(stack)  # its barriers, as the benchmark schedules it
    scale = float(cfg.get("sharp_scale") or 0.0)
    sharp = scale > 0 and sharpens(stack)
    out = {"stack": stack.name, "layouts": {}}
    beat = Heartbeat.from_cfg(cfg, rank)  # progress for the launcher's watchdog (no-op outside a launched job)
    for layout in tcfg.layouts:
        beat.beat(force=True, layout=layout, phase="building the model")
        stack.build(tcfg.corpus.seed)
        reps, schedules, lengths, first = [], [], [], None
        for k in range(tcfg.steps):
            beat.beat(force=True, layout=layout, step=k + 1, of=tcfg.steps)
            batch = global_batch(tcfg.corpus, k)
            ls = [len(x) - 1 for x in batch]
            sched, padding, fixed = layouts.plan(layout, ls, layouts.for_stack(lcfg, ls, passes, execution), cost)
            req = StepRequest(step=k, layout=layout, batch=batch, schedule=sched, padding=padding,
                              fixed_length=fixed, want=frozenset(WANTS) if k == 0 else frozenset({"cp_groups"}))
            first = first or req
            reps.append(_portable(checked_report(stack, stack.step(req), req)))
            schedules.append(sched.to_dict())
            lengths.append(ls)
        out["layouts"][layout] = {"reports": reps, "schedules": schedules, "lengths": lengths,
                                  "sharp": _sharp_step(stack, tcfg.corpus.seed, scale, first, beat)
                                  if sharp and first is not None else None}
    close = getattr(stack, "close", None)
    if callable(close):
        close()
    if cfg.get("inline"):  # carried in the job's result (ranks that share no folder)
        return {"inline": base64.b64encode(pickle.dumps(out)).decode()}
    path = Path(cfg["report_dir"]) / f"rank{rank}.pkl"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(pickle.dumps(out))
    tmp.replace(path)
    return str(path)
