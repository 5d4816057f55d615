"""The reviewer-flagged and harness-found scheduler defects as runnable cases (spec 2.8 and the
upstream differential suite), for the main job's report. The suites pin the same inputs in
``suites/plan/test_reviewed_bugs.py`` and ``suites/upstream/test_upstream_defects.py``.

Each case runs through every harness algorithm (expected: a valid schedule or a typed
``ValueError`` subclass, within a second) and through the installed megatron-core when it has the
feature (expected there: the defect).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from harness.plan import ALGORITHMS, PlanInputError, check_schedule, schedule
from harness.upstream import megatron


@dataclass(frozen=True)
class Case:
    key: str
    title: str
    lengths: list[int]
    kwargs: dict = field(default_factory=dict)


CASES = [
    Case("bug 2", "vacuous expansion check: a pushed group passes the last rank", [8000, 7000],
         dict(n_ranks=10, max_seqlen_per_rank=2048)),
    Case("bug 4", "sequence longer than the domain: truncated assert message", [5000],
         dict(n_ranks=4, max_seqlen_per_rank=1024)),
    Case("bug 9", "VPP alignment of a non-power-of-two domain loops forever", [7152, 2208],
         dict(n_ranks=24, max_seqlen_per_rank=1024, vpp_group=2)),
    Case("bug 10", "VPP alignment with one CP block per micro-batch cannot split", [100, 100, 100],
         dict(n_ranks=4, max_seqlen_per_rank=1024, min_cp_size=4, vpp_group=2)),
    Case("bug 12", "non-power-of-two min_cp_size has no process group", [100, 200],
         dict(n_ranks=8, max_seqlen_per_rank=1024, min_cp_size=3)),
    Case("bug 12b", "non-power-of-two domain: an 8-block in 12 ranks", [7000, 100],
         dict(n_ranks=12, max_seqlen_per_rank=1024)),
    Case("mc-0.16 capacity", "part 1 packs a group past max_seqlen_per_rank", [13, 12],
         dict(n_ranks=2, max_seqlen_per_rank=8)),
    Case("mc-0.16 alignment", "part 1 trim_overload + unsorted leftovers misalign a block",
         [27, 27, 19, 6, 61, 56, 60, 26, 29], dict(n_ranks=8, max_seqlen_per_rank=16)),
]


def _outcome(fn, limit_s: float = 10.0) -> dict:
    box: dict = {}

    def target():
        t = time.perf_counter()
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - we report whatever upstream raises
            box["error"] = e
        box["seconds"] = time.perf_counter() - t

    th = threading.Thread(target=target, daemon=True)
    th.start()
    th.join(limit_s)
    if th.is_alive():
        return {"kind": "hang", "text": f"no answer within {limit_s:g} s"}
    return box


def _describe(box: dict, case: Case, typed_ok: bool) -> dict:
    if box.get("kind") == "hang":
        return {"ok": False, **box}
    if "error" in box:
        e = box["error"]
        ok = typed_ok and isinstance(e, PlanInputError) and box["seconds"] < 1.0
        return {"ok": ok, "kind": "error", "text": f"{type(e).__name__}: {e}"}
    mbs = box["value"]
    mbs = mbs.microbatches if hasattr(mbs, "microbatches") else mbs
    bad = check_schedule(mbs, case.lengths, n_ranks=case.kwargs["n_ranks"],
                         max_seqlen_per_rank=case.kwargs["max_seqlen_per_rank"])
    if bad:
        return {"ok": False, "kind": "invalid",
                "text": "violates " + ", ".join(sorted({v.invariant for v in bad})) + f": {mbs}"}
    return {"ok": True, "kind": "valid", "text": f"valid schedule, {len(mbs)} micro-batch(es)"}


def run_ours(case: Case) -> dict[str, dict]:
    return {a: _describe(_outcome(lambda a=a: schedule(case.lengths, algorithm=a, **case.kwargs)), case, True)
            for a in ALGORITHMS}


def run_upstream(case: Case) -> dict | None:
    if not megatron.available():
        return None
    if case.kwargs.get("vpp_group") or case.kwargs.get("min_cp_size", 1) != 1:
        return {"ok": None, "kind": "n/a", "text": f"megatron-core {megatron.version()} has no such option"}
    kw = {k: case.kwargs[k] for k in ("n_ranks", "max_seqlen_per_rank")}
    return _describe(_outcome(lambda: megatron.sample_id_groups(case.lengths, **kw)), case, False)


def run_all() -> list[dict]:
    return [{"key": c.key, "title": c.title, "input": {"lengths": c.lengths, **c.kwargs},
             "ours": run_ours(c), "upstream": run_upstream(c)} for c in CASES]
