"""How far each rank's host runs ahead of its GPU in the timed steps, without a profiler.

At the start of every pass (a micro-batch's forward or backward) and at the step's end, a timed ``bench step``
records the host clock and a CUDA event (``rank.StepMarks``); after the step's closing synchronisation, the event's
time from the step's start says when the GPU got there. The difference is the host's **lead**: the work queued
ahead of the GPU when the host reached that point. Near zero the GPU had run out of work and was waiting for this
host (the pass *starved* it); large, the host was ahead - its GPU is the bound, or it waits inside a collective for
a peer whose host is late. So in a step bound by one slow host, that rank shows the least lead and its partners
large leads; in a device-bound step every rank leads.

Each pass's **time** on either clock (from its start to the next pass's) says which side bounds it: the host's is
what launching it cost the host (Python, the dispatcher, kernel launches), the GPU's what running it took, the GPU
waiting for the host included. Where the host's time reaches the GPU's, the pass is host-bound, and a faster GPU
or kernel would not shorten it (``pass_line``).

Nothing here slows the step: one event per pass (~16 a step), read after the step. The profiler's breakdown
(``harness.bench.trace``) says what the device did, but its host-side recording lengthens a host-bound step by
~1.5x and so overstates idle time; the leads are read from the timed steps themselves.
"""

from __future__ import annotations

import statistics

STARVED_MS = 0.05
"""A lead under this (ms) counts as the GPU waiting for the host: an event recorded on an idle stream completes
within microseconds of its launch."""


def leads_ms(host_ms: list[float], device_ms: list[float]) -> list[float]:
    """The lead at each point: ms from the host reaching it to the GPU reaching it (both from the step's start)."""
    if len(host_ms) != len(device_ms):
        raise ValueError(f"host and device times differ in length: {len(host_ms)} != {len(device_ms)}")
    return [d - h for h, d in zip(host_ms, device_ms)]


def summarize_rank(steps: list[dict]) -> dict | None:
    """One rank's leads over its measured steps. Each step: ``kinds`` (``"F"`` / ``"B"`` per pass), ``leads`` (ms,
    per pass) and ``end`` (the lead when the host finished the step's launches). None without any pass (a CPU run
    records none: its device is its host)."""
    passes = [(k, v) for s in steps for k, v in zip(s["kinds"], s["leads"])]
    if not passes:
        return None
    every = [v for _, v in passes]

    def median_of(kind: str) -> float | None:
        xs = [v for k, v in passes if k == kind]
        return statistics.median(xs) if xs else None

    def time_of(clock: str, kind: str) -> float | None:
        xs = [v for s in steps for k, v in zip(s["kinds"], s.get(clock) or []) if k == kind]
        return statistics.median(xs) if xs else None

    return {"passes": len(every), "median_ms": statistics.median(every),
            "forward_median_ms": median_of("F"), "backward_median_ms": median_of("B"),
            "starved": sum(v < STARVED_MS for v in every) / len(every),
            "end_median_ms": statistics.median(s["end"] for s in steps),
            "host_forward_ms": time_of("host_ms", "F"), "host_backward_ms": time_of("host_ms", "B"),
            "device_forward_ms": time_of("device_ms", "F"), "device_backward_ms": time_of("device_ms", "B")}


def lead_line(name: str, per_rank: list[dict | None]) -> str | None:
    """One line of an arm's per-rank leads (rank order) and the rank with the least: the host the others wait for.
    None for fewer than two ranks with leads."""
    if len(per_rank) < 2 or any(p is None for p in per_rank):
        return None
    med = [p["median_ms"] for p in per_rank]
    slow = min(range(len(med)), key=med.__getitem__)
    cells = ", ".join(f"{r}: {_ms(p['forward_median_ms'])} / {_ms(p['backward_median_ms'])}, "
                      f"{100 * p['starved']:.0f}%" for r, p in enumerate(per_rank))
    return (f"  {name} host lead by rank (median ms the host ran ahead of its GPU at a forward / backward's start; "
            f"passes that found the GPU waiting): {cells}; the least: rank {slow}, {med[slow]:.2f} ms "
            f"({100 * per_rank[slow]['starved']:.0f}% of its passes starved)")


def pass_line(name: str, per_rank: list[dict | None]) -> str | None:
    """One line of an arm's time per pass on the host and on the GPU, by rank (one rank too: a single GPU can be
    host-bound). None where no rank recorded pass times (a CPU run, or records from before they were kept)."""
    if not per_rank or any(p is None or p.get("host_forward_ms") is None for p in per_rank):
        return None
    cells = ", ".join(f"{r}: {_ms(p['host_forward_ms'])} / {_ms(p['device_forward_ms'])}, "
                      f"{_ms(p['host_backward_ms'])} / {_ms(p['device_backward_ms'])}" for r, p in enumerate(per_rank))
    return (f"  {name} time per pass by rank (median ms from a pass's start to the next's, host / GPU; forward, "
            f"backward; the host's reaching the GPU's: host-bound): {cells}")


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"
