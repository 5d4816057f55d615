"""``dcp-harness bench padding`` (CPU): padding of the two-segment vs the unified step-wise layout,
and the batch builder's throughput.

Batches: multi-turn trajectories turned into step-wise samples. Step s of a trajectory has the
cumulative prompt (initial prompt + every earlier response and observation) and that turn's response;
responses shrink with the turn (x 0.6 each), so prompt and response lengths are anti-correlated, as in
agent rollouts (their Pearson correlation is reported). Figures: padded tokens of both layouts and
their ratio; the builder's median throughput (real tokens / s) on 4096 samples given as Python lists.
Target: >= 1M tokens / s.
"""

from __future__ import annotations

import numpy as np

from harness.bench.common import table, time_call, write_report
from harness.plan.stepwise import build_batch, two_segment_width

TARGET_TOKENS_PER_S = 1e6


def stepwise_batch(n_samples: int, seed: int = 0, max_turns: int = 6):
    rng = np.random.default_rng(seed)
    prompts, responses = [], []
    while len(prompts) < n_samples:
        history = rng.integers(1, 32000, size=int(rng.lognormal(np.log(200), 0.5)) + 1).tolist()
        for turn in range(int(rng.integers(1, max_turns + 1))):
            resp = rng.integers(1, 32000, size=max(1, int(rng.lognormal(np.log(400 * 0.6 ** turn), 0.5)))).tolist()
            prompts.append(list(history))
            responses.append(resp)
            history += resp + rng.integers(1, 32000, size=int(rng.lognormal(np.log(100), 0.5)) + 1).tolist()
            if len(prompts) == n_samples:
                break
    return prompts, responses


def run(batch_sizes=(256, 1024, 4096), seeds=range(3)) -> list[dict]:
    rows = []
    for B in batch_sizes:
        for seed in seeds:
            prompts, responses = stepwise_batch(B, seed)
            pl, rl = np.array([len(p) for p in prompts]), np.array([len(r) for r in responses])
            real = int((pl + rl).sum())
            seconds, batch = time_call(lambda: build_batch(prompts, responses), min_total_s=0.5, max_reps=7)
            two = B * two_segment_width(pl, rl) - real
            rows.append({"samples": B, "seed": seed, "real_tokens": real, "corr_prompt_response": float(np.corrcoef(pl, rl)[0, 1]),
                         "two_segment_padded": two, "unified_padded": batch.padded_tokens,
                         "padding_ratio": two / max(batch.padded_tokens, 1),
                         "width_two_segment": two_segment_width(pl, rl), "width_unified": batch.sequences.shape[1],
                         "build_ms": seconds * 1e3, "tokens_per_s": real / seconds})
    return rows


def main(out=None) -> int:
    rows = run()
    print(table(rows, [("samples", "samples", "d"), ("seed", "seed", "d"), ("corr_prompt_response", "corr(p, r)", ".2f"),
                       ("width_two_segment", "width old", "d"), ("width_unified", "width new", "d"),
                       ("two_segment_padded", "padded old", "d"), ("unified_padded", "padded new", "d"),
                       ("padding_ratio", "old / new", ".2f"), ("build_ms", "build ms", ".1f"),
                       ("tokens_per_s", "tokens/s", ".3g")]))
    big = [r for r in rows if r["samples"] == 4096]
    med = float(np.median([r["tokens_per_s"] for r in big]))
    checks = [{"target": f"builder throughput >= {TARGET_TOKENS_PER_S:.0e} tokens/s at 4096 samples (median)",
               "value": med, "pass": med >= TARGET_TOKENS_PER_S},
              {"target": "unified layout pads less than the two-segment layout on every batch",
               "value": min(r["padding_ratio"] for r in rows), "pass": all(r["padding_ratio"] > 1 for r in rows)}]
    for c in checks:
        print(f"  [{'PASS' if c['pass'] else 'FAIL'}] {c['target']}: {c['value']:.3g}")
    print(f"wrote {write_report('padding', {'batch_sizes': [256, 1024, 4096], 'seeds': 3}, rows, out=out, checks=checks)}")
    return 0 if all(c["pass"] for c in checks) else 1
