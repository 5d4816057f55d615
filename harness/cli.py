"""``dcp-harness`` (also ``python -m harness``): the command line.

  dcp-harness run                      main job: convergence (one stage, a pipeline, the hybrid), schedulers, edge cases, faults
  dcp-harness schedule ...             schedule one global batch; table, occupancy map, --json
  dcp-harness converge ...             train bshd / thd / dcp side by side; report, goldens, wandb
  dcp-harness verify STACK             check a training stack (harness, or your own: file.py:make) through the stack protocol
  dcp-harness nightly                  every model, more steps, GPUs if present; history + trend plots
  dcp-harness faults                   the fault catalogue: real dynamic-CP bugs re-created, each must be caught
  dcp-harness bench schedule           scheduler latency and quality benchmark -> reports/
  dcp-harness bench thd                zig-zag index speed (CPU) -> reports/
  dcp-harness bench padding            step-wise batch padding and builder speed (CPU) -> reports/
  dcp-harness bench attention          CP attention throughput on GPUs -> reports/
  dcp-harness bench step               training step time, dynamic vs static CP (GPUs; --cpu smoke) -> reports/
  dcp-harness bench microbatch         host vs device time of one micro-batch per compile mode and backend -> reports/
  dcp-harness bench opaque             host overhead per call of the opaque attention operator -> reports/
  dcp-harness bench curve A.json ...   bench step's speedup over the global batch's size -> reports/
  dcp-harness bench compare A.json ... the harness's runtime and megatron-core's step side by side -> reports/
  dcp-harness bench replay R.json      a bench step report's batches scheduled again, priced by its calibrated cost
  dcp-harness bench fit A.json ...     bench step's cost model fitted to its reports' measured steps, each held out in turn
  dcp-harness fixtures wikipedia ...   regenerate the committed Wikipedia length sample

Exit codes: 0 success, 1 a verdict or benchmark target failed, 2 bad input (one line on stderr naming the
value, the limit and why; every size, count, seed and wait is bounded: harness.cli_types, harness.plan.limits),
3 a multi-process job failed: a rank raised, died or made no progress (one line names the rank and the log);
130 / 143 interrupted by Ctrl-C / SIGTERM (one line names the log of the job's output so far); 141 the reader of
the output left (dcp-harness ... | head), silently.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness import __version__
from harness import cli_types as T
from harness.apps.nightly.history import HistoryError
from harness.commands import bench, converge, faults, fixtures, nightly, run, schedule, verify
from harness.commands.common import register
from harness.golden import GoldenError
from harness.io import OutputPathError
from harness.jobs.watchdog import JobFailure, Terminated
from harness.plan import PlanInputError
from harness.stack.protocol import StackError

COMMANDS = {c.NAME: c for c in (run, schedule, converge, verify, faults, nightly, bench, fixtures)}
"""The command modules (``harness.commands``), in the order ``--help`` lists them."""
BAD_INPUT = (PlanInputError, GoldenError, OutputPathError, HistoryError, T.UsageError, StackError)
"""The errors that mean bad input (exit 2)."""


def parser() -> argparse.ArgumentParser:
    p = T.Parser(prog="dcp-harness", description=__doc__.split("\n\n")[0],
                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--version", action="version", version=f"dcp-harness {__version__}")
    register(p.add_subparsers(dest="command", required=True), COMMANDS.values())
    return p


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    try:
        return COMMANDS[a.command].run(a)
    except BAD_INPUT as e:
        print(f"dcp-harness: error: {_line(e)}", file=sys.stderr)
        return 2
    except JobFailure as e:
        print(f"dcp-harness: error: {_line(e)}", file=sys.stderr)
        return 3
    except Terminated as e:
        print(f"dcp-harness: terminated by {e}; the job's processes were killed{_output(e)}", file=sys.stderr)
        return 143
    except KeyboardInterrupt as e:
        killed = "; the job's processes were killed" if hasattr(e, "log") else ""
        print(f"dcp-harness: interrupted{killed}{_output(e)}", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (``dcp-harness ... | head``): stop quietly, as a shell tool
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit would raise again
        return 141


def _line(e: BaseException) -> str:
    """An error's message as the one line the exit codes promise."""
    return " ".join(str(e).splitlines())


def _output(e: BaseException) -> str:
    """Where an interrupted job's output so far is (``harness.jobs.entry.launch`` sets ``log``), if it was kept."""
    log = getattr(e, "log", None)
    return f"; output: {log}" if log is not None and Path(log).exists() else ""
