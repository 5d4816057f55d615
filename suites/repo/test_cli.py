"""The command line, run as users run it (a real subprocess of ``python -m harness``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.plan import Schedule, validate_schedule

pytestmark = pytest.mark.usefixtures("shared_zygote")  # CLI jobs fork their ranks from one zygote


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "harness", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=600)


def test_schedule_prints_table_map_and_writes_json(tmp_path):
    out = tmp_path / "s.json"
    r = cli("schedule", "--dist", "lognormal:mean=1024,sigma=1.5,min=128,max=8192", "-n", "64", "--ranks", "8",
            "--max-seqlen-per-rank", "2048", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "rank-occupancy map (8 ranks" in r.stdout and "valid: every invariant holds" in r.stdout
    doc = json.loads(out.read_text())
    s = Schedule.from_dict(doc["schedule"])
    validate_schedule(s)
    assert s.microbatches == doc["microbatches"] and doc["violations"] == []


def test_schedule_from_a_length_file_and_wikipedia(tmp_path):
    f = tmp_path / "lens.txt"
    f.write_text("# my batch\n8192\n4096\n3000\n2048\n1024\n1024\n512\n512\n256\n")
    r = cli("schedule", "--lengths", str(f), "--ranks", "8", "--max-seqlen-per-rank", "2048",
            "--algorithm", "megatron-pr2000", "--cost", "megatron")
    assert r.returncode == 0 and "   0 |AAAABBCC|" in r.stdout, r.stdout
    r = cli("schedule", "--wikipedia", "-n", "300", "--ranks", "256", "--max-seqlen-per-rank", "4096")
    assert r.returncode == 0 and "every 2th shown" in r.stdout


def test_bad_input_exits_2_with_the_fix():
    r = cli("schedule", "--dist", "const:value=9000", "-n", "3", "--ranks", "8", "--max-seqlen-per-rank", "1024")
    assert r.returncode == 2 and "SequenceTooLong" not in r.stderr and ">= 1125" in r.stderr
    assert "Traceback" not in r.stderr
    r = cli("schedule", "--dist", "zipf:a=1", "--ranks", "8", "--max-seqlen-per-rank", "1024")
    assert r.returncode == 2 and "unknown length distribution 'zipf'" in r.stderr


def test_schedule_takes_a_micro_batch_capacity_for_balanced_and_refuses_a_bad_one(tmp_path):
    out = tmp_path / "s.json"
    r = cli("schedule", "--dist", "lognormal:mean=1024,sigma=1.5,min=128,max=8192", "-n", "70", "--ranks", "4",
            "--max-seqlen-per-rank", "2048", "--execution", "synchronous", "--microbatch-tokens-per-rank", "65536",
            "--json", str(out))
    assert r.returncode == 0 and "65536 tokens a rank per micro-batch" in r.stdout, r.stderr[-2000:]
    s = Schedule.from_dict(json.loads(out.read_text())["schedule"])
    validate_schedule(s)
    assert s.capacity == 65536 and max(s.block_tokens(b) / b.size for mb in s.layout for b in mb) > 2048
    for args, says in ((["--microbatch-tokens-per-rank", "1024"], "give at least 2048"),
                       (["--microbatch-tokens-per-rank", "4096", "--algorithm", "megatron-dev"],
                        "capacity of algorithm 'balanced'")):
        r = cli("schedule", "--dist", "const:value=100", "-n", "8", "--ranks", "4", "--max-seqlen-per-rank", "2048",
                *args)
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and says in lines[0], r.stderr


def test_bench_schedule_quick_writes_json(tmp_path):
    out = tmp_path / "bench.json"
    r = cli("bench", "schedule", "--quick", "--batches", "1", "--execution", "independent", "--out", str(out))
    doc = json.loads(out.read_text())
    names = {row["scheduler"] for row in doc["results"]}
    assert {"balanced", "megatron-dev", "megatron-pr2000", "dp-balanced"} <= names
    assert doc["producer"]["versions"]["dcp-harness"] and doc["checks"]
    assert "latency ms" in r.stdout and r.returncode in (0, 1)  # 1 = a latency target missed on a busy box


@pytest.mark.parametrize("faults", [pytest.param(False, id="no-faults"),
                                    pytest.param(True, id="with-faults", marks=pytest.mark.slow)])
def test_main_job_writes_a_complete_report(tmp_path, faults):
    """The main job with a short convergence run (the 50-step golden run is the slow suite's). The default suite
    skips its fault catalogue (``suites/faults`` runs every fault, and the faults command's report is tested
    below), its pipeline case (``suites/convergence``'s pipeline parity and goldens run it, ``suites/runtime``'s
    pipeline report tests its section) and its hybrid model's case (the same convergence path as the other two
    cases; the model's layouts are ``suites/convergence``'s); the slow suite runs the whole job."""
    lean = [] if faults else ["--no-faults", "--no-hybrid", "--no-pipeline"]
    r = cli("run", "--batches", "1", "--steps", "2", "--out", str(tmp_path), *lean)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "verdict: PASS" in r.stdout and "[bshd] step    2/2" in r.stdout and "[dcp ] step    2/2" in r.stdout
    (run,) = [p for p in tmp_path.iterdir() if p.name.startswith("run-")]
    html = (run / "index.html").read_text()
    assert "Edge cases" in html and "Convergence" in html and "Scheduler comparison" in html
    assert "vs reference (1 rank: no CP, PP, TP or EP)" in html
    assert (run / "convergence" / "metrics.jsonl").read_text().count("\n") == 6  # 3 layouts x 2 steps
    assert json.loads((run / "convergence" / "results.json").read_text())["config"]["chunk_shares"] is None
    n = len(__import__("harness.faults", fromlist=["FAULTS"]).FAULTS)
    if faults:
        assert "Fault catalogue" in html and f"faults caught: {n}/{n}" in (run / "summary.md").read_text()
        assert (run / "hybrid" / "metrics.jsonl").read_text().count("\n") == 6
        assert "Pipeline: one step per layout" in html and "converge__tiny_gpt__w4_pp2__m512__fp32" in html
        assert "dcp (pp 2) vs reference" in html
        assert (run / "pipeline" / "metrics.jsonl").read_text().count("\n") == 6
        # the pipeline case's reference is the one-stage case's run (one rank, no PP): trained once
        assert r.stdout.count("the same reference as case converge__tiny_gpt__w4") == 1
        assert (run / "pipeline" / "reference.jsonl").read_bytes() == (run / "convergence" / "reference.jsonl").read_bytes()
        # the pipeline case records the chunk prices it planned with, which its report's simulated bubble reads
        from harness.runtime.model_config import pipeline_shares

        piped = json.loads((run / "pipeline" / "results.json").read_text())["config"]
        assert piped["chunk_shares"] == list(pipeline_shares("tiny-gpt", 2, 1, piped["max_seqlen_per_rank"]))
    else:
        assert "faults caught" not in (run / "summary.md").read_text() and not (run / "pipeline").exists()
    assert json.loads((run / "results.json").read_text())["verdict"] == "PASS"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".run-")]  # no half-written folder


def test_faults_cli_lists_validates_before_running_and_writes_readable_reports(tmp_path, capsys):
    """The listing and the refusals through the CLI's entry in this process (an uncaught exception would fail the
    test); a run of two faults as a user starts it."""
    from harness.cli import main
    from harness.faults import FAULTS

    assert main(["faults", "--list"]) == 0
    listed = capsys.readouterr().out
    assert all(f.name in listed for f in FAULTS)
    assert main(["faults", "--only", "stale-cp-group", "nosuch"]) == 2
    r = capsys.readouterr()
    assert "unknown fault(s) 'nosuch'; the catalogue has: rope-positions-per-rank" in r.err
    assert len(r.err.strip().splitlines()) == 1 and "clean runs first" not in r.out  # refused before any run
    (tmp_path / "file").write_text("x")
    assert main(["faults", "--json", str(tmp_path / "file" / "out.json")]) == 2
    r = capsys.readouterr()
    assert "cannot " in r.err and len(r.err.strip().splitlines()) == 1 and "clean runs first" not in r.out
    out, page = tmp_path / "f.json", tmp_path / "f.html"
    r = cli("faults", "--only", "stepwise-cumsum-interleaved", "pr2000-inverted-empty-slot-assert",
            "--json", str(out), "--html", str(page))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "faults caught: 2/2" in r.stdout and "stepwise-advantages" in r.stdout
    doc = json.loads(out.read_text())
    assert doc["caught"] == doc["total"] == 2 and doc["clean_ok"]
    assert "Fault catalogue" in page.read_text()
    mask = os.umask(0o022)
    os.umask(mask)
    for p in (out, page):
        assert p.stat().st_mode & 0o777 == 0o666 & ~mask  # the umask's mode, not the temporary file's 0600


def test_bad_inputs_are_refused_before_anything_runs(tmp_path, capsys, monkeypatch):
    """Each bad input: exit 2, one line naming the value and the fix, no traceback, nothing launched (through the
    CLI's entry in this process: a refusal starts nothing, and an uncaught exception would fail the test)."""
    from harness import cli as harness_cli

    monkeypatch.chdir(tmp_path)
    (tmp_path / "bin.txt").write_bytes(bytes(range(256)) * 4)
    (tmp_path / "empty.txt").write_text("# only a comment\n\n")
    (tmp_path / "file").write_text("")
    cases = [
        (["schedule", "--lengths", str(tmp_path / "bin.txt")], "is not a text file of lengths"),
        (["schedule", "--lengths", str(tmp_path)], "is a directory"),
        (["schedule", "--lengths", str(tmp_path / "empty.txt")], "holds no lengths"),
        (["schedule", "--dist", "const:value=100", "--json", str(tmp_path / "file" / "x.json")], "cannot create"),
        (["converge", "--scheduler", "nosuch", "--steps", "1"], "unknown scheduler 'nosuch'"),
        (["nightly", "--models", "tiny-gpt,nope", "--steps", "1", "--device", "cpu"], "unknown model(s) 'nope'"),
        (["converge", "--attention", "te", "--cp-exchange", "ring", "--steps", "1"], "--cp-exchange ring is the harness's"),
    ]
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        cases.append((["converge", "--attention", "te", "--steps", "1"],
                      'needs TransformerEngine: pip install "transformer-engine[pytorch]==2.20.2"'))
    else:
        cases.append((["converge", "--attention", "te", "--steps", "1"], "runs on CUDA devices only"))
    import torch

    if not torch.cuda.is_available():
        cases.append((["converge", "--device", "cuda", "--steps", "1"], "this machine has 0 (no CUDA device"))
    for args, expect in cases:
        if args[0] == "schedule":
            args = args + ["--ranks", "4", "--max-seqlen-per-rank", "512"]
        code = harness_cli.main(list(args))
        lines = capsys.readouterr().err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and expect in lines[0], (args, lines)
        assert lines[0].startswith("dcp-harness: error: ")
    assert not (tmp_path / "reports").exists()  # nothing was launched or written
