"""The host probe on a GPU (``harness.bench.host``, ``pytest -m gpu suites/gpu``): a one-element kernel's launch
costs the host microseconds (timed without synchronising each call)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu


def test_on_cuda_a_launch_costs_the_host_microseconds():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from harness.bench import host

    p = host.probe(torch.device("cuda"))
    assert 0 < p["launch_us"] < 1e3 and p["python_mops"] > 0
