"""The checks ``dcp-harness verify`` applies to any stack's step reports (``harness.stack.protocol``).

Two kinds of check, each a ``{"target", "value", "limit", "pass"}`` line (``harness.finite.target``: a NaN
fails):

- **accounting**, against the batch and the schedule themselves: every rank divides by the global batch's loss
  tokens; every rank reports the same loss and gradient norm; at step 1 every loss token of every sequence is
  computed exactly once over the ranks (a CP rank that trains its neighbour's slice, or drops one, is caught);
  each micro-batch ran in the CP group of its block's positions, on every rank; the dcp layout's step 1 forms
  a CP group of more than one rank (``exercise``: else the step-1 checks never saw dynamic CP, and the verdict
  is ``NOT_EXERCISED``);
- **against the reference**: the same stack on one rank, without CP (``REF_LAYOUT``), on the same batches from
  the same seed - every step's loss (absolute) and gradient norm (relative), the step-1 gradient of every
  parameter (relative L2, worst parameter over the ranks) and the step-1 token losses of every sequence
  (relative L2, worst sequence), within ``TOLERANCES`` for the run's precision; in bf16, also a **sharp step 1**
  (``sharp_against_reference``): step 1 from a model whose query and key projections are scaled by
  ``SHARP_SCALE``, on every layout and the reference alike, held to the same step-1 bands.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from harness.finite import badness, target, worst

NOT_EXERCISED = "NOT EXERCISED"
"""The verdict of a run whose every numerical check passed but whose dcp layout ran step 1 at CP 1 only: the
step-1 gradient and token-loss checks, which carry the position and exchange bugs, never saw a CP group."""

REF_LAYOUT = "thd"
"""The reference's layout: on one rank with ``max_seqlen_per_rank`` >= the longest sequence, thd packs whole
sequences (CP 1) into micro-batches."""

TOLERANCES = {
    "float32": {"loss": {"max": 1e-5, "mean": 1e-5}, "grad_norm": 1e-5, "step1_gradients": 1e-5, "token_loss": 1e-5},
    "bfloat16": {"loss": {"max": 2e-3, "mean": 5e-4}, "grad_norm": 2e-2, "step1_gradients": 5e-2, "token_loss": 2e-2},
}
"""Per precision and quantity: what a layout may differ from the reference by. fp32 (CPU): the harness's layouts
stay within ~5e-7 of the reference on every quantity over 50 steps (tiny models), so 1e-5 leaves ~20x for
rounding. bf16 (GPUs, autocast with fp32 master weights): the reference's bf16 rounding differs from a layout's
(other matmul shapes), so losses are held to 2e-3 per step and 5e-4 on average, gradient norms to 2e-2
relative, step-1 gradients to 5e-2 and token losses to 2e-2."""


BF16_MIXER_SCALE = 2.0
"""The bf16 loss tolerances of a model with SSM mixer layers are this many times the table's. Its layouts'
trajectories carry ~2.5x tiny GPT's bf16 rounding from step 1 (the mixer's scan runs in fp32 under autocast and its
gated norm falls back from the fused kernel): on 4 x H200, the nightly corpus, 30 steps, tiny-hybrid's largest
per-step |delta loss| was 1.75e-3 (1 stage) and 2.38e-3 (2 stages), its mean up to 5.3e-4, with layouts that share
all maths (bshd on 2 stages against the one-rank run: 1.42e-3 / 3.8e-4); tiny GPT's and its MTP variant's were
7.1e-4 - 9.7e-4. The step-1 gradients (2.6e-3 of 5e-2) and token losses are held to the table unscaled."""


SHARP_SCALE = 16.0
"""The query / key scale of bf16 runs' sharp step 1 (``harness.stack.protocol``: ``sharpen``); a power of two, so
the scaled weights round as the plain ones. In one CPU process (``docs/repro/sharp_attention_rope.py``, tiny GPT, a
RoPE offset per zig-zag rank of CP 4) the bug's step-1 gradient footprint is 2.6e-2 at scale 1 (under bf16's 5e-2
band), 0.43 at 4 and 1.1 at 8. Through ``verify harness --steps 1 --dtype bfloat16`` on 2 and 4 CPU ranks with
the catalogue's ``rope-positions-per-rank`` planted (``reports/recorded/sharp_step.cpu2.log``): the plain lines
5.7e-3 to 7.2e-3 (they pass), the sharp ones 0.082-0.111 at 4 and 0.71-0.93 at 16 (14-19x the band); with
``zigzag-r-plus-cp`` the dcp layout's sharp line 0.027 at 4 (passes) and 0.39 at 16. Clean layouts sit 2.2e-3 to
3.3e-3 from the reference at 16 on CPU ranks, 2.2e-3 to 2.35e-3 for every model on one H100
(``reports/recorded/sharp_step.h100.log``): ~15x under the band."""


def sharp_scale(value, dtype: str) -> float:
    """The sharp step's scale for ``value``: ``"auto"`` (``SHARP_SCALE`` in bf16, off in fp32, whose own bands see
    step-1 position bugs), ``"off"`` / 0, or a number >= 1; anything else is a ``ValueError`` naming it."""
    if value == "auto":
        return SHARP_SCALE if dtype == "bfloat16" else 0.0
    if value in ("off", 0, 0.0, "0"):
        return 0.0
    try:
        v = float(value)
    except (TypeError, ValueError):
        v = float("nan")
    if not v >= 1.0 or v == float("inf"):
        raise ValueError(f"sharp scale {value!r}: give auto (x{SHARP_SCALE:g} in bf16, off in fp32), off, or a "
                         "finite number >= 1 (the query / key projections' scale of the sharp step 1)")
    return v


def tolerances(dtype: str, model: str | None = None) -> dict:
    """``TOLERANCES[dtype]``, with the loss bands of a bf16 model with SSM mixer layers scaled by
    ``BF16_MIXER_SCALE``."""
    from harness.runtime.model_config import MODELS  # lazy: the protocol's checks need no model table otherwise

    tol = TOLERANCES[dtype]
    if dtype == "bfloat16" and model in MODELS and any(k != "B" for k in MODELS[model].kinds):
        tol = {**tol, "loss": {k: v * BF16_MIXER_SCALE for k, v in tol["loss"].items()}}
    return tol


def accounting(layout: str, steps: list[list], lengths: list[list[int]], schedules: list) -> list[dict]:
    """``steps[k][r]``: rank r's report (a ``StepReport``) of step k; ``lengths[k]``: step k's sequence lengths
    (labels); ``schedules[k]``: the schedule step k ran."""
    out = []
    bad_tokens = [(k, r, rep.tokens, sum(lengths[k])) for k, reps in enumerate(steps) for r, rep in enumerate(reps)
                  if rep.tokens != sum(lengths[k])]
    where = f" (step {bad_tokens[0][0] + 1}, rank {bad_tokens[0][1]}: {bad_tokens[0][2]} against " \
            f"{bad_tokens[0][3]})" if bad_tokens else ""
    out.append(target(f"{layout}: loss divided by the global batch's loss tokens, every step and rank{where}",
                      len(bad_tokens), 0, unit="mismatches"))
    spread = worst(abs(getattr(rep, q) - getattr(reps[0], q)) / max(abs(getattr(reps[0], q)), 1e-30)
                   for reps in steps for rep in reps for q in ("loss", "grad_norm"))
    out.append(target(f"{layout}: every rank reports the same loss and gradient norm (relative spread)",
                      spread, 1e-12))
    if steps and steps[0][0].token_losses is not None:
        out.append(_coverage(layout, steps[0], lengths[0]))
    if steps and steps[0][0].cp_groups is not None:
        out.append(_groups(layout, steps, schedules))
    return out


def exercise(layout: str, schedules: list, lengths: list[list[int]], capacity: int, hint: str = "") -> dict:
    """Whether ``layout`` (dynamic CP) formed a CP group of more than one rank at step 1, the step the gradient
    and token-loss checks compare (an ``exercise`` line: failing it gives ``NOT_EXERCISED``, not FAIL).
    ``capacity``: tokens per rank; ``hint``: how to get a step 1 that needs CP (a seed, a capacity)."""
    first = schedules[0] if schedules else None
    mbs = list(first.layout) if first is not None else []
    n = sum(any(len(b.ranks) > 1 for b in mb) for mb in mbs)
    sizes = sorted({len(b.ranks) for mb in mbs for b in mb})
    why = ""
    if not n and lengths:
        why = (f"; step 1's longest sequence, {max(lengths[0])} tokens, fits {capacity} tokens per rank at CP 1"
               + (f": {hint}" if hint else ""))
    return {"target": f"{layout}: step 1 forms a CP group > 1, so the step-1 checks see dynamic CP ({n} of "
                      f"{len(mbs)} micro-batches; CP sizes {sizes}){why}", "value": n, "pass": n > 0,
            "exercise": True}


def verdict_of(lines: list[dict]) -> str:
    """FAIL when a check fails; else ``NOT_EXERCISED`` when only an ``exercise`` line does; else PASS."""
    if not all(c["pass"] for c in lines if not c.get("exercise")):
        return "FAIL"
    return "PASS" if all(c["pass"] for c in lines) else NOT_EXERCISED


def mark(line: dict) -> str:
    """How a check line prints: PASS, FAIL, or NOT EXERCISED for a failed ``exercise`` line."""
    return "PASS" if line["pass"] else NOT_EXERCISED if line.get("exercise") else "FAIL"


def _coverage(layout: str, reps: list, lengths: list[int]) -> dict:
    count: dict[tuple[int, int], int] = defaultdict(int)
    for rep in reps:
        for g, p, _ in rep.token_losses:
            count[(int(g), int(p))] += 1
    missing = sum(count.get((g, p), 0) == 0 for g, L in enumerate(lengths) for p in range(L))
    twice = sum(c - 1 for c in count.values() if c > 1)
    stray = sum(1 for (g, p) in count if not (0 <= g < len(lengths) and 0 <= p < lengths[g]))
    n = missing + twice + stray
    detail = f" ({missing} missing, {twice} computed more than once, {stray} outside the batch)" if n else ""
    return target(f"{layout}: step 1 computes every loss token exactly once over the ranks{detail}", n, 0,
                  unit="tokens")


def _groups(layout: str, steps: list[list], schedules: list) -> dict:
    wrong, first = 0, ""
    for k, (reps, sched) in enumerate(zip(steps, schedules)):
        for r, rep in enumerate(reps):
            want = {m: tuple(b.ranks) for m, mb in enumerate(sched.layout) for b in mb if b.gids and r in b.ranks}
            got = {int(m): tuple(v) for m, v in (rep.cp_groups or {}).items()}
            for m in sorted(set(want) | set(got)):
                if m in want and got.get(m) != want[m]:
                    wrong += 1
                    first = first or (f" (step {k + 1}, rank {r}, micro-batch {m}: ran in {got.get(m)}, its block "
                                      f"is {want[m]})")
    return target(f"{layout}: each micro-batch ran in its block's CP group, every step and rank{first}", wrong, 0,
                  unit="micro-batches")


def against_reference(layout: str, steps: list[list], ref: list[list], dtype: str, ref_name: str,
                      model: str | None = None) -> list[dict]:
    """``layout``'s reports against the reference's (``ref[k][0]``: the one rank's report of step k); ``model``:
    the model trained, for its loss bands (``tolerances``)."""
    tol, who = tolerances(dtype, model), f"{layout} vs {ref_name}"
    out = []
    if len(steps) != len(ref):
        return [target(f"{who}: {len(steps)} steps against the reference's {len(ref)}", float("nan"), 0)]
    d = [abs(reps[0].loss - r[0].loss) for reps, r in zip(steps, ref)]
    out.append(target(f"{who}: max |delta loss| <= {tol['loss']['max']:g}", worst(d), tol["loss"]["max"]))
    if len(d) > 1:
        mean = float(np.mean(d)) if all(x == x for x in d) else float("nan")
        out.append(target(f"{who}: mean |delta loss| <= {tol['loss']['mean']:g}", mean, tol["loss"]["mean"]))
    rel = worst(abs(reps[0].grad_norm - r[0].grad_norm) / max(abs(r[0].grad_norm), 1e-30) for reps, r in zip(steps, ref))
    out.append(target(f"{who}: max relative |delta grad norm| <= {tol['grad_norm']:g}", rel, tol["grad_norm"]))
    if steps and steps[0][0].gradients is not None and ref[0][0].gradients is not None:
        out.append(_gradients(who, steps[0], ref[0][0].gradients, tol["step1_gradients"]))
    if steps and steps[0][0].token_losses is not None and ref[0][0].token_losses is not None:
        out.append(_token_losses(who, steps[0], ref[0][0].token_losses, tol["token_loss"]))
    return out


def _gradients(who: str, reps: list, want: dict, tol: float) -> dict:
    devs = {}
    for r, rep in enumerate(reps):
        for name, g in rep.gradients.items():
            if name not in want:
                return target(f"{who}: step-1 gradients: rank {r} reports parameter {name!r} the reference has "
                              "not", float("nan"), tol)
            w = np.asarray(want[name], dtype=np.float64)
            v = float(np.linalg.norm(np.asarray(g, dtype=np.float64) - w) / max(np.linalg.norm(w), 1e-30))
            if name not in devs or badness(v) > badness(devs[name][0]):
                devs[name] = (v, r)
    missing = sorted(set(want) - set(devs))
    if missing:
        return target(f"{who}: step-1 gradients: no rank reports {missing[0]!r}", float("nan"), tol)
    name = max(devs, key=lambda n: badness(devs[n][0]))
    return target(f"{who}: step-1 gradients, worst parameter ({name}, rank {devs[name][1]}) relative L2 <= {tol:g}",
                  devs[name][0], tol, parameters=len(devs))


def _sequences(token_losses) -> dict[int, dict[int, float]]:
    out: dict[int, dict[int, float]] = defaultdict(dict)
    for g, p, ce in token_losses:
        out[int(g)][int(p)] = out[int(g)].get(int(p), 0.0) + float(ce)
    return out


def _token_losses(who: str, reps: list, want, tol: float) -> dict:
    got = _sequences([t for rep in reps for t in rep.token_losses])
    ref = _sequences(want)
    rel = {}
    for g, tokens in ref.items():
        b = np.array([tokens[p] for p in sorted(tokens)])
        a = np.array([got.get(g, {}).get(p, 0.0) for p in sorted(tokens)])
        rel[g] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    g = max(rel, key=lambda k: badness(rel[k]))
    return target(f"{who}: step-1 token losses, worst sequence ({g}) relative L2 <= {tol:g}", rel[g], tol,
                  sequences=len(rel))


SHARP_MOVE = 1e-2
"""How far the reference's sharp step 1 must move its step-1 gradients from the plain step 1 (relative L2 over every
parameter) for the sharp lines to count: a ``sharpen`` that scaled nothing (a copy of the weights, the wrong
module) leaves them where they were, and its lines would pass vacuously."""


def sharp_took_effect(plain, sharp, scale: float) -> dict:
    """Whether the reference's sharp step 1 (``sharp``: its report) moved the step-1 gradients from its plain step 1
    (``plain``) by at least ``SHARP_MOVE`` (an ``exercise`` line: failing it gives ``NOT_EXERCISED``)."""
    names = sorted(set(plain.gradients) & set(sharp.gradients))
    a = np.concatenate([np.asarray(plain.gradients[n], dtype=np.float64).ravel() for n in names]) if names else \
        np.zeros(1)
    b = np.concatenate([np.asarray(sharp.gradients[n], dtype=np.float64).ravel() for n in names]) if names else a
    moved = float(np.linalg.norm(b - a) / max(np.linalg.norm(a), 1e-30))
    why = "" if moved >= SHARP_MOVE else ": the stack's sharpen(scale) changed nothing the step computes - it must " \
        "scale the model's own query and key projections in place"
    return {"target": f"reference: queries and keys x{scale:g} move its step-1 gradients by >= {SHARP_MOVE:g} "
                      f"(relative L2), so the sharp lines see sharper attention{why}",
            "value": moved, "pass": bool(moved >= SHARP_MOVE), "exercise": True}


def sharp_against_reference(layout: str, reps: list, ref, dtype: str, ref_name: str, scale: float) -> list[dict]:
    """``layout``'s sharp step 1 (``reps[r]``: rank r's report) against the reference's (``ref``: its one rank's),
    step-1 gradients and token losses within the run's step-1 bands."""
    tol, who = TOLERANCES[dtype], f"{layout} vs {ref_name}, queries and keys x{scale:g}"
    return [_gradients(who, reps, ref.gradients, tol["step1_gradients"]),
            _token_losses(who, reps, ref.token_losses, tol["token_loss"])]
