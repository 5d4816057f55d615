"""The command modules behind ``harness.cli``: each has the same small interface, a benchmark's options
override its configuration's fields by name, and the commands that plan do not import torch."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from harness import cli, cli_types
from harness.bench.microbatch import MicrobatchConfig
from harness.bench.step import StepBenchConfig
from harness.commands.bench import SUBCOMMANDS
from harness.commands.bench import microbatch as microbatch_command
from harness.commands.bench import step as step_command
from harness.commands.common import overrides


def _parsed(module, argv: list[str]):
    p = cli_types.Parser(prog="t")
    module.add_arguments(p)
    return p, p.parse_args(argv)


def test_every_command_module_has_the_interface():
    for c in [*cli.COMMANDS.values(), *SUBCOMMANDS.values()]:
        assert isinstance(c.NAME, str) and isinstance(c.HELP, str), c.NAME
        assert c.DESCRIPTION is None or isinstance(c.DESCRIPTION, str), c.NAME
        assert callable(c.add_arguments) and callable(c.run), c.NAME


@pytest.mark.parametrize("module, config, job", [
    (step_command, StepBenchConfig, {"nproc", "cpu", "stall_timeout", "out", "html", "nnodes", "node_rank",
                                     "rdzv_endpoint", "rdzv_timeout", "numa_binding", "stack", "stack_option",
                                     "stack_arms", "workarounds"}),
    (microbatch_command, MicrobatchConfig, {"cpu", "out"}),
], ids=["bench step", "bench microbatch"])
def test_a_benchmarks_options_are_its_config_fields_or_say_how_the_job_runs(module, config, job):
    """An option whose dest is not a field name would override nothing: each is a field or a job option."""
    p, _ = _parsed(module, [])
    dests = {a.dest for a in p._actions if a.dest != "help"}
    assert dests - {f.name for f in dataclasses.fields(config)} == job


def test_bench_step_overrides_exactly_the_fields_given(tmp_path):
    cost = tmp_path / "cost.json"
    cost.write_text(json.dumps({"quadratic": 1e-12, "linear": 3e-6, "name": "mine"}))
    _, a = _parsed(step_command, ["--cpu", "--iters", "2", "--warmup", "0", "--no-calibrate", "--arms",
                                  " thd:dp-balanced,dcp:balanced,", "--cost-model", str(cost), "--nproc", "2"])
    assert overrides(a, StepBenchConfig, step_command.CONVERT) == {
        "iters": 2, "warmup": 0, "calibrate": False, "arms": ("thd:dp-balanced", "dcp:balanced"),
        "cost_model": {"quadratic": 1e-12, "linear": 3e-6, "name": "mine"}}
    _, a = _parsed(step_command, ["--arms", " , "])
    assert overrides(a, StepBenchConfig, step_command.CONVERT) == {}  # an empty list keeps the default arms


def _torch_after(code: str, timeout: int) -> str:
    """The last line a fresh interpreter prints after running ``code`` with ``harness.cli.main`` at hand and then
    listing the torch modules it imported."""
    code = ("import sys\nfrom harness.cli import main\n" + code +
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-2000:]
    return r.stdout.splitlines()[-1]


def test_help_and_schedule_do_not_import_torch():
    code = ("assert main(['schedule', '--dist', 'const:value=100', '-n', '4', '--ranks', '4', "
            "'--max-seqlen-per-rank', '128']) == 0\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n")
    assert _torch_after(code, 120) == "[]"


@pytest.mark.usefixtures("shared_zygote")
def test_a_training_jobs_launching_process_does_not_import_torch(tmp_path):
    """``converge`` validates, launches, judges and reports without torch in the launching process (its ranks import
    it): ~2.5 s less CPU per job; a bad ``--weights`` / ``--cp-exchange`` / ``--pp`` is still refused there."""
    code = ("rc = main(['converge', '--world', '2', '--steps', '1', '--layouts', 'dcp', '--golden', 'off',"
            f" '--out', {str(tmp_path)!r}])\n"
            "for bad in (['--weights', 'nope'], ['--cp-exchange', 'te:nope'], ['--pp', '3']):\n"
            "    try:\n        code = main(['converge', '--world', '2', *bad])\n    except SystemExit as e:\n"
            "        code = e.code\n"
            "    assert code == 2, (bad, code)\n"
            "print(rc, end=' ')\n")
    assert _torch_after(code, 300) == "0 []"
