"""Metric sinks: a plain JSONL copy (always, written by the training ranks) and wandb runs.

wandb: one run per layout, grouped by the case id, ``mode`` offline unless the user set
``WANDB_MODE`` (e.g. ``online`` after ``wandb login``); runs land in ``<run dir>/wandb/``. Without the
``tracking`` extra installed, nothing is logged and the report says how to enable it.
"""

from __future__ import annotations

import os
from pathlib import Path  # noqa: F401  (type of run_dir)

KEYS = ("loss", "aux_loss", "grad_norm", "tokens_per_s", "padding_fraction", "step_time", "microbatches")


def log_runs(group: str, rows: dict[str, list[dict]], config: dict, run_dir: Path) -> dict:
    try:
        import wandb
    except ImportError:
        return {"wandb": "not installed: pip install -e '.[tracking]' to log wandb runs"}
    mode = os.environ.get("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    dirs, urls = [], {}
    for layout, rs in rows.items():
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "dcp-harness"), group=group, name=f"{group}--{layout}",
                         job_type=layout, config={**config, "layout": layout}, dir=str(run_dir), mode=mode,
                         reinit="create_new")
        for r in rs:
            run.log({k: r[k] for k in KEYS if k in r}, step=r["step"])
        dirs.append(run.dir)
        urls[layout] = getattr(run, "url", None) if mode == "online" else None
        run.finish()
    return {"wandb": mode, "runs": len(dirs), "dir": "wandb/ (in the run folder)", "urls": urls}
