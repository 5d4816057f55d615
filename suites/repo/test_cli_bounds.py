"""Every size, seed, count and wait the command line takes is bounded: bad input is one line on stderr
naming the value, the limit and why, with exit code 2, before anything is allocated, launched or written."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import pytest

from harness import cli_types
from harness.cli import main
from harness.io import OutputPathError

SCHEDULE = ["schedule", "--dist", "const:value=100", "--max-seqlen-per-rank", "512"]

CASES = [
    # schedule: sizes that allocate
    (SCHEDULE + ["--ranks", "1099511627776"],
     "dcp-harness schedule: error: argument --ranks: 1099511627776 exceeds the limit 65536 (the schedulers keep "
     "state per rank"),
    (SCHEDULE + ["--ranks", "16777216"], "argument --ranks: 16777216 exceeds the limit 65536"),
    (SCHEDULE + ["--ranks", "65536", "-n", "32768"],
     "dcp-harness: error: 32768 sequences x 65536 ranks = 2147483648 exceeds the limit 134217728"),
    (SCHEDULE + ["--ranks", "8", "-n", "2000000"], "argument -n/--num-sequences: 2000000 exceeds the limit 1048576"),
    (SCHEDULE + ["--ranks", "8", "--max-seqlen-per-rank", "99999999999"],
     "argument --max-seqlen-per-rank: 99999999999 exceeds the limit 16777216"),
    (SCHEDULE + ["--ranks", "8", "--min-cp", "131072"], "argument --min-cp: 131072 exceeds the limit 65536"),
    (SCHEDULE + ["--ranks", "8", "--vpp", "100000"], "argument --vpp: 100000 exceeds the limit 1024"),
    (SCHEDULE + ["--ranks", "8", "--rows", "1000000"], "argument --rows: 1000000 exceeds the limit 10000"),
    # schedule: accepted before, silently or with a misleading message
    (SCHEDULE + ["--ranks", "8", "-n", "0"], "argument -n/--num-sequences: 0 is below the minimum 1"),
    (["schedule", "--wikipedia", "--max-len", "0", "--ranks", "8", "--max-seqlen-per-rank", "512"],
     "argument --max-len: 0 is below the minimum 1"),
    (["schedule", "--dist", "lognormal:mean=nan,sigma=1.5,min=128,max=8192", "--ranks", "8",
      "--max-seqlen-per-rank", "512"],
     "dcp-harness: error: parameter mean=nan in 'lognormal:mean=nan,sigma=1.5,min=128,max=8192' must be a finite"),
    (["schedule", "--dist", "lognormal:mean=1024,sigma=-2", "--ranks", "8", "--max-seqlen-per-rank", "512"],
     "parameter sigma=-2 in 'lognormal:mean=1024,sigma=-2' must be >= 0"),
    (["schedule", "--dist", "uniform:min=900,max=100", "--ranks", "8", "--max-seqlen-per-rank", "512"],
     "needs 1 <= min <= max, got min=900, max=100"),
    (SCHEDULE + ["--ranks", "8", "--seed", "-1"], "argument --seed: -1 is below the minimum 0"),
    (SCHEDULE + ["--ranks", "8", "--seed", "4294967296"], "argument --seed: 4294967296 exceeds the limit 4294967295"),
    (SCHEDULE + ["--ranks", "8", "--rows", "-3"], "argument --rows: -3 is below the minimum 0"),
    (SCHEDULE + ["--ranks", "8", "--vpp", "0"], "argument --vpp: 0 is below the minimum 1"),
    (SCHEDULE + ["--ranks", "eight"], "argument --ranks: 'eight' is not an integer"),
    (SCHEDULE[:3] + ["--ranks", "8"],
     "dcp-harness schedule: error: the following arguments are required: --max-seqlen-per-rank; see dcp-harness "
     "schedule --help"),
    # converge
    (["converge", "--max-seqlen-per-rank", "0"], "argument --max-seqlen-per-rank: 0 is below the minimum 1"),
    (["converge", "--batch-size", "0"], "argument --batch-size: 0 is below the minimum 1"),
    (["converge", "--batch-size", "100000"], "argument --batch-size: 100000 exceeds the limit 65536"),
    (["converge", "--seed", "-1"], "argument --seed: -1 is below the minimum 0"),
    (["converge", "--stall-timeout", "-5"], "argument --stall-timeout: -5 is below the minimum 1"),
    (["converge", "--stall-timeout", "0"], "argument --stall-timeout: 0 is below the minimum 1"),
    (["converge", "--stall-timeout", "nan"], "argument --stall-timeout: nan is not a finite number"),
    (["converge", "--stall-timeout", "1e9"], "argument --stall-timeout: 1e+09 exceeds the limit 86400"),
    (["converge", "--world", "1000000"], "argument --world: 1000000 exceeds the limit 1024"),
    (["converge", "--world", "16", "--scheduler", "nosuch"],
     "dcp-harness: error: --world 16: 16 CPU ranks exceed this machine's limit of 8"),
    (["converge", "--steps", "1000000"], "argument --steps: 1000000 exceeds the limit 100000"),
    (["converge", "--steps", "0"], "argument --steps: 0 is below the minimum 1"),
    (["converge", "--pp", "0"], "argument --pp: 0 is below the minimum 1"),
    (["converge", "--tp", "0"], "argument --tp: 0 is below the minimum 1"),
    (["converge", "--sequence-parallel", "--steps", "1"],
     "dcp-harness: error: sequence parallelism splits token rows over the tensor-parallel ranks, and tp=1: use tp >= 2"),
    (["converge", "--tp", "3", "--world", "4", "--steps", "1"],
     "dcp-harness: error: world size 4 is not a multiple of tp=3: the world is pp x (DP x CP) x tp ranks"),
    (["converge", "--vpp", "5000"], "argument --vpp: 5000 exceeds the limit 1024"),
    (["converge", "--steps", "100000", "--batch-size", "1024", "--scheduler", "nosuch"],
     "--steps 100000 x --batch-size 1024 = 102400000 sequences exceeds the limit 16777216"),
    (["converge", "--steps", "1", "--batch-size", "65536", "--lengths", "const:value=1024"],
     "global batch 0 has 67108864 tokens (65536 sequences of 'const:value=1024'), over the limit 16777216"),
    (["converge", "--steps", "1", "--lengths", "lognormal:mean=inf,sigma=1"], "parameter mean=inf"),
    (["converge", "--steps", "1", "--out", "{file}"], "dcp-harness: error: --out {file} is a file, not a folder"),
    (["converge", "--steps", "1", "--out", "{file}/reports"],
     "dcp-harness: error: --out {file}/reports cannot be made: {file} is a file"),
    # run, nightly
    (["run", "--steps", "0"], "argument --steps: 0 is below the minimum 1"),
    (["run", "--batches", "100000"], "argument --batches: 100000 exceeds the limit 1000"),
    (["run", "--stall-timeout", "-1"], "argument --stall-timeout: -1 is below the minimum 1"),
    (["run", "--out", "{file}/x"], "--out {file}/x cannot be made: {file} is a file"),
    (["nightly", "--steps", "1000000"], "argument --steps: 1000000 exceeds the limit 100000"),
    (["nightly", "--world", "100000"], "argument --world: 100000 exceeds the limit 1024"),
    (["nightly", "--world", "16", "--device", "cpu", "--models", "nope"], "--world 16: 16 CPU ranks exceed"),
    # bench, fixtures
    (["bench", "schedule", "--batches", "0"], "argument --batches: 0 is below the minimum 1"),
    (["bench", "schedule", "--seed", "-1"], "argument --seed: -1 is below the minimum 0"),
    (["bench", "schedule", "--out", "{file}/b.json"], "cannot create the folder of {file}/b.json"),
    (["bench", "step", "--cpu", "--nproc", "16", "--arms", "thd:balanced"], "--nproc 16: 16 CPU ranks exceed"),
    (["bench", "step", "--cpu", "--microbatches", "0"], "argument --microbatches: 0 is below the minimum 1"),
    (["bench", "step", "--cpu", "--microbatches", "100000"], "argument --microbatches: 100000 exceeds the limit 1024"),
    (["bench", "step", "--cpu", "--warmup", "-1"], "argument --warmup: -1 is below the minimum 0"),
    (["bench", "step", "--cpu", "--iters", "10000000"], "argument --iters: 10000000 exceeds the limit 100000"),
    (["bench", "step", "--cpu", "--token-bucket", "99999999999"], "argument --token-bucket: 99999999999 exceeds"),
    (["bench", "step", "--cpu", "--token-bucket", "64x"], "argument --token-bucket: '64x' is not auto or an integer"),
    (["converge", "--token-bucket", "-2"], "argument --token-bucket: -2 is below the minimum 0"),
    (["converge", "--token-bucket", "7"], "token_bucket must be 'auto', 0 (off) or an even int of tokens, got 7"),
    (["bench", "step", "--cpu", "--cp-comm-flops-per-byte", "nan"], "argument --cp-comm-flops-per-byte: nan is not"),
    (["bench", "step", "--cpu", "--stall-timeout", "-3"], "argument --stall-timeout: -3 is below the minimum 1"),
    (["bench", "microbatch", "--cpu", "--shapes", "1x128,1000000000x2"],
     "argument --shapes: shape '1000000000x2' is 2000000000 tokens, over the limit 1048576"),
    (["bench", "microbatch", "--cpu", "--reps", "0"], "argument --reps: 0 is below the minimum 1"),
    (["bench", "opaque", "--reps", "0"], "argument --reps: 0 is below the minimum 1"),
    (["bench", "attention", "--nproc", "0"], "argument --nproc: 0 is below the minimum 1"),
    (["bench", "attention", "--tokens", "8192,abc"], "argument --tokens: 'abc' is not an integer"),
    (["bench", "attention", "--tokens", "4"], "argument --tokens: 4 is below the minimum 16"),
    (["bench", "attention", "--tokens", ","], "argument --tokens: tokens a pack: give one or more integers"),
    (["bench", "attention", "--sequences", "0"], "argument --sequences: 0 is below the minimum 1"),
    (["fixtures", "wikipedia", "--source", "{file}", "--n", "0"], "argument --n: 0 is below the minimum 1"),
    (["fixtures", "wikipedia", "--source", "{file}", "--n", "2000000"], "argument --n: 2000000 exceeds the limit"),
    (["fixtures", "wikipedia", "--source", "{file}", "--seed", "-1"], "argument --seed: -1 is below the minimum 0"),
    (["fixtures", "wikipedia", "--source", "{lengths}", "--n", "4"],
     "cannot sample 4 lengths without replacement from lengths.txt, which holds 3; use --n 3 or fewer"),
    ([], "dcp-harness: error: the following arguments are required: command; see dcp-harness --help"),
]


def _run(argv: list[str], capsys) -> tuple[int, list[str]]:
    try:
        code = main(argv)
    except SystemExit as e:  # argparse
        code = e.code
    return code, capsys.readouterr().err.splitlines()


@pytest.mark.parametrize("argv, expect", CASES, ids=[" ".join(a)[:70] for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(argv, expect, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(cli_types, "cpu_cores", lambda: 2)  # this machine's CPU rank limit: 8
    (tmp_path / "afile").write_text("")
    (tmp_path / "lengths.txt").write_text("1\n2\n3\n")
    paths = {"file": str(tmp_path / "afile"), "lengths": str(tmp_path / "lengths.txt")}
    argv, expect = [a.format(**paths) for a in argv], expect.format(**paths)
    code, lines = _run(argv, capsys)
    assert code == 2 and len(lines) == 1 and lines[0].strip(), (argv, lines)
    assert expect in lines[0] and "Traceback" not in lines[0], (argv, lines[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "lengths.txt"]  # nothing written or launched


def test_huge_ranks_fail_before_allocating_in_well_under_a_second():
    """As the user ran it (a fresh process), but limited to 2 GiB: before the bound this grew to 24 GB."""
    code = ("import sys, time; from harness.cli import main\n"
            "t = time.perf_counter()\n"
            "try:\n"
            "    code = main(['schedule', '--dist', 'const:value=100', '--ranks', '1099511627776', "
            "'--max-seqlen-per-rank', '512'])\n"
            "except SystemExit as e:\n"
            "    code = e.code\n"
            "print(code, time.perf_counter() - t)\n")

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    t = time.perf_counter()
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail("schedule --ranks 1099511627776 ran past 60 s instead of refusing the size")
    wall = time.perf_counter() - t
    exit_code, took = r.stdout.split()
    assert exit_code == "2" and float(took) < 0.1 and wall < 20, (r.stdout, r.stderr[-2000:], wall)
    assert r.stderr == ("dcp-harness schedule: error: argument --ranks: 1099511627776 exceeds the limit 65536 (the "
                        "schedulers keep state per rank; the largest dynamic-CP deployments have ~12k GPUs)\n")


def test_parser_errors_are_one_line_with_the_help_hint():
    r = subprocess.run([sys.executable, "-m", "harness", "schedule", "--ranks", "8"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and r.stdout == "" and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("dcp-harness schedule: error: the following arguments are required: ")
    assert r.stderr.rstrip().endswith("; see dcp-harness schedule --help") and "usage:" not in r.stderr


def test_a_folder_that_cannot_be_written_is_refused_even_as_root(tmp_path, monkeypatch):
    """``os.access`` says yes to root whatever the mode, so the check writes a real probe file: simulate a
    read-only file system by making that write fail."""
    def refuse(*a, **k):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("harness.io.tempfile.mkstemp", refuse)
    with pytest.raises(OutputPathError, match=r"--out .*/new cannot be written \(Permission denied in .*\); give a "
                                               r"writable folder"):
        cli_types.writable_folder(tmp_path / "new", "--out")
    assert not (tmp_path / "new").exists()


def test_the_type_functions_accept_their_bounds():
    assert cli_types.RANKS("65536") == 65536 and cli_types.SEED("0") == 0 and cli_types.SEED(str(2**32 - 1)) == 2**32 - 1
    assert cli_types.ROWS("0") == 0 and cli_types.STALL_S("1") == 1.0 and cli_types.STALL_S("86400") == 86400.0
    assert cli_types.shapes("4x512,1x1048576") == "4x512,1x1048576"
    assert cli_types.shapes("2by16") == "2by16"  # malformed: left to the benchmark, which names the form
    with pytest.raises(Exception, match="is not an integer"):
        cli_types.RANKS("9" * 5000)  # more digits than Python converts
