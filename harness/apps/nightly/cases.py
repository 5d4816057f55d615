"""The nightly cases: which configurations run where, and the proof that each exercises dynamic CP.

Distributed cases (bshd, thd and dcp side by side, ``harness.apps.converge``): every model of
``NIGHTLY_MODELS`` on one pipeline stage and, on a world of >= 4 ranks, as 2 pipeline stages. They run
on the GPUs when the machine has two or more (NCCL, bf16, the largest power of two <= min(4, GPUs)
ranks; beyond ``harness.apps.converge.BF16_EXACT_STEPS`` steps held to the late-window band, as bf16 rounding
separates the trajectories), otherwise on ``CPU_WORLD`` gloo ranks (fp32, checked against the committed goldens
as well).
On a machine with exactly one GPU, the single-GPU numerics case runs on it too: bshd against THD
packing in bf16 on one rank (packing, varlen attention and autocast; no CP, so no dcp layout and no
claim about dynamic CP).

The configuration is chosen so that dynamic CP is exercised in every step: ``LENGTHS`` (a heavier tail
than the default corpus, capped at 512 tokens) with ``max_seqlen_per_rank`` the longest possible sequence
over the DP x CP domain (so the longest sequences need the whole domain as one CP group), and ``BATCH``
sequences per global batch (so every step holds such a sequence and short ones next to it). ``check_mixing`` plans every step as the ranks will and refuses a case
whose dcp schedule forms both CP 1 and a CP group of the whole domain in fewer than ``MIX_FRACTION`` of its steps.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from harness import golden
from harness.data.corpus import CorpusConfig, batch_lengths
from harness.data.workloads import parse_spec
from harness.runtime.model_config import MODELS
from harness.train.config import TrainConfig
from harness.train.layouts import LayoutError, plan

NIGHTLY_MODELS = ("tiny-gpt", "tiny-moe", "tiny-gpt-mtp", "tiny-hybrid")
CPU_WORLD = 4
LENGTHS = "lognormal:mean=160,sigma=1.2,min=16,max=512"
"""Sequence lengths of the nightly corpus: ~1 in 5 sequences needs the whole 4-rank domain, ~2 in 5 fit
on one rank, so with ``SEED`` each of the first 172 steps of every CPU case mixes CP 1 with CP 4 (and the
2-stage cases CP 1 with CP 2) at the cost of the main job's 32-sequence batches (the default corpus,
capped at 1024 tokens, needs ~96 sequences a step for the same guarantee: 3x the tokens)."""
SEED = 1
"""Corpus seed. With it the MoE cases route identically in every layout over the first 20 steps; seed 0 of this
corpus meets router near-ties at steps 5 and 10 (fp32, 4 ranks), where a rounding-level difference legitimately
flips a top-k choice. The MoE rule now reads where routes first differ (``harness.apps.route_rule``), so either
seed passes; seed 1 keeps the committed goldens."""
BATCH = 32
"""Sequences per global batch."""
MOE_GPU_BATCH = 128
"""bf16 MoE: 128-sequence batches average routing flips the way a real batch does."""
MOE_GPU_MICRO_BATCH = 4
"""Sequences per bshd micro-batch of the bf16 MoE cases: 32 padded micro-batches of 4 a step instead of 128 of one
(the bshd layout was most of those cases' time: the step is launch-bound). thd, dcp and the reference pack as
always."""
NUMERICS = "single-GPU numerics"
NUMERICS_STEPS = 30
"""bf16 trajectories of bshd and thd separate with the steps (on one H100, tiny GPT on the nightly corpus:
max |delta loss| 7.4e-3 at 100 steps against the 2e-3 tolerance); 30 steps is what the GPU suites and the
tolerances were calibrated on."""
DISTRIBUTED = "distributed"
MIX_FRACTION = 0.9
"""Of a distributed case's steps, the share whose dcp schedule must form CP 1 and a CP group of the whole domain
side by side (``check_mixing`` before the run, the nightly's exercise line after it). Not every step: under a
pipeline the scheduler may run a step's every sequence at the whole domain (tiny-hybrid on 2 stages of 4 GPUs:
step 84 of 100)."""
STACK = "megatron-core stack"
STACK_OPTIONS = {"workarounds": "all"}
"""The megatron-core case runs with the stack's workarounds of the upstream defects it documents
(``harness.stack.megatron_core.WORKAROUNDS``): without them it stops in RoPE on the first CP > 1 micro-batch."""
STACK_STEPS = 3
"""verify's default: the committed golden (3 steps) serves runs of at most its length."""


@dataclass(frozen=True)
class NightlyCase:
    cfg: object
    """The ``TrainConfig`` of the run."""
    world: int
    role: str
    """``DISTRIBUTED`` (bshd / thd / dcp on a DP x CP domain) or ``NUMERICS`` (one GPU, no dcp)."""

    @property
    def case_id(self) -> str:
        # lazy: imports torch; the CLI imports this module without it
        from harness.apps.converge import case_id

        if self.role == STACK:
            from harness.apps.verify_golden import case_id as verify_case_id  # lazy: torch, as above

            return verify_case_id("megatron-core", STACK_OPTIONS, self.cfg, self.world)
        return case_id(self.cfg, self.world)

    @property
    def domain(self) -> int:
        return self.cfg.domain(self.world)


@dataclass(frozen=True)
class Plan:
    cases: list[NightlyCase]
    line: str
    """The one line said before anything starts: what runs where."""


def only(plan: Plan, parts: tuple[str, ...]) -> Plan:
    """The cases of ``plan`` whose id contains one of ``parts`` (``nightly --only``: rerun one case, or split the
    nightly over several jobs); a part that matches no case is refused with the ids to choose from."""
    if not parts:
        return plan
    ids = [c.case_id for c in plan.cases]
    missing = [p for p in parts if not any(p in i for i in ids)]
    if missing:
        raise LayoutError(f"nightly --only {','.join(missing)}: no case of this run has that in its id; the ids are "
                          f"{', '.join(ids)}")
    kept = [c for c, i in zip(plan.cases, ids) if any(p in i for p in parts)]
    return Plan(kept, f"{plan.line}; --only {','.join(parts)}: {len(kept)} of {len(ids)} cases")


def _power_of_two_at_most(n: int) -> int:
    p = 1
    while p * 2 <= n:
        p *= 2
    return p


def choose(*, models, steps: int, device: str, world: int | None, gpus: int) -> Plan:
    """The cases for this machine (``gpus`` CUDA devices) and the user's ``device`` / ``world``."""
    unknown = [m for m in models if m not in MODELS]
    if unknown or not models:
        raise LayoutError(f"unknown model(s) {', '.join(map(repr, unknown)) or '(none given)'}; "
                          f"choose from {', '.join(MODELS)}")
    if device == "cuda" and gpus < 2:
        raise LayoutError(f"nightly --device cuda needs >= 2 GPUs for dynamic CP, this machine has {gpus}; use "
                          f"--device auto (distributed cases on {CPU_WORLD} CPU ranks"
                          f"{', numerics on the GPU' if gpus else ''}) or --device cpu")
    dist_device = "cuda" if device == "cuda" or (device == "auto" and gpus >= 2) else "cpu"
    if world is None:
        world = _power_of_two_at_most(min(4, gpus)) if dist_device == "cuda" else CPU_WORLD
    if world >= 2 and world & (world - 1):
        raise LayoutError(f"nightly --world {world}: the ranks of the distributed cases form one DP x CP domain (and "
                          f"2 pipeline stages of half of it), which dynamic CP needs as a power of two: use 2, 4 or 8")
    if world < 2:
        raise LayoutError(f"nightly --world {world}: the dcp layout on one rank never forms a CP group > 1, so its "
                          f"verdict could only be NOT EXERCISED; use --world 2 or more (CPU ranks with --device cpu)")
    cases = [NightlyCase(_config(model, steps, dist_device, world // pp, pp), world, DISTRIBUTED)
             for model in models for pp in (1, 2) if pp == 1 or world >= 4]
    numerics = device == "auto" and gpus == 1
    if numerics:
        cases += [NightlyCase(_numerics_config(model, steps), 1, NUMERICS) for model in models]
    stack_note = ""
    if dist_device == "cuda":  # megatron-core's own hybrid CP through the stack protocol, when it can run here
        why = _stack_unavailable(world)
        if why is None:
            cases.append(NightlyCase(_stack_config(steps, world), world, STACK))
        stack_note = f"; megatron-core's hybrid CP ({'verify megatron-core' if why is None else 'skipped: ' + why})"
    prec = "fp32"
    if dist_device == "cuda":
        from harness.apps.converge import BF16_EXACT_STEPS, LATE_BAND, LATE_WINDOW  # lazy: imports torch

        prec = "bf16" + (f"; per step over the first {BF16_EXACT_STEPS}, then the last-{LATE_WINDOW}-step mean "
                         f"within {LATE_BAND:.0%}" if steps > BF16_EXACT_STEPS else "")
    where = (f"{world} {'GPUs (NCCL' if dist_device == 'cuda' else 'CPU ranks (gloo'}, {prec})"
             + (f" because this machine has {gpus} GPU{'s' * (gpus != 1)}" if dist_device == "cpu" and device == "auto"
                else ""))
    line = (f"nightly: {len(models)} model(s), {steps} steps: the distributed cases on {where}"
            + (f"; the single-GPU numerics (bshd vs thd, bf16, {min(steps, NUMERICS_STEPS)} steps) on the GPU"
               if numerics else "")
            + (f"; goldens: {_goldens(cases)}" if dist_device == "cpu" else "") + stack_note)
    return Plan(cases, line)


def _stack_unavailable(world: int) -> str | None:
    """Why megatron-core's case cannot run here (its preflight's line), or None."""
    from harness.stack.megatron_core import preflight  # lazy: imports torch
    from harness.stack.protocol import StackError  # lazy: torch, as above

    try:
        preflight("cuda", world)
    except StackError as e:
        return str(e)
    return None


def _stack_config(steps: int, world: int):
    """The megatron-core case: ``verify``'s corpus and checks (every layout against the one-rank run, and the
    golden of this hardware when there is one), ``STACK_STEPS`` steps at most, on ``verify``'s default seed (the
    first whose step 1 needs CP > 1: 0 on 4 ranks, 1 on 2)."""
    from harness.apps.verify import exercising  # lazy: imports torch; the CLI imports this module without it

    return exercising(TrainConfig(steps=min(steps, STACK_STEPS), device="cuda", dtype="bfloat16"), world)


def _config(model: str, steps: int, device: str, domain: int, pp: int):
    corpus = CorpusConfig(lengths=LENGTHS, seed=SEED)
    longest = int(parse_spec(corpus.lengths)[1]["max"])
    moe_gpu = MODELS[model].experts > 0 and device == "cuda"
    return TrainConfig(model=model, steps=steps, device=device, dtype="bfloat16" if device == "cuda" else "float32",
                       corpus=replace(corpus, sequences_per_batch=MOE_GPU_BATCH if moe_gpu else BATCH), pp=pp,
                       micro_batch_size=MOE_GPU_MICRO_BATCH if moe_gpu else 1,
                       max_seqlen_per_rank=max(1, longest // domain))


def _numerics_config(model: str, steps: int):
    """The single-GPU numerics case: the configuration the GPU suites calibrate the bf16 tolerances on
    (the default corpus, 1024 tokens per rank, at most ``NUMERICS_STEPS`` steps); bshd against thd."""
    return TrainConfig(model=model, steps=min(steps, NUMERICS_STEPS), device="cuda", dtype="bfloat16",
                       max_seqlen_per_rank=1024, layouts=("bshd", "thd"))


def _goldens(cases: list[NightlyCase]) -> str:
    """How many CPU cases have a committed golden (the others are checked against bshd only)."""
    # lazy: imports torch; the CLI imports this module without it
    from harness.apps.converge import GOLDEN_SUITE, reference_case

    dist = [c for c in cases if c.role == DISTRIBUTED]
    have = [c for c in dist if golden.path_for(GOLDEN_SUITE, _reference_id(c, reference_case), "cpu").exists()]
    return f"{len(have)} of {len(dist)} cases have a committed golden"


def _reference_id(case: NightlyCase, reference_case) -> str:
    # lazy: imports torch; the CLI imports this module without it
    from harness.apps.converge import case_id

    return case_id(*reference_case(case.cfg, case.world))


def mixed_steps_needed(steps: int) -> int:
    """How many of a case's ``steps`` must mix CP 1 with the whole domain (``MIX_FRACTION``, rounded up)."""
    return math.ceil(MIX_FRACTION * steps - 1e-9)


def check_mixing(case: NightlyCase) -> None:
    """Refuse a distributed case whose dcp schedule, planned for every step as the ranks plan it (the run's
    ``layout_config``: its pipeline and expert-parallel execution model included), forms CP groups of 1 and of the
    whole DP x CP domain side by side in fewer than ``mixed_steps_needed`` of its steps."""
    if case.role != DISTRIBUTED:
        return
    # lazy: imports torch; the CLI imports this module without it
    from harness.train.config import model_cost

    cfg, n = case.cfg, case.domain
    lcfg, cost = cfg.layout_config(case.world), model_cost(cfg)
    unmixed = []
    for step in range(cfg.steps):
        sched = plan("dcp", batch_lengths(cfg.corpus, step), lcfg, cost)[0]
        sizes = sorted({b.size for mb in sched.layout for b in mb if b.gids})
        if 1 not in sizes or n not in sizes:
            unmixed.append((step, sizes))
    need = mixed_steps_needed(cfg.steps)
    if cfg.steps - len(unmixed) < need:
        step, sizes = unmixed[0]
        raise LayoutError(f"nightly case {case.case_id}: step {step + 1}'s dcp schedule forms CP groups of "
                          f"{sizes} only, not both 1 and {n} (the whole domain), and so do {len(unmixed) - 1} more of "
                          f"its {cfg.steps} steps: at least {need} must mix them; use --steps {step} or fewer")
