"""What a check's number means: its unit and which way is better, beside the bare value.

Checks are ``{"target": sentence, "value": number, "pass": bool}`` (``harness.bench.schedule``,
``harness.bench.schedule_targets``, ``harness.apps.converge``, the main job); reports read them and do not
reach back, so the unit comes from the target's wording: the first rule whose pattern the target
contains gives it. Worked example: "balanced quality < megatron-dev on ('wikipedia', 32, 256)" with
value 0.545 reads "balanced quality / megatron-dev quality: the ratio of their simulated step times on
the same batches; lower is better, below 1.0 balanced is faster".
"""

from __future__ import annotations

import re

from harness.report.html import Raw, esc, table

QUALITY = "simulated step time / its lower bound; lower is better, 1.0 = the lower bound"
RULES: tuple[tuple[str, str], ...] = (
    (r"quality < megatron-dev", "balanced / megatron-dev quality = ratio of their simulated step times on the "
                                "same batches; lower is better, < 1.0: balanced is faster"),
    (r"worst balanced / megatron-dev", "balanced step time / megatron-dev step time (simulated), the worst input; "
                                       "lower is better, 1.0 = as fast"),
    (r"geometric-mean speedup", "megatron-dev step time / balanced step time (simulated), geometric mean over the "
                                "inputs; higher is better, 1.0 = as fast"),
    (r"quality", QUALITY),
    (r"latency", "ms of wall time per global batch (median of repeated calls); lower is better"),
    (r"\|delta loss\|", "|loss - reference loss| per step, in loss units (nats per token); lower is better"),
    (r"relative \|delta grad norm\|", "|grad norm - reference grad norm| / reference grad norm per step, before "
                                      "clipping; lower is better"),
    (r"step-1 gradients", "||gradient - reference gradient|| / ||reference gradient|| of the worst parameter at "
                          "step 1 (relative L2); lower is better"),
    (r"step-1 token losses", "||token losses - reference's|| / ||reference's|| of the worst sequence at step 1 "
                             "(relative L2); lower is better"),
    (r"steps .*against the reference's", "the two curves have different lengths: not comparable (a failure)"),
    (r"step \d+: .* is (nan|inf|-inf)", "a non-finite value at that step: a failure whatever the tolerance"),
    (r"verdict of", "the case's own verdict: PASS, FAIL, NO REFERENCE or NOT EXERCISED"),
    (r"mean loss within", "|mean loss - reference mean loss| / reference mean loss; lower is better"),
    (r"micro-batches with a CP group", "micro-batches (a count); above 0: dynamic CP formed CP groups"),
    (r"^edge case", "algorithms with a typed error or a valid schedule, of all"),
    (r"^fault catalogue", "faults caught by their check, of all"),
    (r"deterministic", "inputs whose two calls gave different schedules (a count); 0 = deterministic"),
    (r"\bvalid\b", "batches or inputs with an invalid schedule (a count); 0 = all valid"),
)


def explain(target: str) -> str:
    """The unit of a check's value and how to read it ("" when no rule knows the target)."""
    return next((text for pattern, text in RULES if re.search(pattern, target)), "")


HEADER = ["check", "value", "unit: how to read it", "verdict"]


def mark(check: dict) -> str:
    if not check["pass"] and check.get("shown") in ("NO REFERENCE", "NOT EXERCISED"):
        return check["shown"]
    return "PASS" if check["pass"] else "NOT EXERCISED" if check.get("exercise") else "FAIL"


def rows(checks: list[dict], fmt: str = ".4g") -> list[list[str]]:
    """One row per check under ``HEADER`` (plain text: the markdown summaries' rows)."""
    return [[c["target"], c.get("shown", format(c["value"], fmt)), explain(c["target"]), mark(c)] for c in checks]


def html_table(checks: list[dict], fmt: str = ".4g") -> str:
    """The checks as an HTML table, the units in small print."""
    cells = [[t, v, Raw(f'<div class="small note">{esc(u)}</div>'), m] for t, v, u, m in rows(checks, fmt)]
    header = [Raw(f'<div class="note">{esc(h)}</div>') if i == 2 else h for i, h in enumerate(HEADER)]
    return table(cells, header, left=1)
