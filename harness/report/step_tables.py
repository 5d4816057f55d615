"""The tables of ``dcp-harness bench step``: column definitions and row builders over its summary
(``results`` of ``bench_step.json``).

Here, not in the benchmark, so that both the benchmark's printed tables and the HTML report
(``step_report``) read the same definitions while the report imports nothing of the benchmark:
reports read results. A column is ``(key, header, format)``; a row is a dict by key.
"""

from __future__ import annotations

COLUMNS = [("arm", "arm", "s"), ("trimmed_mean_ms", "trimmed ms", ".1f"), ("median_ms", "median ms", ".1f"),
           ("mean_ms", "mean ms", ".1f"), ("speedup_vs_static", "speedup", ".3f"),
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
                 ("microbatch_speedup_vs_static", "micro-batch speedup", ".3f")]


def phase_rows(summary: dict) -> list[dict]:
    """One row per arm with step phases (``PHASE_COLUMNS``)."""
    return [{"arm": k, **v["phases_ms"], "microbatch_speedup_vs_static": v["microbatch_speedup_vs_static"]}
            for k, v in summary["arms"].items() if v.get("phases_ms")]


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
            + [("speedup_vs_static", "speedup vs static", ".3f"), ("speedup_bound", "bound (model)", ".3f"),
               ("speedup_of_bound", "of the bound", ".3f"), ("ours_vs_upstream", "vs upstream", ".3f")])


def arm_rows(summary: dict) -> list[dict]:
    """One row per arm of the representative run (``COLUMNS``)."""
    return [{"arm": k, **v} for k, v in summary["arms"].items()]


def breakdown_rows(summary: dict) -> list[dict]:
    """One row per profiled arm (``BREAKDOWN_COLUMNS``); arms without a breakdown are left out."""
    return [{"arm": k, **v["breakdown"], "compute_imbalance_ms": v["compute_imbalance_ms"]}
            for k, v in summary["arms"].items() if v["breakdown"]]
