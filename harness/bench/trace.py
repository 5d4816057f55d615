"""Where a training step's time goes, from a ``torch.profiler`` Chrome trace.

``breakdown(trace, window)`` splits the wall time of one step (the ``window`` [start, end) in the
trace's microseconds, e.g. a ``record_function`` annotation around the step) into:

- ``attention``: attention kernels (flash / fmha / sdpa);
- ``linear``: GEMM kernels (projections, MLP, logits);
- ``other``: every other compute kernel or copy (norms, activations, RoPE, index/gather, optimizer);
- ``communication``: collective kernels (NCCL) *not overlapped* by compute. NCCL kernels start
  when launched and spin until their peers arrive, so this includes the wait for slower ranks;
- ``idle``: no kernel running at all (host-bound launch gaps, host synchronisation); ``idle_causes`` charges
  each idle stretch to the host operator that launched the kernel ending it (``harness.bench.trace_idle``).

Each instant of the window counts once, for the highest-priority category running then
(attention > linear > other > communication), so the five parts add up to the wall time. The same
instant is also charged to one kernel of that category (the earliest started of those running), so
``kernels`` says which kernels the ``other`` time and the exposed communication were (``top_kernels``).

``host_syncs`` / ``host_sync_ms`` count the host's blocking waits for the device in the window (CUDA
runtime calls ``cuda*Synchronize`` and blocking ``cudaMemcpy``: ``.item()``, ``.tolist()``, ``.cpu()``
of device tensors, explicit synchronisation) and the host time they took: a host-bound step with many
of them waits for its kernels to drain before it can launch the next ones. ``host`` charges the host's
time to operators and runtime calls by self time (an event's time less its children's, per thread):
where a host-bound step's host went.

On a CPU-only run (gloo, no kernels) the host operator events are classified the same way
(``aten::mm`` and friends -> linear, attention ops -> attention, gloo / c10d -> communication, any
other operator -> other); enclosing operators count only where no finer category is active.
"""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path

from harness.bench.trace_idle import KEEP_CAUSES, idle_causes

CATEGORIES = ("attention", "linear", "other", "communication")
PARTS = CATEGORIES + ("idle",)

_COMM_DEVICE = ("nccl",)
_COMM_HOST = ("gloo", "c10d::", "record_param_comms", "nccl")
_ATTN = ("flash", "fmha", "attention", "attn", "sdpa")
_GEMM = ("gemm", "cutlass", "xmma", "nvjet", "cublas", "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul",
         "aten::linear", "aten::_scaled_mm")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_RUNTIME_CATS = ("cuda_runtime", "cuda_driver")


def is_host_sync(name: str) -> bool:
    """Whether a CUDA runtime / driver call blocks the host until the device catches up."""
    return name.endswith("Synchronize") or name in ("cudaMemcpy", "cuMemcpyDtoH", "cuMemcpyDtoH_v2")


@functools.lru_cache(maxsize=1 << 16)
def classify(name: str, source: str = "device") -> str:
    """Category of a kernel (``source="device"``) or host operator (``"host"``) name (memoised: a step's trace
    repeats a few hundred names over tens of thousands of events)."""
    n = name.lower()
    if any(k in n for k in (_COMM_DEVICE if source == "device" else _COMM_HOST)):
        return "communication"
    if any(k in n for k in _ATTN):
        return "attention"
    if any(k in n for k in _GEMM):
        return "linear"
    return "other"


def load_trace(path: str | Path) -> dict:
    p = Path(path)
    raw = p.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)


def events(trace: dict) -> list[dict]:
    ev = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    return [e for e in ev if isinstance(e, dict) and e.get("ph") == "X" and "dur" in e]


def annotations(trace: dict, name: str) -> list[tuple[float, float]]:
    """[start, end) of every host annotation called ``name`` (``torch.profiler.record_function``)."""
    return sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events(trace)
                  if e.get("name") == name and e.get("cat") in ("user_annotation", "cpu_op", None))


def span(trace: dict) -> tuple[float, float]:
    """[start of the first, end of the last) event of a trace: the window of a device-only profile, which has
    no host annotation to bracket the step."""
    evs = events(trace)
    if not evs:
        raise ValueError("the trace has no events")
    return min(float(e["ts"]) for e in evs), max(float(e["ts"]) + float(e["dur"]) for e in evs)


def breakdown(trace: dict, window: tuple[float, float]) -> dict:
    """Milliseconds per part (``PARTS``) of ``window``, plus ``wall`` and ``source`` (``device``
    when the trace has kernels in the window, else ``host``)."""
    t0, t1 = window
    if t1 <= t0:
        raise ValueError(f"empty window {window}")
    evs = events(trace)
    device = [e for e in evs if e.get("cat") in _DEVICE_CATS]
    source = "device" if any(float(e["ts"]) < t1 and float(e["ts"]) + float(e["dur"]) > t0 for e in device) else "host"
    if source == "host":
        chosen = [e for e in evs if e.get("cat") == "cpu_op"]
    else:
        chosen = device
    rank = {c: i for i, c in enumerate(CATEGORIES)}
    points, names = [], []
    for e in chosen:
        a, b = max(t0, float(e["ts"])), min(t1, float(e["ts"]) + float(e["dur"]))
        if b > a:
            name = str(e.get("name", ""))
            c = rank[classify(name, source)]
            i = len(names)
            names.append((short_name(name), c))
            points.append((a, 1, c, i))
            points.append((b, -1, c, i))
    points.sort(key=lambda p: (p[0], p[1]))
    active: list[dict[int, float]] = [{} for _ in CATEGORIES]   # per category: event -> its start
    spent = [0.0] * len(CATEGORIES)
    charged: dict[str, list] = {}
    busy, last = 0.0, t0
    for t, delta, c, i in points:
        if t > last:
            top = next((k for k, running in enumerate(active) if running), None)
            if top is not None:
                spent[top] += t - last
                busy += t - last
                first = min(active[top], key=active[top].get)
                charged.setdefault(names[first][0], [CATEGORIES[top], 0.0, set()])
                charged[names[first][0]][1] += t - last
                charged[names[first][0]][2].add(first)
            last = t
        if delta > 0:
            active[c][i] = t
        else:
            active[c].pop(i, None)
    out = {c: spent[i] / 1e3 for i, c in enumerate(CATEGORIES)}
    out["idle"] = max(0.0, (t1 - t0) - busy) / 1e3
    out["wall"] = (t1 - t0) / 1e3
    out["source"] = source
    syncs = [e for e in evs if e.get("cat") in _RUNTIME_CATS and is_host_sync(str(e.get("name", "")))
             and t0 <= float(e["ts"]) < t1]
    out["host_syncs"] = len(syncs)
    out["host_sync_ms"] = sum(min(float(e["dur"]), t1 - float(e["ts"])) for e in syncs) / 1e3
    kept = sorted(charged.items(), key=lambda kv: -kv[1][1])[:KEEP_KERNELS]
    out["kernels"] = {n: [cat, us / 1e3, len(ids)] for n, (cat, us, ids) in kept}
    if source == "device":
        out["host"] = host_self_times(evs, window)
        out["idle_causes"] = idle_causes(evs, window, device, _RUNTIME_CATS)
    return out


_HOST_CATS = ("cpu_op", "cuda_runtime", "cuda_driver", "python_function")


def host_self_times(evs: list[dict], window: tuple[float, float], keep: int = 40) -> dict:
    """{name: [self ms, calls]} of the host events (operators, CUDA runtime calls) that start in ``window``: each
    event's duration less its children's on the same thread, the most first (``keep`` of them)."""
    t0, t1 = window
    by_thread: dict = {}
    for e in evs:
        if e.get("cat") in _HOST_CATS and t0 <= float(e["ts"]) < t1:
            by_thread.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    totals: dict[str, list] = {}

    def close(item: list) -> None:
        _, name, children, dur = item
        t = totals.setdefault(name, [0.0, 0])
        t[0] += max(0.0, dur - children) / 1e3
        t[1] += 1

    for thread in by_thread.values():
        thread.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list] = []  # [end, name, children's time, duration]
        for e in thread:
            ts, dur = float(e["ts"]), float(e["dur"])
            while stack and stack[-1][0] <= ts:
                close(stack.pop())
            if stack:
                stack[-1][2] += dur
            stack.append([ts + dur, str(e.get("name", "")), 0.0, dur])
        while stack:
            close(stack.pop())
    return dict(sorted(totals.items(), key=lambda kv: -kv[1][0])[:keep])


KEEP_KERNELS = 40
"""Kernels ``breakdown`` keeps (the most charged time first)."""


@functools.lru_cache(maxsize=1 << 16)
def short_name(name: str) -> str:
    """A kernel's name without its return type, template arguments and parameters (at most 64 chars; memoised)."""
    n = name.strip().replace("(anonymous namespace)::", "")
    if n.startswith("void "):
        n = n[5:]
    for stop in ("<", "("):
        if stop in n:
            n = n[:n.index(stop)]
    return n.strip()[:64] or name[:64]


def top_kernels(b: dict, categories=("other", "communication"), n: int = 4) -> dict:
    """The ``n`` kernels charged the most time of each of ``categories`` in a ``breakdown`` (or
    ``mean_breakdown``): {category: [(name, ms, launches), ...]}."""
    out = {c: [] for c in categories}
    for name, (cat, ms, count) in sorted((b.get("kernels") or {}).items(), key=lambda kv: -kv[1][1]):
        if cat in out and len(out[cat]) < n:
            out[cat].append((name, ms, count))
    return out


def kernel_lines(breakdowns: dict, n: int = 4) -> list[str]:
    """Per name (an arm), the ``n`` kernels that took the most of its breakdown's ``other`` time and of
    its exposed communication (ms and launches per step)."""
    out = []
    for k, b in breakdowns.items():
        top = top_kernels(b or {}, n=n)
        for cat, label in (("other", "other"), ("communication", "comm (exposed)")):
            if top[cat]:
                out.append(f"  {k} {label}: " + ", ".join(f"{name} {ms:.1f} ms x{c:.0f}" for name, ms, c in top[cat]))
        for key, label in (("host", "host (self time)"), ("idle_causes", "idle, by what the host was launching")):
            top = sorted(((b or {}).get(key) or {}).items(), key=lambda kv: -kv[1][0])[:n + 2]
            if top:
                out.append(f"  {k} {label}: " + ", ".join(f"{name[:48]} {ms:.1f} ms x{c:.0f}" for name, (ms, c) in top))
    return out


def device_only_line(name: str, b: dict) -> str:
    """One line of a device-only breakdown (``span`` window): how much of it kernels computed."""
    busy = b["attention"] + b["linear"] + b["other"]
    return (f"  {name}, profiled without host activity: {b['wall']:.1f} ms from the first CUDA call to the last "
            f"kernel, computing {busy / b['wall']:.0%} of it (attention {b['attention']:.1f}, linear {b['linear']:.1f}, "
            f"other {b['other']:.1f}; exposed comm {b['communication']:.1f}, idle {b['idle']:.1f})")


def rank_line(name: str, per_rank: list[dict]) -> str | None:
    """One line of an arm's ``breakdown_per_rank`` (rank order): each rank's idle and exposed communication (ms a
    step) and the rank whose GPU idled most in the *profiled* steps, whose host-side recording lengthens host work by
    ~1.5x: whether the timed steps wait for a host is ``harness.bench.host_lead``'s reading. None for fewer than two
    ranks."""
    if len(per_rank) < 2:
        return None
    idle = [p["idle"] for p in per_rank]
    late = max(range(len(idle)), key=idle.__getitem__)
    cells = ", ".join(f"{r}: {p['idle']:.1f} / {p['communication']:.1f}" for r, p in enumerate(per_rank))
    return (f"  {name} by rank (idle / exposed comm ms): {cells}; the most idle: rank {late}, "
            f"{idle[late] - min(idle):.1f} ms more than the least")


def mean_breakdown(parts: list[dict]) -> dict:
    """Element-wise mean of ``breakdown`` results (same source)."""
    if not parts:
        return {}
    keys = PARTS + ("wall", "host_syncs", "host_sync_ms")
    out = {k: sum(p.get(k, 0) for p in parts) / len(parts) for k in keys}
    out["source"] = parts[0]["source"]
    kernels: dict[str, list] = {}
    for p in parts:
        for name, (cat, ms, count) in (p.get("kernels") or {}).items():
            k = kernels.setdefault(name, [cat, 0.0, 0.0])
            k[1] += ms / len(parts)
            k[2] += count / len(parts)
    out["kernels"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1][1])[:KEEP_KERNELS])
    for key, keep in (("host", KEEP_KERNELS), ("idle_causes", KEEP_CAUSES)):
        table: dict[str, list] = {}
        for p in parts:
            for name, (ms, count) in (p.get(key) or {}).items():
                t = table.setdefault(name, [0.0, 0.0])
                t[0] += ms / len(parts)
                t[1] += count / len(parts)
        if table:
            out[key] = dict(sorted(table.items(), key=lambda kv: -kv[1][0])[:keep])
    return out
