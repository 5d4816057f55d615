"""Tiny HTML building blocks: one self-contained page (inline CSS, PNG plots as data URIs)."""

from __future__ import annotations

import base64
import html
import io

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1320px;color:#222;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em} h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.meta{color:#666;font-size:.9em} .verdict{font-size:1.3em;font-weight:600;padding:.4em .8em;border-radius:6px;display:inline-block}
.pass{background:#e3f4e1;color:#1b5e20} .fail{background:#fde4e1;color:#b71c1c} .na{color:#777}
table{border-collapse:collapse;font-size:.86em;margin:.6em 0} th,td{border:1px solid #ddd;padding:.25em .55em;text-align:right;vertical-align:top}
th{background:#f4f4f4} td.l,th.l{text-align:left} tr.best td{font-weight:600}
img{max-width:100%;border:1px solid #eee;margin:.5em 0} code{background:#f5f5f5;padding:0 .25em;border-radius:3px}
.small{font-size:.8em;color:#555;max-width:60em;overflow-wrap:anywhere}
table{max-width:100%} td{overflow-wrap:break-word} table.fixed{table-layout:fixed;width:100%}
table.fixed td,table.fixed th{padding:.2em .4em;line-height:1.3;overflow-wrap:anywhere} div.note{text-align:left}
details summary{cursor:pointer} details[open] summary{margin-bottom:.2em}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(36em,1fr));column-gap:1.5em} .grid h3{font-size:1em}
.grid td.l{white-space:nowrap}
"""


def esc(x) -> str:
    return html.escape(str(x))


def figure_png(fig) -> str:
    """A matplotlib figure as an <img> data URI (the figure is closed)."""
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return f'<img alt="plot" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def table(rows: list[list], header: list[str], left: int = 1, classes: list[str] | None = None,
          widths: list[str] | None = None) -> str:
    """HTML table; the first ``left`` columns are left-aligned. Cells are escaped unless they are
    ``Raw`` strings. ``widths`` (CSS widths, one per column) fix the layout to the page's width: long
    cells wrap inside their column instead of widening the table."""
    def cell(i, v, tag):
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{v if isinstance(v, Raw) else esc(v)}</{tag}>"

    head = "".join(cell(i, h, "th") for i, h in enumerate(header))
    body = "".join(f'<tr class="{(classes or [""] * len(rows))[k]}">' + "".join(cell(i, v, "td") for i, v in enumerate(r))
                   + "</tr>" for k, r in enumerate(rows))
    if widths is None:
        return f"<table><tr>{head}</tr>{body}</table>"
    cols = "".join(f'<col style="width:{w}">' for w in widths)
    return f'<table class="fixed"><colgroup>{cols}</colgroup><tr>{head}</tr>{body}</table>'


class Raw(str):
    """Markup that ``table`` must not escape."""


VERSION_ORDER = ("dcp-harness", "torch", "numpy", "megatron-core", "transformer-engine", "python")


def versions_line(versions: dict | None) -> str:
    """``{"torch": "2.13.0+cpu", "python": "3.11.7"}`` -> "torch 2.13.0+cpu &middot; python 3.11.7" (escaped
    HTML; the known packages first, then the rest in their order)."""
    names = sorted(versions or {}, key=lambda k: VERSION_ORDER.index(k) if k in VERSION_ORDER else len(VERSION_ORDER))
    return " &middot; ".join(f"{esc(k)} {esc(versions[k])}" for k in names)


def page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head><body>{body}</body></html>\n")
