"""The reference a convergence verdict is judged against: a run without the parallelism under test.

bshd, thd and dcp share everything but how they lay the batch out, and bshd and thd share the static CP size,
so comparing them with each other cannot fail for a bug they share (in the pipeline, expert parallelism, the
MTP head, the SSM mixer, or anything that depends on the CP size alone). Every ``converge`` run therefore also
trains a **reference**: the same model, corpus, seed and batches on **one rank** - no CP, no pipeline, no VPP,
no expert parallelism, no collective at all - with whole sequences packed per micro-batch (thd at CP 1). Each
layout is compared with it, quantity by quantity (``TOLERANCES``):

- ``loss``: every step's loss (and each MTP depth's), absolute; MoE models and long bf16 runs under the rule of
  ``harness.apps.converge.strict_span`` (strict for the first ``MOE_EXACT_STEPS`` / ``BF16_EXACT_STEPS`` steps,
  then a band on the late mean; an fp32 MoE layout until its routes first differ from the reference's at a
  near-tie, ``harness.apps.converge.route_span``);
- ``grad_norm``: every step's gradient norm before clipping, relative (the strict span only);
- ``step1_gradients``: every parameter's reduced step-1 gradient, relative L2, worst parameter over the ranks
  that hold it (per parameter, so a bug confined to one layer is not averaged away);
- ``token_loss``: every sequence's step-1 token losses, relative L2, worst sequence.

fp32 (CPU): the layouts stay within ~5e-7 of the reference on every quantity over 50 steps (tiny models), so
1e-5 leaves ~20x for rounding. bf16 (GPUs, autocast with fp32 master weights): the reference's bf16 rounding
differs from a layout's (other matmul shapes), so losses are held to 2e-3 per step and 5e-4 on average (the
layout rule), gradient norms to 2e-2 relative, step-1 gradients to 5e-2 and token losses to 2e-2.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

from harness.faults.checks import gradient_deviations, token_accounting, token_loss_deviations
from harness.finite import nonfinite_message, within, worst
from harness.io import atomic_write_bytes
from harness.stack.checks import REF_LAYOUT, tolerances
from harness.train.config import PROBE_SUFFIX, TrainConfig, longest_sequence
from harness.train.records import load

FP32_PROBE_CUDA = 1e-4
"""The step-1 bands of the fp32 probe step on GPUs: fp32 without TF32 (``harness.train.trainer``), attention by the
exact ``sdpa`` backend. On one H100 (``reports/recorded/fp32_probe.h100.log``) the probe lines read 2.8e-7 / 3.7e-7
(gradients) and ~5e-8 (token losses), fp32 layouts against the reference 9e-8 to 3.3e-7: the CPU's floor. 10x the
CPU's 1e-5 leaves room for a CP group's collectives (not yet measured on GPUs); the RoPE plant's footprint in fp32 is
~1.6e-2 (step-1 gradients, 4 CPU ranks)."""

NO_REFERENCE = "NO REFERENCE"
"""The verdict of a run that had nothing outside its own layouts to be judged against (``--reference off``
and no golden): never PASS."""


def config(cfg: TrainConfig) -> TrainConfig:
    """The reference run of ``cfg``: one rank, thd of whole sequences, no pipeline, no expert or tensor parallelism,
    probes on (step-1 gradients and token losses), weights cast at each call and accumulated by autograd (not the
    step's weight copies of ``harness.runtime.weight_cache``: the layouts' optimisation is judged, not shared), the
    replicated optimiser (the distributed one is judged against it), no token bucket (the layouts' padding is
    judged, not shared), the loss head's logits whole (a chunked head is judged, not shared)."""
    return replace(cfg, layouts=(REF_LAYOUT,), pp=1, vpp=1, pipeline="1f1b", schedule_delivery="broadcast",
                   expert_parallel=False, tp=1, sequence_parallel=False, probes=True, weights="per-call",
                   optimizer="replicated", token_bucket=0, loss_chunk=0,
                   max_seqlen_per_rank=max(cfg.max_seqlen_per_rank, longest_sequence(cfg)))


def key(job: dict) -> str:
    """What identifies a trained reference (``trained``'s ``references``): its whole job configuration - the
    reference's ``TrainConfig`` (model, corpus, seed, steps, dtype, device...) and any planted fault."""
    return json.dumps(job, sort_keys=True, default=str)


def probes_of(res: dict) -> list[dict]:
    """Every rank's probes of a ``converge`` job's result, their large records read back from the files the ranks
    wrote."""
    return [{"probes": {layout: load(p) for layout, p in r["probes"].items()}} for r in res["ranks"]]


def trained(job: dict, run_dir: Path, probe_dir: Path, case: str, *, progress, stall_s, log: Path,
            references: dict | None = None) -> dict:
    """The reference of a ``converge`` run: ``job`` (``config(cfg)``'s dict and any planted fault) trained on one rank
    now, or the run ``references`` already holds for the same ``key`` - a dict a caller keeps across the runs of one
    job (the main job's one-stage and pipeline cases share their reference: it runs neither pipeline nor CP).
    Returns its ``rows``, ``routes`` (the recorded routes' entry, or None), ``probes`` (``probes_of``, in memory),
    ``metrics`` (its metrics JSONL, written to ``run_dir/reference.jsonl`` either way) and the ``case`` that trained
    it."""
    from harness.jobs.entry import launch  # lazy: looked up at each call; tests replace it

    metrics = run_dir / "reference.jsonl"
    got = (references or {}).get(key(job))
    if got is not None:
        progress(f"  the same reference as case {got['case']} of this job: its run is reused")
        if got["metrics"] is not None:
            atomic_write_bytes(metrics, got["metrics"])
        return {**got, "rows": copy.deepcopy(got["rows"])}  # a case's report never reaches another's rows
    raw = run_dir / "reference_raw.json"
    res = launch("converge", 1, raw, {**job, "metrics_path": str(metrics), "probe_dir": str(probe_dir)},
                 stream=lambda line: progress("  " + line.replace(f"[{REF_LAYOUT:4s}]", "[ref ]", 1))
                 if line.startswith("[") else None, stall_s=stall_s, log=log)
    rank0 = res["ranks"][0]
    got = {"rows": rank0["layouts"][REF_LAYOUT], "routes": (rank0.get("routes") or {}).get(REF_LAYOUT),
           "probes": probes_of(res), "metrics": metrics.read_bytes() if metrics.exists() else None, "case": case}
    raw.unlink()
    if references is not None:
        references[key(job)] = got
    return got


def name() -> str:
    return "reference (1 rank: no CP, PP, TP or EP)"


def tag(cfg: TrainConfig) -> str:
    """What a layout of ``cfg`` runs beyond DP x CP, for its reference lines: `` (pp 2, vpp 2, ep)``."""
    parts = ([f"pp {cfg.pp}"] if cfg.pp > 1 else []) + ([f"vpp {cfg.vpp}"] if cfg.vpp > 1 else []) + \
        (["ep"] if cfg.expert_parallel else []) + ([f"tp {cfg.tp}"] if cfg.tp > 1 else []) + \
        (["sp"] if cfg.sequence_parallel else [])
    return f" ({', '.join(parts)})" if parts else ""


def _relative(name_: str, vals: list[float], ref: list[float], tol: float, span: int, what: str) -> dict:
    """The worst relative per-step deviation of a series over its first ``span`` steps."""
    if len(vals) != len(ref):
        return {"target": f"{name_}: {len(vals)} steps of {what} against the reference's {len(ref)}",
                "value": float("nan"), "limit": tol, "pass": False}
    who, against = name_.split(" vs ", 1)
    bad = nonfinite_message(vals, what, who) or nonfinite_message(ref, what, against)
    if bad:
        return {"target": f"{name_}: {bad}", "value": float("nan"), "limit": tol, "pass": False}
    d = worst(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(vals[:span], ref[:span]))
    steps = "" if span >= len(ref) else f" (first {span} steps)"
    return {"target": f"{name_}: max relative |delta {what}|{steps} <= {tol:g}", "value": d, "limit": tol,
            "pass": within(d, tol)}


def checks(rows: dict[str, list[dict]], ranks: list[dict], ref_rows: list[dict], ref_ranks: list[dict],
           cfg: TrainConfig, *, compare, span: tuple[int | None, str] | dict = (None, "")) -> list[dict]:
    """Every layout of a run against its reference, one line per layout and quantity. ``ranks``/``ref_ranks``:
    each rank's probes (``{"probes": {layout: ...}}``); ``compare``: ``harness.apps.converge._compare`` (the loss rule);
    ``span``: the per-step rule's span and the band's reason (``harness.apps.converge.strict_span``), or one per
    layout (``harness.apps.converge.route_span``: an MoE model's, from its routes)."""
    tol, ref_name, t = tolerances(cfg.dtype, cfg.model), name(), tag(cfg)
    ref_loss = [r["loss"] for r in ref_rows]
    ref_norm = [r["grad_norm"] for r in ref_rows]
    out = [_accounting(ref_name, ref_ranks, REF_LAYOUT)] if ref_ranks else []
    if ref_ranks and REF_LAYOUT + PROBE_SUFFIX in ref_ranks[0]["probes"]:
        out += _own_fp32(ref_name, ref_ranks, REF_LAYOUT, tol)
    for layout, rs in rows.items():
        who = f"{layout}{t} vs {ref_name}"
        if ranks:
            out.append(_accounting(f"{layout}{t}", ranks, layout))
        lspan = span.get(layout, (None, "")) if isinstance(span, dict) else span
        out += compare(who, [r["loss"] for r in rs], ref_loss, tol["loss"], lspan)
        for k in range(len(rs[0].get("mtp_loss") or [])):
            out += compare(f"{layout}{t} vs {ref_name} (MTP depth {k + 1})", [r["mtp_loss"][k] for r in rs],
                           [r["mtp_loss"][k] for r in ref_rows], tol["loss"], lspan)
        strict = len(ref_norm) if lspan[0] is None else min(lspan[0], len(ref_norm))
        out.append(_relative(who, [r["grad_norm"] for r in rs], ref_norm, tol["grad_norm"], strict, "grad norm"))
        out += _step1(who, ranks, ref_ranks, layout, REF_LAYOUT, tol, "")
        probe = layout + PROBE_SUFFIX
        if ranks and probe in ranks[0]["probes"]:
            out += _own_fp32(f"{layout}{t}", ranks, layout, tol)
            if ref_ranks and REF_LAYOUT + PROBE_SUFFIX in ref_ranks[0]["probes"]:
                out += _step1(who, ranks, ref_ranks, probe, REF_LAYOUT + PROBE_SUFFIX, probe_tolerances(cfg.device),
                              " in fp32 (step 1 run again in fp32)")
            else:  # the layout ran step 1 in fp32 and the reference did not: nothing to judge it against
                out.append({"target": f"{who}: step 1 in fp32: the reference recorded no fp32 step 1",
                            "value": float("nan"), "limit": 0, "pass": False})
    return out


def probe_tolerances(device: str) -> dict:
    """The step-1 bands of a bf16 run's fp32 probe step (``TrainConfig.fp32_probe``): fp32's on CPU;
    ``FP32_PROBE_CUDA`` on GPUs."""
    fp32 = tolerances("float32")
    if device != "cuda":
        return fp32
    return {**fp32, "step1_gradients": FP32_PROBE_CUDA, "token_loss": FP32_PROBE_CUDA}


def _own_fp32(who: str, ranks, layout: str, tol: dict) -> list[dict]:
    """A bf16 run's step 1 against its own fp32 step 1, within bf16's step-1 bands: the fp32 step ran the same model
    and batch. A wrong fp32 step that the layouts and the reference share (another seed, another batch) passes their
    comparison and fails here."""
    return _step1(who, ranks, ranks, layout, layout + PROBE_SUFFIX, tol, " in bf16 against its own fp32 step 1")


def _accounting(who: str, ranks, layout: str) -> dict:
    """Step 1 computed every loss token of the batch exactly once on ``ranks`` (``harness.faults.checks``): a dropped
    or doubled sequence is named here, not read as a token-loss deviation (or, in the reference, as none)."""
    alarm = token_accounting(None, ranks, layout)
    return {"target": f"{who}: step 1 trains every loss token exactly once" + (f": {alarm.message}" if alarm else ""),
            "value": 0 if alarm is None else alarm.where.get("sequences", 1), "limit": 0, "pass": alarm is None}


def _step1(who: str, ranks, ref_ranks, layout: str, ref_layout: str, tol: dict, how: str) -> list[dict]:
    """The step-1 gradient and token-loss checks of ``layout``'s probes against ``ref_layout``'s."""
    out = []
    grads = gradient_deviations(ref_ranks, ranks, layout, ref_layout=ref_layout)
    if grads:
        p = max(grads, key=lambda n: (grads[n][0] != grads[n][0], grads[n][0]))
        v = grads[p][0]
        out.append({"target": f"{who}: step-1 gradients{how}, worst parameter ({p}) relative L2 <= "
                              f"{tol['step1_gradients']:g}", "value": v, "limit": tol["step1_gradients"],
                    "pass": within(v, tol["step1_gradients"]), "parameters": len(grads)})
    seqs, _ = token_loss_deviations(ref_ranks, ranks, layout, ref_layout=ref_layout)
    g = max(seqs, key=lambda k: (seqs[k] != seqs[k], seqs[k]))
    out.append({"target": f"{who}: step-1 token losses{how}, worst sequence ({g}) relative L2 <= "
                          f"{tol['token_loss']:g}", "value": seqs[g], "limit": tol["token_loss"],
                "pass": within(seqs[g], tol["token_loss"])})
    return out
