"""Results to render the reports from without training: a convergence run's rows (tiny GPT, 4 ranks,
bshd / thd / dcp agreeing to ~1e-7 as the committed golden does), and the main job's result around it
(the recorded fault catalogue, a one-batch scheduler comparison, the edge cases, one timeline).

The reports read results only, so these give them the pages a user opens in seconds."""

from __future__ import annotations

import json
import math
from pathlib import Path

RECORDED_FAULTS = Path(__file__).resolve().parents[2] / "reports" / "recorded" / "faults.cpu2.json"
DELTAS = {"bshd": 0.0, "thd": 1.5e-7, "dcp": 1.7e-7}
"""Each layout's largest |loss - bshd loss| (the main job's golden: thd 1.5e-7, dcp 1.7e-7)."""


def loss_rows(steps: int = 50, deltas: dict[str, float] = DELTAS) -> dict[str, list[dict]]:
    """Metrics rows per layout: a decaying loss, each layout off bshd by up to its delta (0 at step 0)."""
    def row(layout, step):
        loss = 5.56 - 0.9 * (1 - math.exp(-step / 15)) + deltas[layout] * math.sin(step)
        return {"layout": layout, "step": step, "loss": loss, "grad_norm": 0.7, "tokens": 4337,
                "tokens_per_s": {"bshd": 2400.0, "thd": 11000.0, "dcp": 13000.0}[layout] + 10 * step,
                "padding_fraction": {"bshd": 0.8, "thd": 0.006, "dcp": 0.002}[layout], "microbatches": 8,
                "cp_groups": {"1": 26, "2": 6}}

    return {layout: [row(layout, s) for s in range(steps)] for layout in deltas}


def convergence_result(rows: dict[str, list[dict]] | None = None):
    """A passing ``ConvergeResult`` of the main job's case on ``rows`` (``loss_rows()`` by default)."""
    from harness.apps.converge import ConvergeResult, case_id, evaluate
    from harness.train.layouts import static_cp_for
    from harness.train.trainer import TrainConfig, longest_sequence

    rows = rows or loss_rows()
    cfg = TrainConfig(steps=len(rows["bshd"]))
    case = case_id(cfg, 4)
    config = {**cfg.to_dict(), "world": 4, "static_cp": static_cp_for(longest_sequence(cfg), 4, cfg.max_seqlen_per_rank),
              "longest": longest_sequence(cfg), "case_id": case, "hardware": "cpu", "golden": None}
    from harness.apps.converge import step0_schedules
    from harness.train.config import model_cost

    return ConvergeResult("PASS", Path("."), case, rows, evaluate(rows, cfg, 4, "cpu"), config,
                          schedules=step0_schedules(config), cost=model_cost(cfg))


def main_result() -> dict:
    """The main job's ``result`` (``harness.apps.main_job``) with the recorded fault catalogue."""
    from harness.apps import main_job
    from harness.bench import schedule as bench_schedule
    from harness.data.edge_cases import run_all
    from harness.golden import producer

    conv = convergence_result()
    faults = json.loads(RECORDED_FAULTS.read_text())
    bench = bench_schedule.run(quick=True, batches=1, dists=["wikipedia"], progress=lambda s: None)
    fault_check = {"target": "fault catalogue: every re-created bug caught by its check, no alarm on the clean runs",
                   "value": faults["caught"], "shown": f"faults caught: {faults['caught']}/{faults['total']}",
                   "pass": True}
    return {"verdict": "PASS", "checks": conv.checks + bench["checks"] + [fault_check], "bench": bench,
            "edge_cases": run_all(), "faults": faults, "timeline": main_job._timeline(), "convergence": conv,
            "producer": producer("dcp-harness run"), "finished": "2026-11-26T12:00:00"}
