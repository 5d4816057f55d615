"""``dcp-harness nightly``: the larger convergence configuration, a history across runs and a page.

Which cases run where (``harness.apps.nightly.cases``): every model of ``NIGHTLY_MODELS``, ``steps`` steps
(default 100), bshd / thd / dcp side by side, on GPUs when the machine has two or more, otherwise on
4 CPU ranks (fp32, against the committed goldens) plus the single-GPU numerics on a lone GPU; one line
says which before anything starts. Every case is checked before the first one starts (model, world,
root, history format, and that dynamic CP mixes CP 1 with the whole domain in at least 90% of the steps), so a bad
input writes nothing.

Each case's run is a ``converge-<time>`` folder under ``<root>/runs/`` (``harness.apps.converge``); one line
per case is appended to ``<root>/history.jsonl`` (``harness.apps.nightly.history``: locked, so two jobs may
share a root) and ``<root>/index.html`` is redrawn (``harness.report.nightly_report``). ``--json PATH``
writes the run's summary. Exit status: 0 when every case passed, 1 when one failed or was not exercised
(dynamic CP never formed a CP group > 1), 2 for a usage error (``harness.cli``). A case stopped by SIGTERM /
SIGHUP or Ctrl-C is appended as FAIL ("interrupted") and the page redrawn before the job ends as an
interrupted CLI does (143 / 130).
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

from harness.apps.nightly import history
from harness.apps.nightly.cases import (
    DISTRIBUTED,
    NIGHTLY_MODELS,
    STACK,
    STACK_OPTIONS,
    NightlyCase,
    Plan,
    check_mixing,
    choose,
    mixed_steps_needed,
    only,
)
from harness.golden import producer
from harness.io import atomic_write_json, writable
from harness.jobs.watchdog import JobFailure
from harness.paths import REPORTS
from harness.report.nightly_report import render

__all__ = ["NIGHTLY", "NIGHTLY_MODELS", "NightlyCase", "prepare", "run", "run_cases"]

NIGHTLY = REPORTS / "nightly"


def prepare(*, steps: int, models, device: str, world: int | None, root: Path, json_path: Path | None = None,
            gpus: int | None = None, select: tuple[str, ...] = ()) -> Plan:
    """Choose the cases (those whose id contains one of ``select``, when given) and check everything a run needs
    before it starts (typed errors, nothing written)."""
    # lazy: imports torch; the CLI imports this module without it
    from harness.apps import converge

    if gpus is None:
        import torch

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    plan = only(choose(models=models, steps=steps, device=device, world=world, gpus=gpus), tuple(select))
    history.check_root(root)
    if json_path is not None:
        writable(json_path)
    for case in plan.cases:  # the cheap checks first: a bad world or too many steps fails in seconds
        case.cfg.validate(case.world)
        check_mixing(case)
        if case.role != STACK:
            converge.preflight(case.cfg, case.world)
            converge.golden_of(case.cfg, case.world)  # a golden shorter than the run: refused before anything runs
    return plan


def run(*, steps: int = 100, models=NIGHTLY_MODELS, device: str = "auto", world: int | None = None,
        root: Path | str = NIGHTLY, stall_s: float | None = None, json_path: Path | str | None = None,
        select: tuple[str, ...] = ()) -> int:
    """The nightly job; returns the exit status (0 every case passed, 1 otherwise). ``select``: run only the cases
    whose id contains one of these parts (``--only``)."""
    root, json_path = Path(root), None if json_path is None else Path(json_path)
    plan = prepare(steps=steps, models=tuple(models), device=device, world=world, root=root, json_path=json_path,
                   select=tuple(select))
    print(plan.line, flush=True)
    return run_cases(plan.cases, root=root, stall_s=stall_s, json_path=json_path)


def _mixing_checks(result, case: NightlyCase) -> list[dict]:
    """The nightly promise, read off what ran: at least ``mixed_steps_needed`` of the dcp layout's steps mixed CP 1
    and the whole domain."""
    ex = result.config.get("dcp_exercise")
    if case.role != DISTRIBUTED or ex is None:
        return []
    need = mixed_steps_needed(ex["steps"])
    return [{"target": f"dcp: steps that mixed CP 1 and CP {ex['largest']} (of {ex['steps']}; at least {need})",
             "value": ex["steps_mixed"], "pass": ex["steps_mixed"] >= need, "exercise": True}]


def _stack(case: NightlyCase, root: Path, prod: dict, stall_s) -> dict:
    """The megatron-core case: ``dcp-harness verify megatron-core`` into a ``verify-<time>`` run folder."""
    from harness.apps import verify  # lazy: imports torch; the CLI imports this module without it
    from harness.stack import checks  # lazy: as above

    out = root / "runs" / f"verify-{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    try:
        res = verify.verify("megatron-core", case.cfg, world=case.world, out=out, options=dict(STACK_OPTIONS),
                            stall_s=stall_s, golden="auto")
    except JobFailure as e:
        print(f"nightly {case.case_id}: the job failed: {e}", flush=True)
        return history.failure(case, str(e), prod)
    for c in res.checks:
        print(f"  [{checks.mark(c)}] {c['target']}: {c['value']:.3g}", flush=True)
    return history.stack_entry(res, case, root=root, producer=prod)


def _one(case: NightlyCase, root: Path, prod: dict, stall_s, references: dict | None = None) -> dict:
    # lazy: imports torch; the CLI imports this module without it
    from harness.apps import converge

    if case.role == STACK:
        return _stack(case, root, prod, stall_s)
    try:
        res = converge.run(case.cfg, world=case.world, out_root=root / "runs", golden="auto", stall_s=stall_s,
                           progress=lambda s: print(s, flush=True), references=references)
    except JobFailure as e:
        print(f"nightly {case.case_id}: the job failed: {e}", flush=True)
        return history.failure(case, str(e), prod)
    extra = _mixing_checks(res, case)
    res.verdict = converge.verdict_of(res.checks + extra)
    return history.entry(res, role=case.role, root=root, producer=prod, extra_checks=extra)


def run_cases(cases: list[NightlyCase], *, root: Path | str, stall_s: float | None = None,
              json_path: Path | str | None = None) -> int:
    """Run checked cases, append each to the history, redraw the page, write the summary."""
    root, json_path = Path(root), None if json_path is None else Path(json_path)
    root.mkdir(parents=True, exist_ok=True)
    prod, started = producer("dcp-harness nightly"), dt.datetime.now().isoformat(timespec="seconds")
    entries, references = [], {}  # a model's cases on one stage and on two share their reference (one rank, no PP)
    for i, case in enumerate(cases, 1):
        print(f"[{i}/{len(cases)}] {case.case_id} ({case.role})", flush=True)
        try:
            e = _one(case, root, prod, stall_s, references)
        except KeyboardInterrupt as stop:  # Ctrl-C, or SIGTERM / SIGHUP (``Terminated``) while the case's job ran
            _interrupted(case, stop, root, prod)
            raise
        history.append(root, e)
        entries.append(e)
        m = "-" if e.get("margin") is None else f"{e['margin']:.3g}"
        print(f"nightly {e['case_id']}: {e['verdict']} (margin {m}; {e.get('report') or 'no report'})", flush=True)
    with history.locked(root):
        page = render(history.read(root), root)
    verdict = overall(entries)
    summary = {"verdict": verdict, "exit_code": 0 if verdict == "PASS" else 1, "started": started,
               "finished": dt.datetime.now().isoformat(timespec="seconds"), "root": str(root), "page": str(page),
               "producer": prod, "cases": entries}
    if json_path is not None:
        atomic_write_json(json_path, summary)
    print(f"page: {page}\nverdict: {verdict} ({sum(e['verdict'] == 'PASS' for e in entries)}/{len(entries)} cases "
          f"passed)")
    return summary["exit_code"]


def _interrupted(case: NightlyCase, stop: KeyboardInterrupt, root: Path, prod: dict) -> None:
    """A case stopped before it finished (a scheduler's time limit, Ctrl-C) is a failed line of the history, and the
    page is redrawn: the dashboard shows the case that did not finish instead of leaving it out."""
    how = str(stop) or "Ctrl-C"
    log = getattr(stop, "log", None)
    e = history.failure(case, f"interrupted ({how}) before the case finished" + (f"; output: {log}" if log else ""),
                        prod)
    history.append(root, e)
    with history.locked(root):
        render(history.read(root), root)
    print(f"nightly {case.case_id}: FAIL (interrupted: {how}; recorded in {root / history.NAME})", flush=True)


def overall(entries: list[dict]) -> str:
    """FAIL when a case failed, else NO REFERENCE when one had nothing outside its layouts to be judged against,
    else NOT EXERCISED when one was not exercised, else PASS (never PASS without a case)."""
    # lazy: imports torch; the CLI imports this module without it
    from harness.apps.converge import NOT_EXERCISED
    from harness.apps.reference import NO_REFERENCE  # lazy: torch, as above

    verdicts = {e["verdict"] for e in entries}
    for v in ("FAIL", NO_REFERENCE, NOT_EXERCISED):
        if v in verdicts:
            return v
    return "PASS" if entries else "FAIL"

