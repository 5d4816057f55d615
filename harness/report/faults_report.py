"""The fault catalogue's report: a console table, an HTML section (its own page for
``dcp-harness faults``, a section of the main job's page) and markdown rows.

It reads a ``harness.faults.run.run_catalogue`` result; it never runs anything.
"""

from __future__ import annotations

from harness.report import md
from harness.report.html import Raw, esc, table, versions_line
from harness.report.html import page as html_page


def _where(w: dict | None) -> str:
    if not w:
        return "-"
    return ", ".join(f"{k} {v}" for k, v in w.items() if v not in (None, [], "") and k != "layout") or "-"


def _margin(m, nonfinite: bool = False) -> str:
    """A numeric check's margin; ``non-finite`` when it fired on NaN or inf, ``exact`` for counts and invariants."""
    return "non-finite" if nonfinite else "exact" if m is None else f"{m:,.0f}x"


def clean_text(run: dict) -> str:
    """A clean run's outcome: its error (a run that died proves nothing), its first alarm, or "no alarm"."""
    if run.get("error"):
        return f"ERROR: {run['error']}"
    return "no alarm" if not run["alarms"] else run["alarms"][0]["message"]


def console(result: dict) -> str:
    rows = [("fault", "layer", "caught by", "where", "margin", "s")]
    for f in result["faults"]:
        rows.append((f["name"], f["layer"], f["caught_by"] if f["caught"] else f"MISSED ({f['caught_by'] or '-'})",
                     _where(f["where"])[:48], _margin(f["margin"], f.get("nonfinite")) if f["caught"] else "-",
                     f"{f['seconds']:.1f}"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    numeric, floor = [f for f in result["faults"] if f["margin"] is not None], 10  # suites/faults' minimum margin
    if numeric:
        weak, fmt = min(numeric, key=lambda f: f["margin"]), lambda m: _margin(m) if m >= 100 else f"{m:.3g}x"
        nonfinite = sum(bool(f.get("nonfinite")) for f in result["faults"])
        lines += ["", f"margins: weakest {fmt(weak['margin'])} ({weak['name']}, {weak['check']}) of {len(numeric)} "
                      f"numeric; {nonfinite} non-finite; {len(result['faults']) - len(numeric) - nonfinite} exact"
                  + ("" if weak["margin"] >= floor else f"; BELOW the {floor}x floor: "
                     + ", ".join(f"{f['name']} {fmt(f['margin'])}" for f in numeric if f["margin"] < floor))]
    clean = "; ".join(f"{k}: {clean_text(v)}" for k, v in result["clean"].items())
    lines += ["", f"clean runs: {clean}",
              f"faults caught: {result['caught']}/{result['total']} in {result['seconds']:.0f} s"]
    return "\n".join(lines)


SHORT = 72
"""Characters of an alarm's message shown before its <details> is opened."""
COLUMNS = [("fault", "19%"), ("source", "24%"), ("layer", "6.5%"), ("caught by, margin", "12%"), ("where", "12%"),
           ("alarm (open for the seam and the other checks that fired)", "23%"), ("s", "3.5%")]
"""The catalogue table's columns and their share of the page: fixed, so that every column stays on a
1400-pixel screen and long text wraps inside its cell."""


def _small(text: str) -> str:
    return f'<span class="small">{esc(text)}</span>'


def _alarm(f: dict) -> Raw:
    """The alarm in one line (its start) and, opened, the whole message, the seam and the other alarms."""
    msg = f["message"] or "-"
    head = msg if len(msg) <= SHORT else msg[:SHORT].rsplit(" ", 1)[0] + " ..."
    others = ", ".join(f"{a['check']} ({_margin(a['margin'])})" for a in f["alarms"][1:]) or "-"
    body = "".join([f"<div>{esc(msg)}</div>" if head != msg else "",
                    f'<div>seam <code>{esc(f["seam"])}</code></div>', f"<div>also fired: {esc(others)}</div>"])
    return Raw(f'<details class="small"><summary>{esc(head)}</summary>{body}</details>')


def _source(f: dict) -> Raw:
    """The source's name as the link, its account after it: "Megatron-LM PR #3405: RoPE computed ..."."""
    name, sep, rest = f["source"].partition(": ")
    return Raw(f'<span class="small"><a href="{esc(f["url"])}">{esc(name)}</a>{esc(sep + rest)}</span>')


def _row(f: dict) -> list:
    caught = f'{esc(f["caught_by"])}<br>{_margin(f["margin"], f.get("nonfinite"))}' if f["caught"] else f"MISSED (expected {esc(f['check'])})"
    return [Raw(f'<b>{esc(f["name"])}</b><br>{_small(f["title"])}'),
            _source(f), f["layer"], Raw(caught),
            Raw(_small(_where(f["where"]))), _alarm(f), f"{f['seconds']:.1f}"]


def section(result: dict) -> str:
    """The HTML section: verdict line, the table, the clean runs, the checks."""
    rows = [_row(f) for f in result["faults"]]
    classes = ["" if f["caught"] else "fail" for f in result["faults"]]
    ok = result["clean_ok"] and result["caught"] == result["total"]
    clean = table([[k, clean_text(v), f"{v['seconds']:.1f}"]
                   for k, v in result["clean"].items()], ["scenario", "clean run", "s"], left=2)
    checks = table([[k, v] for k, v in result["checks"].items()], ["check", "what it asserts"], left=2)
    return "\n".join([
        "<h2>Fault catalogue</h2>",
        f'<p><span class="verdict {"pass" if ok else "fail"}">faults caught: {result["caught"]}/{result["total"]}'
        f'</span> <span class="meta">in {result["seconds"]:.0f} s; margin = observed deviation / tolerance of '
        f'the check that caught it ("exact": a count or an invariant)</span></p>',
        table(rows, [h for h, _ in COLUMNS], left=len(COLUMNS) - 1, classes=classes, widths=[w for _, w in COLUMNS]),
        "<h3>Clean runs (no check may fire)</h3>", clean,
        "<h3>Checks, cheapest first</h3>", checks])


def page(result: dict) -> str:
    prod = result.get("producer", {})
    head = (f'<h1>dcp-harness: fault catalogue</h1><p class="meta">git {esc(prod.get("git_rev"))} &middot; '
            f'{versions_line(prod.get("versions"))}</p>')
    return html_page("dcp-harness faults", head + section(result))


def markdown(result: dict) -> str:
    rows = [[f["name"], f["layer"], f["caught_by"] if f["caught"] else "MISSED", _where(f["where"]),
             _margin(f["margin"], f.get("nonfinite")) if f["caught"] else "-"] for f in result["faults"]]
    return "\n".join([f"## Fault catalogue: {result['caught']}/{result['total']} caught", ""]
                     + md.table(["fault", "layer", "caught by", "where", "margin"], rows))
