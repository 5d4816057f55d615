"""The scheduler-comparison report: ``index.html`` (plots embedded) and ``summary.md``."""

from __future__ import annotations

import datetime as dt

from harness.report import faults_report, md, plots, units
from harness.report.convergence_report import markdown, section
from harness.report.html import Raw, esc, figure_png, page, table, versions_line

TABLE_KEYS = [("scheduler", "scheduler"), ("latency_ms", "latency ms"), ("quality", "quality (GPT cost)"),
              ("quality_l2", "quality (L^2/cp)"), ("microbatches", "micro-batches"), ("invalid_batches", "invalid")]
QUALITY = ("Quality = simulated step time / its lower bound, a ratio of two times of the same batch: lower is "
           "better, 1.0 = the lower bound (no schedule can be faster)")


def _fmt(v) -> str:
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def _config_tables(rows: list[dict]) -> str:
    out = []
    for cfg in dict.fromkeys((r["distribution"], r["ranks"], r["sequences"]) for r in rows):
        sub = [r for r in rows if (r["distribution"], r["ranks"], r["sequences"]) == cfg]
        best = min(r["quality"] for r in sub)
        cells = [[r[k] if k == "scheduler" else _fmt(r[k]) for k, _ in TABLE_KEYS] + [", ".join(r["violations"]) or "-"]
                 for r in sub]
        out.append(f"<h3>{esc(cfg[0])}: {cfg[1]} ranks, {cfg[2]} sequences, max_seqlen_per_rank "
                   f"{sub[0]['max_seqlen_per_rank']}</h3>"
                   + table(cells, [h for _, h in TABLE_KEYS] + ["violated"], left=1,
                           classes=["best" if r["quality"] == best else "" for r in sub]))
    return "".join(f"<div>{x}</div>" for x in out)


def _edge_table(edges: list[dict]) -> str:
    algos = list(edges[0]["ours"]) if edges else []
    rows = []
    for e in edges:
        up = e["upstream"]
        up_text = "not installed" if up is None else f"{up['kind']}: {up['text']}"
        by_text: dict[tuple, list[str]] = {}
        for a, o in e["ours"].items():
            by_text.setdefault((o["ok"], o["text"]), []).append(a)
        ours = "<br>".join(f"<b>{esc(', '.join(names))}</b>: {'OK' if ok else 'FAIL'} - {esc(text)}"
                           for (ok, text), names in by_text.items())
        rows.append([e["key"], e["title"], Raw(f'<span class="small">{esc(e["input"])}</span>'),
                     Raw(f'<span class="small">{esc(up_text[:300])}</span>'), Raw(f'<span class="small">{ours}</span>')])
    return table(rows, ["case", "defect", "input", "installed megatron-core", f"harness ({', '.join(algos)})"], left=5)


CONVERGENCE_KEYS = ("convergence", "pipeline", "hybrid")
"""The main job's convergence cases in its ``result`` (``harness.apps.main_job.CASES``; reports never import
the job)."""


def render(result: dict) -> tuple[str, str]:
    """(html, markdown) for a main-job ``result`` (see ``harness.apps.main_job``)."""
    bench, checks, edges = result["bench"], result["checks"], result["edge_cases"]
    ok = result["verdict"] == "PASS"
    stamp = result.get("finished", dt.datetime.now().isoformat(timespec="seconds"))
    cases = [result[k] for k in CONVERGENCE_KEYS if result.get(k) is not None]
    conv_html = ""
    if cases:
        conv_html = "".join(section(c, None) for c in cases)
    body = [
        "<h1>dcp-harness: convergence, scheduler comparison, edge cases, fault catalogue</h1>",
        f'<p class="meta">{esc(stamp)} &middot; git {esc(result["producer"].get("git_rev"))} &middot; '
        f'{versions_line(result["producer"]["versions"])} &middot; {bench["batches"]} global batches per configuration</p>',
        f'<p><span class="verdict {"pass" if ok else "fail"}">{result["verdict"]}</span></p>',
        "<h2>Checks</h2>", units.html_table(checks),
        conv_html,
        "<h2>Scheduler comparison</h2>",
        f"<p>{QUALITY}; under the cost of a 12-layer, hidden-2048, "
        "FFN-8192 GPT with K/V exchange priced at 1000 FLOP/byte; <i>balanced</i> is given that cost, "
        "<i>balanced[L2]</i> only upstream's L&sup2;/cp estimate. Latency checks are informational here: "
        "<code>dcp-harness bench schedule</code> gates them. \"balanced quality &lt; megatron-dev\" in the checks is "
        "balanced's quality / megatron-dev's on the same batches: below 1.0 balanced's step is that fraction of "
        "megatron-dev's.</p>",
        "<h3>Quality</h3>",
        figure_png(plots.grouped_bars(bench["rows"], "quality", "step time / lower bound\n(lower is better; 1.0 = bound)",
                                      ref=1.0)),
        "<h3>Latency per global batch</h3>", figure_png(plots.grouped_bars(bench["rows"], "latency_ms", "ms (log)", log=True)),
        "<h3>One global batch, rank by rank</h3>",
        f"<p>{esc(result['timeline']['title'])}. White gaps: a rank waits for the other members of its next CP block "
        "(or has finished).</p>",
        result["timeline"]["img"],
        "<h2>Edge cases (spec 2.8 and defects found by the differential suite)</h2>", _edge_table(edges),
        faults_report.section(result["faults"]) if result.get("faults") else "",
        "<h2>Per configuration</h2>", f"<p>{QUALITY}; latency in ms of wall time per global batch (median); "
        "invalid: batches whose schedule breaks an invariant (violated: which); the bold row has the best quality."
        f'</p><div class="grid">{_config_tables(bench["rows"])}</div>',
    ]
    return page("dcp-harness run", "\n".join(body)), _markdown(result, cases, stamp)


def _markdown(result: dict, cases: list, stamp: str) -> str:
    bench = result["bench"]
    lines = [f"# dcp-harness run: {result['verdict']}", "", f"{stamp}, git {result['producer'].get('git_rev')}", ""]
    lines += md.table(units.HEADER, units.rows(result["checks"]))
    for c in cases:
        lines += ["", markdown(c)]
    if result.get("faults"):
        lines += ["", faults_report.markdown(result["faults"])]
    lines += ["", QUALITY + "."]
    lines += [""] + md.table(["distribution", "ranks", "seqs", "scheduler", "latency ms", "quality", "q(L^2/cp)", "#mb",
                              "invalid"],
                             [[r["distribution"], r["ranks"], r["sequences"], r["scheduler"], f"{r['latency_ms']:.2f}",
                               f"{r['quality']:.3f}", f"{r['quality_l2']:.3f}", f"{r['microbatches']:.0f}",
                               r["invalid_batches"]] for r in bench["rows"]])
    lines += [""] + md.table(["edge case", "harness", "megatron-core"],
                             [[f"{e['key']}: {e['title']}", "all OK" if all(o["ok"] for o in e["ours"].values())
                               else "FAIL", "not installed" if e["upstream"] is None else e["upstream"]["kind"]]
                              for e in result["edge_cases"]])
    return "\n".join(lines) + "\n"
