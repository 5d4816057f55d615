"""Every fault of the catalogue is caught, by its cheapest detecting check, with the expected message;
the clean runs raise no alarm; every seam is live and a pass-through replacement changes nothing.

A scenario's clean run and all its faults share one 4-rank gloo world, run once per test session
(``suites.computed_once``: the xdist workers share it). The whole catalogue through the CLI (with its timing) is the ``slow`` test."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from harness.faults import FAULTS, SEAMS
from harness.faults import scenarios as sc
from harness.faults.run import ORDER
from harness.jobs.launch import run_on_ranks
from suites.computed_once import computed_once

pytestmark = [pytest.mark.dist_cpu, pytest.mark.usefixtures("shared_zygote")]



def _outcomes(scenario, tmp_path_factory) -> dict:
    """Clean and fault outcomes of a scenario, computed once per test session (one world for all, shared by the
    xdist workers)."""
    from harness.faults.run import _outcomes as outcomes

    names = [f.name for f in FAULTS if f.scenario == scenario]
    return computed_once(tmp_path_factory, f"faults-{scenario}",
                         lambda: outcomes(scenario, names, tmp_path_factory.mktemp(f"faults-{scenario}")))


@pytest.mark.parametrize("scenario", ["train", "train-small-batch", "train-pp-mtp", "train-dist-opt", "train-bucketed",
                                      "train-bf16", "verify-bf16", "train-tp", "train-tp-moe", "train-tp-dist-opt",
                                      "train-sp", "train-ep", "train-ep-tp", "replay", "replay-sp", "plan",
                                      "stepwise"])
def test_clean_runs_raise_no_alarm(scenario, tmp_path_factory):
    clean = _outcomes(scenario, tmp_path_factory)[None]
    assert clean["alarms"] == [] and clean["error"] is None, clean


@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: f.name)
def test_fault_is_caught_by_its_cheapest_check(fault, tmp_path_factory):
    o = _outcomes(fault.scenario, tmp_path_factory)[fault.name]
    assert o["error"] is None, o["error"]
    alarms = sorted(o["alarms"], key=lambda a: ORDER[a.check])
    assert alarms, f"{fault.name}: no check fired"
    first = alarms[0]
    assert first.check == fault.check, [(a.check, a.message) for a in alarms]
    assert re.search(fault.expect, first.message), first.message
    if first.margin is not None:
        assert first.margin >= 10, f"{fault.name}: margin {first.margin:.3g}x of {first.check} < 10x"


def test_every_seam_is_live_and_a_passthrough_changes_nothing(tmp_path):
    """Each seam wrapped by a call counter: the train and replay runs call every one of theirs, and the
    results equal the clean runs'. (The plan and step-wise seams are called in-process by their
    scenarios; their clean runs are the tests above.)"""
    train_seams = [s for s in SEAMS if s.startswith(("harness.train.step", "harness.parallel.reroute",
                                                     "harness.train.layouts", "harness.plan.layout"))
                   and not s.endswith("step:expert_square_norm")]  # expert parallelism's: the ep-tp case below
    replay_seams = [s for s in SEAMS if s.startswith("harness.train.replay")]
    cfg = {**sc.TRAIN_CONFIGS["train"], "layouts": ["bshd", "dcp"]}
    got = run_on_ranks(sc.passthrough_world, world_size=sc.WORLD, tmp_path=tmp_path,
                       args=({"kind": "train", "cfg": cfg, "seams": train_seams, "clean": True},), timeout_s=120)
    assert all(got[0]["counts"].get(s, 0) > 0 for s in train_seams), got[0]["counts"]
    for r in got:  # the same run without the pass-throughs went first in the same world
        assert r["out"]["probes"]["dcp"]["digests"] == r["clean"]["probes"]["dcp"]["digests"]
    counts = {}
    for name, cfg in sc.REPLAY_CONFIGS.items():  # the sequence-parallel split runs in replay-sp only
        rep = run_on_ranks(sc.passthrough_world, world_size=sc.WORLD, tmp_path=tmp_path / name,
                           args=({"kind": "replay", "cfg": cfg, "seams": replay_seams},), timeout_s=120)
        assert all(r["out"]["replay_mismatches"] == 0 for r in rep)
        counts.update({s: counts.get(s, 0) + n for s, n in rep[0]["counts"].items()})
    assert all(counts.get(s, 0) > 0 for s in replay_seams), counts


MODEL_SEAM_MODULES = ("harness.train.passes", "harness.runtime", "harness.train.pipeline", "harness.train.step",
                      "harness.parallel.ssm_cp", "harness.parallel.dist_opt", "harness.train.trainer",
                      "harness.train.shared_embedding", "harness.parallel.tensor_parallel", "harness.parallel.groups",
                      "harness.parallel.sequence_parallel")


def _tp_wanted(seam: str, cfg: dict) -> bool:
    """Whether a run of ``cfg`` calls ``seam`` as far as tensor and sequence parallelism decide: the sequence-parallel
    seams with sequence parallelism only (the MoE router's with an MoE model), the distributed optimiser's TP norm with
    both, the split experts' with an MoE model under TP, TP's all-reduce collectives with TP without it (sequence parallelism
    gathers and reduce-scatters instead), the SSM norm's channel sum with a hybrid model under TP, the TP norm and the
    TP groups with TP."""
    tp, sp = cfg.get("tp", 1) > 1, bool(cfg.get("sequence_parallel"))
    if "chunked_loss:" in seam:  # the chunked loss head's (runs with a loss chunk, TP or not)
        return True
    if seam.endswith("dist_opt:tp_square_norm"):  # the distributed optimiser's norm under TP
        return tp and cfg.get("optimizer") == "distributed"
    moe = cfg["model"] == "tiny-moe"
    if seam.endswith("layers:tp_expert_outputs"):  # an MoE layer's experts split over TP
        return tp and moe
    if seam.endswith(("layers:sp_gates", "sequence_parallel:sum_loss")):  # an MoE layer's router under SP
        return sp and moe
    if "sequence_parallel:" in seam:
        return sp
    if seam.endswith(("tensor_parallel:enter", "tensor_parallel:leave")):
        return tp and not sp
    if seam.endswith("tensor_parallel:channel_sum"):  # an SSM mixer's gated norm over its split channels
        return tp and cfg["model"] == "tiny-hybrid"
    return ("tensor_parallel" in seam or "tp_group_ranks" in seam) == tp


@pytest.mark.parametrize("cfg", [
    {**sc.TRAIN_CONFIGS["train-pp"], "model": "tiny-gpt-mtp", "layouts": ["dcp"]},
    {**sc.TRAIN_CONFIGS["train-hybrid"], "layouts": ["dcp"]},
    # the fused weight mode with the loss head over chunks: its weight gradient added into the fp32 .grad chunk by chunk
    {**sc.TRAIN_CONFIGS["train-fused"], "loss_chunk": 40, "layouts": ["dcp"]},
    {**sc.TRAIN_CONFIGS["train-dist-opt"], "layouts": ["dcp"]},
    {**sc.TRAIN_CONFIGS["train-bf16"], "layouts": ["dcp"]},
    {**sc.TRAIN_CONFIGS["train-tp"], "layouts": ["dcp"]},
    {**sc.TRAIN_CONFIGS["train-tp-dist-opt"], "layouts": ["dcp"]},
    {**sc.TRAIN_CONFIGS["train-tp-moe"], "layouts": ["dcp"]},
    # the MoE model under SP with expert parallelism and the balance loss: its dense block and attention call every SP
    # seam, its MoE blocks the router's, the experts' (dispatched) and the balance loss's
    {**sc.TRAIN_CONFIGS["train-ep-tp"], "moe_aux_loss": 1e-2, "layouts": ["dcp"]},
], ids=["mtp-pp2", "hybrid", "fused", "dist-opt", "bf16", "tp", "tp-dist-opt", "tp-moe", "ep-tp-sp-moe"])
def test_model_and_pipeline_seams_are_live_and_a_passthrough_changes_nothing(cfg, tmp_path):
    """The seams of the forward passes, the model's CP calls, the SSM scan, the pipeline stages, the weight paths, the
    chunked loss head and tensor parallelism: wrapped by call counters in a pipelined MTP run, a hybrid (SSM) run, a
    fused-weight run with a chunked loss head, a
    distributed-optimiser run, a bf16 run's fp32 step 1, a TP run (dense, MoE, with the distributed optimiser) and a
    sequence-parallel one, each one is called, and the run's parameters equal those of the same run without
    pass-throughs, bit for bit."""
    seams = [s for s in SEAMS if s.startswith(MODEL_SEAM_MODULES)]
    got = run_on_ranks(sc.passthrough_world, world_size=sc.WORLD, tmp_path=tmp_path,
                       args=({"kind": "train", "cfg": cfg, "seams": seams, "clean": True},), timeout_s=180)
    counts = {s: sum(r["counts"].get(s, 0) for r in got) for s in seams}
    ssm = ("scan_layout", "ssm_sequences", "pack_order")  # the SSM mixer's: built at its first call, SSM models only
    wanted = [s for s in seams if any(k in s for k in ssm) == (cfg["model"] == "tiny-hybrid")
              and ("mtp_columns" in s) <= (cfg["model"] == "tiny-gpt-mtp")
              and ("stage_view" in s) <= (cfg.get("pp", 1) > 1)
              # the embedding's replica: multi-token prediction under a pipeline only
              and ("shared_embedding" in s) == (cfg["model"] == "tiny-gpt-mtp" and cfg.get("pp", 1) > 1)
              # the fused weight mode accumulates in its GEMM, the others in the step copy's backward
              and ("fused_linear" in s) == (cfg.get("weights") == "fused")
              and ("weight_cache:accumulate" in s) == (cfg.get("weights") != "fused")
              and ("dist_opt" in s) == (cfg.get("optimizer") == "distributed")
              and ("probe_config" in s) == (cfg.get("dtype") == "bfloat16")
              # the routers' balance loss: MoE runs that have one; the experts' norm: expert parallelism's
              and ("passes:balance_" in s) == bool(cfg.get("moe_aux_loss"))
              and ("step:expert_square_norm" in s) == bool(cfg.get("expert_parallel"))
              and ("chunked_loss" in s) == bool(cfg.get("loss_chunk"))
              and _tp_wanted(s, cfg)]
    assert all(counts[s] > 0 for s in wanted), {s: counts[s] for s in wanted}
    for r in got:
        assert r["out"]["probes"]["dcp"]["digests"] == r["clean"]["probes"]["dcp"]["digests"]


@pytest.mark.slow
def test_the_whole_catalogue_through_the_cli(tmp_path):
    out = tmp_path / "faults.json"
    proc = subprocess.run([sys.executable, "-m", "harness", "faults", "--json", str(out), "--html",
                           str(tmp_path / "faults.html")], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["caught"] == result["total"] == len(FAULTS) and result["clean_ok"]
    for f in result["faults"]:
        assert f["caught_by"] == f["check"], f
        assert f["margin"] is None or f["margin"] >= 10, f
    assert result["seconds"] <= 300, result["seconds"]
    assert f"faults caught: {len(FAULTS)}/{len(FAULTS)}" in proc.stdout


def test_a_run_that_breaks_its_world_is_reported_and_the_rest_still_judged(tmp_path):
    """A run that kills its world (here: a name no rank can resolve) makes the batch fall back to one
    world per run: the clean run is still judged, the broken one carries its error."""
    out = sc.run_batch("replay", ["no-such-fault"], tmp_path)
    assert out[None]["alarms"] == [] and out[None]["error"] is None
    assert out["no-such-fault"]["alarms"] == [] and "unknown fault 'no-such-fault'" in out["no-such-fault"]["error"]


def test_the_shared_replica_check_names_a_differing_copy_and_a_missing_step():
    """``shared-replica`` on made-up probes: equal digests pass; the last stage's differing copy is named with its step;
    a rank that recorded fewer steps is an alarm, not a shorter comparison; ranks that hold no copy are left out."""
    from harness.faults.checks import shared_replica

    def rank(stage, digests):
        return {"probes": {"dcp": {"stage": stage, "embedding": digests}}}

    same = [rank(0, ["a", "b"]), rank(0, ["a", "b"]), rank(1, ["a", "b"]), rank(1, ["a", "b"])]
    assert shared_replica(None, same, "dcp") is None
    stale = [rank(0, ["a", "b"]), rank(0, ["a", "b"]), rank(1, ["a", "a"]), rank(1, ["a", "a"])]
    alarm = shared_replica(None, stale, "dcp")
    assert alarm.check == "shared-replica" and alarm.where == {"step": 2, "ranks": [2, 3]}
    short = [rank(0, ["a", "b"]), rank(0, ["a", "b"]), rank(1, ["a"]), rank(1, ["a", "b"])]
    assert "different numbers of steps" in shared_replica(None, short, "dcp").message
    assert shared_replica(None, [rank(0, []), rank(0, [])], "dcp") is None  # no pipeline MTP: nothing to judge
