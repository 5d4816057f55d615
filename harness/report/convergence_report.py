"""Convergence section and standalone report (``reports/converge-<time>/index.html``)."""

from __future__ import annotations

import statistics

from harness.report import loss_plots, md, pipeline_report, plots, units
from harness.report.html import esc, figure_png, page, table


def _pipelined(result) -> bool:
    return int(result.config.get("pp", 1)) > 1


def _pipeline_section(result, schedules, markdown: bool = False) -> str:
    """The pipeline timelines and bubbles of step 0 ("" for PP = 1 or a result without its step-0 schedules;
    ``harness.report.pipeline_report``), simulated on the schedules under the trained model's cost."""
    if not _pipelined(result) or not schedules:
        return ""
    render = pipeline_report.markdown if markdown else pipeline_report.section
    return render(result.rows, result.config, schedules, result.cost)


def summary_rows(result) -> list[list]:
    ref = "bshd" if "bshd" in result.rows else next(iter(result.rows))
    diffs = loss_plots.deltas(result.rows, ref)
    out = []
    for layout, rs in result.rows.items():
        d = loss_plots.max_text(diffs[layout]) if layout in diffs else "0 (reference)"
        out.append([layout, f"{rs[0]['loss']:.5f}", f"{rs[-1]['loss']:.5f}", d,
                    f"{statistics.median(r['tokens_per_s'] for r in rs):.0f}",
                    f"{100 * statistics.fmean(r['padding_fraction'] for r in rs):.1f}%",
                    f"{statistics.fmean(r['microbatches'] for r in rs):.1f}"])
    return out


HEADER = ["layout", "first loss", "last loss", "max |delta| vs bshd", "tokens/s (median)", "padding", "micro-batches"]


def section(result, tracking: dict | None = None) -> str:
    c = result.config
    schedules = result.schedules or {}
    track = "" if tracking is None else f"<p class=\"meta\">tracking: {esc(tracking)}</p>"
    return "".join([
        f"<h2>Convergence: bshd vs THD packing vs dynamic CP ({esc(result.case_id)})</h2>",
        f'<p class="meta">model {esc(c["model"])}, {c["world"]} ranks ({esc(c["hardware"])}, {esc(c["dtype"])}), '
        f'{c["steps"]} steps, {c["corpus"]["sequences_per_batch"]} sequences per global batch '
        f'({esc(c["corpus"]["lengths"])}), max_seqlen_per_rank {c["max_seqlen_per_rank"]}, static CP {c["static_cp"]}, '
        f'scheduler {esc(c["scheduler"])}; golden: {esc(c["golden"] or "not compared")}</p>', track,
        _exercise_line(c.get("dcp_exercise")),
        units.html_table(result.checks, ".3g"),
        table(summary_rows(result), HEADER, left=1),
        figure_png(loss_plots.loss_curves(result.rows)),
        figure_png(plots.layout_bars(result.rows)),
        *(["<h3>One global batch (step 0) in each layout</h3>",
           "<p>Ranks x micro-batches; a rectangle is a CP block, coloured by its first sequence, labelled with its "
           "size.</p>", figure_png(plots.schedule_grids(schedules))] if schedules else []),
        _pipeline_section(result, schedules),
    ])


def _exercise_line(ex: dict | None) -> str:
    """What dynamic CP did in the dcp layout (``harness.apps.converge.dcp_exercise``)."""
    if not ex:
        return ""
    sizes = ", ".join(f"CP {k}: {v}" for k, v in ex["cp_groups"].items())
    return (f'<p class="meta">dynamic CP: CP groups formed over {ex["microbatches"]} micro-batches: {esc(sizes)} '
            f'({ex["distinct_sizes"]} distinct sizes); {ex["microbatches_cp_gt1"]} micro-batches with CP &gt; 1; '
            f'{ex["steps_mixed"]} of {ex["steps"]} steps mixed CP 1 and CP {ex["largest"]}</p>')


def markdown(result) -> str:
    lines = [f"## Convergence {result.case_id}: {result.verdict}", ""]
    lines += md.table(units.HEADER, units.rows(result.checks, ".3g"))
    lines += [""] + md.table(HEADER, summary_rows(result))
    pipe = _pipeline_section(result, result.schedules, markdown=True)
    return "\n".join(lines) + "\n" + ("\n" + pipe if pipe else "")


def render_standalone(result, tracking: dict | None) -> tuple[str, str]:
    ok = result.verdict == "PASS"
    body = (f"<h1>dcp-harness convergence: {esc(result.case_id)}</h1>"
            f'<p><span class="verdict {"pass" if ok else "fail"}">{result.verdict}</span></p>' + section(result, tracking))
    return page(f"dcp-harness {result.case_id}", body), markdown(result)
