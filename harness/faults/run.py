"""Run the catalogue: every scenario clean (no check may fire), then every fault (its check must).

``run_catalogue(names)`` returns a JSON-able dict: per fault its source, layer, seam, the check that
must catch it, every alarm raised (check, message, where, margin) in check order, the check that
caught it first, and seconds; per scenario the clean run's alarms; totals and the producer.
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

from harness.faults import scenarios as sc
from harness.faults.catalogue import Fault, select
from harness.faults.checks import CHECKS, Alarm
from harness.golden import producer
from harness.io import atomic_write_json, atomic_write_text
from harness.report.faults_report import page

ORDER = {name: i for i, name in enumerate(CHECKS)}


def _outcomes(scenario: str, names: list[str], work: Path) -> dict:
    """``{None: clean, name: fault}`` outcomes (``alarms``, ``seconds``, ``error``) of one scenario."""
    if scenario.startswith(("train", "replay")):
        return sc.run_batch(scenario, names, work)
    runner = {"plan": sc.run_plan, "stepwise": sc.run_stepwise, "verify-bf16": sc.run_verify}[scenario]
    out = {}
    for name in [None, *names]:
        t = time.perf_counter()
        try:
            out[name] = {"alarms": runner(name, work), "seconds": time.perf_counter() - t, "error": None}
        except Exception as e:  # noqa: BLE001 - a run that dies is reported, not caught
            out[name] = {"alarms": [], "seconds": time.perf_counter() - t,
                         "error": f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"}
    return out


def _clean_line(c: dict) -> str:
    if c["error"]:
        return f"ERROR: {c['error']}"
    return "no alarm" if not c["alarms"] else "ALARM: " + c["alarms"][0].message


def _judge(f: Fault, alarms: list[Alarm], seconds: float, error: str | None) -> dict:
    alarms = sorted(alarms, key=lambda a: ORDER.get(a.check, len(ORDER)))
    mine = next((a for a in alarms if a.check == f.check), None)
    caught = mine is not None and re.search(f.expect, mine.message) is not None
    first = alarms[0] if alarms else None
    return {"name": f.name, "title": f.title, "source": f.source, "url": f.url, "layer": f.layer, "seam": f.seam,
            "scenario": f.scenario, "check": f.check, "caught": caught, "caught_by": first.check if first else None,
            "where": first.where if first else None, "margin": mine.margin if mine else None,
            "nonfinite": mine is not None and mine.observed is None and mine.tolerance is not None,
            "message": first.message if first else (error or "no check fired"),
            "alarms": [a.to_dict() for a in alarms], "error": error, "seconds": round(seconds, 2)}


def run_catalogue(names=None, *, progress=print) -> dict:
    """Clean scenarios first, then the selected faults (all by default), in catalogue order."""
    faults = select(names)
    t0 = time.perf_counter()
    work = Path(sc.workdir())
    clean, results = {}, {}
    try:
        for name in dict.fromkeys(f.scenario for f in faults):
            mine = [f for f in faults if f.scenario == name]
            t = time.perf_counter()
            outcomes = _outcomes(name, [f.name for f in mine], work)
            wall = time.perf_counter() - t
            c = outcomes[None]
            clean[name] = {"alarms": [a.to_dict() for a in c["alarms"]], "error": c["error"],
                           "seconds": round(c["seconds"], 2), "wall_seconds": round(wall, 2)}
            progress(f"  clean {name:18s} {_clean_line(c)}  ({wall:.1f} s for the clean run and "
                     f"{len(mine)} fault(s))")
            for f in mine:
                o = outcomes[f.name]
                r = results[f.name] = _judge(f, o["alarms"], o["seconds"], o["error"])
                margin = "" if r["margin"] is None else f"  margin {r['margin']:.3g}x"
                progress(f"  {'caught' if r['caught'] else 'MISSED'} {f.name:34s} by {r['caught_by'] or '-':20s}"
                         f"{margin}  ({r['seconds']:.1f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    results = [results[f.name] for f in faults]
    seconds = time.perf_counter() - t0
    clean_ok = all(not c["alarms"] and not c["error"] for c in clean.values())
    return {"faults": results, "clean": clean, "clean_ok": clean_ok, "caught": sum(r["caught"] for r in results),
            "total": len(results), "seconds": round(seconds, 1), "checks": CHECKS,
            "producer": producer("dcp-harness faults")}


def verdict(result: dict) -> bool:
    """Every fault caught by its check and no alarm in any clean run."""
    return result["clean_ok"] and result["caught"] == result["total"]


def write(result: dict, json_path: Path, html_path: Path | None) -> None:
    atomic_write_json(json_path, result)
    if html_path is not None:
        atomic_write_text(html_path, page(result))
