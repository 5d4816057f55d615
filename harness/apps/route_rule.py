"""The tie-aware MoE rule of ``converge``: how long two runs of an MoE model must agree step by step.

Two layouts of an MoE model compute the same maths in another order, so their router logits differ by rounding; a
token whose k-th and (k+1)-th logits are closer than that rounding (a near-tie) may take other experts in one run,
and from that step on the two trajectories separate. A fixed strict span (the first N steps) either fails a correct
run whose near-tie flips early or lets a routing bug's late steps go unchecked. Here each run records its routes
(``harness.train.routes``: per MoE layer and cell of ``harness.train.routes.BLOCK`` positions of a sequence, a
digest of the expert sets its tokens took and their smallest top-k margin), and the comparison of a run with its
reference reads them:

- routes equal at every step: the per-step loss rule holds over **every** step;
- routes first differ at step s, only where the reference's or the run's smallest margin is within ``TIE`` of a tie
  (rounding flipped a near-tie): the per-step rule holds over the s steps before it, the late-window band after;
- routes differ where no choice was near a tie: a routing bug - a failing check naming the step, layer, sequence,
  position and margin, and the fixed span (``MOE_EXACT_STEPS``) for the losses.

A cell's smallest margin bounds the margin of the token that flipped from below, so a bug that flips only tokens of
cells that also hold a near-tie passes this check (the loss checks of the strict span still see it). bf16 runs on
GPUs flip near-ties from the first step (their rounding is far coarser) and keep the fixed span; their first route
differences are recorded (``differences``), not judged: no bf16 ``TIE`` is calibrated yet.
"""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np

from harness.train.records import first_difference

TIE = {"float32": 3e-5}
"""The largest top-k margin (router logits, absolute) a rounding difference between two fp32 runs may flip. Measured
(tiny-moe, 4 CPU ranks, the nightly corpus with seed 0): the tokens that flipped had margins of 4e-8 to 3.7e-6 in the
two runs; a planted RoPE bug flipped cells whose smallest margins were 2.5e-4 to 7.4e-4."""


def load(entry: dict | None) -> dict | None:
    """One layout's route arrays from what a job returned (``harness.train.trainer._routes_result``), or None."""
    if not entry:
        return None
    if "file" in entry:
        if not Path(entry["file"]).exists():
            return None
        source = entry["file"]
    else:
        source = io.BytesIO(base64.b64decode(entry["npz"]))
    with np.load(source) as z:
        return {k: z[k] for k in z.files}


def judge(who: str, own: dict | None, ref: dict | None, dtype: str, fixed: int) -> tuple[tuple[int | None, str], list]:
    """The span of the per-step rule for the run ``who`` (``"dcp vs bshd"``) against its reference, and the route
    checks (a list of zero or one check). ``own`` / ``ref``: route arrays (``load``); ``fixed``: the span to fall
    back on (``MOE_EXACT_STEPS``)."""
    why = "MoE routing"
    if own is None or ref is None or dtype not in TIE:
        return (fixed, why), []
    d = first_difference(own, ref)
    if d is None:
        return (None, why), []
    tie, step = TIE[dtype], d["step"] + 1
    layer, seq, pos, ref_m, own_m = d["cells"][0]
    where = f"layer {layer}, sequence {seq} from position {pos}" + \
        (f", and {d['count'] - 1} more cells" if d["count"] > 1 else "")
    if d["worst_margin"] <= tie:
        return (d["step"], why), [{
            "target": f"{who}: routes equal until step {step}, then differ only at near-ties (largest top-k margin "
                      f"of a differing cell <= {tie:g}; {where})", "value": d["worst_margin"], "limit": tie,
            "pass": True, "route_difference": d}]
    return (fixed, why), [{
        "target": f"{who}: routes differ at step {step} where no top-k choice was near a tie ({where}: smallest "
                  f"margin {min(ref_m, own_m):.3g} > {tie:g}): a routing bug, not rounding",
        "value": d["worst_margin"], "limit": tie, "pass": False, "route_difference": d}]


def span_of(checks: list[dict], fixed: int) -> int | None:
    """The shortest per-step span the route checks among ``checks`` set (``judge``): a passing one's first
    difference, a failing one's ``fixed``; None when no route differed (every step was held per step)."""
    spans = [c["route_difference"]["step"] if c["pass"] else fixed for c in checks if "route_difference" in c]
    return min(spans) if spans else None


def differences(routes: dict[str, dict | None], ref_routes: dict | None, ref_name: str) -> dict:
    """Where each layout's routes first part from bshd's and from the reference's (``first_difference``; None: they
    never do), recorded for every precision - bf16 runs are not judged by them (``judge``), and their records are
    what a bf16 ``TIE`` would be calibrated from. Empty without route records (a dense model)."""
    base = "bshd" if "bshd" in routes else next(iter(routes), None)
    out = {}
    for layout, own in routes.items():
        if own is None:
            continue
        if layout != base and routes.get(base) is not None:
            out[f"{layout} vs {base}"] = first_difference(own, routes[base])
        if ref_routes is not None:
            out[f"{layout} vs {ref_name}"] = first_difference(own, ref_routes)
    return out
