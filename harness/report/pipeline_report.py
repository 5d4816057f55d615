"""The pipeline section of a training report: one step's measured pass timeline per layout and its bubble,
beside the bubble the planner's simulator predicts for the same schedule.

A run with pp > 1 records, on the first step of each layout, ``row["timeline"]``: one dict per rank,
``{"rank", "stage", "position", "chunks", "cp_sizes", "events"}`` with ``events`` = ``[kind "F"/"B",
micro-batch, virtual chunk, start_s, ready_s, end_s]`` in seconds since that rank started the step's passes
(``harness.train.pipeline.Timeline``): start -> ready waits for the input activation / gradient, ready -> end
computes (waits for CP partners inside the pass's collectives included).

* Measured bubble = ``1 - sum(end - ready) / (ranks x span)``, span = the latest ``end`` of any rank (every
  rank's clock starts at 0 when it begins its passes; the ranks start within a collective of each other).
* Simulated bubble = ``harness.plan.bounds.simulate(schedule, cost, Execution.pipeline(pp, vpp=...))
  .bubble_fraction`` on the schedule that ran. The caller passes it (the convergence report re-plans step 0
  of each layout, which is deterministic) and the cost model of the model trained; the model is split evenly
  over the chunks (the runtime's split counts the embedding and the loss as layers exactly so that the slots
  divide evenly). A schedule whose ``local_cp_size`` differs from the timeline's is not simulated ("n/a").

Functions take rows / config and return HTML (or markdown) strings, so any report can reuse them; they
return "" when the config has pp <= 1.
"""

from __future__ import annotations

from collections.abc import Mapping

from harness.plan.bounds import simulate
from harness.plan.cost import CostModel
from harness.plan.execution import Execution
from harness.plan.layout import Schedule
from harness.report import md
from harness.report.html import esc, figure_png, table

HEADER = ["layout", "micro-batches", "measured bubble", "simulated bubble", "measured span (ms)"]
FORWARD_CMAP, BACKWARD_CMAP = "Blues", "Oranges"


# ----------------------------------------------------------------------------------------- figures
def compute_time(timeline: list[dict]) -> float:
    """Seconds every rank spent computing passes (``end - ready``), summed over ranks."""
    return sum(e[5] - e[4] for r in timeline for e in r["events"])


def span(timeline: list[dict]) -> float:
    """Seconds from the step's start to the last pass's end on any rank."""
    return max((e[5] for r in timeline for e in r["events"]), default=0.0)


def measured_bubble(timeline: list[dict]) -> float:
    """``1 - compute / (ranks x span)``: the share of the ranks' step time not spent computing passes."""
    total = len(timeline) * span(timeline)
    return 1.0 - compute_time(timeline) / total if total > 0 else 0.0


def num_microbatches(timeline: list[dict]) -> int:
    return max((len(r["cp_sizes"]) for r in timeline), default=0)


def execution_of(config: Mapping) -> Execution:
    """The pipeline a training config ran (``TrainConfig``'s ``pp``, ``vpp``, ``pipeline``), its chunks priced as
    its planner priced them (``chunk_shares``, which ``converge`` records: each chunk's FLOPs, the head on the last;
    even shares in results from before it did): with vpp > 1 the runtime runs the interleaved 1F1B whatever
    ``pipeline`` says."""
    pp, vpp = int(config.get("pp", 1)), int(config.get("vpp", 1))
    kind = "1f1b" if vpp > 1 else config.get("pipeline", "1f1b")
    shares = config.get("chunk_shares") if pp > 1 else None
    return Execution.pipeline(pp, vpp=vpp, schedule=kind, chunk_shares=shares or None)


def first_timelines(rows: Mapping[str, list[dict]]) -> dict[str, tuple[dict, list[dict]]]:
    """layout -> (its first row with a timeline, that timeline)."""
    out = {}
    for layout, rs in rows.items():
        row = next((r for r in rs if r.get("timeline")), None)
        if row is not None:
            out[layout] = (row, row["timeline"])
    return out


def timeline_figure(timeline: list[dict], *, title: str):
    """A Gantt chart of one step: a row per (stage, position), a box per pass from ready to end (forward and
    backward in two colour families, darker for a wider CP block), labelled ``m`` or ``m.v`` under VPP; the
    thin grey line before a box is the wait for its input, white space is idle."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    ranks = sorted(timeline, key=lambda r: (r["stage"], r["position"]))
    vpp = max((len(r["chunks"]) for r in ranks), default=1)
    sizes = sorted({s for r in ranks for s in r["cp_sizes"]}) or [1]
    colours = {k: _shades(plt.get_cmap(cmap), sizes) for k, cmap in (("F", FORWARD_CMAP), ("B", BACKWARD_CMAP))}
    end = span(timeline) * 1e3 or 1.0
    fig, ax = plt.subplots(figsize=(12, 1.3 + 0.42 * len(ranks)))
    for y, r in enumerate(ranks):
        for kind, m, v, start, ready, stop in r["events"]:
            t0, t1, t2 = start * 1e3, ready * 1e3, stop * 1e3
            if t1 > t0:
                ax.plot([t0, t1], [y, y], color="#999999", lw=0.8, solid_capstyle="butt")
            size = r["cp_sizes"][m] if m < len(r["cp_sizes"]) else sizes[0]
            ax.add_patch(Rectangle((t1, y - 0.38), t2 - t1, 0.76, facecolor=colours[kind][size], edgecolor="white",
                                   lw=0.4))
            if t2 - t1 > end / 90:
                ax.text((t1 + t2) / 2, y, f"{m}.{v}" if vpp > 1 else f"{m}", ha="center", va="center", fontsize=6,
                        color="white" if size == sizes[-1] and len(sizes) > 1 else "black")
        if y and ranks[y - 1]["stage"] != r["stage"]:
            ax.axhline(y - 0.5, color="#555555", lw=0.6)
    ax.set_xlim(0, end * 1.01)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"stage {r['stage']}, pos {r['position']}" for r in ranks], fontsize=7)
    ax.set_xlabel("ms since the rank began the step's passes")
    ax.set_title(title, fontsize=9, loc="left")
    handles = [Patch(facecolor=colours[k][s], label=f"{'forward' if k == 'F' else 'backward'}, CP {s}")
               for k in ("F", "B") for s in sizes]
    handles.append(plt.Line2D([], [], color="#999999", lw=0.8, label="waiting for input"))
    ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0), frameon=False)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    return fig


def _shades(cmap, sizes: list[int]) -> dict[int, tuple]:
    """Lighter for CP 1, darker for the widest block size."""
    if len(sizes) == 1:
        return {sizes[0]: cmap(0.6)}
    return {s: cmap(0.4 + 0.5 * i / (len(sizes) - 1)) for i, s in enumerate(sizes)}


def timeline_png(timeline: list[dict], *, layout: str, config: Mapping) -> str:
    """The timeline picture of one layout as an ``<img>`` data URI (see ``timeline_figure``)."""
    ex = execution_of(config)
    title = (f"{layout}: pp {ex.pp}, vpp {ex.vpp}, {ex.pipeline_kind}; {num_microbatches(timeline)} micro-batches; "
             f"measured bubble {measured_bubble(timeline):.1%}")
    return figure_png(timeline_figure(timeline, title=title))


# -------------------------------------------------------------------------------------- simulation
def matches(schedule: Schedule, timeline: list[dict]) -> bool:
    """Whether ``schedule`` is the one the timeline ran: same micro-batch count and, on every rank, the same
    ``local_cp_size`` of every micro-batch at its position."""
    for r in timeline:
        sizes = r["cp_sizes"]
        if len(sizes) != schedule.num_microbatches or r["position"] >= schedule.n_ranks:
            return False
        if any(schedule.local_cp_size(m)[r["position"]] != s for m, s in enumerate(sizes)):
            return False
    return True


def simulated_bubble(schedule: Schedule | None, timeline: list[dict], config: Mapping,
                     cost: CostModel | None = None) -> float | None:
    """The simulator's bubble fraction of ``schedule`` under the config's pipeline and ``cost`` (default: the
    schedule's), or None without a schedule or when it is not the one the timeline ran."""
    if schedule is None or not matches(schedule, timeline):
        return None
    return simulate(schedule, cost, execution_of(config)).bubble_fraction


def bubble_rows(rows: Mapping[str, list[dict]], config: Mapping, schedules: Mapping[str, Schedule] | None = None,
                cost: CostModel | None = None) -> list[list]:
    """One row per layout with a timeline: layout, micro-batches, measured and simulated bubble, span."""
    out = []
    for layout, (_, tl) in first_timelines(rows).items():
        sim = simulated_bubble((schedules or {}).get(layout), tl, config, cost)
        out.append([layout, num_microbatches(tl), f"{measured_bubble(tl):.1%}",
                    "n/a" if sim is None else f"{sim:.1%}", f"{span(tl) * 1e3:.1f}"])
    return out


def _pipelined(config: Mapping, rows: Mapping[str, list[dict]]) -> bool:
    return int(config.get("pp", 1)) > 1 and bool(first_timelines(rows))


# ----------------------------------------------------------------------------------------- sections
def section(rows: Mapping[str, list[dict]], config: Mapping, schedules: Mapping[str, Schedule] | None = None,
            cost: CostModel | None = None) -> str:
    """The HTML section: a table of bubbles and one timeline picture per layout ("" for pp <= 1)."""
    if not _pipelined(config, rows):
        return ""
    ex = execution_of(config)
    cost_name = cost.name if cost is not None else "each schedule's own cost model"
    parts = [
        f"<h3>Pipeline: one step per layout ({esc(ex.describe())})</h3>",
        "<p>Measured bubble = 1 - compute time / (ranks x span) from the passes of the first step (compute: "
        "input there to pass done; span: to the last pass's end). Simulated bubble: the planner's pipeline "
        f"simulator (harness.plan.bounds.simulate) on the same schedule under {esc(cost_name)}, each chunk's "
        "share its FLOPs (the LM head on the last), forward 1/3 and backward 2/3 of a pass pair; n/a when the "
        "re-planned schedule is not the one that ran.</p>",
        table(bubble_rows(rows, config, schedules, cost), HEADER, left=1),
    ]
    for layout, (_, tl) in first_timelines(rows).items():
        parts.append(timeline_png(tl, layout=layout, config=config))
    return "".join(parts)


def markdown(rows: Mapping[str, list[dict]], config: Mapping, schedules: Mapping[str, Schedule] | None = None,
             cost: CostModel | None = None) -> str:
    """The bubble table as markdown ("" for pp <= 1)."""
    if not _pipelined(config, rows):
        return ""
    lines = [f"### Pipeline ({execution_of(config).describe()})", ""]
    lines += md.table(HEADER, bubble_rows(rows, config, schedules, cost))
    return "\n".join(lines) + "\n"
