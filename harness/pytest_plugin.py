"""Tooling for dcp-harness suites (loaded by the root conftest).

Options:
  --impl NAME        implementation under test for the scheduler invariant suites:
                     ``ours`` (default: every harness algorithm) or ``megatron-core`` (the installed
                     upstream; its invariant violations are reported by name).
  --update-golden    rewrite golden files from the current code instead of comparing.
  --gpu-part NAME    of the GPU suite (``-m gpu suites/gpu``), run only part NAME (``GPU_PARTS``): parts sized to
                     fit one 10-minute device call each on 4 GPUs.

Hypothesis profiles (choose with ``--hypothesis-profile``): ``ci`` (default: 100 examples per
property, hypothesis's own default, derandomized so CI is reproducible), ``nightly`` (5000, random), ``quick`` (50).
"""

from __future__ import annotations

import os

import pytest

from harness import golden as golden_mod

IMPLS = ("ours", "megatron-core")

GPU_PARTS = {
    "attention": "TransformerEngine's and the harness's CP attention against unsharded attention, TE's padding call",
    "models": "the MTP and hybrid models on one GPU, router replay, the NCCL reducer, bench step, two nodes",
    "converge-2": "bf16 convergence of every model on 2 GPUs",
    "converge-4": "bf16 convergence of every model on 4 GPUs",
    "pipeline-vpp1": "two pipeline stages with dynamic CP, every model",
    "pipeline-vpp2": "two pipeline stages of two virtual chunks with dynamic CP, every model",
}
"""Parts of ``suites/gpu`` (``--gpu-part``): every GPU test belongs to exactly one (``gpu_part``)."""


def gpu_part(nodeid: str, params: dict) -> str | None:
    """The ``GPU_PARTS`` name of the GPU test ``nodeid`` (with its parametrization ``params``), None outside
    ``suites/gpu``."""
    path, _, name = nodeid.partition("::")
    if not path.startswith("suites/gpu/"):
        return None
    file = path.rsplit("/", 1)[-1]
    if file in ("test_gpu_te.py", "test_gpu_cp.py"):
        return "attention"
    if file == "test_gpu_convergence.py":
        if name.startswith("test_pipeline"):
            return f"pipeline-vpp{params.get('vpp', 1)}"
        return f"converge-{params.get('nproc', 2)}"
    return "models"

try:
    from hypothesis import HealthCheck, settings

    _common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
                   print_blob=True)
    settings.register_profile("ci", max_examples=100, derandomize=True, **_common)
    settings.register_profile("nightly", max_examples=5000, **_common)
    settings.register_profile("quick", max_examples=50, derandomize=True, **_common)
    settings.load_profile("ci")
except ImportError:  # hypothesis is a test extra; the plugin still loads without it
    pass


def pytest_configure(config):
    # xdist workers share the machine's cores: one intra-op thread each (torch reads this at import)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_addoption(parser):
    group = parser.getgroup("dcp-harness")
    group.addoption("--impl", choices=IMPLS, default="ours",
                    help="implementation under test for the scheduler invariant suites")
    group.addoption("--update-golden", action="store_true", default=False,
                    help="rewrite golden files from the current code (atomically) instead of comparing")
    group.addoption("--gpu-part", choices=list(GPU_PARTS), default=None,
                    help="of the GPU suite (-m gpu suites/gpu), run only this part: " +
                         "; ".join(f"{k}: {v}" for k, v in GPU_PARTS.items()))


def pytest_collection_modifyitems(config, items):
    part = config.getoption("--gpu-part")
    if part is None:
        return
    keep, drop = [], []
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        (keep if gpu_part(item.nodeid, params) == part else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def impl(request) -> str:
    return request.config.getoption("--impl")


class Golden:
    """``golden.check(suite, case_id, config, data, rule=None, hw="any")`` compares with (or with
    ``--update-golden`` rewrites) ``golden/<suite>/<case_id>.<hw>.json``. ``rule`` is the test's tolerance
    (None: exact); the file's own rule may only tighten it."""

    def __init__(self, update: bool, nodeid: str):
        self.update, self.nodeid = update, nodeid

    def check(self, suite: str, case_id: str, config: dict, data, rule: dict | None = None, hw: str = "any"):
        path = golden_mod.path_for(suite, case_id, hw)
        hint = f"pytest '{self.nodeid}' --update-golden"
        if self.update:
            golden_mod.write(path, suite=suite, case_id=case_id, hw=hw, config=config, data=data,
                             rule=rule, command=hint)
            return
        doc = golden_mod.load(path, hint)
        if doc["config"] != config:
            pytest.fail(f"{path}: the golden was made for config {doc['config']}, this test runs {config}; "
                        f"if the change is intended: {hint}")
        try:  # the test's rule is the harness's tolerance: the file may only tighten it
            file_rule = golden_mod.checked_rule(doc["rule"], rule, path, hint)
        except golden_mod.GoldenError as e:
            pytest.fail(str(e))
        diffs = golden_mod.compare(doc["data"], data, file_rule)
        if diffs:
            shown = "\n  ".join(diffs[:20])
            pytest.fail(f"{path}: {len(diffs)} difference(s) under rule {file_rule}:\n  {shown}\n"
                        f"if the change is intended: {hint}")


@pytest.fixture
def golden(request) -> Golden:
    return Golden(request.config.getoption("--update-golden"), request.node.nodeid)
