"""``dcp-harness nightly``: the larger convergence configuration and a history across runs.

Every model of ``NIGHTLY_MODELS`` (tiny GPT, tiny MoE, tiny GPT with multi-token prediction, the
Mamba-style hybrid), ``steps`` steps (default 100), on GPUs when present (NCCL, bf16,
``min(4, GPUs)`` ranks; checked against bshd with the bf16 tolerances) or on 4 CPU ranks (fp32;
checked against bshd and the committed golden of that case). Each run is a ``converge-<time>``
folder under ``reports/nightly/runs/``; one line per run is appended to
``reports/nightly/history.jsonl`` and ``reports/nightly/index.html`` is redrawn with the history
table and trend plots (last loss per layout, max |delta| against bshd, tokens/s), one panel per case.
"""

from __future__ import annotations

import datetime as dt
import json
import statistics
from pathlib import Path

from harness import golden
from harness.bench.common import REPORTS
from harness.io import atomic_write_text

NIGHTLY = REPORTS / "nightly"


def history_line(res) -> dict:
    base = res.rows.get("bshd") or next(iter(res.rows.values()))
    return {"date": dt.datetime.now().isoformat(timespec="seconds"), "case_id": res.case_id,
            "hardware": res.config["hardware"], "verdict": res.verdict, "run_dir": str(res.run_dir),
            "git_rev": golden.producer()["git_rev"],
            "last_loss": {k: v[-1]["loss"] for k, v in res.rows.items()},
            "max_delta": {k: max(abs(r["loss"] - b["loss"]) for r, b in zip(v, base)) for k, v in res.rows.items()},
            "tokens_per_s": {k: statistics.median(r["tokens_per_s"] for r in v) for k, v in res.rows.items()}}


def read_history(root: Path = NIGHTLY) -> list[dict]:
    path = root / "history.jsonl"
    if not path.exists():
        return []
    out = []
    for i, line in enumerate(path.read_text().splitlines(), 1):
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            print(f"nightly: skipping unreadable line {i} of {path}")
    return out


def render_index(history: list[dict], root: Path = NIGHTLY) -> Path:
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    from harness.report.html import esc, figure_png, page, table

    cases = sorted({h["case_id"] for h in history})
    body = ["<h1>dcp-harness nightly</h1>", f'<p class="meta">{len(history)} runs, {len(cases)} cases</p>']
    for case in cases:
        runs = [h for h in history if h["case_id"] == case]
        fig, axes = plt.subplots(1, 3, figsize=(13, 3))
        colors = {"bshd": "k", "thd": "#ff7f0e", "dcp": "#1f77b4"}
        for key, ax, title, log in (("last_loss", axes[0], "last loss", False),
                                    ("max_delta", axes[1], "max |loss - bshd|", True),
                                    ("tokens_per_s", axes[2], "tokens/s (median)", False)):
            for layout in runs[-1][key]:
                if key == "max_delta" and layout == "bshd":
                    continue
                ys = [r[key].get(layout) for r in runs]
                ax.plot(range(len(runs)), [max(y, 1e-12) if log and y is not None else y for y in ys], "o-",
                        label=layout, color=colors.get(layout))
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("run (oldest first)")
            ax.set_xlim(-0.5, len(runs) - 0.5)
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            if log:
                ax.set_yscale("log")
            ax.legend(fontsize=7)
        fig.tight_layout()
        rows = [[r["date"], r["hardware"], r["verdict"], r["git_rev"] or "-",
                 ", ".join(f"{k} {v:.4f}" for k, v in r["last_loss"].items())] for r in runs[-10:]]
        body += [f"<h2>{esc(case)}</h2>", figure_png(fig), table(rows, ["date", "hw", "verdict", "git", "last loss"], left=5)]
    return atomic_write_text(root / "index.html", page("dcp-harness nightly", "".join(body)))


NIGHTLY_MODELS = ("tiny-gpt", "tiny-moe", "tiny-gpt-mtp", "tiny-hybrid")


def run(*, steps: int = 100, models=NIGHTLY_MODELS, device: str = "auto", world: int | None = None,
        root: Path = NIGHTLY, stall_s: float | None = None) -> int:
    import torch

    from harness import converge
    from harness.dist.layouts import LayoutError
    from harness.dist.train import TrainConfig
    from harness.io import atomic_write_bytes
    from harness.runtime.model import MODELS

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise LayoutError("nightly --device cuda: this machine has no CUDA device; use --device cpu (or auto)")
    unknown = [m for m in models if m not in MODELS]
    if unknown:
        raise LayoutError(f"unknown model(s) {', '.join(map(repr, unknown))}; choose from {', '.join(MODELS)}")
    world = world or (min(4, torch.cuda.device_count()) if device == "cuda" else 4)
    dtype = "bfloat16" if device == "cuda" else "float32"
    verdicts = []
    from harness.corpus import CorpusConfig

    cases = [(model, pp) for model in models for pp in (1, 2) if pp == 1 or world >= 4]
    for model, pp in cases:  # each model on one stage, and as 2 pipeline stages of world / 2 ranks
        # bf16 MoE: 128-sequence batches average routing flips the way a real batch does
        corpus = CorpusConfig(sequences_per_batch=128 if (model == "tiny-moe" and device == "cuda") else 32)
        cfg = TrainConfig(model=model, steps=steps, device=device, dtype=dtype, corpus=corpus, pp=pp,
                          max_seqlen_per_rank=max(256, 1024 // (world // pp)))
        res = converge.run(cfg, world=world, out_root=root / "runs", golden="auto", stall_s=stall_s)
        line = history_line(res)
        path = root / "history.jsonl"
        old = path.read_bytes() if path.exists() else b""
        atomic_write_bytes(path, old + (json.dumps(line) + "\n").encode())
        verdicts.append(res.verdict)
        print(f"nightly {res.case_id}: {res.verdict} ({res.run_dir})")
    print(f"history: {render_index(read_history(root), root)}")
    return 0 if all(v == "PASS" for v in verdicts) else 1
