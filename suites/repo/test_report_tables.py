"""What the reports write beside the pictures: markdown tables that keep their columns, a unit beside every
check's number, a readable versions line, and loss plots that survive exact zeros and non-finite losses."""

from __future__ import annotations

import math
import re

import pytest

from harness.report import md, units
from suites.repo.report_examples import convergence_result, loss_rows, main_result

CELL_SPLIT = re.compile(r"(?<!\\)\|")


def tables(markdown: str) -> list[list[list[str]]]:
    """Every table of a markdown text: its rows (header first, rule dropped), each row's cells unescaped."""
    out, current = [], []
    for line in markdown.splitlines() + [""]:
        if line.startswith("|"):
            cells = [c.strip().replace("\\|", "|") for c in CELL_SPLIT.split(line)[1:-1]]
            if not all(set(c) <= {"-"} for c in cells):
                current.append(cells)
        elif current:
            out.append(current)
            current = []
    return out


@pytest.fixture(scope="module")
def summary() -> str:
    from harness.report.schedule_report import render

    return render(main_result())[1]


def test_a_cell_with_pipes_stays_one_cell():
    assert md.row(["max |delta loss| <= 1e-05", "a\nb", 3]) == "| max \\|delta loss\\| <= 1e-05 | a b | 3 |"
    assert md.table(["x", "y"], [[1, "|2|"]]) == ["| x | y |", "|---|---|", "| 1 | \\|2\\| |"]


def test_every_summary_table_row_has_its_header_s_column_count(summary):
    found = tables(summary)
    assert len(found) >= 6  # checks, convergence checks and layouts, faults, scheduler rows, edge cases
    for t in found:
        assert {len(r) for r in t} == {len(t[0])}, t[0]
    checks = found[0]
    assert checks[0] == units.HEADER
    delta = [r for r in checks if r[0].startswith("thd vs bshd: max |delta loss|")]
    assert delta and delta[0][3] == "PASS" and "|loss - reference loss|" in delta[0][2]
    layouts = next(t for t in found if t[0][0] == "layout")
    assert layouts[0][3] == "max |delta| vs bshd" and [r[0] for r in layouts[1:]] == ["bshd", "thd", "dcp"]


def test_every_check_of_the_main_job_says_its_unit(summary):
    rows = next(t for t in tables(summary) if t[0] == units.HEADER)[1:]
    assert rows and all(r[2] for r in rows), [r[0] for r in rows if not r[2]]
    ratio = [r for r in rows if r[0].startswith("balanced quality < megatron-dev")]
    assert ratio and all("lower is better" in r[2] and "step times" in r[2] for r in ratio)
    assert "1.0 = the lower bound" in units.explain("balanced quality <= 1.05 on ('lognormal-1024', 8, 256)")


def test_the_versions_are_a_line_not_a_dict():
    from harness.report.html import versions_line

    line = versions_line({"python": "3.11.7", "numpy": "2.4.6", "dcp-harness": "0.1.0", "torch": "2.13.0+cpu"})
    assert line == "dcp-harness 0.1.0 &middot; torch 2.13.0+cpu &middot; numpy 2.4.6 &middot; python 3.11.7"
    assert versions_line(None) == ""


def _texts(fig) -> str:
    return " ".join([ax.get_title(loc="left") for ax in fig.axes]
                    + [t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()])


def test_overlapping_curves_are_said_to_overlap_and_their_differences_drawn_first():
    from harness.report import loss_plots

    fig = loss_plots.loss_curves(loss_rows(steps=20))
    diff, loss = fig.axes
    assert diff.get_yscale() == "log" and diff.get_position().y0 > loss.get_position().y0  # differences on top
    assert "curves overlap: max |delta| vs bshd = 1.70e-07" in _texts(fig)


def test_loss_plots_survive_zero_and_non_finite_differences():
    from harness.report import loss_plots
    from harness.report.html import figure_png

    rows = loss_rows(steps=6, deltas={"bshd": 0.0, "thd": 0.0, "dcp": 2e-7})
    rows["dcp"][2]["loss"], rows["dcp"][4]["loss"] = math.nan, math.inf
    fig = loss_plots.loss_curves(rows)
    text = _texts(fig)
    assert "thd: = 0 (at the floor)" in text and "dcp: non-finite loss" in text and "(2 non-finite)" in text
    assert figure_png(fig).startswith("<img")
    assert loss_plots.max_text(loss_plots.deltas(rows)["dcp"]).endswith("(2 non-finite)")
    only = loss_plots.loss_curves({"bshd": rows["bshd"]})  # nothing to compare: the loss panel alone
    assert len(only.axes) == 1


def test_the_convergence_summary_escapes_its_headers():
    from harness.report.convergence_report import markdown

    text = markdown(convergence_result(loss_rows(steps=5)))
    assert "max \\|delta\\| vs bshd" in text and re.search(r"(?<!\\)\|delta", text) is None
