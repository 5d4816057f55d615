"""``bench step``'s inputs: the config, its arms, the option choices and their errors.

Everything here is checked before any process starts (``StepBenchConfig.validate``), so a bad
option fails in the CLI with a message naming the fix. Pure Python: the valid names come from the torch-free
``harness.parallel.options`` and ``harness.runtime.options``.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from harness.data.workloads import parse_spec
from harness.parallel.options import EXCHANGES, HeadSplitError, kv_replicas
from harness.plan import ALGORITHMS, CostModel
from harness.plan.errors import PlanInputError
from harness.plan.execution import NAMED as EXECUTIONS
from harness.plan.token_bucket import check as check_bucket
from harness.plan.token_bucket import resolve as resolve_bucket
from harness.runtime.model_config import MODELS, loss_chunk_problem
from harness.runtime.options import COMPILE_SCOPES, WEIGHT_MODES

_COST_NAME = re.compile(r"[A-Za-z0-9_-]+")


class BenchConfigError(PlanInputError):
    """A ``bench step`` option is invalid (names the value and the fix)."""


@dataclass(frozen=True)
class Arm:
    layout: str
    scheduler: str
    padding: str = "local"
    exchange: str | None = None
    """K/V exchange of this arm's CP blocks; None = the config's ``cp_exchange``."""
    scope: str | None = None
    """What one compiled call covers for this arm (``TinyLM.compile_blocks(scope=...)``: ``segments``
    or ``chain``); None = the config's ``compile``."""
    execution: str | None = None
    """The execution model the arm's schedules are made for (``harness.plan.execution``: ``independent`` or
    ``synchronous``, the fourth field); None = the layout's default (independent)."""
    cost: str | None = None
    """The name of a fixed cost model of the config's ``arm_cost_models`` this arm schedules with (``~NAME``);
    None = the run's (calibrated or ``cost_model``). Two arms that differ only here are an A/B of cost models."""
    weights: str | None = None
    """How the step's layers take their matrix weights (``%MODE``, ``harness.runtime.weight_cache.MODES``); None =
    ``cached``. ``dcp:balanced%per-call`` beside ``dcp:balanced`` is an A/B of the step's weight copies."""
    token_bucket: int | None = None
    """Pad each rank's micro-batch to a multiple of this many tokens (``#N``; 0 = off); None = the config's
    ``token_bucket``. ``dcp:balanced#64`` beside ``dcp:balanced`` is an A/B of the bucket: fewer distinct matrix
    shapes (a shape missing from cuBLASLt's heuristics cache costs the host a lookup) against the padding's work."""

    @property
    def label(self) -> str:
        tail = f":{self.padding}" if self.padding != "local" or self.execution else ""
        return (f"{self.layout}:{self.scheduler}" + tail + (f":{self.execution}" if self.execution else "")
                + (f"@{self.exchange}" if self.exchange else "") + (f"+{self.scope}" if self.scope else "")
                + (f"%{self.weights}" if self.weights else "")
                + (f"#{self.token_bucket}" if self.token_bucket is not None else "") + (f"~{self.cost}" if self.cost else ""))


def parse_arm(text: str) -> Arm:
    text = str(text)
    text_, tilde, cost = text.partition("~")
    if tilde and not _COST_NAME.fullmatch(cost):
        raise BenchConfigError(f"arm {text!r}: after '~' comes the name of a cost model given by --arm-cost-model "
                               f"NAME=PATH (letters, digits, '-' and '_'), got {cost!r}")
    text_, hash_, bucket = text_.partition("#")
    if hash_ and not (bucket.isascii() and bucket.isdigit() and len(bucket) <= 6 and int(bucket) % 2 == 0):
        raise BenchConfigError(f"arm {text!r}: after '#' comes the token bucket, 0 (off) or an even number of tokens "
                               f"(at most 6 digits), e.g. dcp:balanced#64; got {bucket!r}")
    text_, percent, weights = text_.partition("%")
    if percent and weights not in WEIGHT_MODES:
        raise BenchConfigError(f"arm {text!r}: after '%' comes how the step takes its weights, one of "
                               f"{', '.join(WEIGHT_MODES)}, got {weights!r}")
    rest, plus, scope = text_.partition("+")
    if plus and scope not in COMPILE_SCOPES:
        raise BenchConfigError(f"arm {text!r}: compile scope must be one of {', '.join(COMPILE_SCOPES)} after '+', "
                               f"got {scope!r}")
    body, _, exchange = rest.partition("@")
    if "@" in rest and exchange not in EXCHANGES:
        raise BenchConfigError(f"arm {text!r}: exchange must be one of {', '.join(EXCHANGES)} after '@', got {exchange!r}")
    parts = body.split(":")
    if len(parts) not in (2, 3, 4):
        raise BenchConfigError(f"arm {text!r} is not layout:scheduler[:padding[:execution]][@exchange][+scope][%weights][#bucket][~cost], e.g. "
                               f"thd:dp-balanced, dcp:balanced@ring, dcp:balanced:local:synchronous or "
                               f"dcp:balanced+chain")
    layout, scheduler = parts[0], parts[1]
    padding = parts[2] if len(parts) >= 3 and parts[2] else "local"
    execution = parts[3] if len(parts) == 4 else None
    if execution is not None and execution not in EXECUTIONS:
        raise BenchConfigError(f"arm {text!r}: execution must be one of {', '.join(EXECUTIONS)} in the fourth field, "
                               f"got {execution!r}")
    if layout not in ("thd", "dcp"):
        raise BenchConfigError(f"arm {text!r}: layout must be thd (static CP) or dcp (dynamic CP), got {layout!r}")
    if layout == "thd" and scheduler != "dp-balanced":
        raise BenchConfigError(f"arm {text!r}: static CP (thd) packs with dp-balanced; write thd:dp-balanced")
    if scheduler not in ALGORITHMS:
        raise BenchConfigError(f"arm {text!r}: unknown scheduler {scheduler!r}; choose from {', '.join(ALGORITHMS)}")
    if padding not in ("local", "domain"):
        raise BenchConfigError(f"arm {text!r}: padding must be local or domain, got {padding!r}")
    if cost and scheduler.startswith("megatron"):
        raise BenchConfigError(f"arm {text!r}: the {scheduler} scheduler ignores the cost model (as upstream); name a "
                               f"cost model on a balanced or dp-balanced arm")
    return Arm(layout, scheduler, padding, exchange or None, scope or None, execution, cost or None, weights or None,
               int(bucket) if hash_ else None)


@dataclass(frozen=True, kw_only=True)
class StepBenchConfig:
    model: str = "gpt-12l-h2048"
    """A key of ``harness.runtime.model.MODELS``."""
    lengths: str = "lognormal:mean=1024,sigma=1.5,min=128,max=8192"
    """Length distribution (``harness.data.workloads`` spec)."""
    max_seqlen_per_rank: int = 2048
    microbatches: int = 8
    """Global batch = ``microbatches x N x max_seqlen_per_rank`` tokens (at most), with
    ``global_batch="tokens"``."""
    global_batch: str = "tokens"
    """How big a global batch is (``GLOBAL_BATCH_CHOICES``):

    - ``tokens``: lengths drawn until the next one would pass ``microbatches x N x
      max_seqlen_per_rank`` tokens: enough for ``microbatches`` full packs of the DP x CP domain
      (65536 tokens, ~75 sequences at 4 ranks). This project's reading of "8 micro-batches per
      global batch", and the default.
    - ``megatron``: ``microbatches x dp`` sequences, where dp = N / ``static_cp``: exactly what
      Megatron's ``benchmark_dcp.sh`` loads per step. It sets ``GLOBAL_BATCH_SIZE = MICRO_BATCH_SIZE
      (1) x DP x NUM_MICROBATCHES (8)``, and its ``MockVarlenDataset`` emits one unpacked sequence
      per sample, so at 4 GPUs with CP 4 a step trains on 8 sequences (~7K tokens) in 1-2 packed
      micro-batches.
    - ``sequences:K``: K sequences per global batch.

    The sequence modes take the first sequences of the ``tokens`` mode's draw, so their batches are
    prefixes of the default ones."""
    static_cp: int = 0
    """CP size of the ``thd`` baseline; 0 = the world size."""
    warmup: int = 10
    iters: int = 30
    arms: tuple[str, ...] = ("thd:dp-balanced", "dcp:balanced", "dcp:megatron-dev")
    dtype: str = "bfloat16"
    seed: int = 1234
    lr: float = 1e-4
    cp_comm_flops_per_byte: float = 2000.0
    """Cost model of the ``balanced`` scheduler: FLOP-equivalents per byte of K/V exchanged, calibrated
    from ``bench attention`` (the figures: ``reports/recorded/README.md``, "Measurements quoted in code")."""
    per_microbatch_flops: float = 0.0
    """Cost model: fixed FLOP-equivalents per micro-batch a rank runs (launch overhead)."""
    calibrate: bool = True
    """Fit the scheduler's cost model to measured micro-batch times on this machine first
    (``calibrate_cost``); otherwise use the FLOP model with ``cp_comm_flops_per_byte``."""
    cost_model: dict | None = None
    """A fixed cost model (``CostModel`` fields, e.g. ``results.cost_model`` of an earlier
    ``bench_step.json``): no calibration, and schedules identical from run to run."""
    arm_cost_models: dict | None = None
    """Named fixed cost models (name -> ``CostModel`` fields) for arms that name one (``dcp:balanced~NAME``): the
    other arms keep the run's cost, so a calibrated and a fitted model schedule side by side in one run."""
    calibration_reps: int = 3
    calibration_burst: int = 4
    """Each calibration sample times this many forward + backward passes of the shape back to back
    between two synchronisations and divides: in a step, micro-batches pipeline (the host enqueues
    the next while the device runs this one), and a lone micro-batch between synchronisations also
    pays the device's wake-up and the pipeline's fill and drain, nearly doubling its time."""
    runs: int = 3
    """Independent repetitions in one job: each re-calibrates the cost model (unless one is pinned)
    and runs every arm's warm-up and measured steps again from the initial weights. The
    targets are judged on the median over runs of each ratio: one run's ratio moves by a few percent
    with the machine's drift, so a single run can pass or fail by luck."""
    cp_exchange: str = "gather"
    """How CP blocks exchange K/V (``harness.parallel.cp_attention.EXCHANGES``): ``gather`` (all-gather
    before the attention kernels, fp32 reduce-scatter of dK/dV after) or ``ring`` (K/V passed around
    the block while each received block's attention part runs, as TransformerEngine's ``p2p`` CP and
    Megatron's static-CP baseline; needs the ``flash`` kernels on CUDA) or ``auto`` (ring for long
    blocks, ``harness.parallel.cp_attention.choose_exchange``). An arm may override it (``@ring``)."""
    grad_reduce: str = "overlap"
    """Gradient all-reduce over the DP x CP group: ``overlap`` (buckets of 40M elements reduced as
    the step's last backward completes them, ``harness.parallel.grad_reduce``; Megatron's
    ``--overlap-grad-reduce``) or ``after`` (one all-reduce of the whole buffer after the last backward)."""
    optimizer: str = "replicated"
    """``replicated`` (every rank keeps the whole AdamW) or ``distributed`` (``harness.parallel.dist_opt``: each rank
    keeps and updates 1/N of it; the gradient buckets reduce-scattered - overlapped with the last backward under
    ``grad_reduce="overlap"`` - and the parameters all-gathered after the update). Every arm alike."""
    plan: str = "ahead"
    """Where each step's schedule is computed: ``ahead`` (a ``harness.plan.ahead.PlanAhead`` process
    plans step k + 1 while step k runs, as Megatron describes its asynchronous dynamic-CP solver; a
    step waits only if the planner is behind, and that wait is timed in its schedule phase) or
    ``inline`` (at the start of the step, on its critical path). Every arm is treated alike; the
    planner's own time per schedule is still reported (``plan ms``) and the wait as ``plan wait ms``."""
    gc: str = "manual"
    """Python's garbage collector: ``manual`` (as Megatron's ``--manual-gc`` and torchtitan's
    ``gc_freq``) disables automatic collection and collects generation 1 between steps, outside the
    timed window, and a full collection before every run; ``auto`` leaves Python's thresholds on,
    so a collection can fall inside any rank's step (and stall its CP group)."""
    profile_iters: int = 2
    """Extra profiled steps per arm for the breakdown (0 = no breakdown), after the *last* run's
    measured steps only: profiling leaves host overhead behind in the process, which would slow the
    runs after it."""
    peak_tflops: float = 0.0
    """Peak dense TFLOP/s per GPU for MFU; 0 = by device name (``DEVICE_PEAK_TFLOPS``)."""
    trim: float = 0.1
    """Fraction trimmed from each end for the trimmed mean."""
    trace_dir: str = ""
    """Where rank 0 keeps one gzipped Chrome trace per arm ('' = none)."""
    compile: str = "auto"
    """``torch.compile`` backend for the dense blocks' per-token segments and the loss head
    (``TinyLM.compile_blocks``; attention and its collectives stay eager): ``auto`` = ``inductor-chain``
    on CUDA and eager on CPU, ``off`` = eager, a backend name (``inductor``, ``aot_eager``: segments), or
    ``reduce-overhead`` (inductor, each segment replayed as a CUDA graph; set ``token_bucket``). The
    eager model is launch-bound (one micro-batch enqueues ~1000 kernels).
    ``inductor-chain`` / ``aot_eager-chain``: the whole model as one compiled call per micro-batch,
    attentions opaque (``scope="chain"``; no arm slower than with the segments, static CP and balanced
    faster). An arm's ``+segments`` / ``+chain`` overrides the scope.
    With ``grad_reduce="overlap"`` the last micro-batch of a chain arm's step runs the segments: a
    chain's backward hands over every gradient at its end, leaving the all-reduce nothing to overlap."""
    token_bucket: int | str = "auto"
    """Pad every rank's micro-batch to a multiple of this many tokens (0 = off; even), or ``auto``: 64 on CUDA when
    it divides ``max_seqlen_per_rank``, else off (``harness.plan.token_bucket``: why, and the figures). The padding
    is processed and counted (``padding_fraction``), never trained on. With ``reduce-overhead`` the graphs are
    recorded once per multiple."""
    moe_aux_loss: float | None = None
    """MoE models: the routers' sequence-level load-balancing loss with this coefficient (``harness.runtime.balance``;
    its counts summed over each sequence's CP block), in every arm's step as in ``converge --moe-aux-loss``; None: off."""
    loss_chunk: int = 0
    """Run every arm's LM head and loss this many tokens at a time (``harness.runtime.chunked_loss``, the step
    ``converge --loss-chunk`` verifies; the compiled head is whole, so only with an eager model: ``compile=off``);
    0 = the whole logits."""
    expert_parallel: bool = False
    """MoE models: shard the experts over the DP x CP domain (``harness.parallel.expert_parallel``; every rank joins
    every micro-batch's all-to-alls, so micro-batches run in lockstep: the ``synchronous`` execution model fits);
    expert gradients are not all-reduced."""
    device: str = "cpu"

    def model_config(self):
        """The ``ModelConfig`` every arm trains: the named model with the job's seed, ``moe_aux_loss`` when given and
        its ``loss_chunk``."""
        m = replace(MODELS[self.model], seed=self.seed, loss_chunk=self.loss_chunk)
        return m if self.moe_aux_loss is None else replace(m, aux_loss=float(self.moe_aux_loss))

    def bucket(self) -> int:
        """The resolved ``token_bucket`` (``harness.plan.token_bucket.resolve``)."""
        return resolve_bucket(self.token_bucket, self.device, self.max_seqlen_per_rank)

    def token_bucket_of(self, arm: Arm) -> int:
        """The token bucket ``arm``'s micro-batches are padded to: its own (``#N``), else the config's."""
        return self.bucket() if arm.token_bucket is None else arm.token_bucket

    def arm_list(self) -> list[Arm]:
        arms = [parse_arm(a) for a in self.arms]
        labels = [a.label for a in arms]
        if not arms or len(set(labels)) != len(labels):
            raise BenchConfigError(f"arms must be a non-empty list without repeats, got {list(self.arms)}")
        return arms

    def validate(self, world: int) -> None:
        if self.model not in MODELS:
            raise BenchConfigError(f"unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        parse_spec(self.lengths)
        arms = self.arm_list()
        if self.cost_model is not None:
            cost_model_from(self.cost_model)
        named = dict(self.arm_cost_models or {})
        for name, d in named.items():
            if not isinstance(name, str) or not _COST_NAME.fullmatch(name) or not isinstance(d, dict):
                raise BenchConfigError(f"arm cost model {name!r}: give NAME=PATH with a NAME of letters, digits, '-' "
                                       f"and '_' and a JSON object of CostModel fields")
            cost_model_from(d)
        missing = sorted({a.cost for a in arms if a.cost and a.cost not in named})
        if missing:
            raise BenchConfigError(f"arms name cost models {missing} that no --arm-cost-model NAME=PATH gives "
                                   f"(given: {sorted(named) or 'none'})")
        unused = sorted(set(named) - {a.cost for a in arms})
        if unused:
            raise BenchConfigError(f"--arm-cost-model {unused} named by no arm: add an arm such as "
                                   f"dcp:balanced~{unused[0]} or drop it")
        if world < 1 or world & (world - 1):
            raise BenchConfigError(f"world size {world} is not a power of two; use 1, 2, 4 or 8 processes")
        for name in ("max_seqlen_per_rank", "microbatches", "iters", "calibration_reps", "calibration_burst", "runs"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise BenchConfigError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        for name in ("warmup", "profile_iters", "static_cp"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                raise BenchConfigError(f"{name} must be an int >= 0, got {getattr(self, name)!r}")
        if self.profile_iters > self.iters:
            raise BenchConfigError(f"profile_iters={self.profile_iters} must be <= iters={self.iters}")
        if self.static_cp and (self.static_cp > world or self.static_cp & (self.static_cp - 1)):
            raise BenchConfigError(f"static_cp={self.static_cp} must be a power of two <= the world size {world}")
        if self.expert_parallel and (not MODELS[self.model].experts or MODELS[self.model].experts % world):
            raise BenchConfigError(f"--ep shards the experts over the {world} ranks: model {self.model!r} has "
                                   f"{MODELS[self.model].experts} experts; use an MoE model whose experts divide by "
                                   f"{world} ({', '.join(k for k, m in MODELS.items() if m.experts)})")
        aux = self.moe_aux_loss
        if aux is not None and (isinstance(aux, bool) or not isinstance(aux, (int, float)) or not 0 <= aux < 1e3):
            raise BenchConfigError(f"moe_aux_loss must be a number in [0, 1000) or None (off), got {aux!r}")
        if aux and not MODELS[self.model].experts:
            raise BenchConfigError(f"moe_aux_loss balances MoE routers: model {self.model!r} has none; use an MoE model "
                                   f"({', '.join(k for k, m in MODELS.items() if m.experts)}) or leave it out")
        if (problem := loss_chunk_problem(self.loss_chunk)) is not None:
            raise BenchConfigError(problem)
        if self.loss_chunk and self.compile_backend():
            raise BenchConfigError(f"loss_chunk={self.loss_chunk} runs the loss head eagerly and compile={self.compile!r} compiles it "
                                   "whole on this device: use compile=off with a loss chunk")
        if not 0 <= self.trim < 0.5:
            raise BenchConfigError(f"trim must be in [0, 0.5), got {self.trim}")
        n = self.batch_sequences(world)
        if n is not None and n < world:
            raise BenchConfigError(f"global_batch={self.global_batch!r} gives {n} sequences per step on {world} ranks; "
                                   f"every rank needs at least one: use sequences:{world} or more (or 'tokens')")
        if self.dtype not in ("float32", "bfloat16"):
            raise BenchConfigError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.plan not in ("ahead", "inline"):
            raise BenchConfigError(f"plan must be 'ahead' or 'inline', got {self.plan!r}")
        if self.cp_exchange not in EXCHANGES:
            raise BenchConfigError(f"cp_exchange must be one of {', '.join(EXCHANGES)}, got {self.cp_exchange!r}")
        if "a2a" in {a.exchange or self.cp_exchange for a in arms}:  # a block of the whole world: heads must split
            try:
                kv_replicas(MODELS[self.model].heads, MODELS[self.model].kv_heads, world)
            except HeadSplitError as e:
                raise BenchConfigError(f"{e} (the largest CP block of this job: its {world} ranks)") from None
        if self.gc not in ("manual", "auto"):
            raise BenchConfigError(f"gc must be manual or auto, got {self.gc!r}")
        if self.optimizer not in ("replicated", "distributed"):
            raise BenchConfigError(f"optimizer must be replicated or distributed, got {self.optimizer!r}")
        if self.grad_reduce not in GRAD_REDUCE_CHOICES:
            raise BenchConfigError(f"grad_reduce must be one of {', '.join(GRAD_REDUCE_CHOICES)}, got {self.grad_reduce!r}")
        if self.compile not in COMPILE_CHOICES:
            raise BenchConfigError(f"compile must be one of {', '.join(COMPILE_CHOICES)}, got {self.compile!r}")
        if self.compile == "reduce-overhead" and self.device != "cuda":
            raise BenchConfigError("compile=reduce-overhead records CUDA graphs; it needs CUDA (use inductor or off)")
        arms = self.arm_list()
        if any(a.scope for a in arms) and not self.compile_backend():
            raise BenchConfigError(f"arms {[a.label for a in arms if a.scope]} choose a compile scope but compile="
                                   f"{self.compile!r} runs eager (on this device); pick a compile backend, e.g. "
                                   f"compile=inductor")
        if self.compile_mode() == "reduce-overhead" and any(a.scope == "chain" for a in arms):
            raise BenchConfigError("compile=reduce-overhead records CUDA graphs of segments; a '+chain' arm cannot "
                                   "(its attentions run collectives); drop '+chain' or use compile=inductor")
        try:
            check_bucket(self.token_bucket)
        except ValueError as e:
            raise BenchConfigError(str(e)) from None

    def batch_sequences(self, world: int) -> int | None:
        """Sequences per global batch (None for ``global_batch="tokens"``); raises
        ``BenchConfigError`` naming a bad ``global_batch``."""
        gb = self.global_batch
        if gb == "tokens":
            return None
        if gb == "megatron":
            return self.microbatches * max(1, world // (self.static_cp or world))
        head, _, count = gb.partition(":") if isinstance(gb, str) else ("", "", "")
        if head == "sequences" and count.isascii() and count.isdigit() and 1 <= int(count) <= MAX_BATCH_SEQUENCES:
            return int(count)
        raise BenchConfigError(f"global_batch must be one of {', '.join(GLOBAL_BATCH_CHOICES)} "
                               f"(1 <= K <= {MAX_BATCH_SEQUENCES}), got {gb!r}")

    def compile_backend(self) -> str | None:
        """The resolved ``compile``: a ``torch.compile`` backend name, or None for eager."""
        if self.compile == "auto":
            return "inductor" if self.device == "cuda" else None
        if self.compile == "reduce-overhead":
            return "inductor"
        return None if self.compile == "off" else self.compile.removesuffix("-chain")

    def compile_mode(self) -> str | None:
        return "reduce-overhead" if self.compile == "reduce-overhead" else None

    def compile_scope(self) -> str:
        """``chain`` for the ``-chain`` choices and for ``auto`` on CUDA, else ``segments``."""
        return "chain" if self.compile.endswith("-chain") or (self.compile == "auto" and self.device == "cuda") \
            else "segments"

    def compile_label(self) -> str | None:
        """What the report says: None (eager), a backend, ``inductor/reduce-overhead`` or
        ``inductor/chain``."""
        be, mode = self.compile_backend(), self.compile_mode()
        if be and self.compile_scope() == "chain":
            return f"{be}/chain"
        return f"{be}/{mode}" if be and mode else be

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepBenchConfig:
        d = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        if "arms" in d:
            d["arms"] = tuple(d["arms"])
        return cls(**d)


GLOBAL_BATCH_CHOICES = ("tokens", "megatron", "sequences:K")
MAX_BATCH_SEQUENCES = 65536
"""Most sequences ``global_batch="sequences:K"`` takes (Megatron's benchmark: 8 x dp)."""
COMPILE_CHOICES = ("auto", "off", "inductor", "aot_eager", "reduce-overhead", "inductor-chain", "aot_eager-chain")
GRAD_REDUCE_CHOICES = ("overlap", "after")
PHASES = ("schedule", "microbatches", "grad_reduce", "optimizer")
"""A step's phases, timed in every measured step: scheduling, rerouting and building the
micro-batches; their forwards and backwards; the gradient all-reduce left after the last backward
plus clipping; AdamW."""


def arm_cost(cfg: StepBenchConfig, arm: Arm, run_cost: CostModel) -> CostModel:
    """The cost model ``arm`` schedules with: its named one (``cfg.arm_cost_models``), else the run's."""
    return cost_model_from(cfg.arm_cost_models[arm.cost]) if arm.cost else run_cost


def cost_model_from(d: dict) -> CostModel:
    """A ``CostModel`` from a dict of its fields (unknown keys are an error naming them)."""
    fields = set(CostModel.__dataclass_fields__)
    bad = sorted(set(d) - fields)
    if bad:
        raise BenchConfigError(f"cost model has unknown fields {bad}; use {sorted(fields)}")
    return CostModel(**d)


def load_cost_model(path) -> dict:
    """The cost-model dict in ``path``: a ``bench_step.json`` or a plain JSON object of fields."""
    p = Path(path)
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError) as e:
        raise BenchConfigError(f"cannot read a cost model from {str(p)!r}: {e}") from None
    d = doc.get("results", {}).get("cost_model", doc) if isinstance(doc, dict) else None
    if not isinstance(d, dict):
        raise BenchConfigError(f"{str(p)!r} holds no cost model (a JSON object of CostModel fields)")
    cost_model_from(d)
    return d
