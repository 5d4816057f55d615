"""The nightly page (``<root>/index.html``), drawn from the history and the latest runs' results.

Top: one row per case and hardware + precision with the last verdict, date and commit, the margin
(tolerance / observed deviation of the tightest check) now and its median over the last ``WINDOW``
runs (the latest included), and a flag where the margin shrank by ``SHRINK`` x or more against that
median or the verdict changed. Then per case: trends against the run date (max |delta| against bshd
with the tolerance drawn, tokens/s and last loss per layout; one marker and line style per hardware +
precision), the latest run's per-step loss of every layout against the golden (or bshd) with the
tolerance band, and the history with links to each run's report and wandb runs (relative links, so the
folder can be served or copied as it is). Reads ``history.jsonl`` lines and ``results.json`` files only.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import statistics
from pathlib import Path

from harness.io import atomic_write_text
from harness.report.html import Raw, esc, figure_png, page, table

WINDOW, SHRINK, ROWS = 7, 2.0, 20
COLORS = {"bshd": "k", "thd": "#ff7f0e", "dcp": "#1f77b4"}
STYLES = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]
CSS = """.flag{color:#b71c1c;font-weight:600} .ok{color:#1b5e20} .ne{color:#8a6d00;font-weight:600}
td a{margin-right:.5em}"""


def series(entry: dict) -> str:
    """``<hardware> <precision>``: one line of a case's plots (precision read off the case id for the
    first format)."""
    prec = entry.get("precision") or entry["case_id"].rsplit("__", 1)[-1]
    return f"{entry.get('hardware', '?')} {prec}"


def case_key(entry: dict) -> str:
    """The case without its precision: CPU fp32 and GPU bf16 runs of one configuration share a section
    and differ by series."""
    return entry["case_id"].rsplit("__", 1)[0]


def _margin(e: dict) -> float | None:
    """The entry's margin: a number, inf (no deviation at all), or None (unknown: old format, no run)."""
    if "margin" not in e or not e.get("run"):
        return None
    return math.inf if e["margin"] is None else float(e["margin"])


def _fmt_margin(m: float | None) -> str:
    return "-" if m is None else "no deviation" if math.isinf(m) else f"{m:.3g}x"


def _verdict(v: str) -> Raw:
    cls = "ok" if v == "PASS" else "ne" if v in ("NOT EXERCISED", "NO REFERENCE") else "flag"
    return Raw(f'<span class="{cls}">{esc(v)}</span>')


def flag(runs: list[dict]) -> tuple[str, float | None, float | None]:
    """(flag text, margin now, median margin of the last ``WINDOW`` runs) of one series' runs, oldest first."""
    now = _margin(runs[-1])
    window = [m for m in (_margin(r) for r in runs[-WINDOW:]) if m is not None]
    med = statistics.median(window) if window else None
    notes = []
    if len(runs) > 1 and runs[-2]["verdict"] != runs[-1]["verdict"]:
        notes.append(f"verdict changed: {runs[-2]['verdict']} -> {runs[-1]['verdict']}")
    if now is not None and med is not None and not (math.isinf(now) and math.isinf(med)):
        if now == 0:  # a check saw no finite value (a diverged run): 0 against a median above it
            if med > 0:
                notes.append("margin shrank to 0 against the median")
        elif med / now >= SHRINK:
            notes.append(f"margin shrank {'from no deviation' if math.isinf(med) else f'{med / now:.1f}x'} against "
                         f"the median")
    return "; ".join(notes), now, med


def _groups(history: list[dict]) -> dict[str, dict[str, list[dict]]]:
    out: dict[str, dict[str, list[dict]]] = {}
    for e in history:
        out.setdefault(case_key(e), {}).setdefault(series(e), []).append(e)
    return out


def _anchor(key: str) -> str:
    return "case-" + "".join(ch if ch.isalnum() else "-" for ch in key)


def _summary(groups) -> str:
    rows, classes = [], []
    for key, by_series in sorted(groups.items()):
        for s, runs in sorted(by_series.items()):
            note, now, med = flag(runs)
            last = runs[-1]
            rows.append([Raw(f'<a href="#{_anchor(key)}">{esc(key)}</a>'), s, _verdict(last["verdict"]),
                         f"{last['date'].replace('T', ' ')} ({last.get('git_rev') or '-'})", _fmt_margin(now),
                         _fmt_margin(med), Raw(f'<span class="flag">{esc(note)}</span>' if note else "")])
            classes.append("")
    return table(rows, ["case", "hardware, precision", "last verdict", "last run (commit)", "margin now",
                        f"median margin (last {WINDOW})", "flag"], left=3, classes=classes)


def _number(v) -> float:
    """A value read back from a history line or a results file: ``null`` (how strict JSON holds a NaN or an
    infinity, ``harness.io.json_ready``) or a missing value is NaN."""
    return math.nan if v is None else v


def _date(e: dict) -> dt.datetime:
    return dt.datetime.fromisoformat(e["date"])


def _trends(by_series: dict[str, list[dict]]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.dates as mdates
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.3))
    panels = (("max_delta", "max |loss - bshd| (span its rule covers)", True),
              ("tokens_per_s", "tokens/s (median over steps)", False), ("last_loss", "last loss", False))
    for k, (s, runs) in enumerate(sorted(by_series.items())):
        marker, ls = STYLES[k % len(STYLES)]
        xs = [_date(r) for r in runs]
        for key, ax, log in ((p[0], axes[i], p[2]) for i, p in enumerate(panels)):
            layouts = sorted({lay for r in runs for lay in r.get(key, {})})
            for lay in layouts:
                ys = [_number(r.get(key, {}).get(lay)) for r in runs]
                ys = [max(y, 1e-12) if log and y == y else y for y in ys]
                ax.plot(xs, ys, marker=marker, ls=ls, color=COLORS.get(lay), label=f"{lay} ({s})", ms=4)
        tol = runs[-1].get("tolerance")
        if tol:
            axes[0].axhline(tol, color="#b71c1c", ls=ls, lw=1.0, label=f"tolerance {tol:g} ({s})")
    dates = [_date(r) for runs in by_series.values() for r in runs]
    pad = dt.timedelta(minutes=30) if max(dates) - min(dates) < dt.timedelta(hours=1) else dt.timedelta(0)
    for (_, title, log), ax in zip(panels, axes):
        if pad:  # runs within the hour: a readable axis, not a degenerate one
            ax.set_xlim(min(dates) - pad, max(dates) + pad)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("run date", fontsize=8)
        ax.xaxis.set_major_locator(mdates.AutoDateLocator(maxticks=6))
        ax.xaxis.set_major_formatter(mdates.ConciseDateFormatter(ax.xaxis.get_major_locator()))
        ax.tick_params(labelsize=7)
        if log:
            ax.set_yscale("log")
        if ax.lines:
            ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def _draw_rule(ax, e: dict, rows: dict, ref: list[float], tol: float) -> str:
    """Draw the run's rule on the deviation panel and name it: the per-step band over the steps it covers and,
    where the rule ends earlier (``rule.strict_steps``: bf16 rounding, MoE routing), the late window's band on
    the mean with each layout's late-mean deviation as a bar - the band a curve is held to where it is held."""
    rule, n = e.get("rule") or {}, len(ref)
    strict = rule.get("strict_steps")
    if strict is None or strict >= n:
        ax.fill_between(range(1, n + 1), -tol, tol, color="#2e7d32", alpha=0.12, label=f"per step +-{tol:g}")
        return "tolerance band"
    w, band = min(rule["late_window"], n), rule["late_band"]
    if strict > 0:  # 0: an MoE run whose routes parted at a near-tie in its first step
        ax.fill_between(range(1, strict + 1), -tol, tol, color="#2e7d32", alpha=0.12,
                        label=f"per step +-{tol:g} (first {strict})")
        ax.axvline(strict + 0.5, color="#2e7d32", ls=":", lw=0.8)
    late = range(n - w + 1, n + 1)
    ref_mean = sum(ref[-w:]) / w
    ax.fill_between(late, -band * abs(ref_mean), band * abs(ref_mean), color="#1565c0", alpha=0.10,
                    label=f"last-{w}-step mean within {band:.0%} (+-{band * abs(ref_mean):.3g})")
    seen = [tol]
    for lay, rs in rows.items():
        d = sum(r["loss"] for r in rs[-w:]) / w - ref_mean
        ax.plot([late[0], late[-1]], [d, d], color=COLORS.get(lay), lw=3, alpha=0.8)
        seen += [abs(d)] + [abs(r["loss"] - g) for r, g in zip(rs, ref)]
    lim = 1.2 * max(x for x in seen if math.isfinite(x))  # the curves and the per-step band readable (a diverged
    # run's inf / NaN steps stay off the scale); the late band may run off it
    ax.set_ylim(-lim, lim)
    return f"per step over the first {strict} ({rule.get('why') or 'rule'}), then the last-{w}-step mean (bars)"


def _latest_curves(root: Path, s: str, e: dict):
    """The latest run's per-step loss of every layout and the golden's (or bshd's), and each layout's
    deviation from it with the tolerance band (None when the run's results cannot be read)."""
    try:
        res = json.loads((root / e["run"] / "results.json").read_text())
    except (OSError, ValueError, TypeError):
        return None
    import matplotlib.pyplot as plt

    rows = {lay: [{**r, "loss": _number(r.get("loss"))} for r in rs] for lay, rs in res["layouts"].items()}
    ref_name, ref = "bshd (reference)", [r["loss"] for r in rows.get("bshd") or next(iter(rows.values()))]
    gpath = res["config"].get("golden")
    if gpath:
        try:
            ref = [_number(x) for x in json.loads(Path(gpath).read_text())["data"]["bshd"]]
            ref_name = "golden bshd"
        except (OSError, ValueError, KeyError):
            pass
    n = min([len(ref)] + [len(rs) for rs in rows.values()])  # a golden serves every run of at most its length
    ref, rows = ref[:n], {lay: rs[:n] for lay, rs in rows.items()}
    tol = e.get("tolerance") or 0.0
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 3.3))
    steps = range(1, len(ref) + 1)
    a.plot(steps, ref, color="#888", lw=3, alpha=0.5, label=ref_name)
    for lay, rs in rows.items():
        ys = [r["loss"] for r in rs]
        a.plot(steps, ys, color=COLORS.get(lay), lw=1, label=lay)
        b.plot(steps, [y - g for y, g in zip(ys, ref)], color=COLORS.get(lay), lw=1, marker=".", ms=3, label=lay)
    b.axhline(0, color="#888", lw=0.6)
    a.set_title(f"latest run ({s}, {e['date'].replace('T', ' ')}): loss per step", fontsize=9)
    b.set_title(f"loss - {ref_name} per step, " + _draw_rule(b, e, rows, ref, tol), fontsize=9)
    for ax in (a, b):
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6)
    fig.tight_layout()
    return fig


def _exercise(e: dict) -> str:
    ex = e.get("dcp_exercise")
    if not ex:
        return "-"
    sizes = " ".join(f"{k}:{v}" for k, v in ex["cp_groups"].items())
    return f"{sizes}; CP>1 in {ex['microbatches_cp_gt1']}/{ex['microbatches']} mb; mixed {ex['steps_mixed']}/{ex['steps']} steps"


def _links(e: dict) -> Raw:
    out = [f'<a href="{esc(e["report"])}">report</a>'] if e.get("report") else []
    out += [f'<a href="{esc(w["href"])}">{esc(w["label"])}</a>' for w in e.get("wandb") or []]
    return Raw(" ".join(out) or "-")


def _history_table(runs: list[dict]) -> str:
    rows = []
    for e in sorted(runs, key=lambda r: r["date"], reverse=True)[:ROWS]:
        title = f"commit {e.get('git_rev') or '-'}, dcp-harness {e.get('version', '?')}"
        rows.append([Raw(f'<span title="{esc(title)}">{esc(e["date"].replace("T", " "))}</span>'),
                     e.get("git_rev") or "-", series(e), _verdict(e["verdict"]), _fmt_margin(_margin(e)),
                     _exercise(e), "; ".join(e.get("failed") or []) or "-", _links(e)])
    return table(rows, ["date", "commit", "hardware, precision", "verdict", "margin", "dynamic CP (CP groups)",
                        "failed checks", "links"], left=4)


def _section(key: str, by_series: dict[str, list[dict]], root: Path) -> str:
    runs = [r for rs in by_series.values() for r in rs]
    parts = [f'<h2 id="{_anchor(key)}">{esc(key)}</h2>',
             f'<p class="meta">{len(runs)} runs; {esc(", ".join(sorted(by_series)))}</p>', figure_png(_trends(by_series))]
    for s, rs in sorted(by_series.items()):
        latest = next((r for r in reversed(rs) if r.get("run")), None)
        fig = _latest_curves(root, s, latest) if latest else None
        if fig is not None:
            parts.append(figure_png(fig))
    parts.append(_history_table(runs))
    return "".join(parts)


def render(history: list[dict], root: Path) -> Path:
    """Write ``<root>/index.html`` from the history (oldest first); returns its path."""
    groups = _groups(history)
    stamp = dt.datetime.now().isoformat(timespec="seconds").replace("T", " ")
    body = ["<h1>dcp-harness nightly</h1>",
            f'<p class="meta">{len(history)} case runs, {len(groups)} cases; drawn {esc(stamp)}. Margin = tolerance / '
            f'observed deviation of the tightest check; flagged when it shrank {SHRINK:g}x or more against the '
            f'median of the last {WINDOW} runs, or when the verdict changed. NOT EXERCISED: dynamic CP never formed '
            f'a CP group &gt; 1 (or mixed CP 1 with the whole domain in fewer than 90% of the steps). NO REFERENCE: '
            f'nothing outside the run\'s own layouts judged it (no reference run, no golden).</p>', _summary(groups)]
    body += [_section(key, by_series, root) for key, by_series in sorted(groups.items())]
    html = page("dcp-harness nightly", "".join(body)).replace("</style>", CSS + "</style>", 1)
    return atomic_write_text(root / "index.html", html)
