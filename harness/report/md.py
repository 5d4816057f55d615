"""Markdown tables of the summaries (``summary.md``): every writer goes through ``table`` so that every
cell is escaped the same way.

A ``|`` inside a cell ends the cell in every markdown renderer, so ``max |delta loss|`` would split one
column into three; ``cell`` writes it as ``\\|``. A line break would end the row; it becomes a space.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def cell(value) -> str:
    """One cell's text: ``|`` escaped as ``\\|``, line breaks as spaces."""
    return " ".join(str(value).replace("|", "\\|").split("\n"))


def row(cells: Iterable) -> str:
    return "| " + " | ".join(cell(c) for c in cells) + " |"


def table(header: Sequence, rows: Iterable[Iterable]) -> list[str]:
    """The lines of a markdown table: the header, its rule, one line per row."""
    return [row(header), "|" + "---|" * len(header)] + [row(r) for r in rows]
