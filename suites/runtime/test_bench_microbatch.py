"""``dcp-harness bench microbatch``: one micro-batch's host and device time per compile mode and
attention backend (the CPU variant here: tiny-gpt, fp32, sdpa; the GPU figures are recorded in
``reports/recorded/bench_microbatch.h200.json``)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.bench import microbatch as mb


def test_every_variant_of_a_shape_runs_the_same_tokens_and_loss(tmp_path):
    """Eager, compiled (aot_eager) segments and the compiled whole chain on the same tokens: the
    same loss (fp32), every repetition timed, rows for each (shape, variant), the order of variants
    rotating."""
    cfg = mb.MicrobatchConfig(shapes=("1x40", "3x12"), variants=("off/sdpa", "aot_eager/sdpa", "aot_eager-chain/sdpa"),
                              reps=3, warmup=0)
    res = mb.measure(cfg)
    rows = res["rows"]
    assert [(r["shape"], r["variant"]) for r in rows] == [(s, v) for s in cfg.shapes for v in cfg.variants]
    for r in rows:
        assert r["tokens"] == {"1x40": 40, "3x12": 36}[r["shape"]] and r["sequences"] == {"1x40": 1, "3x12": 3}[r["shape"]]
        assert len(r["enqueue_ms_all"]) == len(r["total_ms_all"]) == 3 and min(r["enqueue_ms_all"]) > 0
        assert r["device_ms"] is None and r["host_bound"] is None  # no CUDA profile on the CPU
        assert r["loss_spread"] < 1e-5
    by = {(r["shape"], r["variant"]): r["loss"] for r in rows}
    assert by[("1x40", "off/sdpa")] == pytest.approx(by[("1x40", "aot_eager/sdpa")], rel=1e-5)
    assert by[("1x40", "off/sdpa")] == pytest.approx(by[("1x40", "aot_eager-chain/sdpa")], rel=1e-5)
    assert by[("1x40", "off/sdpa")] != pytest.approx(by[("3x12", "off/sdpa")], rel=1e-3)  # other tokens


@pytest.mark.parametrize("over,msg", [
    ({"shapes": ("4y512",)}, "shape '4y512' is not KxL"),
    ({"shapes": ("0x512",)}, "shape '0x512' is not KxL"),
    ({"variants": ("fast/sdpa",)}, "variant 'fast/sdpa' is not <compile>/<backend>"),
    ({"variants": ("off/flash",)}, "variant 'off/flash': attention backend 'flash' is not available on cpu"),
    ({"variants": ("off/sdpa", "off/sdpa")}, "variants repeat"),
    ({"reps": 0}, "reps must be an int >= 1"),
    ({"model": "gpt-x"}, "unknown model 'gpt-x'"),
])
def test_bad_options_are_refused_with_the_fix(over, msg):
    with pytest.raises(mb.MicrobatchConfigError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        mb.MicrobatchConfig(**over).validate()


def test_cli_cpu_run_writes_json_and_bad_input_exits_2(tmp_path):
    out = tmp_path / "mb.json"
    r = subprocess.run([sys.executable, "-m", "harness", "bench", "microbatch", "--cpu", "--shapes", "2x16",
                        "--reps", "2", "--warmup", "0", "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "enqueue ms" in r.stdout and "off/sdpa" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "microbatch" and doc["config"]["shapes"] == ["2x16"] and len(doc["results"]) == 1
    r = subprocess.run([sys.executable, "-m", "harness", "bench", "microbatch", "--cpu", "--shapes", "2by16"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "shape '2by16' is not KxL" in r.stderr and "Traceback" not in r.stderr


def test_variants_that_disagree_on_the_loss_fail_the_command(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(mb, "LOSS_SPREAD_MAX", -1.0)  # any spread, even 0, now counts as a disagreement
    code = mb.main(cpu=True, out=tmp_path / "mb.json", overrides={"shapes": ("1x8",), "reps": 1, "warmup": 0})
    assert code == 1 and "[FAIL] shape 1x8" in capsys.readouterr().out


def test_opaque_overhead_times_every_variant_against_the_plain_attention(capsys):
    """``opaque_overhead`` (no timing asserted): one row per variant, the same gradients required of
    every variant (a variant that computes others is refused), and the table printed."""
    from harness.runtime import opaque

    res = mb.opaque_overhead({"a": opaque, "b": opaque}, reps=2, inner=1, layers=2)
    assert [r["variant"] for r in res["rows"]] == ["a", "b"]
    assert all(r["eager_us"] > 0 and r["chain_us"] > 0 for r in res["rows"]) and res["attention_us"] > 0
    assert "overhead us/layer" in capsys.readouterr().out

    class Doubled:  # another attention: other gradients
        attending = staticmethod(opaque.attending)

        @staticmethod
        def opaque_attention(q, k, v):
            return 2 * opaque.opaque_attention(q, k, v)

    with pytest.raises(ValueError, match="other gradients"):
        mb.opaque_overhead({"a": opaque, "doubled": Doubled}, reps=1, inner=1, layers=1)


def test_bench_opaque_cli_times_an_older_operator_against_this_one(tmp_path, capsys):
    """``dcp-harness bench opaque --against FILE``: the file (here this checkout's own opaque.py, as
    a fresh clone may lack older revisions) is loaded under a renamed operator namespace next to the
    checkout's, both rows come out and the JSON is written; a file that is not an ``opaque.py`` is
    refused by name, writing nothing."""
    from harness.cli import main
    from harness.runtime import opaque

    old = Path(opaque.__file__)
    out = tmp_path / "bench_opaque.json"
    assert main(["bench", "opaque", "--against", str(old), "--reps", "2", "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "opaque" and [r["variant"] for r in doc["results"]["rows"]] == ["against", "current"]
    assert doc["config"]["against"] == str(old)
    row = doc["results"]["rows"][1]
    lo, hi = row["chain_overhead_iqr_us_per_layer"]
    assert lo <= row["chain_overhead_us_per_layer"] <= hi
    renamed = mb.renamed_opaque_copy(old, tmp_path).read_text()
    assert re.search(r"dcp_harness_ab_[0-9a-f]{10}::attention", renamed) and "dcp_harness::" not in renamed
    # a second A/B in the same process reuses the loaded copy (its operators cannot register twice)
    assert main(["bench", "opaque", "--against", str(old), "--reps", "2", "--out", str(out)]) == 0
    bad = tmp_path / "not_opaque.py"
    bad.write_text("x = 1\n")
    assert main(["bench", "opaque", "--against", str(bad), "--reps", "1", "--out", str(tmp_path / "b.json")]) == 2
    assert "is not an opaque.py" in capsys.readouterr().err
    assert not (tmp_path / "b.json").exists()
