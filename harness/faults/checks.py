"""The checks that judge a run, in the order the catalogue reports them (cheapest first), and the
``Alarm`` a check raises when a run breaks it.

In-run checks stop the run where they fire (every rank raises the same error): ``schedule-invariants``
(``harness.plan.validate_schedule`` on the blocks every rank runs, in ``harness.train.layouts.deliver``),
``group-audit`` (``harness.parallel.audit``) and ``expert-dispatch`` (``harness.parallel.expert_parallel``). The others compare a run's probes
(``harness.train.probes``) with the clean bshd run of the same scenario, or need no reference at all
(``token-accounting``, ``replica-consistency``, ``shared-replica``). Numeric checks carry a tolerance; their margin is
observed deviation / tolerance (fp32 on CPU: the clean dynamic-CP run stays within ~2e-7 of bshd on
every one of them, so 1e-5 leaves ~50x for noise and every fault is ~1e3x past it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from harness.finite import badness, first_nonfinite, nonfinite_message, within
from harness.train.config import PROBE_SUFFIX

CHECKS: dict[str, str] = {
    "schedule-invariants": "every block the ranks run satisfies harness.plan.INVARIANTS (in the run, before the step)",
    "group-audit": "every micro-batch's CP-aware calls get exactly its block's process group (in the run)",
    "schedule-agreement": "every pipeline stage runs the first stage's blocks (in the run, before activations move)",
    "pipeline-schedule": "the micro-batch count fits the pipeline schedule (interleaved: a multiple of its group)",
    "expert-dispatch": "every rank's announced per-expert counts add up to the token rows it sends each expert owner "
                       "(in the run, before the tokens' all-to-all)",
    "token-accounting": "at step 1 every position of every sequence is trained exactly once over all ranks",
    "replica-consistency": "after every step all ranks hold bit-identical parameters",
    "shared-replica": "after every step the embedding replica of a pipeline's last stage (multi-token prediction) is "
                      "bit-identical to the first stage's table",
    "step1-gradients": "at step 1 every parameter's reduced gradient on every rank equals the bshd run's (relative)",
    "clipped-gradients": "at step 1 every parameter's clipped gradient (what the optimiser gets) equals the bshd run's",
    "token-loss": "at step 1 each sequence's token losses equal the bshd run's (relative L2 over its tokens)",
    "grad-norm": "every step's reduced gradient norm equals the bshd run's (relative)",
    "loss-curve": "every step's loss equals the bshd run's (absolute)",
    "fp32-step-consistency": "a bf16 run's step-1 gradients equal its own fp32 step 1's within bf16's step-1 band (the "
                             "fp32 step ran the same model and batch)",
    "fp32-step1-gradients": "at step 1 every parameter's gradient of a bf16 run's fp32 step equals the bshd run's "
                            "fp32 step's (relative, fp32's band)",
    "sharp-took-effect": "verify's sharp step 1 moved the reference's step-1 gradients by >= 1e-2 (sharpen scaled the "
                         "model the step trains)",
    "verify-checks": "every other line of verify (harness.stack.checks): accounting, CP groups, and the layouts "
                     "against the one-rank reference, plain and sharp step 1",
    "replay-routes": "under replay every real token's experts equal the rollout's, per layer (exact)",
    "replay-gradients": "replayed loss and gradients equal a single-process replayed reference (relative)",
    "bound-soundness": "no schedule the scheduler makes runs faster than the lower bound of its batch (simulated, "
                       "under its execution model)",
    "prediction-agreement": "the step time balanced predicts for its schedule is the simulator's under the same cost "
                            "(every term of the cost model priced as CostModel.seq_cost prices it)",
    "stepwise-advantages": "every response token gets its own trajectory's advantage, or the batch is refused",
}
TOLERANCES = {"token-loss": 1e-5, "step1-gradients": 1e-5, "clipped-gradients": 1e-5, "grad-norm": 1e-5, "loss-curve": 1e-5,
              "replay-gradients": 1e-5, "fp32-step1-gradients": 1e-5, "fp32-step-consistency": 5e-2}
"""fp32's band on CPU; ``fp32-step-consistency`` compares bf16 with fp32, so it has bf16's step-1 gradient band
(``harness.apps.reference``; clean tiny-GPT runs on 4 CPU ranks: ~2e-3 to 1.2e-2)."""


@dataclass
class Alarm:
    check: str
    message: str
    where: dict = field(default_factory=dict)
    observed: float | None = None
    tolerance: float | None = None

    @property
    def margin(self) -> float | None:
        """observed deviation / tolerance (numeric checks only)."""
        if self.observed is None or not self.tolerance:
            return None
        return self.observed / self.tolerance

    def to_dict(self) -> dict:
        return {**asdict(self), "margin": self.margin}


# ------------------------------------------------------------------------ train scenario checks
def _tokens(ranks: list[dict], layout: str) -> tuple[dict, dict]:
    """({gid: {position: [cross-entropies]}}, {gid: length}) at step 1 over every rank."""
    seen: dict[int, dict[int, list[float]]] = {}
    for r in ranks:
        s = r["probes"][layout]["sequences"][0]
        for g, p, ce in zip(s["seq"], s["pos"], s["ce"]):
            seen.setdefault(int(g), {}).setdefault(int(p), []).append(ce)
    lengths = {int(g): L for g, L in ranks[0]["probes"][layout]["sequences"][0]["lengths"].items()}
    return seen, lengths


def token_accounting(ref, got, layout) -> Alarm | None:
    seen, lengths = _tokens(got, layout)
    bad = {}
    for g, L in lengths.items():
        pos = seen.get(g, {})
        off = [p for p in range(L) if len(pos.get(p, ())) != 1] + [p for p in pos if not 0 <= p < L]
        if off:
            bad[g] = off
    if not bad:
        return None
    g = min(bad)
    n_pos, trained = len(bad[g]), sum(len(v) for v in seen.get(g, {}).values())
    return Alarm("token-accounting", f"{len(bad)} of {len(lengths)} sequences not trained exactly once at step 1: "
                 f"sequence {g} ({lengths[g]} tokens) had {n_pos} positions trained other than once, "
                 f"{trained} token losses in all ({trained / lengths[g]:.2f}x)",
                 {"step": 1, "sequence": g, "sequences": len(bad)})


def token_loss_deviations(ref, got, layout, ref_layout: str = "bshd") -> tuple[dict[int, float], dict[int, int]]:
    """Per sequence, the relative L2 distance of its step-1 token losses from the reference's (a position
    trained twice counts twice, one never trained counts 0), and the sequences' lengths."""
    seen, lengths = _tokens(got, layout)
    want, _ = _tokens(ref, ref_layout)
    rel = {}
    for g, L in lengths.items():
        a = np.array([sum(seen.get(g, {}).get(p, [0.0])) for p in range(L)])
        b = np.array([sum(want.get(g, {}).get(p, [0.0])) for p in range(L)])
        rel[g] = float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))
    return rel, lengths


def token_loss(ref, got, layout, ref_layout: str = "bshd") -> Alarm | None:
    rel, lengths = token_loss_deviations(ref, got, layout, ref_layout)
    g = max(rel, key=lambda k: badness(rel[k]))
    tol = TOLERANCES["token-loss"]
    if within(rel[g], tol):
        return None
    n = sum(not within(v, tol) for v in rel.values())
    return Alarm("token-loss", f"{n} of {len(rel)} sequences' step-1 token losses differ from {ref_layout}: sequence {g} "
                 f"({lengths[g]} tokens) by {rel[g]:.3g} relative (L2 over its tokens; > {tol:g})",
                 {"step": 1, "sequence": g, "sequences": n}, rel[g], tol)


def replica_consistency(ref, got, layout) -> Alarm | None:
    """Replicas: the ranks of one pipeline stage (all ranks without a pipeline)."""
    stages = {}
    for rank, r in enumerate(got):
        stages.setdefault(r["probes"][layout].get("stage", 0), []).append(rank)
    for step in range(len(got[0]["probes"][layout]["digests"])):
        for stage, ranks in sorted(stages.items()):
            digests = {k: got[k]["probes"][layout]["digests"][step] for k in ranks}
            first = digests[ranks[0]]
            odd = [k for k in ranks if digests[k] != first]
            if odd:
                where = "between ranks" if len(stages) == 1 else f"between the ranks of stage {stage}"
                return Alarm("replica-consistency", f"after step {step + 1} the parameters differ {where}: ranks "
                             f"{odd} do not match rank {ranks[0]} ({len(set(digests.values()))} distinct replicas)",
                             {"step": step + 1, "ranks": odd})
    return None


def shared_replica(ref, got, layout) -> Alarm | None:
    """The embedding a pipeline's first and last stages share (``harness.train.shared_embedding``): every rank that
    holds it recorded its digest after each step (``Probes.embedding``); the last stage's must equal the first's."""
    held = {rank: r["probes"][layout].get("embedding") or [] for rank, r in enumerate(got)}
    held = {rank: d for rank, d in held.items() if d}
    if not held:
        return None
    owners = [rank for rank in held if got[rank]["probes"][layout].get("stage", 0) == 0] or sorted(held)
    counts = {rank: len(d) for rank, d in held.items()}
    if len(set(counts.values())) > 1:  # a rank that stopped recording is not a rank that agreed
        return Alarm("shared-replica", f"the ranks recorded the embedding after different numbers of steps: {counts}",
                     {"ranks": sorted(counts)})
    for step in range(min(counts.values())):
        table = held[owners[0]][step]
        odd = sorted(rank for rank, d in held.items() if d[step] != table)
        if odd:
            return Alarm("shared-replica", f"after step {step + 1} the embedding on ranks {odd} differs from the first "
                         f"stage's table (rank {owners[0]})", {"step": step + 1, "ranks": odd})
    return None


def gradient_deviations(ref, got, layout, key: str = "grads", ref_layout: str = "bshd") -> dict[str, tuple[float, int]]:
    """Per parameter, the worst relative L2 distance over the ranks that hold it of its step-1 gradient
    (``key``: ``grads`` reduced, ``clipped`` after clipping) from the reference's, and that rank."""
    want = {}
    for r in ref:  # with pipeline stages every rank holds its stage's parameters: take each from its first holder
        for name, g in r["probes"][ref_layout][key].items():
            want.setdefault(name, g)
    out: dict[str, tuple[float, int]] = {}
    for rank, r in enumerate(got):
        for name, g in r["probes"][layout][key].items():
            w = np.asarray(want[name])
            rel = float(np.linalg.norm(np.asarray(g) - w) / max(np.linalg.norm(w), 1e-30))
            if name not in out or badness(rel) > badness(out[name][0]):
                out[name] = (rel, rank)
    return out


def step1_gradients(ref, got, layout, key: str = "grads", check: str = "step1-gradients",
                    what: str = "step-1 gradient", ref_layout: str = "bshd") -> Alarm | None:
    devs = gradient_deviations(ref, got, layout, key, ref_layout)
    worst = max(((v[0], v[1], n) for n, v in devs.items()), key=lambda x: badness(x[0]), default=(0.0, None, None))
    tol = TOLERANCES[check]
    if within(worst[0], tol):
        return None
    return Alarm(check, f"{what} of {worst[2]} on rank {worst[1]} differs from {ref_layout} by "
                 f"{worst[0]:.3g} relative (> {tol:g})", {"step": 1, "rank": worst[1], "parameter": worst[2]},
                 worst[0], tol)


def clipped_gradients(ref, got, layout) -> Alarm | None:
    return step1_gradients(ref, got, layout, "clipped", "clipped-gradients", "clipped step-1 gradient")


def _per_step(name, ref_vals, vals, relative: bool, ref_layout: str = "bshd") -> Alarm | None:
    tol = TOLERANCES[name]
    if len(vals) != len(ref_vals):
        return Alarm(name, f"{len(vals)} steps against {ref_layout}'s {len(ref_vals)}", {})
    what = {"grad-norm": "gradient norm", "loss-curve": "loss"}.get(name, name)
    for series, who in ((vals, "this run's"), (ref_vals, f"{ref_layout}'s")):
        bad = first_nonfinite(series)
        if bad is not None:
            return Alarm(name, nonfinite_message(series, what, who), {"step": bad[0] + 1}, None, tol)
    devs = [abs(a - b) / (max(abs(b), 1e-30) if relative else 1.0) for a, b in zip(vals, ref_vals)]
    k = int(np.argmax(devs))
    if within(devs[k], tol):
        return None
    kind = "relative" if relative else "absolute"
    return Alarm(name, f"step {k + 1}: {vals[k]:.6g} vs {ref_layout} {ref_vals[k]:.6g} ({kind} {devs[k]:.3g} > {tol:g})",
                 {"step": k + 1}, devs[k], tol)


def grad_norm(ref, got, layout) -> Alarm | None:
    return _per_step("grad-norm", ref[0]["probes"]["bshd"]["grad_norms"], got[0]["probes"][layout]["grad_norms"],
                     True)


def loss_curve(ref, got, layout) -> Alarm | None:
    return _per_step("loss-curve", [r["loss"] for r in ref[0]["rows"]["bshd"]],
                     [r["loss"] for r in got[0]["rows"][layout]], False)


def fp32_step_consistency(ref, got, layout) -> Alarm | None:
    """The run's own bf16 step 1 against its fp32 step 1 (no reference run: a wrong fp32 step that the layouts and
    the reference share - another model, another batch - shows here, not in their comparison)."""
    return step1_gradients(got, got, layout, check="fp32-step-consistency", what="bf16 step-1 gradient",
                           ref_layout=layout + PROBE_SUFFIX)


def fp32_step1_gradients(ref, got, layout) -> Alarm | None:
    return step1_gradients(ref, got, layout + PROBE_SUFFIX, check="fp32-step1-gradients",
                           what="fp32 step-1 gradient", ref_layout="bshd" + PROBE_SUFFIX)


BF16_CHECKS = {"token-accounting": token_accounting, "replica-consistency": replica_consistency,
               "fp32-step-consistency": fp32_step_consistency, "fp32-step1-gradients": fp32_step1_gradients}
"""A bf16 run's checks: its bf16 numbers stay 2e-3 and more from the bshd run's, so the step-1 checks are its fp32
step's (``TrainConfig.fp32_probe``)."""

TRAIN_CHECKS = {"token-accounting": token_accounting, "replica-consistency": replica_consistency,
                "shared-replica": shared_replica,
                "token-loss": token_loss, "step1-gradients": step1_gradients,
                "clipped-gradients": clipped_gradients, "grad-norm": grad_norm,
                "loss-curve": loss_curve}
