"""Timing and output helpers shared by benchmarks."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from harness.golden import producer
from harness.io import atomic_write_json
from harness.paths import REPORTS


def time_call(fn: Callable[[], object], *, min_total_s: float = 0.2, max_reps: int = 7) -> tuple[float, object]:
    """Median wall time (seconds) of ``fn()`` over repetitions (GC off while timing), and the
    last result, after one untimed warm-up call. Repeats until ``min_total_s`` has passed or
    ``max_reps`` runs were made."""
    times, result = [], fn()
    while len(times) < max_reps and (not times or sum(times) < min_total_s):
        enabled = gc.isenabled()
        gc.disable()
        try:
            t = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t)
        finally:
            if enabled:
                gc.enable()
    return statistics.median(times), result


def write_report(name: str, config: dict, results, out: Path | None = None, **extra) -> Path:
    """Write ``reports/bench_<name>.json`` (or ``out``) for ``dcp-harness bench <name>``."""
    path = out or REPORTS / f"bench_{name}.json"
    doc = {"benchmark": name, "config": config, "producer": producer(f"dcp-harness bench {name}"),
           "results": results, **extra}
    return atomic_write_json(path, doc)


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Render ``rows`` with ``columns`` = (key, header, format)."""
    cells = [[h for _, h, _ in columns]] + [[format(r[k], f) if r.get(k) is not None else "-" for k, _, f in columns]
                                            for r in rows]
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c[i].rjust(widths[i]) for i in range(len(columns))) for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
