"""Terminal rendering of a schedule: a per-micro-batch table and a rank-occupancy map."""

from __future__ import annotations

import string

from harness.plan.bounds import stats
from harness.plan.layout import Schedule

GLYPHS = string.ascii_uppercase + string.ascii_lowercase + string.digits


def microbatch_table(s: Schedule, limit: int = 40) -> str:
    lines = [f"{'mb':>4}  {'blocks (CP sizes)':<28} {'seqs':>5} {'tok/rank max':>12} {'load max/mean':>13}  gids (first block)"]
    for m, mb in enumerate(s.layout[:limit]):
        sizes = [b.size for b in mb]
        runs: list[str] = []
        for size in sizes:  # "4x2, 1x4" style
            if runs and runs[-1].split("x")[1] == str(size):
                k = int(runs[-1].split("x")[0]) + 1
                runs[-1] = f"{k}x{size}"
            else:
                runs.append(f"1x{size}")
        load = s.load(m)
        mean = sum(load) / len(load)
        first = list(mb[0].gids)
        lines.append(f"{m:>4}  {', '.join(runs):<28} {sum(len(b.gids) for b in mb):>5} "
                     f"{max(s.packed_tokens(m)):>12.0f} {max(load) / mean if mean else 1.0:>13.3f}  "
                     f"{first[:6]}{' ...' if len(first) > 6 else ''}")
    if s.num_microbatches > limit:
        lines.append(f"  ... {s.num_microbatches - limit} more micro-batches")
    return "\n".join(lines)


def occupancy_map(s: Schedule, width: int = 128, limit: int = 40) -> str:
    """One line per micro-batch, one column per rank (sampled when N > width): each CP block drawn
    with its own letter, so block widths show the local_cp_size."""
    step = max(1, -(-s.n_ranks // width))
    lines = [f"rank-occupancy map ({s.n_ranks} ranks{f', every {step}th shown' if step > 1 else ''}; "
             f"one letter per CP block)"]
    for m, mb in enumerate(s.layout[:limit]):
        row = []
        for k, b in enumerate(mb):
            row += [GLYPHS[k % len(GLYPHS)]] * b.size
        lines.append(f"{m:>4} |{''.join(row[::step])}|")
    return "\n".join(lines)


def summary(s: Schedule) -> str:
    st = stats(s)
    hist = ", ".join(f"cp{k}: {v}" for k, v in st.cp_histogram.items())
    return (f"micro-batches {st.num_microbatches} | simulated step {st.step_time:.4g} | lower bound "
            f"{st.lower_bound:.4g} | quality {st.quality:.3f} | token fill {st.token_fill:.2f}\n"
            f"sequences per CP size: {hist}")


def aligned(header: list[str], rows: list[list]) -> str:
    """``header`` and ``rows`` (cells already formatted) as a right-aligned text table with a rule under the header."""
    grid = [header] + rows
    widths = [max(len(str(r[i])) for r in grid) for i in range(len(header))]
    lines = ["  ".join(str(c).rjust(w) for c, w in zip(r, widths)) for r in grid]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
