"""What the device waited for: each idle stretch of a profiled step, charged to the host operator that launched the
kernel ending it (``harness.bench.trace.breakdown``'s ``idle_causes``).

A stretch with no kernel running ends when the host's next launch reaches the device. The kernel that ends it
carries the correlation id of its launch (``cudaLaunchKernel`` / ``cuLaunchKernelEx`` ...), and the launch lies inside
the host operators that made it; the innermost of them on the launching thread names what the host was doing while
the device waited: ``aten::_flash_attention_backward`` (the attention's backward being prepared), ``aten::mm``, a
collective (``nccl:_all_gather_base``), a copy. A stretch before the window's first kernel is ``(before the first
kernel)`` (the step's scheduling and data on the host), one after its last ``(after the last kernel)``, and one whose
launch the profile did not record (a device-only profile: no host operators) ``(no host operator)``. The stretches
add up to the breakdown's ``idle``.
"""

from __future__ import annotations

import bisect
import itertools

KEEP_CAUSES = 24
"""Host operators ``idle_causes`` keeps (the most idle time first)."""

BEFORE, AFTER, UNKNOWN = "(before the first kernel)", "(after the last kernel)", "(no host operator)"
_COMPILED = "## Call CompiledFxGraph"


def _op_name(name: str) -> str:
    """A host operator's name as the table shows it: a compiled graph's call without its hash."""
    return "compiled graph call" if name.startswith(_COMPILED) else name[:64]


class _Threads:
    """Per (pid, tid): the host operators sorted by start, to find the innermost one around an instant."""

    def __init__(self, ops: list[dict]):
        self.ops: dict = {}
        for e in ops:
            self.ops.setdefault((e.get("pid"), e.get("tid")), []).append(
                (float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", ""))))
        self.starts, self.reach = {}, {}
        for k, v in self.ops.items():
            v.sort()
            self.starts[k] = [a for a, _, _ in v]
            self.reach[k] = list(itertools.accumulate((b for _, b, _ in v), max))  # the latest end so far

    def innermost(self, thread, t: float) -> str | None:
        """The latest-starting operator of ``thread`` that contains ``t`` (the innermost: operators nest)."""
        ops = self.ops.get(thread)
        if not ops:
            return None
        reach = self.reach[thread]
        for i in range(bisect.bisect_right(self.starts[thread], t) - 1, -1, -1):
            if reach[i] < t:  # no operator from here back reaches t: stop scanning
                return None
            a, b, name = ops[i]
            if b >= t:
                return name
        return None


def idle_causes(evs: list[dict], window: tuple[float, float], device: list[dict], runtime_cats: tuple[str, ...],
                keep: int = KEEP_CAUSES) -> dict:
    """{cause: [idle ms, stretches]} of ``window`` (``device``: its kernels, copies and memsets), the most first."""
    t0, t1 = window
    launches = {}
    for e in evs:
        if e.get("cat") in runtime_cats and isinstance(e.get("args"), dict) and "correlation" in e["args"]:
            launches[e["args"]["correlation"]] = e
    threads = _Threads([e for e in evs if e.get("cat") == "cpu_op"])
    spans = sorted((max(t0, float(e["ts"])), min(t1, float(e["ts"]) + float(e["dur"])), e) for e in device
                   if float(e["ts"]) < t1 and float(e["ts"]) + float(e["dur"]) > t0)
    out: dict[str, list] = {}

    def charge(cause: str, us: float) -> None:
        c = out.setdefault(cause, [0.0, 0])
        c[0] += us / 1e3
        c[1] += 1

    end = None
    for a, b, e in spans:
        if a > (t0 if end is None else end):
            if end is None:
                charge(BEFORE, a - t0)
            else:
                launch = launches.get((e.get("args") or {}).get("correlation"))
                name = threads.innermost((launch.get("pid"), launch.get("tid")), float(launch["ts"])) if launch else None
                charge(_op_name(name) if name else UNKNOWN, a - end)
        end = b if end is None else max(end, b)
    if end is None:
        charge(BEFORE, t1 - t0)
    elif end < t1:
        charge(AFTER, t1 - end)
    return dict(sorted(out.items(), key=lambda kv: -kv[1][0])[:keep])
