"""The host probe every benchmark report carries (``harness.bench.host``): what it measures moves with the host's
speed, and the line a job prints names the CPU and the spread over its ranks."""

from __future__ import annotations

import time

import torch

from harness.bench import host


def test_the_probe_names_the_cpu_and_measures_both_speeds():
    p = host.probe(torch.device("cpu"))
    assert set(p) == {"cpu", "logical_cpus", "usable_cpus", "launch_us", "python_mops"}
    assert 1 <= p["usable_cpus"] <= p["logical_cpus"]
    assert 0 < p["launch_us"] < 1e4 and 0 < p["python_mops"] < 1e4
    assert p["cpu"] == host.cpu_name()


def test_a_slower_operator_path_reads_as_a_slower_launch(monkeypatch):
    """The figure is a measurement of the call path, not a constant: 50 us more per call shows as >= 40 us more."""
    fast = host.launch_us(torch.device("cpu"))
    real_add = torch.add

    def slow_add(*args, **kwargs):
        t = time.perf_counter()
        while time.perf_counter() - t < 50e-6:
            pass
        return real_add(*args, **kwargs)

    monkeypatch.setattr(torch, "add", slow_add)
    assert host.launch_us(torch.device("cpu")) >= fast + 40


def test_the_line_names_the_host_and_the_ranks_spread():
    a = {"cpu": "Intel Xeon Platinum 8480+", "logical_cpus": 224, "usable_cpus": 28, "launch_us": 8.04,
         "python_mops": 41.2}
    b = {**a, "launch_us": 9.46, "python_mops": 39.0}
    assert host.describe([a, b]) == ("host: Intel Xeon Platinum 8480+ (224 CPUs, 28 usable), 8.8 us per operator "
                                     "launch (ranks 8.0-9.5), Python 40 M additions/s")
    assert host.describe([a]) == ("host: Intel Xeon Platinum 8480+ (224 CPUs, 28 usable), 8.0 us per operator "
                                  "launch, Python 41 M additions/s")
    assert "2 CPU models" in host.describe([a, {**b, "cpu": "AMD EPYC 9654"}])
    assert host.describe([None, None]) == "" and host.describe([]) == ""  # reports from before the probe

