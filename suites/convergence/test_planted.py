"""``converge --plant``: a catalogued bug active on every rank must turn the verdict to FAIL, and a loss that
turns non-finite after the first step is named (Python's ``max()`` would have skipped it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from harness.apps import converge
from harness.faults.catalogue import UnknownFaultError
from harness.train.layouts import LayoutError
from harness.train.trainer import TrainConfig

pytestmark = pytest.mark.usefixtures("shared_zygote")  # CLI jobs fork their ranks from one zygote


def test_a_loss_that_turns_nan_after_step_one_fails_every_comparison(tmp_path):
    cfg = TrainConfig(steps=2, layouts=("bshd", "dcp"), max_seqlen_per_rank=512)
    res = converge.run(cfg, world=2, out_root=str(tmp_path), progress=lambda s: None, plant="adam-eps-underflow")
    losses = {k: [r["loss"] for r in rs] for k, rs in res.rows.items()}
    assert all(v[0] == v[0] and v[1] != v[1] for v in losses.values()), losses  # finite at step 1, NaN at step 2
    failed = sorted(c["target"] for c in res.checks if not c["pass"])
    ref = "reference (1 rank: no CP, PP, TP or EP)"
    assert {"bshd vs golden bshd: step 2: bshd loss is nan", "dcp vs bshd: step 2: dcp loss is nan",
            "dcp vs golden bshd: step 2: dcp loss is nan", f"dcp vs {ref}: step 2: dcp loss is nan",
            f"dcp vs {ref}: step 2: dcp grad norm is nan"} <= set(failed), failed
    assert all("step 2" in t or "step-1" not in t for t in failed), failed  # step 1 was still exact
    assert res.verdict == "FAIL" and res.config["planted"] == "adam-eps-underflow"
    page = (res.run_dir / "index.html").read_text()  # the report draws the non-finite steps it names
    assert "nan" in page.lower() and "data:image/png" in page


def test_plant_refuses_unknown_faults_and_golden_updates(tmp_path):
    with pytest.raises(UnknownFaultError, match="unknown fault 'nope'"):
        converge.run(TrainConfig(steps=1), world=4, out_root=tmp_path, plant="nope")
    with pytest.raises(LayoutError, match="would write a golden of a planted bug"):
        converge.run(TrainConfig(steps=1), world=4, out_root=tmp_path, golden="update", plant="adam-eps-underflow")
    r = subprocess.run([sys.executable, "-m", "harness", "converge", "--plant", "nope", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unknown fault 'nope'" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.slow  # ~1 min on 2 cores; the rule's own cases are suites/convergence/test_route_rule.py
def test_a_routing_bug_in_an_moe_model_fails_the_route_checks_naming_it(tmp_path):
    """RoPE positions per rank change every CP layout's hidden states, so their routers route tokens far from any tie
    differently from bshd's and the reference's: each such comparison fails as a routing bug, not rounding."""
    cfg = TrainConfig(model="tiny-moe", steps=2)
    res = converge.run(cfg, world=4, out_root=str(tmp_path), progress=lambda s: None, report=False, plant="rope-positions-per-rank")
    routing = [c for c in res.checks if "route_difference" in c]
    assert res.verdict == "FAIL" and routing and not any(c["pass"] for c in routing), routing
    assert all("routes differ at step 1 where no top-k choice was near a tie" in c["target"] for c in routing)
    assert {c["target"].split(":")[0] for c in routing} >= {"thd vs bshd", "dcp vs bshd"}


def test_a_bf16_run_catches_a_rope_offset_bug_by_its_fp32_step_one(tmp_path):
    """bf16's step-1 bands (5e-2 / 2e-2) let RoPE positions numbered per rank pass (measured on 4 CPU ranks: step-1
    gradients 6e-3 to 1.2e-2, token losses 1.8e-4 to 2.5e-4, losses within 1.5e-3 over 30 steps); the fp32 probe step
    sees it at ~2e4 times its clean deviation."""
    cfg = TrainConfig(steps=1, dtype="bfloat16", layouts=("dcp",))
    clean = converge.run(cfg, world=4, out_root=str(tmp_path / "clean"), progress=lambda s: None, report=False, golden="off")
    probes = [c for c in clean.checks if "in fp32" in c["target"]]
    assert clean.verdict == "PASS" and len(probes) == 2 and all(c["value"] < 1e-6 for c in probes), probes
    bad = converge.run(cfg, world=4, out_root=str(tmp_path / "bad"), progress=lambda s: None, report=False, golden="off",
                       plant="rope-positions-per-rank")
    failed = [c for c in bad.checks if not c["pass"]]
    assert bad.verdict == "FAIL" and failed and all("in fp32" in c["target"] for c in failed), failed
    assert any(c["target"].startswith("dcp vs reference") for c in failed), failed


def test_a_dropped_sequence_is_named_by_the_token_accounting_not_a_key_error(tmp_path):
    """A plant that drops sequences in the reroute (the reference's too): the step-1 accounting names the sequences
    trained other than once in each layout and in the reference; the token-loss comparison reads a position the
    reference never trained as 0 (it had raised ``KeyError``)."""
    cfg = TrainConfig(steps=1, layouts=("dcp",))
    res = converge.run(cfg, world=4, out_root=str(tmp_path), progress=lambda s: None, report=False, golden="off",
                       plant="reroute-drops-sequence")
    failed = [c["target"] for c in res.checks if not c["pass"]]
    assert res.verdict == "FAIL", failed
    ref = "reference (1 rank: no CP, PP, TP or EP)"
    for who in ("dcp", ref):
        assert any(t.startswith(f"{who}: step 1 trains every loss token exactly once: ") and "not trained exactly once"
                   in t for t in failed), (who, failed)


def test_the_fp32_step_runs_for_bf16_runs_only_and_not_with_te_attention():
    assert TrainConfig(dtype="bfloat16").probed_in_fp32()
    assert not TrainConfig(dtype="float32").probed_in_fp32()  # fp32 runs are judged at fp32's band already
    assert not TrainConfig(dtype="bfloat16", fp32_probe=False).probed_in_fp32()
    assert not TrainConfig(dtype="bfloat16", cp_exchange="te:p2p").probed_in_fp32()  # TE's kernels: half precision


def test_an_fp32_step_without_the_references_fails_instead_of_going_unjudged():
    import numpy as np

    from harness.apps import reference

    def probes(ce):
        return {"sequences": [{"step": 0, "lengths": {0: 2}, "seq": [0, 0], "pos": [0, 1], "ce": ce}],
                "grads": {"w": np.ones(2)}, "clipped": {"w": np.ones(2)}, "grad_norms": [1.0], "digests": ["x"]}
    ranks = [{"probes": {"dcp": probes([1.0, 2.0]), "dcp@fp32": probes([1.0, 2.0])}}]
    rows, ref_rows = {"dcp": [{"loss": 1.0, "grad_norm": 1.0}]}, [{"loss": 1.0, "grad_norm": 1.0}]
    cfg = TrainConfig(dtype="bfloat16")
    both = [{"probes": {"thd": probes([1.0, 2.0]), "thd@fp32": probes([1.0, 2.5])}}]
    lines = reference.checks(rows, ranks, ref_rows, both, cfg, compare=lambda *a: [])
    assert [c["pass"] for c in lines if "in fp32" in c["target"]] == [True, False]  # token losses 2 vs 2.5: judged
    lines = reference.checks(rows, ranks, ref_rows, [{"probes": {"thd": probes([1.0, 2.0])}}], cfg, compare=lambda *a: [])
    missing = [c for c in lines if "recorded no fp32 step 1" in c["target"]]
    assert len(missing) == 1 and not missing[0]["pass"], lines


def test_each_runs_bf16_step_one_is_held_to_its_own_fp32_step_one():
    """An fp32 step 1 of another model or batch, shared by the layout and the reference: their fp32 lines agree, and
    the lines of each run's bf16 step 1 against its own fp32 step 1 (bf16's bands) fail, the reference's and the
    layout's."""
    import numpy as np

    from harness.apps import reference

    def probes(ce, g):
        return {"sequences": [{"step": 0, "lengths": {0: 2}, "seq": [0, 0], "pos": [0, 1], "ce": ce}],
                "grads": {"w": np.asarray(g)}, "clipped": {"w": np.asarray(g)}, "grad_norms": [1.0], "digests": ["x"]}
    bf16, same, other = probes([1.0, 2.0], [1.0, 1.0]), probes([1.0, 2.001], [1.0, 1.001]), probes([1.5, 2.5], [2.0, 0.5])
    rows, ref_rows, cfg = {"dcp": [{"loss": 1.0, "grad_norm": 1.0}]}, [{"loss": 1.0, "grad_norm": 1.0}], TrainConfig(dtype="bfloat16")
    for fp32, ok in ((same, True), (other, False)):
        ranks, ref = [{"probes": {"dcp": bf16, "dcp@fp32": fp32}}], [{"probes": {"thd": bf16, "thd@fp32": fp32}}]
        lines = reference.checks(rows, ranks, ref_rows, ref, cfg, compare=lambda *a: [])
        own = [c for c in lines if "against its own fp32 step 1" in c["target"]]
        assert len(own) == 4 and all(c["pass"] is ok for c in own), own  # gradients and token losses, both runs
        assert all(c["pass"] for c in lines if "in fp32" in c["target"])  # the layout agrees with the reference
