"""pytest policy for dcp-harness: markers, default selection, the plugin with our options.

- Markers are registered here and ``--strict-markers`` is on (pyproject), so a typo fails.
- ``slow``, ``nightly`` and ``gpu`` tests are deselected unless ``-m`` names what to run
  (e.g. ``pytest -m slow``, ``pytest -m "gpu or nightly"``). ``dist_cpu`` and ``upstream`` run by default.
- Tooling (``--impl``, ``--update-golden``, hypothesis profiles, fixtures) lives in
  ``harness/pytest_plugin.py``.
"""

import os

import pytest

pytest_plugins = ["harness.pytest_plugin"]

MARKERS = {
    "slow": "long-running CPU tests; deselected by default, select with -m slow",
    "nightly": "nightly-only tests (large hypothesis profiles, long runs); select with -m nightly",
    "dist_cpu": "spawns gloo worlds of real torch.distributed processes on CPU",
    "gpu": "needs CUDA GPUs (the device machine); select with -m gpu",
    "upstream": "runs the installed upstream implementation (megatron-core)",
}
OPT_IN = ("slow", "nightly", "gpu")


def pytest_configure(config):
    # the jobs the suites run log no wandb runs (~1-2 s of CPU a layout, in every converge job): the sink itself is
    # suites/repo/test_tracking.py's, which logs real offline runs; a WANDB_MODE the user set is kept
    os.environ.setdefault("WANDB_MODE", "disabled")
    for name, doc in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {doc}")


def pytest_collection_modifyitems(config, items):
    if config.option.markexpr:
        return  # the user chose with -m
    keep, drop = [], []
    for item in items:
        (drop if any(item.get_closest_marker(m) for m in OPT_IN) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(scope="session")
def shared_zygote():
    """For the modules whose tests start ``dcp-harness`` CPU jobs as processes: those jobs fork their ranks from
    one zygote per test process (torch imported once, not once a job; ``harness.jobs.zygote.share``). A test of
    a launcher's own zygote drops ``DCP_HARNESS_ZYGOTE_AT`` from the environment it starts the launcher with."""
    from harness.jobs.launcher import share_zygote

    yield share_zygote()
