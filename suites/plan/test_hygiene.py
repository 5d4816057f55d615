"""Layering and documentation promises of the planning layer."""

from __future__ import annotations

import doctest
import importlib
import json
import os
import pkgutil
import subprocess
import sys

import pytest

import harness.plan

PLAN_MODULES = sorted(m.name for m in pkgutil.iter_modules(harness.plan.__path__, "harness.plan."))


def test_plan_never_imports_torch():
    code = ("import sys, harness.plan, harness.data.workloads, harness.testing; "
            "from harness.plan import schedule; schedule([5000, 300], n_ranks=4, max_seqlen_per_rank=2048); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", PLAN_MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_schedules_do_not_depend_on_hash_seeds():
    """Determinism across processes: no set or dict iteration order leaks into a schedule."""
    code = ("import json; from harness.plan import schedule, ALGORITHMS; from harness.data.workloads import sample; "
            "L = sample('wikipedia:max=32768', 300, 7); "
            "print(json.dumps({a: schedule(L, n_ranks=16, max_seqlen_per_rank=4096, algorithm=a).microbatches "
            "for a in ALGORITHMS}))")
    outs = set()
    for seed in ("0", "1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        outs.add(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                env=env).stdout)
    assert len(outs) == 1 and json.loads(outs.pop())
