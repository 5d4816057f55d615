"""Compilation inside a benchmark's timed window: how many graphs ``torch.compile`` built during a step.

A compiled model compiles on its first call and again on the first call whose shapes differ (Dynamo's
automatic dynamic shapes make the second compile's graph shape-generic), and again whenever a guard fails later.
A timed step that compiles measures the compiler (seconds on a GPU, where the step takes milliseconds), not the
step: with one warm-up step every compiled arm's first measured step does. Benchmarks read ``compile_events``
before and after each timed step and report the steps that compiled (``bench step``'s check "no measured step
compiled") instead of averaging them in.

The count is the sum of torch's compile counters (``torch._dynamo.utils.counters``): graphs Dynamo captured
(``stats/unique_graphs``), AOTAutograd compilations (``aot_autograd/total``) and Inductor graphs built or loaded
from its cache (``inductor/fxgraph_cache_miss`` and ``fxgraph_cache_hit``: a backward graph compiles at its
first backward, so it is counted where it is built). One compilation moves several of them: the figure says
whether and roughly how much a step compiled, not how many frames. Not counted: a CUDA graph recorded for a new
shape under ``compile=reduce-overhead`` (a recording is no compilation; that mode records once per token multiple,
so a multiple first seen in a measured step records there).
"""

from __future__ import annotations

import sys

COUNTERS = (("stats", "unique_graphs"), ("aot_autograd", "total"), ("inductor", "fxgraph_cache_miss"),
            ("inductor", "fxgraph_cache_hit"))
"""The ``(group, name)`` counters of ``torch._dynamo.utils.counters`` that compilation moves."""


def compile_events() -> int:
    """The process's compile counters summed (``COUNTERS``); 0 when Dynamo was never imported (nothing compiled).
    Cheap (a few dict reads): call it around each timed step and take the difference."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return 0
    counters = utils.counters
    return sum(int(counters[group][name]) for group, name in COUNTERS if group in counters)


def compiled_line(label: str, compiled: list[int], warmup: int) -> str | None:
    """The report's line for an arm whose measured steps compiled (``compiled[i]``: compile events of step ``i``, the
    most on any rank), or None when none did."""
    steps = [i + 1 for i, c in enumerate(compiled) if c > 0]
    if not steps:
        return None
    which = ", ".join(str(s) for s in steps[:8]) + (", ..." if len(steps) > 8 else "")
    return (f"  {label}: {len(steps)} of {len(compiled)} measured steps compiled (step {which}; "
            f"{sum(compiled)} compile events): their times include the compiler; raise --warmup (now {warmup}; a "
            f"compiled model compiles again at its first new shape, so at least 2)")
