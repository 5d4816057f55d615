"""``dcp-harness verify STACK``: check a training stack through the stack protocol (``harness.stack``).

Two torchrun jobs run the stack (``harness.stack.drive``): every layout on ``world`` ranks, then the reference on
one rank without CP (``harness.stack.checks.REF_LAYOUT``), both on the same corpus batches from the same seed.
The checks (``harness.stack.checks``) judge token accounting, rank agreement, token coverage and CP groups
against the batch and the schedule, and loss, gradient norm, step-1 gradients and token losses against the
reference; a bf16 run also holds a sharp step 1 (queries and keys scaled, ``harness.stack.checks.SHARP_SCALE``)
to the reference's, where the stack offers ``sharpen``. With a golden of the case on this hardware
(``harness.apps.verify_golden``) the loss and gradient-norm curves are also held to it. The verdict is PASS only when every check passes; ``verify.json`` keeps every line.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from harness import golden as golden_mod
from harness.apps import verify_golden as vg
from harness.apps.converge import hardware
from harness.data.corpus import batch_lengths
from harness.io import atomic_write_json
from harness.jobs.entry import launch, launched_world, register
from harness.jobs.launch import run_on_ranks
from harness.plan import Schedule
from harness.stack import checks
from harness.stack.drive import BUILTIN, job, load_reports, reference_config
from harness.stack.protocol import StackError
from harness.train.config import TrainConfig, longest_sequence

JOB = register("verify-stack", "harness.stack.drive:job")
PLANTED = "harness.faults.catalogue:planted"
REF_NAME = "reference (1 rank, no CP)"


@dataclass
class Verified:
    verdict: str
    checks: list[dict]
    stack: str
    out: Path
    golden: str | None = None
    """The golden file compared with or written (None: none)."""
    curves: dict | None = None
    """Rank 0's ``{"loss": [...], "grad_norm": [...]}`` per layout and of the reference (``"reference"``)."""
    notes: list[str] | None = None
    """What the run could not check and why (e.g. a bf16 stack that offers no ``sharpen``)."""


def default_max_seqlen(cfg, world: int) -> int:
    """Without ``--max-seqlen-per-rank``: the training default, or the least even value at which the static
    layouts fit the run's longest sequence on ``world`` ranks."""
    need = -(-longest_sequence(cfg) // world)
    return max(cfg.max_seqlen_per_rank, need + need % 2)


SEED_SEARCH = 64
"""``exercising``'s corpus seeds: 0 to 63."""


def step1_needs_cp(cfg, world: int) -> bool:
    """Whether step 1 of ``cfg``'s corpus holds a sequence longer than its tokens per rank, which every scheduler
    must split over a CP group of more than one rank (``world`` > 1)."""
    return world > 1 and max(batch_lengths(cfg.corpus, 0)) > cfg.max_seqlen_per_rank


def exercising(cfg, world: int, capacity: int | None = None):
    """``cfg`` with the first corpus seed (0 to ``SEED_SEARCH`` - 1) whose step 1 needs CP > 1 (``step1_needs_cp``),
    and ``capacity`` tokens per rank (None: ``default_max_seqlen`` of that seed): the dcp layout's step-1 checks
    then see a CP group. Without a dcp layout, on one rank, or when no seed gives one, ``cfg``'s own seed."""
    def at(seed: int):
        c = replace(cfg, corpus=replace(cfg.corpus, seed=seed))
        return replace(c, max_seqlen_per_rank=capacity or default_max_seqlen(c, world))

    if "dcp" in cfg.layouts and world > 1:
        for seed in range(SEED_SEARCH):
            c = at(seed)  # with the user's capacity, the static layouts must still fit the seed's longest sequence
            if step1_needs_cp(c, world) and longest_sequence(c) <= c.max_seqlen_per_rank * world:
                return c
    return at(cfg.corpus.seed)


def _exercise_hint(cfg, world: int) -> str:
    found = exercising(cfg, world, cfg.max_seqlen_per_rank)
    if step1_needs_cp(found, world):
        return f"--seed {found.corpus.seed} gives a step 1 that needs CP > 1 at {cfg.max_seqlen_per_rank} tokens per rank"
    return "a lower --max-seqlen-per-rank (the static layouts need the longest sequence / world) or longer --lengths"


def spawned_rank(rank: int, world: int, cfg: dict) -> str:
    """``harness.stack.drive.job`` in a forked rank, inside ``cfg["around"]`` as torchrun's entry runs it."""
    if not cfg.get("around"):
        return job(rank, world, cfg)
    from harness.faults.catalogue import planted  # lazy: the fault modules import torch

    with planted(*cfg["around"][1:]):
        return job(rank, world, cfg)


def _run(stack: str, options: dict, cfg: TrainConfig, world: int, folder: Path, *, stall_s, stream,
         spawn: bool, plant: str | None, sharp: float) -> list[dict] | None:
    folder.mkdir(parents=True, exist_ok=True)
    job_cfg = {**cfg.to_dict(), "stack": stack, "options": options, "report_dir": str(folder), "sharp_scale": sharp,
               # ranks a user's launcher started may share no folder: their reports travel with the results
               "inline": launched_world() is not None, **({"around": [PLANTED, plant]} if plant else {})}
    if spawn:  # forked CPU ranks (gloo): no torchrun start-up; the suites' way
        return load_reports(run_on_ranks(spawned_rank, world_size=world, tmp_path=folder, args=(job_cfg,),
                                  timeout_s=float(stall_s or 120)))
    res = launch(JOB, world, folder / "job.json", job_cfg, stall_s=stall_s, stream=stream)
    return None if res is None else load_reports(res["ranks"])  # None: a rank other than 0 of a user-launched world


def verify(stack: str, cfg: TrainConfig, *, world: int, out: Path | str, options: dict | None = None, stall_s=None,
           stream=None, spawn: bool = False, plant: str | None = None, golden: str = "off",
           golden_root: Path | str | None = None, sharp="auto") -> Verified | None:
    """Run ``stack`` (``harness.stack.drive.load_factory``'s spec) under ``cfg`` (layouts, steps, corpus, dtype,
    device, scheduler, max_seqlen_per_rank) on ``world`` ranks and its one-rank reference; judge and write
    ``out/verify.json``. ``spawn``: run the ranks as forked CPU processes (``harness.jobs.launch.run_on_ranks``)
    instead of under torchrun. ``plant``: a fault of the catalogue (``harness.faults``) active on every rank of
    both runs - the harness's runtime only (the faults replace its functions); the verdict must be FAIL.
    ``golden``: ``auto`` (compare with the case's golden on this hardware when there is one), ``require`` (a
    missing golden is a ``GoldenError``), ``update`` (write it from this run, which must PASS), ``off``.
    ``sharp``: the sharp step 1's query / key scale (``harness.stack.checks.sharp_scale``: ``auto``, ``off``, or a
    number >= 1)."""
    out, golden_root = Path(out), None if golden_root is None else Path(golden_root)
    if golden not in ("auto", "require", "update", "off"):
        raise StackError(f"golden must be auto, require, update or off, got {golden!r}")
    if plant is not None and golden == "update":
        raise StackError(f"--plant {plant} with --update-golden would write a golden of a planted bug: drop one")
    cfg.validate(world)
    try:
        scale = checks.sharp_scale(sharp, cfg.dtype)
    except ValueError as e:
        raise StackError(str(e)) from None
    if plant is not None:
        from harness.faults.catalogue import get  # lazy: the fault modules import torch

        get(plant)  # an unknown name: one line before anything starts
        if BUILTIN.get(stack, stack) != BUILTIN["harness"]:
            raise StackError(f"--plant {plant} replaces functions of the harness's runtime; it applies to the stack "
                             f"'harness' only, not {stack!r}")
    cfg.layout_config(world)  # a batch the layouts cannot lay out fails here, before any rank starts
    options = options or {}
    work = out / "verify-work"
    here = launched_world()
    if here is None or here[0] == 0:  # under a user's launcher every rank runs this: rank 0 owns the folder
        shutil.rmtree(work, ignore_errors=True)
    got = _run(stack, options, cfg, world, work / "layouts", stall_s=stall_s, stream=stream, spawn=spawn, plant=plant,
               sharp=scale)
    if got is None:  # a rank other than 0 of a world the user's launcher started: rank 0 judges and writes
        return None
    ref_cfg = reference_config(cfg, checks.REF_LAYOUT)
    ref = _run(stack, options, ref_cfg, 1, work / "reference", stall_s=stall_s, stream=stream, spawn=spawn, plant=plant,
               sharp=scale)
    ref_steps = [[r] for r in ref[0]["layouts"][checks.REF_LAYOUT]["reports"]]
    ref_sharp = ref[0]["layouts"][checks.REF_LAYOUT].get("sharp")
    lines, notes = [], []
    if ref_sharp is not None:
        lines.append(checks.sharp_took_effect(ref_steps[0][0], ref_sharp, scale))
    if scale and ref_sharp is None:
        notes.append(f"no sharp step 1: stack {got[0]['stack']!r} offers no sharpen(scale), so a step-1 position or "
                     f"exchange bug under {cfg.dtype}'s step-1 bands can pass (harness.stack.protocol: sharpen)")
    for layout in cfg.layouts:
        per_rank = [g["layouts"][layout] for g in got]
        steps = [[pr["reports"][k] for pr in per_rank] for k in range(cfg.steps)]
        schedules = [Schedule.from_dict(s) for s in per_rank[0]["schedules"]]
        lines += checks.accounting(layout, steps, per_rank[0]["lengths"], schedules)
        if layout == "dcp" and world > 1:
            lines.append(checks.exercise(layout, schedules, per_rank[0]["lengths"], cfg.max_seqlen_per_rank,
                                         _exercise_hint(cfg, world)))
        lines += checks.against_reference(layout, steps, ref_steps, cfg.dtype, REF_NAME, cfg.model)
        sharp_reps = [pr.get("sharp") for pr in per_rank]
        if ref_sharp is not None and all(r is not None for r in sharp_reps):
            lines += checks.sharp_against_reference(layout, sharp_reps, ref_sharp, cfg.dtype, REF_NAME, scale)
    runs = {**{layout: vg.series(got[0]["layouts"][layout]["reports"]) for layout in cfg.layouts},
            "reference": vg.series(ref[0]["layouts"][checks.REF_LAYOUT]["reports"])}
    hw, cid = hardware(cfg), vg.case_id(stack, options, cfg, world)
    path = golden_mod.path_for(vg.GOLDEN_SUITE, cid, hw, **({"root": golden_root} if golden_root else {}))
    command = vg.update_command(stack, options, cfg, world)
    hint = f"{command} (on {hw})"
    compare = golden == "require" or (golden == "auto" and path.is_file())
    if compare:
        lines += vg.against(path, runs, cfg, hw, hint)
    verdict = checks.verdict_of(lines)
    used = str(path) if compare else None
    if golden == "update":
        if verdict != "PASS":
            raise StackError(f"refusing to write the golden {path}: this run's verdict is {verdict} (a golden must "
                             "come from a run whose every check passes)")
        vg.write(path, runs, cfg, stack=stack, stack_name=got[0]["stack"], options=options, world=world, hw=hw,
                 command=command)
        used = str(path)
    atomic_write_json(out / "verify.json", {"stack": got[0]["stack"], "spec": stack, "world": world,
                                             "verdict": verdict, "checks": lines, "config": cfg.to_dict(),
                                             "golden": used, "sharp_scale": scale, "notes": notes})
    shutil.rmtree(work, ignore_errors=True)
    return Verified(verdict, lines, got[0]["stack"], out, used, runs, notes)
