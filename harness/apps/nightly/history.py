"""The nightly history: one JSON line per case and run in ``<root>/history.jsonl``.

Appends take an exclusive lock (``<root>/.history.lock``, ``fcntl.flock``) and write the whole line
in one ``write`` to a file opened for appending, so two nightly jobs sharing a root interleave whole
lines; the page is rendered under the same lock. A line that does not parse (a job killed mid-write)
is skipped with a warning. Every line carries ``format``; a history holding a line of a newer format
is refused before anything runs (this version would misread it). Lines without ``format`` are the
first format (no precision, no margin, no links): they are read and drawn as far as they go.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import math
import os
import statistics
from pathlib import Path

from harness.finite import is_finite_number
from harness.io import strict_json, writable_folder

FORMAT = 2
NAME = "history.jsonl"


class HistoryError(ValueError):
    """A history this version cannot read or extend (names the file and the fix)."""


@contextlib.contextmanager
def locked(root: Path):
    """Hold the root's history lock (exclusive; other nightly jobs wait)."""
    import fcntl

    fd = os.open(root / ".history.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def append(root: Path, entry: dict) -> None:
    """Add one line (under the lock; the file keeps the umask's mode)."""
    data = (strict_json(entry) + "\n").encode()  # a diverged run's NaN loss as null (it raised here)
    with locked(root):
        fd = os.open(root / NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)


def read(root: Path, warn=print) -> list[dict]:
    """Every readable line, oldest first; unreadable lines are skipped with a warning."""
    path = root / NAME
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        try:
            doc = json.loads(line)
            if not isinstance(doc, dict) or "case_id" not in doc:
                raise ValueError("not a history entry")
        except ValueError:
            warn(f"nightly: skipping unreadable line {i} of {path}")
            continue
        out.append(doc)
    return out


def check_root(root: Path) -> None:
    """Refuse, before anything runs, a root that is a file or cannot be written, and a history from a
    newer version."""
    writable_folder(root, "nightly root", " with --root")
    newer = [d.get("format") for d in read(root, warn=lambda _: None)
             if isinstance(d.get("format"), int) and d["format"] > FORMAT]
    if newer:
        raise HistoryError(f"{root / NAME} has lines of history format {max(newer)}, written by a newer "
                           f"dcp-harness (this one writes format {FORMAT}); upgrade, or use another --root")


def margin(checks: list[dict]) -> float:
    """Tolerance / observed deviation of the tightest check that has a tolerance (inf: no deviation; 0 for a
    check whose value is not a finite number: NaN or inf is no margin at all)."""
    ratios = [0.0 if not is_finite_number(c["value"]) else c["limit"] / c["value"] if c["value"] > 0 else math.inf
              for c in checks if c.get("limit")]
    return min(ratios) if ratios else math.inf


def deltas(checks: list[dict], reference: str) -> dict[str, float]:
    """Per layout, the value of its ``<layout> vs <reference>: max |delta loss|`` check (the span its rule
    covers)."""
    out = {}
    for c in checks:
        name, _, rest = c["target"].partition(": ")
        layout, _, ref = name.partition(" vs ")
        if ref == reference and rest.startswith("max |delta loss|"):
            out[layout] = c["value"]
    return out


def entry(result, *, role: str, root: Path, producer: dict, extra_checks: list[dict]) -> dict:
    """The history line of one case's run (``result``: a ``harness.apps.converge.ConvergeResult``)."""
    # lazy: imports torch; the CLI imports this module without it
    from harness.apps import route_rule
    from harness.apps.converge import LATE_BAND, LATE_WINDOW, loss_tolerance, strict_span
    from harness.runtime.model import MODELS
    from harness.train.config import TrainConfig

    rows, cfg = result.rows, result.config
    kind = TrainConfig(model=cfg["model"], dtype=cfg["dtype"])
    strict, why = strict_span(kind)
    checks = result.checks + extra_checks
    if MODELS[kind.model].experts > 0 and kind.dtype in route_rule.TIE:  # the span the recorded routes set
        strict = route_rule.span_of(checks, strict)
    base = "bshd" if "bshd" in rows else next(iter(rows))
    run = Path(os.path.relpath(result.run_dir, root)).as_posix()
    tracking = _tracking(result.run_dir)
    m = margin(checks)
    return {"format": FORMAT, "date": dt.datetime.now().isoformat(timespec="seconds"), "case_id": result.case_id,
            "hardware": cfg["hardware"], "precision": result.case_id.rsplit("__", 1)[-1], "role": role,
            "world": cfg["world"], "verdict": result.verdict, "run": run, "report": f"{run}/index.html",
            "git_rev": producer["git_rev"], "version": producer["versions"]["dcp-harness"],
            "tolerance": loss_tolerance(kind)["max"], "margin": None if math.isinf(m) else m,
            "rule": {"strict_steps": strict, "why": why, "late_window": LATE_WINDOW, "late_band": LATE_BAND},
            "golden": bool(cfg.get("golden")),
            "last_loss": {k: v[-1]["loss"] for k, v in rows.items()},
            "max_delta": deltas(checks, base), "golden_delta": deltas(checks, "golden bshd"),
            "tokens_per_s": {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in rows.items()},
            "dcp_exercise": cfg.get("dcp_exercise"), "wandb": _wandb_links(tracking, run),
            "failed": [c["target"] for c in checks if not c["pass"]]}


def stack_entry(result, case, *, root: Path, producer: dict) -> dict:
    """The history line of a stack case (``result``: a ``harness.apps.verify.Verified`` with its ``curves``)."""
    # lazy: imports torch; the CLI imports this module without it
    from harness.apps.converge import hardware
    from harness.stack.checks import tolerances

    checks, run = result.checks, Path(os.path.relpath(result.out, root)).as_posix()
    m = margin(checks)
    hw = hardware(case.cfg)
    return {"format": FORMAT, "date": dt.datetime.now().isoformat(timespec="seconds"), "case_id": case.case_id,
            "hardware": hw, "precision": case.case_id.rsplit("__", 1)[-1], "role": case.role, "world": case.world,
            "verdict": result.verdict, "run": run, "report": f"{run}/verify.json", "git_rev": producer["git_rev"],
            "version": producer["versions"]["dcp-harness"], "tolerance": tolerances(case.cfg.dtype, case.cfg.model)["loss"]["max"],
            "margin": None if math.isinf(m) else m, "golden": bool(result.golden),
            "last_loss": {k: v["loss"][-1] for k, v in (result.curves or {}).items()},
            "max_delta": deltas(checks, "reference (1 rank, no CP)"), "golden_delta": deltas(checks, f"golden ({hw})"),
            "tokens_per_s": {}, "dcp_exercise": None, "wandb": [],
            "failed": [c["target"] for c in checks if not c["pass"]]}


def failure(case, error: str, producer: dict) -> dict:
    """The history line of a case whose job failed (no run folder; the error names the log)."""
    # lazy: imports torch; the CLI imports this module without it
    from harness.apps.converge import hardware, loss_tolerance

    return {"format": FORMAT, "date": dt.datetime.now().isoformat(timespec="seconds"), "case_id": case.case_id,
            "hardware": hardware(case.cfg), "precision": case.case_id.rsplit("__", 1)[-1], "role": case.role,
            "world": case.world, "verdict": "FAIL", "run": None, "report": None, "git_rev": producer["git_rev"],
            "version": producer["versions"]["dcp-harness"], "tolerance": loss_tolerance(case.cfg)["max"],
            "margin": None, "golden": False, "last_loss": {}, "max_delta": {}, "golden_delta": {}, "tokens_per_s": {},
            "dcp_exercise": None, "wandb": [], "failed": [f"the job failed: {error}"]}


def _tracking(run_dir: Path) -> dict | None:
    try:
        return json.loads((Path(run_dir) / "results.json").read_text()).get("tracking")
    except (OSError, ValueError):
        return None


def _wandb_links(tracking: dict | None, run: str) -> list[dict]:
    """Links to the run's wandb runs when wandb was on: the online run pages, else the offline folder."""
    if not tracking or tracking.get("wandb") not in ("online", "offline"):
        return []
    urls = tracking.get("urls") or {}
    if tracking["wandb"] == "online" and urls:
        return [{"label": f"wandb {layout}", "href": url} for layout, url in urls.items() if url]
    return [{"label": "wandb (offline)", "href": f"{run}/wandb/"}]
