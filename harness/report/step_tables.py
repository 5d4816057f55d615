"""The tables of ``dcp-harness bench step``: column definitions and row builders over its summary
(``results`` of ``bench_step.json``).

Here, not in the benchmark, so that both the benchmark's printed tables and the HTML report
(``step_report``) read the same definitions while the report imports nothing of the benchmark:
reports read results. A column is ``(key, header, format)``; a row is a dict by key.
"""

from __future__ import annotations

COLUMNS = [("arm", "arm", "s"), ("trimmed_mean_ms", "trimmed ms", ".1f"), ("median_ms", "median ms", ".1f"),
           ("mean_ms", "mean ms", ".1f"), ("speedup_vs_static", "speedup", ".3f"),
           ("trimmed_speedup_vs_static", "trimmed-mean speedup", ".3f"),
           ("predicted_speedup_vs_static", "predicted", ".3f"), ("predicted_ms", "model ms", ".1f"), ("tokens_per_s_per_gpu", "tok/s/GPU", ".0f"),
           ("tflops_per_gpu", "TFLOP/s/GPU", ".3g"), ("mfu", "MFU", ".3f"), ("padding_fraction", "padding", ".3f"),
           ("microbatches", "micro-batches", ".1f"), ("plan_ms_median", "plan ms", ".2f"),
           ("plan_wait_ms_median", "plan wait ms", ".2f")]
BREAKDOWN_COLUMNS = [("arm", "arm", "s"), ("wall", "wall ms", ".1f"), ("attention", "attention", ".1f"),
                     ("linear", "linear", ".1f"), ("other", "other", ".1f"), ("communication", "comm (exposed)", ".1f"),
                     ("idle", "idle", ".1f"), ("compute_imbalance_ms", "imbalance", ".1f"),
                     ("host_syncs", "host syncs", ".0f"), ("host_sync_ms", "sync ms", ".1f")]
PHASE_COLUMNS = [("arm", "arm", "s"), ("schedule", "schedule ms", ".1f"), ("microbatches", "micro-batches ms", ".1f"),
                 ("grad_reduce", "grad reduce ms", ".1f"), ("optimizer", "optimizer ms", ".1f"), ("total", "total ms", ".1f"),
                 ("arrival_spread", "arrival spread ms", ".1f"), ("microbatch_speedup_vs_static", "micro-batch speedup", ".3f")]


def phase_rows(summary: dict) -> list[dict]:
    """One row per arm with step phases (``PHASE_COLUMNS``) and the ranks' arrival spread at the gradient reduction
    (``summarise.arrival``; None for a result without each rank's marks)."""
    return [{"arm": k, **v["phases_ms"], "microbatch_speedup_vs_static": v["microbatch_speedup_vs_static"],
             "arrival_spread": (v.get("arrival") or {}).get("spread_ms")}
            for k, v in summary["arms"].items() if v.get("phases_ms")]


def arrival_line(arm: str, v: dict) -> str | None:
    """Which ranks reached the gradient reduction last, and how often (None without per-rank marks)."""
    a = v.get("arrival")
    if not a:
        return None
    counts = ", ".join(f"{r}: {c}" for r, c in enumerate(a["last_counts"]))
    if a.get("lateness_ms"):
        counts += "; mean ms after the step's mean end by rank: " + ", ".join(
            f"{r}: {x:+.1f}" for r, x in enumerate(a["lateness_ms"]))
    model = []
    if a.get("modelled_spread_ms") is not None:
        model.append(f"{a['modelled_spread_ms']:.1f} ms modelled")
    if a.get("correlation") is not None:
        model.append(f"correlation of each rank's measured and modelled lateness {a['correlation']:.2f}")
    return (f"  {arm}: the first rank to finish its micro-batches waited {a['spread_ms']:.1f} ms for the last "
            f"(trimmed mean{'; ' + ', '.join(model) if model else ''}); steps each rank finished last: {counts}")


def runs_rows(summary: dict) -> list[dict]:
    """One row per run: its calibrated per-micro-batch and per-CP-block costs, each arm's trimmed
    mean, the ratios."""
    out = []
    for k, run in enumerate(summary["runs"]):
        c = run.get("cost_model") or {}
        row = {"run": f"{k + 1}{' *' if k == summary['representative_run'] else ''}",
               "per_mb_ms": 1e3 * c["per_microbatch"] if run.get("calibration") else None,
               "cp_block_ms": 1e3 * c.get("cp_block", 0.0) if run.get("calibration") else None}
        row.update({label: a["trimmed_mean_ms"] for label, a in run["arms"].items()})
        row.update({name: r["per_run"][k] for name, r in summary["ratios"].items()})
        out.append(row)
    return out


def run_columns(summary: dict) -> list[tuple[str, str, str]]:
    """The columns of ``runs_rows``: the calibrated costs, one per arm of the summary, the ratios."""
    return ([("run", "run", "s"), ("per_mb_ms", "calibrated ms/micro-batch", ".1f"),
             ("cp_block_ms", "+ ms/CP block", ".1f")]
            + [(label, label, ".1f") for label in summary["arms"]]
            + [("speedup_vs_static", "speedup vs static", ".3f"),
               ("trimmed_speedup_vs_static", "trimmed-mean speedup", ".3f"), ("speedup_bound", "bound (model)", ".3f"),
               ("speedup_of_bound", "of the bound", ".3f"), ("ours_vs_upstream", "vs upstream", ".3f")])


def arm_rows(summary: dict) -> list[dict]:
    """One row per arm of the representative run (``COLUMNS``)."""
    return [{"arm": k, **v} for k, v in summary["arms"].items()]


def breakdown_rows(summary: dict) -> list[dict]:
    """One row per profiled arm (``BREAKDOWN_COLUMNS``); arms without a breakdown are left out."""
    return [{"arm": k, **v["breakdown"], "compute_imbalance_ms": v["compute_imbalance_ms"]}
            for k, v in summary["arms"].items() if v["breakdown"]]


BASELINE = "thd:dp-balanced"
"""The arm every other arm's savings are measured against (static CP; ``summarise.TARGETS['baseline']``)."""
COLLECTIVES = (("all-reduce", ("allreduce",)), ("all-gather", ("allgather",)), ("reduce-scatter", ("reducescatter",)),
               ("all-to-all", ("alltoall",)), ("send/recv", ("sendrecv", "send", "recv")))
"""Exposed communication by collective: a kernel's (NCCL) or operator's (gloo) name, lower-cased without '_', holds
one of the tags; anything else, and the time of kernels the breakdown kept no name for, is ``other collectives``."""
SAVED_PARTS = ("attention", "linear", "other") + tuple(n for n, _ in COLLECTIVES) + ("other collectives", "idle")
SAVED_COLUMNS = ([("arm", "arm", "s"), ("timed", "timed step", "+.1f"), ("profile", "profile", "s"),
                  ("wall", "profiled step", "+.1f")] + [(p, p, "+.1f") for p in SAVED_PARTS])


def saved_columns(rows: list[dict]) -> list[tuple[str, str, str]]:
    """``SAVED_COLUMNS`` for ``rows`` (``saved_rows``) without the collectives no row has a tenth of a ms of."""
    quiet = {n for n, _ in COLLECTIVES if all(abs(r[n]) < 0.05 for r in rows)}
    return [c for c in SAVED_COLUMNS if c[0] not in quiet]


def exposed_by_collective(b: dict) -> dict:
    """A ``breakdown``'s exposed communication (ms) split by collective (``COLLECTIVES``); the parts add up to its
    ``communication``."""
    out = dict.fromkeys([n for n, _ in COLLECTIVES] + ["other collectives"], 0.0)
    for name, (cat, ms, _count) in (b.get("kernels") or {}).items():
        if cat != "communication":
            continue
        key = str(name).lower().replace("_", "")
        out[next((n for n, tags in COLLECTIVES if any(t in key for t in tags)), "other collectives")] += ms
    rest = b["communication"] - sum(out.values())
    out["other collectives"] += 0.0 if rest < 0 else rest  # a rounding deficit is dropped; a NaN stays NaN
    return out


def _parts(b: dict) -> dict:
    return {"wall": b["wall"], "attention": b["attention"], "linear": b["linear"], "other": b["other"],
            **exposed_by_collective(b), "idle": b["idle"]}


def saved_rows(summary: dict) -> list[dict]:
    """Where each arm's speedup over static CP comes from: per part of the profiled step, the ms static CP spends
    more than the arm (negative: the arm spends more); the parts add up to the step's difference. From the
    device-only profiles when both arms have one (no host recording lengthening idle time and communication), else
    from the profiled steps; ``timed`` is the difference of the timed steps' trimmed means, for scale (a profiled step
    runs longer than a timed one). Empty without a profiled static arm."""
    arms = summary["arms"]
    base = arms.get(BASELINE)
    if not base or not base.get("breakdown"):
        return []
    rows = []
    for k, v in arms.items():
        if k == BASELINE or not v.get("breakdown"):
            continue
        src = "breakdown_device" if base.get("breakdown_device") and v.get("breakdown_device") else "breakdown"
        b, a = _parts(base[src]), _parts(v[src])
        rows.append({"arm": k, "timed": base["trimmed_mean_ms"] - v["trimmed_mean_ms"],
                     "profile": "device-only" if src == "breakdown_device" else "profiled",
                     **{p: b[p] - a[p] for p in b}})
    return rows
