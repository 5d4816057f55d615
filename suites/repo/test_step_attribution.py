"""Where ``bench step``'s speedup comes from: a profiled step's exposed communication split by collective, and each
part's saving against static CP - checked on a recorded 4 x H200 profile (read independently of the code under test)
and on hand-made breakdowns."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest

from harness.report.step_tables import BASELINE, SAVED_PARTS, exposed_by_collective, saved_columns, saved_rows

RECORDED = Path(__file__).resolve().parents[2] / "reports" / "recorded"
MEGATRON_BATCH = RECORDED / "bench_step.h200x4.2026-11-28-megatron.json"  # e81a505: device-only profiles, kernels kept


def test_nccl_and_gloo_collectives_are_told_apart_and_the_unnamed_rest_kept():
    b = {"communication": 10.0, "kernels": {
        "ncclDevKernel_AllReduce_Sum_f32_RING_LL": ["communication", 3.0, 14],
        "ncclDevKernel_AllGather_RING_LL": ["communication", 2.0, 12],
        "ncclDevKernel_ReduceScatter_Sum_f32_RING_LL": ["communication", 1.0, 12],
        "c10d::alltoall_base_": ["communication", 0.5, 1],  # gloo on the CPU: operator names
        "ncclDevKernel_SendRecv": ["communication", 0.25, 1],
        "ncclDevKernel_Broadcast_RING_LL": ["communication", 0.25, 1],
        "triton_allreduce_shaped_elementwise": ["other", 9.0, 1]}}  # compute is never communication
    out = exposed_by_collective(b)
    assert out == {"all-reduce": 3.0, "all-gather": 2.0, "reduce-scatter": 1.0, "all-to-all": 0.5, "send/recv": 0.25,
                   "other collectives": 0.25 + 3.0}  # the broadcast and the 3 ms of kernels the breakdown kept no name for
    assert sum(out.values()) == pytest.approx(b["communication"])
    assert exposed_by_collective({"communication": 4.0})["other collectives"] == 4.0  # a record without kernel names
    assert math.isnan(exposed_by_collective({"communication": math.nan})["other collectives"])  # never hidden as 0


def test_a_recorded_profile_says_what_dynamic_cp_saved_and_what_it_paid():
    res = json.loads(MEGATRON_BATCH.read_text())["results"]
    (row,) = saved_rows(res)
    base, arm = (res["arms"][k]["breakdown_device"] for k in (BASELINE, "dcp:balanced"))
    assert row["arm"] == "dcp:balanced" and row["profile"] == "device-only"
    assert row["wall"] == pytest.approx(base["wall"] - arm["wall"])
    assert sum(row[p] for p in SAVED_PARTS) == pytest.approx(row["wall"], abs=1e-6)  # the parts add up
    assert row["timed"] == pytest.approx(res["arms"][BASELINE]["trimmed_mean_ms"] - res["arms"]["dcp:balanced"]["trimmed_mean_ms"])
    k = "ncclDevKernel_AllGather_RING_LL"
    assert row["all-gather"] == pytest.approx(base["kernels"][k][1] - arm["kernels"][k][1])
    # Megatron's batch on 4 x H200: dynamic CP drops ~12 ms of K/V all-gathers, its all-reduce waits ~5 ms longer
    assert row["all-gather"] > 10 and row["all-reduce"] < -5 and abs(row["linear"]) < 2
    shown = [k for k, _, _ in saved_columns([row])]  # no all-to-all in this job: its column is left out
    assert "all-to-all" not in shown and {"all-reduce", "all-gather", "send/recv", "idle", "attention"} <= set(shown)


def test_without_both_device_only_profiles_the_profiled_steps_are_compared_and_without_a_baseline_nothing():
    res = json.loads(MEGATRON_BATCH.read_text())["results"]
    one = copy.deepcopy(res)
    one["arms"]["dcp:balanced"]["breakdown_device"] = None
    (row,) = saved_rows(one)
    b, a = (one["arms"][k]["breakdown"] for k in (BASELINE, "dcp:balanced"))
    assert row["profile"] == "profiled" and row["wall"] == pytest.approx(b["wall"] - a["wall"])
    assert row["idle"] == pytest.approx(b["idle"] - a["idle"])
    none = copy.deepcopy(res)
    none["arms"][BASELINE]["breakdown"] = None
    assert saved_rows(none) == []
    del none["arms"][BASELINE]
    assert saved_rows(none) == []


def test_the_step_report_shows_the_attribution():
    from harness.bench.step.config import StepBenchConfig
    from harness.report.step_report import render

    doc = json.loads(MEGATRON_BATCH.read_text())
    html = render(doc["results"], StepBenchConfig.from_dict(doc["config"]), doc["checks"], doc["results"]["world"])
    section = html[html.index("Where each arm's speedup comes from"):]
    assert "all-gather" in section and "+12.0" in section and "-5.3" in section and "device-only" in section
    assert "all-to-all" not in section[:section.index("</table>")]


def test_the_baseline_is_the_benchmark_s():
    from harness.bench.step.summarise import TARGETS

    assert BASELINE == TARGETS["baseline"]  # the report names it without importing the benchmark
