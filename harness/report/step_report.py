"""HTML report of ``dcp-harness bench step`` (``reports/bench_step.html``).

Drawn from the benchmark's summary and config alone; its tables' columns come from
``harness.report.step_tables`` (shared with the printed tables), so the report never imports the
benchmark (reports read results).
"""

from __future__ import annotations

from harness.report.html import esc, figure_png, page, table
from harness.report.step_tables import (
    PHASE_COLUMNS,
    arrival_line,
    phase_rows,
    run_columns,
    runs_rows,
    saved_columns,
    saved_rows,
)

PART_COLORS = {"attention": "#4c72b0", "linear": "#55a868", "other": "#8172b2", "communication": "#c44e52",
               "idle": "#cccccc"}


def _batch_size(cfg, gb: dict, gpus: int) -> str:
    """How the global batch was sized (``StepBenchConfig.global_batch``)."""
    if cfg.global_batch == "tokens":
        return f"&lt;= {cfg.microbatches} x {gpus} x {cfg.max_seqlen_per_rank} tokens"
    n = gb.get("sequences")
    if cfg.global_batch == "megatron":
        return (f"{n} sequences (Megatron's benchmark_dcp.sh: {cfg.microbatches} micro-batches x dp, one "
                f"unpacked sequence per sample)")
    return f"{n} sequences"


def _fmt(v, f):
    return "-" if v is None else format(v, f)


def _step_plot(summary: dict):
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 3.8))
    labels = list(summary["arms"])
    for label in labels:
        ax1.plot(summary["arms"][label]["step_ms"], marker=".", lw=1, label=label)
    ax1.set_xlabel("measured step")
    ax1.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax1.set_ylabel("step time (ms, slowest rank)")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    tm = [summary["arms"][k]["trimmed_mean_ms"] for k in labels]
    bars = ax2.bar(range(len(labels)), tm, color="#4c72b0")
    for bar, k in zip(bars, labels):
        s = summary["arms"][k]["speedup_vs_static"]
        ax2.text(bar.get_x() + bar.get_width() / 2, bar.get_height(), "" if s is None else f"{s:.2f}x",
                 ha="center", va="bottom", fontsize=8)
    ax2.set_xticks(range(len(labels)))
    ax2.set_xticklabels(labels, fontsize=8)
    ax2.set_ylabel("10%-trimmed mean step (ms)")
    ax2.grid(axis="y", alpha=0.3)
    return fig


def _breakdown_plot(summary: dict):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [(k, v) for k, v in summary["arms"].items() if v["breakdown"]]
    fig, ax = plt.subplots(figsize=(9, 0.6 + 0.55 * max(1, len(rows))))
    for i, (_, v) in enumerate(rows):
        left = 0.0
        for part, color in PART_COLORS.items():
            w = v["breakdown"][part]
            ax.barh(i, w, left=left, color=color, label=part if i == 0 else None)
            left += w
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([k for k, _ in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("ms of one profiled step (mean over ranks)")
    ax.legend(fontsize=7, ncol=5, loc="lower right")
    ax.grid(axis="x", alpha=0.3)
    return fig


def _calibration(summary: dict) -> str:
    cal, c = summary.get("calibration"), summary.get("cost_model") or {}
    head = "<h2>The scheduler's cost model</h2>"
    if not cal:
        return head + (f"<p>FLOP model {esc(c.get('name', ''))} (not calibrated on this machine): "
                       f"{esc(c)}</p>" if c else "<p>not recorded</p>")
    rows = [[s["cp"], len(s["lengths"]), s["lengths"][0], f"{1e3 * s['seconds']:.2f}", f"{1e3 * s['predicted']:.2f}",
             f"{100 * (s['predicted'] / s['seconds'] - 1):+.1f}%"] for s in cal["shapes"]]
    return (head + f"<p>Fitted to one forward + backward of each micro-batch shape below (slowest rank, "
            f"median); per rank, in seconds: ({c['quadratic']:.3e} L&sup2; + {c['linear']:.3e} L + "
            f"{c['constant']:.3e}) / cp per sequence, + {c['cp_comm']:.3e} L (cp-1)/cp for the K/V exchange, "
            f"+ {1e3 * c['per_microbatch']:.2f} ms per micro-batch, + {1e3 * c.get('cp_block', 0.0):.2f} ms per "
            f"block of more than one rank (its CP collectives). Worst fit error "
            f"{100 * cal['max_rel_error']:.1f}%.</p>"
            + table(rows, ["cp", "sequences", "length", "measured ms", "model ms", "error"], left=0)
            + _rank_speed(cal))


def _rank_speed(cal: dict) -> str:
    """Each rank's time on the CP-1 shapes over the fastest rank's (``calibrate.rank_slowdown``), when recorded."""
    slow = cal.get("rank_slowdown")
    if not slow:
        return ""
    return ('<p class="small">The same CP-1 micro-batches on each rank, its time over the fastest rank\'s (a rank '
            'slower on the same work is a slow GPU or host: no schedule balances it): '
            + ", ".join(f"rank {r} {x:.3f}" for r, x in enumerate(slow)) + ".</p>")


def _bound(summary: dict) -> str:
    b = summary["ratios"].get("speedup_bound") or {}
    if b.get("median") is None:
        return ""
    return (f'<p class="small">Room under this machine\'s measured costs: the static baseline\'s modelled step '
            f'time over the lower bound of any schedule of the same batches (harness.plan.bounds.lower_bound, '
            f'each run\'s calibrated cost model) is {b["median"]:.3f}x (median; runs '
            f'{", ".join(_fmt(x, ".3f") for x in b["per_run"])}): no scheduler is modelled to beat it, and the '
            f'bound is a relaxation that a real schedule may not reach.' + _share(summary) + '</p>')


def _share(summary: dict) -> str:
    """The measured speedup's share of the bound, as a sentence (empty without one)."""
    s = summary["ratios"].get("speedup_of_bound") or {}
    if s.get("median") is None:
        return ""
    return (f' The measured speedup reached {s["median"]:.3f} of it (median; runs '
            f'{", ".join(_fmt(x, ".3f") for x in s["per_run"])}).')


def _twins(items, lede: str, ratio: str, faster: str) -> str:
    """A list of arms against their twins (``summary["cost_ab"]`` / ``["weights_ab"]``), or nothing."""
    lines = [f"<li>{ratio.format(label=esc(label), base=esc(r['base']))}: {r['median']:.3f} (median of the runs' "
             f"time ratios; runs {', '.join(_fmt(x, '.3f') for x in r['per_run'])}; &gt; 1: "
             f"{faster.format(label=esc(label))} faster)</li>" for label, r in items]
    return f"<p>{lede}, each arm on the same batches in the same runs:</p><ul>" + "".join(lines) + "</ul>" if lines else ""


def _cost_ab(summary: dict) -> str:
    """Arms that named a cost model against their twins on the run's model (``summary["cost_ab"]``)."""
    return _twins((summary.get("cost_ab") or {}).items(), "Cost models side by side", "{base} / {label}", "{label}")


def _bucket_ab(summary: dict) -> str:
    """Arms with their own token bucket against their twins without one (``summary["bucket_ab"]``)."""
    return _twins((summary.get("bucket_ab") or {}).items(), "Token buckets side by side (each rank's micro-batch "
                  "padded to a multiple of the arm's bucket, the padding's work included)", "{base} / {label}",
                  "{label}")


def _weights_ab(summary: dict) -> str:
    """Arms that took their weights per call against their twins with the step's weight copies."""
    return _twins((summary.get("weights_ab") or {}).items(), "The step's weight copies "
                  "(harness.runtime.weight_cache) side by side with weights cast per call", "{label} / {base}",
                  "the weight copies")


def _runs(summary: dict) -> str:
    """The per-run table (several runs only): the targets' medians come from these rows."""
    if len(summary["runs"]) < 2:
        return ""
    cols = run_columns(summary)
    rows = [[_fmt(r.get(k), f) for k, _, f in cols] for r in runs_rows(summary)]
    return ("<h2>Runs</h2><p>Each run re-calibrated the scheduler's cost model and ran every arm's "
            "warm-up and measured steps again from the same initial weights (only the last run then profiles: a "
            "profiler session leaves host overhead behind). The targets judge the "
            "median of each ratio over runs; the run marked * (the median speedup) is shown in detail below.</p>"
            + table(rows, [h for _, h, _ in cols], left=1))


def _phases(summary: dict, cfg) -> str:
    """The step's phases (every measured step): where dynamic CP can save time and where it cannot."""
    rows = phase_rows(summary)
    if not rows:
        return ""
    return ("<h3>Step phases</h3><p>Trimmed-mean ms over the measured steps; each phase ends when the slowest "
            "rank leaves it (CUDA events, no extra synchronisation), so a phase includes waiting for ranks "
            "still in it. The schedule phase is planning (" + (
                "done one step ahead in a planner process, as Megatron's asynchronous solver: a step pays only "
                "its wait for the plan, the 'plan wait ms' column" if getattr(cfg, "plan", "inline") == "ahead"
                else "inline, on the step's critical path") + "), rerouting the samples and building the "
            "micro-batches; it grows with the CP micro-batches to build (host work and small copies), so static "
            "CP's is the longest. Dynamic CP changes mostly the micro-batches phase; the gradient all-reduce left "
            f"after the last backward (mode: {esc(cfg.grad_reduce)}) and the optimiser ({esc(cfg.optimizer)}: under the "
            "distributed one, AdamW on 1/N and the parameters' all-gather) cost every arm about the same and "
            "dilute the whole step's speedup. 'Arrival spread' is how long the first rank to finish its "
            "micro-batches waited for the last, each rank's own CUDA events (trimmed mean): the part of the "
            "gradient all-reduce's exposed time that the ranks' balance decides; beside it, per arm, what the "
            "schedule's model expected and how well each rank's modelled lateness follows the measured one (near 1: "
            "the schedule's imbalance; near 0: run-time variation the model does not see).</p>"
            + table([[_fmt(r.get(k), f) for k, _, f in PHASE_COLUMNS] for r in rows],
                    [h for _, h, _ in PHASE_COLUMNS], left=1) + _arrival_list(summary))


def _arrival_list(summary: dict) -> str:
    lines = [x for x in (arrival_line(k, v) for k, v in summary["arms"].items()) if x]
    return "<ul>" + "".join(f"<li>{esc(x.strip())}</li>" for x in lines) + "</ul>" if lines else ""


def _saved(summary: dict) -> str:
    """Where each arm's speedup over static CP comes from, part by part of a profiled step (``saved_rows``)."""
    rows = saved_rows(summary)
    if not rows:
        return ""
    cols = saved_columns(rows)
    return ("<h3>Where each arm's speedup comes from</h3><p>ms static CP spends more than the arm in each part of one "
            "profiled step (negative: the arm spends more), exposed communication split by collective; the parts add "
            "up to the profiled step's difference. From the device-only profiles where both arms have one. A profiled "
            "step runs longer than a timed one (the timed steps' difference is beside it, for scale), so read the "
            "parts as shares. Dynamic CP saves attention (short sequences kept out of CP blocks) and the K/V "
            "all-gathers and gradient reduce-scatters of the blocks it does not form; what it pays elsewhere - an "
            "all-reduce its ranks reach at different times, idle - is where its gap to the model bound lies.</p>"
            + table([[_fmt(r.get(k), f) if f != "s" else str(r.get(k)) for k, _, f in cols] for r in rows],
                    [h for _, h, _ in cols], left=1))


def _rank_table(summary: dict, key: str, cell, title: str, blurb: str) -> str:
    """A table of each arm's per-rank figures ``summary["arms"][arm][key]`` (one cell each), for arms with two ranks or
    more that all have figures; empty when there is none."""
    arms = {k: v.get(key) or [] for k, v in summary["arms"].items()}
    arms = {k: p for k, p in arms.items() if len(p) >= 2 and all(x is not None for x in p)}
    if not arms:
        return ""
    n = max(len(p) for p in arms.values())
    rows = [[k] + [cell(p) for p in per] + [""] * (n - len(per)) for k, per in arms.items()]
    return f"<h3>{title}</h3><p>{blurb}</p>" + table(rows, ["arm"] + [f"rank {r}" for r in range(n)], left=1)


def _by_rank(summary: dict) -> str:
    """Each rank's idle and exposed communication in the profiled steps (``breakdown_per_rank``)."""
    return _rank_table(summary, "breakdown_per_rank", lambda p: f"{p['idle']:.1f} / {p['communication']:.1f}",
                       "Idle and exposed communication by rank",
                       "ms a profiled step, idle / exposed communication. The profiler's host-side recording lengthens "
                       "host work by ~1.5x, so a rank idling here need not idle in the timed steps: the host lead below "
                       "says whether a GPU waits for its host there.")


def _host_lead(summary: dict) -> str:
    """Each rank's lead over its GPU in the timed steps (``host_lead_per_rank``; CUDA runs only)."""
    return _rank_table(summary, "host_lead_per_rank",
                       lambda p: (f"{_fmt(p['forward_median_ms'], '.2f')} / {_fmt(p['backward_median_ms'], '.2f')}; "
                                  f"{100 * p['starved']:.0f}%"),
                       "Host lead by rank",
                       "Median ms the host ran ahead of its GPU when a forward / backward pass started, over the timed "
                       "steps (CUDA events, no profiler); the share of passes that found the GPU waiting for the host. "
                       "The rank with the least lead is the host the others wait for.")


def render(summary: dict, cfg, checks: list[dict], gpus: int) -> str:
    arms = summary["arms"]
    rows = [[k, _fmt(v["trimmed_mean_ms"], ".1f"), _fmt(v["median_ms"], ".1f"), _fmt(v["mean_ms"], ".1f"),
             _fmt(v["speedup_vs_static"], ".3f"), _fmt(v.get("trimmed_speedup_vs_static"), ".3f"),
             _fmt(v["predicted_speedup_vs_static"], ".3f"), _fmt(v["tokens_per_s_per_gpu"], ".0f"), _fmt(v["tflops_per_gpu"], ".3g"), _fmt(v["mfu"], ".3f"),
             f"{100 * v['padding_fraction']:.1f}%", _fmt(v["microbatches"], ".1f"),
             ", ".join(f"{s}:{n}" for s, n in v["cp_histogram"].items()), _fmt(v["plan_ms_median"], ".2f"),
             _fmt(v.get("plan_wait_ms_median"), ".2f"), _fmt(v["peak_memory_gb"], ".1f")] for k, v in arms.items()]
    header = ["arm", "trimmed mean ms", "median ms", "mean ms", "speedup vs static", "trimmed-mean speedup",
              "predicted speedup",
              "tokens/s/GPU", "TFLOP/s/GPU", "MFU", "padding", "micro-batches", "sequences per CP size",
              "plan ms", "plan wait ms", "peak mem GiB"]
    brows = [[k, _fmt(v["breakdown"]["wall"], ".1f")] + [_fmt(v["breakdown"][p], ".1f") for p in PART_COLORS]
             + [_fmt(v["compute_imbalance_ms"], ".1f"), v["breakdown"]["source"]]
             for k, v in arms.items() if v["breakdown"]]
    missing = [f"{k}: {v['breakdown_error']}" for k, v in arms.items() if v["breakdown_error"]]
    profiled = summary.get("breakdown_run")
    bnote = f" (run {profiled + 1}, the last)" if len(summary.get("runs", [])) > 1 and profiled is not None else ""
    verdicts = [[c["target"], c.get("shown") or f"{c['value']:.3f}", ", ".join(f"{x:.3f}" for x in c["per_run"]),
                 "n/a (targets apply to 4 GPUs)" if c["pass"] is None else ("PASS" if c["pass"] else "FAIL")]
                for c in checks]
    ok = all(c["pass"] is not False for c in checks)
    applicable = any(c["pass"] is not None for c in checks if not c.get("validity"))
    verdict = "FAIL" if not ok else ("PASS" if applicable else "NO TARGETS APPLY")  # a failed validity check fails
    gb = summary["global_batch"]
    body = "".join([
        "<h1>dcp-harness bench step: dynamic CP vs static CP</h1>",
        f'<p><span class="verdict {"fail" if not ok else ("pass" if applicable else "na")}">{verdict}</span></p>',
        f'<p class="meta">{gpus} x {esc(summary["device_name"])}'
        f'{"; " + esc(summary["host_line"]) if summary.get("host_line") else ""}; torch {esc(summary["torch"])}; model '
        f'{esc(cfg.model)} ({summary["parameters"] / 1e6:.3g}M parameters), {esc(cfg.dtype)}, blocks '
        f'{"compiled (" + esc(summary["compile"]) + ")" if summary.get("compile") else "eager"}'
        f'{f", micro-batches padded to multiples of {cfg.bucket()} tokens per rank" if cfg.bucket() else ""}; lengths '
        f'{esc(cfg.lengths)}; max_seqlen_per_rank {cfg.max_seqlen_per_rank}; global batch {_batch_size(cfg, gb, gpus)} (mean {gb["tokens_mean"]:.0f} tokens in '
        f'{gb["sequences_mean"]:.1f} sequences, longest {gb["longest"]}, {gb["clipped"]} clipped); {cfg.warmup} '
        f'warm-up + {cfg.iters} measured steps per arm on identical global batches, interleaved, '
        f'{len(summary["runs"])} run(s); Python GC {esc(cfg.gc)}; gradient all-reduce {esc(cfg.grad_reduce)}; {esc(cfg.optimizer)} optimizer; peak for MFU: '
        f'{_fmt(summary["peak_tflops"], ".0f")} TFLOP/s per GPU.</p>',
        table(verdicts, ["target", "value", "per run", "verdict"], left=1) if verdicts else "",
        _bound(summary),
        _cost_ab(summary),
        _weights_ab(summary),
        _bucket_ab(summary),
        _runs(summary),
        "<h2>Step time" + (f" (run {summary['representative_run'] + 1} of {len(summary['runs'])})"
                           if len(summary["runs"]) > 1 else "") + "</h2>",
        table(rows, header, left=1),
        "<p class=\"small\">Step time: schedule, reroute, every micro-batch's forward and backward, gradient "
        "all-reduce, clipping and AdamW, between device synchronisations; the slowest rank's. Speedup: static "
        "(thd:dp-balanced) time over the arm's on the same measured steps (the ratio of their sums, without the "
        "10% of steps with the lowest and the 10% with the highest per-step ratio: what happened to one arm only); "
        "trimmed-mean speedup: the ratio of each arm's own 10%-trimmed mean, which drops each arm's heaviest "
        "batches. Predicted: the same ratio under the step-time model "
        "the balanced scheduler optimises (harness.plan.bounds.simulate).</p>",
        figure_png(_step_plot(summary)),
        "<h2>Where the time goes</h2>",
        ("<p>Kernel time of profiled steps" + bnote + ", each instant counted once (attention &gt; linear &gt; other "
         "&gt; communication): communication is NCCL time not hidden behind compute, including waits for "
         "slower ranks; idle is time with no kernel running (launch-bound gaps, host work); imbalance is "
         "the slowest rank's compute time minus the mean rank's.</p>"
         + table(brows, ["arm", "wall ms"] + list(PART_COLORS) + ["imbalance ms", "source"], left=1)
         + figure_png(_breakdown_plot(summary))) if brows else "<p>No breakdown was measured.</p>",
        _saved(summary),
        _by_rank(summary),
        _host_lead(summary),
        "".join(f'<p class="small">no breakdown for {esc(m)}</p>' for m in missing),
        _phases(summary, cfg),
        _calibration(summary),
    ])
    return page("dcp-harness bench step", body)
