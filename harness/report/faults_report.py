"""The fault catalogue's report: a console table, an HTML section (its own page for
``dcp-harness faults``, a section of the main job's page) and markdown rows.

It reads a ``harness.faults.run.run_catalogue`` result; it never runs anything.
"""

from __future__ import annotations

from harness.report.html import Raw, esc, table
from harness.report.html import page as html_page


def _where(w: dict | None) -> str:
    if not w:
        return "-"
    return ", ".join(f"{k} {v}" for k, v in w.items() if v not in (None, [], "") and k != "layout") or "-"


def _margin(m) -> str:
    return "exact" if m is None else f"{m:,.0f}x"


def console(result: dict) -> str:
    rows = [("fault", "layer", "caught by", "where", "margin", "s")]
    for f in result["faults"]:
        rows.append((f["name"], f["layer"], f["caught_by"] if f["caught"] else f"MISSED ({f['caught_by'] or '-'})",
                     _where(f["where"])[:48], _margin(f["margin"]) if f["caught"] else "-", f"{f['seconds']:.1f}"))
    widths = [max(len(str(r[i])) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    clean = "; ".join(f"{k}: {'no alarm' if not v['alarms'] else v['alarms'][0]['message']}"
                      for k, v in result["clean"].items())
    lines += ["", f"clean runs: {clean}",
              f"faults caught: {result['caught']}/{result['total']} in {result['seconds']:.0f} s"]
    return "\n".join(lines)


def section(result: dict) -> str:
    """The HTML section: verdict line, the table, the clean runs, the checks."""
    rows, classes = [], []
    for f in result["faults"]:
        others = [f"{a['check']} ({_margin(a['margin'])})" for a in f["alarms"][1:]]
        rows.append([Raw(f'<b>{esc(f["name"])}</b><br><span class="small">{esc(f["title"])}</span>'),
                     Raw(f'<a href="{esc(f["url"])}">{esc(f["source"])}</a>'), f["layer"],
                     Raw(f'<code>{esc(f["seam"])}</code>'),
                     f["caught_by"] if f["caught"] else f"MISSED (expected {f['check']})",
                     _where(f["where"]), _margin(f["margin"]) if f["caught"] else "-",
                     Raw(f'<span class="small">{esc(f["message"])}</span>'),
                     Raw(f'<span class="small">{esc(", ".join(others) or "-")}</span>'), f"{f['seconds']:.1f}"])
        classes.append("" if f["caught"] else "fail")
    ok = result["clean_ok"] and result["caught"] == result["total"]
    clean = table([[k, "no alarm" if not v["alarms"] else v["alarms"][0]["message"], f"{v['seconds']:.1f}"]
                   for k, v in result["clean"].items()], ["scenario", "clean run", "s"], left=2)
    checks = table([[k, v] for k, v in result["checks"].items()], ["check", "what it asserts"], left=2)
    return "\n".join([
        "<h2>Fault catalogue</h2>",
        f'<p><span class="verdict {"pass" if ok else "fail"}">faults caught: {result["caught"]}/{result["total"]}'
        f'</span> <span class="meta">in {result["seconds"]:.0f} s; margin = observed deviation / tolerance of '
        f'the check that caught it ("exact": a count or an invariant)</span></p>',
        table(rows, ["fault", "source", "layer", "seam", "caught by", "where", "margin", "alarm", "also fired", "s"],
              left=10, classes=classes),
        "<h3>Clean runs (no check may fire)</h3>", clean,
        "<h3>Checks, cheapest first</h3>", checks])


def page(result: dict) -> str:
    prod = result.get("producer", {})
    head = (f'<h1>dcp-harness: fault catalogue</h1><p class="meta">git {esc(prod.get("git_rev"))} &middot; '
            f'{esc(prod.get("versions"))}</p>')
    return html_page("dcp-harness faults", head + section(result))


def markdown(result: dict) -> str:
    lines = [f"## Fault catalogue: {result['caught']}/{result['total']} caught", "",
             "| fault | layer | caught by | where | margin |", "|---|---|---|---|---|"]
    lines += [f"| {f['name']} | {f['layer']} | {f['caught_by'] if f['caught'] else 'MISSED'} | {_where(f['where'])} | "
              f"{_margin(f['margin']) if f['caught'] else '-'} |" for f in result["faults"]]
    return "\n".join(lines)
