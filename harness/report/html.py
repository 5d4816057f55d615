"""Tiny HTML building blocks: one self-contained page (inline CSS, PNG plots as data URIs)."""

from __future__ import annotations

import base64
import html
import io

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:2em auto;max-width:1200px;color:#222;padding:0 1em}
h1{font-size:1.6em;margin-bottom:.2em} h2{font-size:1.25em;margin-top:1.8em;border-bottom:1px solid #ddd;padding-bottom:.2em}
.meta{color:#666;font-size:.9em} .verdict{font-size:1.3em;font-weight:600;padding:.4em .8em;border-radius:6px;display:inline-block}
.pass{background:#e3f4e1;color:#1b5e20} .fail{background:#fde4e1;color:#b71c1c} .na{color:#777}
table{border-collapse:collapse;font-size:.86em;margin:.6em 0} th,td{border:1px solid #ddd;padding:.25em .55em;text-align:right;vertical-align:top}
th{background:#f4f4f4} td.l,th.l{text-align:left} tr.best td{font-weight:600}
img{max-width:100%;border:1px solid #eee;margin:.5em 0} code{background:#f5f5f5;padding:0 .25em;border-radius:3px}
.small{font-size:.8em;color:#555;max-width:60em;overflow-wrap:anywhere}
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


def table(rows: list[list], header: list[str], left: int = 1, classes: list[str] | None = None) -> str:
    """HTML table; the first ``left`` columns are left-aligned. Cells are escaped unless they are
    ``Raw`` strings."""
    def cell(i, v, tag):
        cls = ' class="l"' if i < left else ""
        return f"<{tag}{cls}>{v if isinstance(v, Raw) else esc(v)}</{tag}>"

    head = "".join(cell(i, h, "th") for i, h in enumerate(header))
    body = "".join(f'<tr class="{(classes or [""] * len(rows))[k]}">' + "".join(cell(i, v, "td") for i, v in enumerate(r))
                   + "</tr>" for k, r in enumerate(rows))
    return f"<table><tr>{head}</tr>{body}</table>"


class Raw(str):
    """Markup that ``table`` must not escape."""


def page(title: str, body: str) -> str:
    return (f"<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>{esc(title)}</title>"
            f"<style>{CSS}</style></head><body>{body}</body></html>\n")
