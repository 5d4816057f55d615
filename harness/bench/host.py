"""The host a benchmark ran on, and how fast it issues work: what a step's host side pays per call.

The same GPU kind comes with hosts of very different speed: on three one-H100 leases the same code's one-GPU step
took 195-245 ms and its speedup over static CP's packer read 1.10-1.26x; on the slowest, a PyTorch matrix product
cost ~30 us of host time against ~19 us, and the device idled waiting for the host. Within one host, processes
differ too: three started one after the other ran Python at 18, 33 and 31 M additions/s, each steady over its
rounds (where the process landed, not a busy moment). A step that is host-bound somewhere (small micro-batches, a
CP group's shards) measures the host as much as the GPU, so every report names the host each rank had, with two
figures measured in the rank's own process, before its steps:

- ``launch_us``: host microseconds per small PyTorch operator on the rank's device (``torch.add`` of one-element
  tensors into a preallocated output; on CUDA without synchronising, so dispatch plus kernel launch: the unit of a
  launch-bound step);
- ``python_mops``: millions of pure-Python integer additions a second (the interpreter's speed: schedule phases,
  plan building, Inductor's Python wrapper).

Each is the best of 15 short rounds (~60 ms in all), so a moment's interruption does not set it. The figures name
the host; they do not predict a step's ratio by themselves (two leases whose ranks probed alike gave 1.096x and
1.261x: ``reports/recorded/host_speed.h100.log``).
"""

from __future__ import annotations

import os
import platform
import statistics
import time

ROUNDS = 15
OPS_PER_ROUND = 200
ADDS_PER_ROUND = 100_000


def cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``; ``platform.processor()`` elsewhere; '' when unknown)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor() or ""


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        return os.cpu_count() or 0


def launch_us(device) -> float:
    """Host microseconds per small operator on ``device`` (a ``torch.device``), issued back to back (the best
    round)."""
    import torch

    a = torch.ones(1, device=device)
    b = torch.ones(1, device=device)
    c = torch.empty(1, device=device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(20):  # warm the dispatcher and the launch path
        torch.add(a, b, out=c)
    sync()
    per_op = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        for _ in range(OPS_PER_ROUND):
            torch.add(a, b, out=c)
        per_op.append(1e6 * (time.perf_counter() - t0) / OPS_PER_ROUND)
        sync()  # each round starts with an empty queue: the host never waits on a full one
    return min(per_op)


def python_mops() -> float:
    """Millions of pure-Python integer additions a second (the best of short rounds)."""
    rates = []
    for _ in range(ROUNDS):
        t0 = time.perf_counter()
        x = 0
        for i in range(ADDS_PER_ROUND):
            x += i
        rates.append(ADDS_PER_ROUND / 1e6 / max(time.perf_counter() - t0, 1e-9))
    return max(rates)


def probe(device) -> dict:
    """This process's host: CPU model, logical CPUs of the machine and usable by this process, and the two
    speeds (``launch_us`` on ``device``, ``python_mops``)."""
    return {"cpu": cpu_name(), "logical_cpus": os.cpu_count() or 0, "usable_cpus": _usable_cpus(),
            "launch_us": launch_us(device), "python_mops": python_mops()}


def describe(probes: list[dict | None]) -> str:
    """One line for a job's ranks, e.g. ``host: AMD EPYC 9654 (192 CPUs, 12 usable), 8.1 us per operator launch
    (ranks 7.9-8.4), Python 41 M additions/s``; '' when no rank probed (a report from before the probe)."""
    found = [p for p in probes if p]
    if not found:
        return ""
    first = found[0]
    launch = [p["launch_us"] for p in found]
    mops = [p["python_mops"] for p in found]
    spread = f" (ranks {min(launch):.1f}-{max(launch):.1f})" if len(found) > 1 else ""
    cpus = {p["cpu"] for p in found}
    name = first["cpu"] if len(cpus) == 1 else f"{len(cpus)} CPU models"
    return (f"host: {name or 'unknown CPU'} ({first['logical_cpus']} CPUs, {first['usable_cpus']} usable), "
            f"{statistics.median(launch):.1f} us per operator launch{spread}, "
            f"Python {statistics.median(mops):.0f} M additions/s")
