"""``dcp-harness converge``: train bshd, thd and dcp side by side and check they agree.

One torchrun world (gloo on CPU, NCCL on GPUs) trains every layout in turn from the same seed on the
same global batches (``harness.train.trainer``); rank 0 streams a progress line per step and writes
``metrics.jsonl``. The run folder (``reports/converge-<time>/``, written to a hidden temporary folder
and renamed when complete, so an interrupted run leaves earlier reports intact) holds the metrics,
``results.json``, ``index.html`` + ``summary.md`` and, when wandb is installed, offline wandb runs.

Checks (``TOLERANCES``): CPU fp32: every layout within 1e-5 of bshd at every step and, for a config
with a committed golden (``golden/convergence/<case_id>.cpu.json``), within 1e-5 of the golden's bshd
curve. GPU bf16: per-step |delta| <= 2e-3 and mean |delta| <= 5e-4 against bshd.

MoE models: hard top-k routing is discontinuous, so last-bit differences between layouts (matmuls
over different row counts, attention over different key partitions) eventually resolve a near-tie
differently and the trajectories separate. Every run records its routes (``harness.train.routes``) and
an fp32 layout is held per step while its routes equal its reference's, up to their first difference
where that difference is a near-tie, with a failing check where it is not (``route_span``,
``harness.apps.route_rule``); bf16 runs, goldens and runs without route records keep the fixed span of
``MOE_EXACT_STEPS`` steps. After the span, the mean loss of the last ``LATE_WINDOW`` steps must stay
within ``LATE_BAND`` (relative) of the reference's. Exact MoE agreement over long horizons needs the same
routes in every layout (router replay).

bf16 runs longer than ``BF16_EXACT_STEPS``: bf16 rounding makes the layouts' trajectories separate with the
steps as well (tiny GPT on one H100, the nightly corpus: bshd vs thd 7.4e-3 at 100 steps against the 2e-3 per
step the bf16 tolerances were calibrated on over 30 steps). The strict rule covers the first
``BF16_EXACT_STEPS`` steps, then the late-window band applies (``strict_span``): a wrong loss, label or
normalisation shows from the first step, far inside the strict span.
"""

from __future__ import annotations

import datetime as dt
import math
import os
import re
import shutil
import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from harness import golden as golden_mod
from harness.apps import reference, route_rule
from harness.data.corpus import CorpusConfig, batch_lengths, global_batch
from harness.finite import nonfinite_message, within, worst
from harness.io import atomic_write_json, atomic_write_text, temporary_folder
from harness.jobs.entry import launched_world, local_ranks
from harness.jobs.nodes import Nodes
from harness.paths import REPORTS
from harness.report.tracking import log_runs
from harness.runtime.model_config import MODELS
from harness.stack.checks import NOT_EXERCISED as STACK_NOT_EXERCISED
from harness.stack.checks import TOLERANCES as STACK_TOLERANCES
from harness.stack.checks import tolerances
from harness.train.config import TrainConfig, execution_line, longest_sequence, model_cost
from harness.train.layouts import LayoutConfig, LayoutError, plan, static_cp_for

TOLERANCES = {dtype: t["loss"] for dtype, t in STACK_TOLERANCES.items()}
"""Loss bands per precision (``harness.stack.checks.TOLERANCES``): fp32 1e-5 per step and on average; bf16 2e-3 per
step, 5e-4 on average (``loss_tolerance``: scaled for models with SSM mixer layers)."""
MOE_EXACT_STEPS, LATE_WINDOW, LATE_BAND = 20, 10, 0.01
"""The MoE rule's strict span, and the late-window band of every rule with one (MoE routing, long bf16 runs)."""
BF16_EXACT_STEPS = 30
GOLDEN_SUITE = "convergence"


def loss_tolerance(cfg: TrainConfig) -> dict:
    """``TOLERANCES[cfg.dtype]``, scaled for a bf16 model with SSM mixer layers
    (``harness.stack.checks.BF16_MIXER_SCALE``)."""
    return tolerances(cfg.dtype, cfg.model)["loss"]


DEFAULT_MAX_SEQLEN_PER_RANK = TrainConfig().max_seqlen_per_rank
DEFAULT_BATCH = TrainConfig().corpus.sequences_per_batch
DEFAULT_LENGTHS = TrainConfig().corpus.lengths
DEFAULT_SEED = TrainConfig().corpus.seed


def case_id(cfg: TrainConfig, world: int) -> str:
    """``converge__<model>[_aux<coef>]__w<world>[_pp<P>[_vpp<V>][_afab]][_ep][_tp<T>[_sp]][__m<tokens per rank>][__b<sequences>][__<lengths>][__seed<corpus seed>]__<dtype>``:
    a load-balancing loss, the pipeline, expert parallelism, a non-default ``max_seqlen_per_rank``, batch, length spec
    and corpus seed are part of the case. The step count is not: step k's batch and learning rate do not depend on how many steps
    follow, so a golden of N steps serves every run of the case with at most N steps (its prefix)."""
    dtype = {"float32": "fp32", "bfloat16": "bf16"}[cfg.dtype]
    pipe = "" if cfg.pp == 1 else f"_pp{cfg.pp}" + (f"_vpp{cfg.vpp}" if cfg.vpp > 1 else "") + \
        ("_afab" if cfg.pipeline == "afab" else "")
    pipe += "_ep" if cfg.expert_parallel else ""
    pipe += f"_tp{cfg.tp}" if cfg.tp > 1 else ""
    pipe += "_sp" if cfg.sequence_parallel else ""
    m = "" if cfg.max_seqlen_per_rank == DEFAULT_MAX_SEQLEN_PER_RANK else f"__m{cfg.max_seqlen_per_rank}"
    b = "" if cfg.corpus.sequences_per_batch == DEFAULT_BATCH else f"__b{cfg.corpus.sequences_per_batch}"
    L = "" if cfg.corpus.lengths == DEFAULT_LENGTHS else "__" + _lengths_tag(cfg.corpus.lengths)
    L += "" if cfg.corpus.seed == DEFAULT_SEED else f"__seed{cfg.corpus.seed}"
    aux = f"_aux{cfg.moe_aux_loss:g}" if cfg.moe_aux_loss else ""
    return f"converge__{cfg.model.replace('-', '_')}{aux}__w{world}{pipe}{m}{b}{L}__{dtype}"


def _lengths_tag(spec: str) -> str:
    """A non-default length spec as a file-name-safe part of the case id:
    ``lognormal:mean=160,sigma=1.2,min=16,max=512`` -> ``lognormal-mean160-sigma1.2-min16-max512``."""
    return re.sub(r"[^A-Za-z0-9.-]", "", spec.replace(":", "-").replace(",", "-").replace("=", ""))


def reference_case(cfg: TrainConfig, world: int) -> tuple[TrainConfig, int]:
    """The case a pipelined, expert-parallel or tensor-parallel run must equal: the same run on one stage's DP x CP
    domain with every expert and every head on every rank (its golden is theirs)."""
    if cfg.pp == 1 and not cfg.expert_parallel and cfg.tp == 1:
        return cfg, world
    return replace(cfg, pp=1, vpp=1, pipeline="1f1b", schedule_delivery="broadcast",
                   expert_parallel=False, tp=1, sequence_parallel=False), world // (cfg.pp * cfg.tp)


def hardware(cfg: TrainConfig) -> str:
    if cfg.device != "cuda":
        return "cpu"
    import torch

    name = torch.cuda.get_device_name(0).lower()
    return next((k for k in ("h200", "h100", "a100", "b200") if k in name), "gpu")


@dataclass
class ConvergeResult:
    verdict: str
    run_dir: Path
    case_id: str
    rows: dict[str, list[dict]]
    checks: list[dict]
    config: dict
    reference: list[dict] | None = None
    """The reference run's rows (``harness.apps.reference``), or None when none ran."""
    schedules: dict | None = None
    """Step 0's schedule of each layout as the ranks planned it (``step0_schedules``), for the report."""
    cost: object | None = None
    """The cost model the schedules were planned with (``harness.train.config.model_cost``)."""


def strict_span(cfg: TrainConfig) -> tuple[int | None, str]:
    """How many leading steps the per-step rule covers for ``cfg`` (None: all of them) and why the rest is held
    to the late-window band instead: MoE routing (``MOE_EXACT_STEPS``), else bf16 rounding (``BF16_EXACT_STEPS``).
    An fp32 MoE layout compared with a reference whose routes were recorded gets its span from them instead
    (``route_span``)."""
    if MODELS[cfg.model].experts > 0:
        return MOE_EXACT_STEPS, "MoE routing"
    if cfg.dtype == "bfloat16":
        return BF16_EXACT_STEPS, "bf16 rounding"
    return None, ""


def _compare(name: str, losses: list[float], ref: list[float], tol: dict, span: tuple[int | None, str] = (None, ""),
             what: str = "loss") -> list[dict]:
    """Checks of one loss curve against a reference curve of the same length: per step over the first ``span[0]``
    steps (None: all), then the late-window band for the reason ``span[1]`` (``strict_span``; the module doc). A curve
    of another length, or a non-finite value in either, is one failing check that says so."""
    if len(losses) != len(ref):
        return [{"target": f"{name}: {len(losses)} steps against the reference's {len(ref)}", "value": math.nan,
                 "limit": tol["max"], "pass": False}]
    who, against = name.split(" vs ", 1) if " vs " in name else (name, "reference")
    bad = nonfinite_message(losses, what, who) or nonfinite_message(ref, what, against)
    if bad:
        return [{"target": f"{name}: {bad}", "value": math.nan, "limit": tol["max"], "pass": False}]
    exact = len(ref) if span[0] is None else min(len(ref), span[0])
    d = [abs(a - b) for a, b in zip(losses[:exact], ref[:exact])]
    first = "" if exact == len(ref) else f" (first {exact} steps)"
    out = [{"target": f"{name}: max |delta {what}|{first} <= {tol['max']:g}", "value": worst(d), "limit": tol["max"],
            "pass": within(worst(d), tol["max"])}]
    if tol["mean"] != tol["max"]:
        m = statistics.fmean(d)
        out.append({"target": f"{name}: mean |delta {what}|{first} <= {tol['mean']:g}", "value": m,
                    "limit": tol["mean"], "pass": within(m, tol["mean"])})
    if exact < len(ref):
        w = min(LATE_WINDOW, len(ref))
        rel = abs(statistics.fmean(losses[-w:]) - statistics.fmean(ref[-w:])) / abs(statistics.fmean(ref[-w:]))
        out.append({"target": f"{name}: last-{w}-step mean {what} within {LATE_BAND:.0%} ({span[1]})", "value": rel,
                    "limit": LATE_BAND, "pass": within(rel, LATE_BAND)})
    return out


def load_golden(cfg: TrainConfig, world: int, hw: str) -> dict:
    """The committed golden of the run's reference case (``reference_case``), checked before anything trains:
    a well-formed rule no looser than ``TOLERANCES`` (a golden may only tighten the harness's tolerance), finite
    numbers, at least the run's steps (its first ``cfg.steps`` serve), and every curve the run compares (bshd's
    loss and, with MTP, each depth's). Raises ``GoldenError`` naming the file, the value and the fix."""
    cid, hint = case_id(*reference_case(cfg, world)), _update_hint(cfg, world)
    path = golden_mod.path_for(GOLDEN_SUITE, cid, hw)
    doc = golden_mod.load(path, hint)
    policy = {"atol": loss_tolerance(cfg)["max"], "rtol": 0.0}
    rule = golden_mod.checked_rule(doc["rule"], policy, path, hint)
    keys = ["bshd"] + [_mtp_key("bshd", k) for k in range(MODELS[cfg.model].mtp_depth)]
    series = {k: golden_mod.checked_series(doc, k, path, hint, cfg.steps)[:cfg.steps] for k in keys}
    atol = rule.get("atol", 0.0)
    return {"case_id": cid, "path": str(path), "steps": len(doc["data"]["bshd"]), "series": series,
            "tol": {"max": atol, "mean": atol}}


def golden_of(cfg: TrainConfig, world: int, golden: str = "auto") -> dict | None:
    """The golden a run of ``cfg`` on ``world`` ranks is held to (``load_golden``; None: none), for ``golden``
    ``auto`` (the case's golden on this hardware when it exists) or ``require``; any other mode: None. A missing
    (``require``), corrupted, loose or short golden raises ``GoldenError`` before anything trains."""
    hw = hardware(cfg)
    path = golden_mod.path_for(GOLDEN_SUITE, case_id(*reference_case(cfg, world)), hw)
    if golden == "require" or (golden == "auto" and path.exists()):
        return load_golden(cfg, world, hw)
    return None


def route_span(who: str, cfg: TrainConfig, own: dict | None, ref: dict | None) -> tuple[tuple[int | None, str], list]:
    """The per-step rule's span for the run ``who`` against its reference, and its route checks: for an MoE model
    from the two runs' recorded routes (``harness.apps.route_rule``), else ``strict_span``."""
    if MODELS[cfg.model].experts > 0:
        return route_rule.judge(who, own, ref, cfg.dtype, MOE_EXACT_STEPS)
    return strict_span(cfg), []


def evaluate(rows: dict[str, list[dict]], cfg: TrainConfig, world: int, hw: str, *, use_golden: bool = False,
             golden: dict | None = None, routes: dict | None = None) -> list[dict]:
    """Layout-vs-bshd and layout-vs-golden checks (``golden``: from ``load_golden``; ``use_golden`` loads it).
    ``routes``: each layout's recorded MoE routes (``route_rule.load``), which set an MoE layout's span against
    bshd (``route_span``); without them the fixed span applies."""
    tol, span = loss_tolerance(cfg), strict_span(cfg)
    base = "bshd" if "bshd" in rows else next(iter(rows))
    ref = [r["loss"] for r in rows[base]]
    routes = routes or {}
    checks = []
    for layout, rs in rows.items():
        if layout != base:
            lspan, route_checks = route_span(f"{layout} vs {base}", cfg, routes.get(layout), routes.get(base))
            checks += _compare(f"{layout} vs {base}", [r["loss"] for r in rs], ref, tol, lspan)
            for k in range(len(rs[0].get("mtp_loss") or [])):  # each multi-token-prediction depth's loss too
                checks += _compare(f"{layout} vs {base} (MTP depth {k + 1})", [r["mtp_loss"][k] for r in rs],
                                   [r["mtp_loss"][k] for r in rows[base]], tol, lspan)
            checks += route_checks
    if golden is None and use_golden:
        golden = load_golden(cfg, world, hw)
    if golden is not None:
        gref, gtol = golden["series"], golden["tol"]
        gchecks, t, gname = [], reference.tag(cfg), "golden bshd" + (" of the PP = 1 case" if cfg.pp > 1 else "")
        for layout, rs in rows.items():
            gchecks += _compare(f"{layout}{t} vs {gname}", [r["loss"] for r in rs], gref["bshd"], gtol, span)
            for k in range(len(rs[0].get("mtp_loss") or [])):
                gchecks += _compare(f"{layout}{t} vs {gname} (MTP depth {k + 1})", [r["mtp_loss"][k] for r in rs],
                                    gref[_mtp_key("bshd", k)], gtol, span)
        checks += [{**c, "reference": True} for c in gchecks]
    return checks


def _mtp_key(layout: str, k: int) -> str:
    """A golden's key for the loss curve of MTP depth ``k + 1`` of ``layout``."""
    return f"{layout}:mtp{k + 1}"


def _golden_data(rows) -> dict:
    data = {layout: [r["loss"] for r in rs] for layout, rs in rows.items()}
    for layout, rs in rows.items():
        for k in range(len(rs[0].get("mtp_loss") or [])):
            data[_mtp_key(layout, k)] = [r["mtp_loss"][k] for r in rs]
    return data


def write_golden(rows, cfg: TrainConfig, world: int, cid: str, hw: str) -> Path:
    return golden_mod.write(golden_mod.path_for(GOLDEN_SUITE, cid, hw), suite=GOLDEN_SUITE, case_id=cid, hw=hw,
                            config={**cfg.to_dict(), "world": world},
                            data=_golden_data(rows),
                            rule={"kind": "approx", "atol": loss_tolerance(cfg)["max"], "rtol": 0.0},
                            command=_update_hint(cfg, world))


def preflight(cfg: TrainConfig, world: int, local: int | None = None) -> None:
    """Fail before launching anything: bad model / layout / scheduler / world, no CUDA device (or too
    few) for a CUDA run (``local``: the ranks this machine runs, default the world), sequences too long for
    the world."""
    cfg.validate(world)
    n = cfg.domain(world)
    local = world if local is None else local
    if cfg.device == "cuda":
        import torch

        found = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if found < local:
            raise LayoutError(f"--device cuda needs {local} CUDA devices for this machine's {local} ranks, this machine "
                              f"has {found}" + ("" if found else " (no CUDA device: use --device cpu)"))
    C = static_cp_for(longest_sequence(cfg), n, cfg.max_seqlen_per_rank)
    seqs, dp = cfg.corpus.sequences_per_batch, n // C
    if "bshd" in cfg.layouts and seqs % (dp * cfg.micro_batch_size):
        raise LayoutError(f"bshd splits each global batch ({seqs} sequences) over {dp} data-parallel replicas in "
                          f"micro-batches of {cfg.micro_batch_size}: use a batch size that is a multiple of "
                          f"{dp * cfg.micro_batch_size}")
    _plan_every_step(cfg, n, C, cfg.execution_model(world)[0])


def _plan_every_step(cfg: TrainConfig, n: int, static_cp: int, execution=None) -> None:
    """Schedule every step of every layout as the ranks will (pure and fast), so that a batch the
    configuration cannot run (e.g. a VPP group a micro-batch cannot be split for) fails here, naming
    the step and the layout, before any process starts."""
    lcfg = LayoutConfig(n_ranks=n, max_seqlen_per_rank=cfg.max_seqlen_per_rank, static_cp=static_cp,
                        micro_batch_size=cfg.micro_batch_size, scheduler=cfg.scheduler, dcp_padding=cfg.dcp_padding,
                        vpp_group=cfg.pipeline_config().vpp_group, execution=execution, tp_padding=cfg.tp_padding)
    cost = model_cost(cfg)
    for step in range(cfg.steps):
        lengths = batch_lengths(cfg.corpus, step)
        for layout in cfg.layouts:
            try:
                plan(layout, lengths, lcfg, cost)
            except ValueError as e:
                raise LayoutError(f"step {step + 1}, layout {layout}: {e}") from None


def run(cfg: TrainConfig, *, world: int, out_root: Path | str = REPORTS, golden: str = "auto", progress=print,
        report: bool = True, run_dir: Path | None = None, stall_s: float | None = None,
        plant: str | None = None, reference_mode: str = "run", nodes: Nodes | None = None,
        references: dict | None = None) -> ConvergeResult | None:
    """Train, check, report. ``golden``: ``auto`` (compare if a golden exists for this case),
    ``require`` (missing golden is an error), ``update`` (write it), ``off``. ``run_dir``: write into
    this (existing, caller-owned) folder instead of a new ``out_root/converge-<time>``. ``stall_s``: fail
    when no rank reports progress for this long (``harness.jobs.entry.DEFAULT_STALL_S``); a failed job
    leaves its whole output in ``out_root/logs/`` and raises ``JobFailure`` naming the rank. ``plant``: a fault of
    the catalogue (``harness.faults``) active on every rank for the whole job - the verdict must then fail.
    ``reference_mode``: ``run`` (default) also trains the run's reference (``harness.apps.reference``: one rank, no CP,
    PP or EP) and judges every layout against it; ``off`` skips it - without a golden the verdict is then
    ``NO REFERENCE``. ``nodes``: this machine of a multi-node job (``harness.jobs.nodes``; every node calls ``run``
    with the same arguments and ``world``, the job's whole world): every node trains its share of the ranks, node 0
    also trains the reference and writes the report; the other nodes return None. ``references``: a dict the caller
    keeps across runs (``harness.apps.reference.trained``): a reference it holds for the same configuration is reused instead of
    trained again (a pipeline case and its PP = 1 case share theirs: the reference runs neither pipeline nor CP)."""
    # lazy: looked up at each call; tests replace harness.jobs.entry.launch
    from harness.jobs.entry import launch

    nodes = nodes or Nodes()
    out_root = Path(out_root)
    here = launched_world()
    if here is not None and here[0] != 0:  # a rank of a world the user's launcher started: rank 0 speaks
        progress = lambda line: None  # noqa: E731
    preflight(cfg, world, local_ranks(world // nodes.nnodes))
    if reference_mode not in ("run", "off"):
        raise LayoutError(f"reference must be 'run' or 'off', got {reference_mode!r}")
    if plant is not None:
        from harness.faults.catalogue import get  # lazy: the fault modules import torch

        get(plant)  # an unknown name: one line before anything starts
        if golden == "update":
            raise LayoutError(f"--plant {plant} with --update-golden would write a golden of a planted bug: drop one")
    if golden == "update" and (cfg.pp > 1 or cfg.expert_parallel or cfg.tp > 1):
        raise LayoutError(f"goldens are written by the PP = 1, TP = 1, non-expert-parallel case a pipeline, "
                          f"tensor-parallel or expert-parallel run must equal; run: {_update_hint(cfg, world)}")
    cid, hw = case_id(cfg, world), hardware(cfg)
    gold = golden_of(cfg, world, golden)  # missing, corrupted, loose or short: fail before training
    if run_dir is None:
        out_root.mkdir(parents=True, exist_ok=True)
        tmp = temporary_folder(".converge-", out_root)
    else:
        tmp = Path(run_dir)
        tmp.mkdir(parents=True, exist_ok=True)
    try:
        progress(f"converge {cid}: layouts {', '.join(cfg.layouts)} on {world} {cfg.device} ranks ({hw})")
        progress(f"  {execution_line(cfg, world)}")
        if cfg.tp > 1:
            progress(f"  tensor parallelism: {cfg.tp} ranks per position split each block's heads and FFN"
                     + (" and, sequence-parallel, the token rows between them" if cfg.sequence_parallel else "")
                     + f"; {cfg.pp} x a {cfg.domain(world)}-rank DP x CP domain x {cfg.tp}")
        if cfg.bucket():
            progress(f"  token bucket: every thd / dcp micro-batch padded to a multiple of {cfg.bucket()} tokens per rank"
                     + (" (auto on CUDA, as bench step; --token-bucket 0 turns it off)" if cfg.token_bucket == "auto" else ""))
        if plant:
            progress(f"  planted fault: {plant} (harness.faults) on every rank: the verdict must be FAIL")
        if "dcp" in cfg.layouts and cfg.domain(world) == 1:
            progress("  dcp on a DP x CP domain of one rank never forms a CP group > 1: its verdict is NOT EXERCISED "
                     "(dynamic CP needs a domain of >= 2 ranks)")
        stamp = f"{dt.datetime.now():%Y%m%d-%H%M%S}-{os.getpid()}"
        around = {"around": ["harness.faults.catalogue:planted", plant]} if plant else {}
        probe_dir = tmp / "probes"
        probe_dir.mkdir(exist_ok=True)
        with_probes = reference_mode == "run"
        # several machines, or ranks the user's launcher started: the probes travel with the results to rank 0
        # (no folder all ranks share is assumed)
        shared = not nodes.multi and here is None
        job = {**replace(cfg, probes=with_probes).to_dict(), "metrics_path": str(tmp / "metrics.jsonl"),
               **({"probe_dir": str(probe_dir)} if shared else {}), **around}
        res = launch("converge", world // nodes.nnodes, tmp / "results_raw.json", job,
                     stream=lambda line: progress("  " + line) if line.startswith("[") else None,
                     stall_s=stall_s, log=out_root / "logs" / f"{cid}-{stamp}.log", nodes=nodes)
        if res is None:  # a node other than node 0: its ranks are done; node 0 writes the report
            shutil.rmtree(tmp, ignore_errors=True)
            progress(f"{nodes.describe()}: its {world // nodes.nnodes} ranks finished; node 0 writes the report")
            return None
        rank0 = res["ranks"][0]
        rows = rank0["layouts"]
        routes = {layout: route_rule.load(e) for layout, e in (rank0.get("routes") or {}).items()}
        if golden == "update":
            progress(f"wrote golden {write_golden(rows, cfg, world, cid, hw)}")
        ref_rows, ref_checks, ref_routes = None, [], None
        if with_probes:
            progress(f"  {reference.name()}: the same model, corpus, seed and batches, whole sequences packed (thd)")
            trained = reference.trained({**reference.config(cfg).to_dict(), **around}, tmp, probe_dir / "ref", cid,
                                        progress=progress, stall_s=stall_s,
                                        log=out_root / "logs" / f"{cid}-reference-{stamp}.log", references=references)
            ref_rows = trained["rows"]
            ref_routes = route_rule.load(trained["routes"])
            spans, route_checks = {}, []
            for layout in rows:
                spans[layout], more = route_span(f"{layout}{reference.tag(cfg)} vs {reference.name()}", cfg,
                                                 routes.get(layout), ref_routes)
                route_checks += more
            ref_checks = reference.checks(rows, reference.probes_of(res), ref_rows, trained["probes"], cfg, compare=_compare,
                                          span=spans) + route_checks
            for c in ref_checks:
                c["reference"] = True
        shutil.rmtree(probe_dir, ignore_errors=True)
        exercise = dcp_exercise(rows, cfg.domain(world))
        checks = evaluate(rows, cfg, world, hw, golden=gold, routes=routes) + ref_checks + exercise_checks(exercise)
        verdict = verdict_of(checks)
        shares = cfg.execution_model(world)[0].chunk_shares  # the pipeline's chunk prices (None without stages)
        config = {**cfg.to_dict(), "token_bucket_resolved": cfg.bucket(), "world": world,
                  "route_differences": route_rule.differences(routes, ref_routes, reference.name()),
                  "chunk_shares": list(shares) if shares else None,
                  "static_cp": rank0["static_cp"], "longest": rank0["longest"], "case_id": cid, "hardware": hw,
                  "golden": gold["path"] if gold else None, "dcp_exercise": exercise, "planted": plant,
                  "reference": reference.name() if with_probes else None}
        result = ConvergeResult(verdict, tmp, cid, rows, checks, config, ref_rows, step0_schedules(config),
                                model_cost(cfg))
        tracking = None
        if report:
            tracking = log_runs(cid, rows, config, tmp)
        atomic_write_json(tmp / "results.json", {"verdict": verdict, "case_id": cid, "config": config,
                                                 "checks": checks, "layouts": rows, "reference": ref_rows,
                                                 "tracking": tracking,
                                                 "producer": golden_mod.producer("dcp-harness converge")})
        (tmp / "results_raw.json").unlink()
        if report:
            # lazy: imports matplotlib; only the report needs it
            from harness.report.convergence_report import render_standalone

            html, md = render_standalone(result, tracking)
            atomic_write_text(tmp / "index.html", html)
            atomic_write_text(tmp / "summary.md", md)
        if run_dir is None:
            final = out_root / f"converge-{dt.datetime.now():%Y%m%d-%H%M%S}"
            if final.exists():
                final = final.with_name(final.name + f"-{os.getpid()}")
            os.replace(tmp, final)
            result.run_dir = final
        return result
    except BaseException:
        if run_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def step0_schedules(config: dict) -> dict:
    """Step 0's schedule of each layout of a run (``config``: its results' config), re-planned (deterministic) on
    one stage's DP x CP domain with the interleaved pipeline's micro-batch group, as the ranks planned it."""
    cfg = TrainConfig.from_dict(config)
    world = config["world"]
    lengths = [len(x) - 1 for x in global_batch(cfg.corpus, 0)]
    lcfg = LayoutConfig(n_ranks=cfg.domain(world), max_seqlen_per_rank=cfg.max_seqlen_per_rank,
                        static_cp=config["static_cp"], micro_batch_size=cfg.micro_batch_size, scheduler=cfg.scheduler,
                        dcp_padding=cfg.dcp_padding, vpp_group=cfg.pipeline_config().vpp_group,
                        execution=cfg.execution_model(world)[0], tp_padding=cfg.tp_padding)
    return {layout: plan(layout, lengths, lcfg, model_cost(cfg))[0] for layout in cfg.layouts}


NOT_EXERCISED = STACK_NOT_EXERCISED
"""The verdict of a run whose dcp layout never formed a CP group of more than one rank: its agreement
says nothing about dynamic CP (one rank, or lengths that never needed CP). The same verdict as ``verify``'s
(``harness.stack.checks.NOT_EXERCISED``)."""


def dcp_exercise(rows: dict[str, list[dict]], domain: int) -> dict | None:
    """What dynamic CP did in the run's dcp layout (None without one): CP groups formed per size over
    all its micro-batches, the number of distinct sizes, the micro-batches with a CP group > 1, and the
    steps that mixed CP 1 with the largest group of the DP x CP domain (0 on a domain of one rank)."""
    rs = rows.get("dcp")
    if not rs:
        return None
    hist: dict[str, int] = {}
    for r in rs:
        for k, v in r["cp_groups"].items():
            hist[k] = hist.get(k, 0) + v
    mixed = sum({"1", str(domain)} <= set(r["cp_groups"]) for r in rs) if domain > 1 else 0
    return {"cp_groups": dict(sorted(hist.items(), key=lambda kv: int(kv[0]))), "distinct_sizes": len(hist),
            "microbatches": sum(r["microbatches"] for r in rs),
            "microbatches_cp_gt1": sum(r["microbatches_cp_gt1"] for r in rs),
            "largest": domain, "steps": len(rs), "steps_mixed": mixed}


def exercise_checks(exercise: dict | None) -> list[dict]:
    """The check that the dcp layout formed a CP group > 1 (failing it gives ``NOT_EXERCISED``)."""
    if exercise is None:
        return []
    n = exercise["microbatches_cp_gt1"]
    return [{"target": f"dcp: micro-batches with a CP group > 1 (of {exercise['microbatches']}; CP groups "
                       f"{exercise['cp_groups']})", "value": n, "pass": n > 0, "exercise": True}]


def verdict_of(checks: list[dict]) -> str:
    """FAIL when a numerical check fails; else NO REFERENCE when nothing outside the run's own layouts judged it
    (no reference run, no golden); else NOT EXERCISED when dynamic CP never ran; else PASS."""
    if not all(c["pass"] for c in checks if not c.get("exercise")):
        return "FAIL"
    if not any(c.get("reference") for c in checks):
        return reference.NO_REFERENCE
    return "PASS" if all(c["pass"] for c in checks) else NOT_EXERCISED


def _update_hint(cfg: TrainConfig, world: int) -> str:
    """The command that writes this case's golden: the PP = 1 case (``reference_case``)."""
    ref, w = reference_case(cfg, world)
    m = "" if ref.max_seqlen_per_rank == DEFAULT_MAX_SEQLEN_PER_RANK else f" --max-seqlen-per-rank {ref.max_seqlen_per_rank}"
    b = "" if ref.corpus.sequences_per_batch == DEFAULT_BATCH else f" --batch-size {ref.corpus.sequences_per_batch}"
    b += "" if ref.corpus.lengths == DEFAULT_LENGTHS else f" --lengths {ref.corpus.lengths}"
    b += "" if ref.corpus.seed == DEFAULT_SEED else f" --seed {ref.corpus.seed}"
    return (f"dcp-harness converge --model {ref.model} --world {w} --steps {ref.steps} --device {ref.device}{m}{b} "
            f"--update-golden")


def _given(value, default):
    """``value`` unless the caller left it out (None): 0 is a value."""
    return default if value is None else value


def config_from_args(a) -> TrainConfig:
    corpus = CorpusConfig(**{k: v for k, v in {"lengths": a.lengths, "sequences_per_batch": a.batch_size,
                                               "seed": a.seed}.items() if v is not None})
    cfg = TrainConfig(model=a.model, layouts=tuple(x.strip() for x in a.layouts.split(",") if x.strip()),
                      steps=a.steps, scheduler=a.scheduler, device=a.device, corpus=corpus,
                      cp_exchange=a.cp_exchange, pp=a.pp, vpp=a.vpp, pipeline=a.pipeline,
                      schedule_delivery=a.schedule_delivery, expert_parallel=bool(getattr(a, "ep", False)),
                      tp=getattr(a, "tp", None) or 1, sequence_parallel=bool(getattr(a, "sequence_parallel", False)),
                      make_vocab_size_divisible_by=getattr(a, "make_vocab_size_divisible_by", None) or 1,
                      dtype=a.dtype or ("bfloat16" if a.device == "cuda" else "float32"),
                      weights=getattr(a, "weights", None) or "cached",
                      optimizer=getattr(a, "optimizer", None) or "replicated",
                      token_bucket=_given(getattr(a, "token_bucket", None), "auto"),
                      fp32_probe=getattr(a, "fp32_probe", "on") != "off",
                      moe_aux_loss=getattr(a, "moe_aux_loss", None), loss_chunk=getattr(a, "loss_chunk", None) or 0)
    if a.max_seqlen_per_rank:
        cfg = replace(cfg, max_seqlen_per_rank=a.max_seqlen_per_rank)
    return cfg
