"""Configuration of a training run (``harness.train.trainer``): model, layouts, optimiser, the DP x CP
domain's scheduling, the pipeline, precision and the corpus."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from harness.data.corpus import CorpusConfig, batch_lengths
from harness.parallel.options import (
    COMM_TYPES,
    DEFAULT_BUCKET_ELEMENTS,
    EXCHANGES,
    OPTIMIZERS,
    HeadSplitError,
    SequenceParallelError,
    TensorParallelError,
    check_divisible,
    check_tp_model,
    comm_type,
    kv_replicas,
    require_te,
)
from harness.plan import ALGORITHMS, CostModel, token_bucket
from harness.plan.execution import INDEPENDENT, SYNCHRONOUS, Execution
from harness.runtime.model_config import MODELS, loss_chunk_problem, pipeline_shares
from harness.runtime.options import WEIGHT_MODES
from harness.train.layouts import LAYOUTS, LayoutConfig, LayoutError, static_cp_for
from harness.train.pipeline_config import PipelineConfig
from harness.upstream.megatron import NAME as UPSTREAM_SCHEDULER


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    model: str = "tiny-gpt"
    """A key of ``harness.runtime.model.MODELS``."""
    layouts: tuple[str, ...] = LAYOUTS
    steps: int = 50
    lr: float = 3e-3
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    max_seqlen_per_rank: int = 256
    micro_batch_size: int = 1
    scheduler: str = "balanced"
    dcp_padding: str = "local"
    dtype: str = "float32"
    """``float32``, or ``bfloat16`` (autocast; fp32 master weights)."""
    device: str = "cpu"
    cp_exchange: str = "gather"
    """How CP blocks exchange K/V (``harness.parallel.cp_attention.EXCHANGES``; ``te:p2p``, ``te:all_gather``,
    ``te:a2a``: TransformerEngine's CP attention, ``harness.parallel.te_cp``): ``gather``, ``ring`` or
    ``auto``; the attention is the same either way, so the goldens apply to all."""
    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    probes: bool = False
    """Record what the fault catalogue's checks read (``harness.train.probes``) on every rank and
    return it with the rows."""
    fp32_probe: bool = True
    """With ``probes`` in a bf16 run: each layout first runs step 1 in fp32 from the same initial model (its update
    thrown away) and records its probes under ``<layout>@fp32`` (``PROBE_SUFFIX``), so the step-1 gradients and token
    losses are judged at fp32's tolerance too. bf16's (5e-2, 2e-2) let a wrong RoPE offset through: at initialisation
    attention barely depends on position, and the bug's step-1 footprint sits under bf16 rounding's bands. Not with
    TransformerEngine's CP attention (half precision only): ``probed_in_fp32``."""
    pp: int = 1
    """Pipeline stages (``harness.train.pipeline``); the world is pp stages of a DP x CP domain each."""
    tp: int = 1
    """Tensor-parallel ranks (``harness.parallel.tensor_parallel``: each block's heads and FFN - an MoE's experts -
    split over them); the world is pp stages x a DP x CP domain x tp. Dense, MTP, MoE (each expert split, the router
    replicated; with expert parallelism under sequence parallelism only) and hybrid models (each SSM mixer's heads split,
    its B / C parameters replicated), the vocabulary split too; the harness's gather / ring / a2a exchanges."""
    sequence_parallel: bool = False
    """With tp > 1: the block stack's token rows split over the TP ranks too (``harness.parallel.sequence_parallel``,
    Megatron's ``--sequence-parallel``); every sequence is padded to a multiple of tp times its CP divisor. An MoE
    model's routers route each TP rank's rows (``harness.runtime.layers.tp_expert_outputs``)."""
    make_vocab_size_divisible_by: int = 1
    """With tp > 1: the split vocabulary is padded to a multiple of this times tp (Megatron's
    ``--make-vocab-size-divisible-by``, 128 there); the padding's rows are zero, their logits masked out of the loss,
    so the run trains the unpadded model (``harness.parallel.vocab_parallel``). A vocabulary that tp does not divide
    is padded at any value."""
    vpp: int = 1
    """Virtual chunks per stage (the interleaved 1F1B schedule when > 1)."""
    pipeline: str = "1f1b"
    """``1f1b`` or ``afab`` (with vpp > 1 the interleaved 1F1B runs)."""
    schedule_delivery: str = "broadcast"
    """``broadcast`` (the first stage computes each schedule and sends it down the pipelines) or
    ``compute`` (every stage computes it); the stages are checked to agree either way."""
    expert_parallel: bool = False
    """MoE models: shard every MoE layer's experts over the DP x CP domain of each stage
    (``harness.parallel.expert_parallel``; the experts a multiple of the domain's ranks). Every MoE layer of
    every micro-batch sends its tokens to the experts' owners and back (all-to-alls over the domain), so
    the domain's ranks run their micro-batches in lockstep: the dcp schedule is made for the
    ``synchronous`` execution model."""
    moe_aux_loss: float | None = None
    """MoE models: the routers' sequence-level load-balancing loss coefficient (``ModelConfig.aux_loss``, Megatron's
    ``seq_aux_loss``: ``harness.runtime.balance``; each sequence balanced over its own tokens, whichever ranks hold
    them); None: the model's own (0: none, for every named model)."""
    loss_chunk: int = 0
    """Tokens per chunk of the LM head and its cross-entropy (``ModelConfig.loss_chunk``,
    ``harness.runtime.chunked_loss``: the logits never whole; the head's GEMM runs twice); 0 = the whole logits at
    once. The reference run computes them whole (the chunking is judged, not shared)."""
    weights: str = "cached"
    """How a step's layers take their matrix weights (``harness.runtime.weight_cache``): ``cached`` (a copy in the
    compute dtype made once per step, gradients added into ``.grad`` in place), ``fused`` (the copies, and the
    weight-gradient GEMM accumulating into ``.grad``: within bf16 rounding) or ``per-call`` (autocast's cast at each
    call, autograd's accumulation; the same numbers as ``cached``). The reference run uses ``per-call``."""

    token_bucket: int | str = "auto"
    """Pad every rank's micro-batch of the thd / dcp layouts to a multiple of this many tokens (0 = off; even), or
    ``auto`` (the default: 64 on CUDA when it divides ``max_seqlen_per_rank``, else off), as ``bench step`` does
    (``harness.plan.token_bucket``): the padding is processed, never trained on (bshd is not padded again; the
    reference run never). ``bucket()`` is the resolved number."""

    optimizer: str = "replicated"
    """``replicated`` (every rank keeps the whole AdamW) or ``distributed`` (each of a stage's DP x CP ranks keeps
    and updates 1/N of it; the gradients reduce-scattered, the parameters all-gathered: ``harness.parallel.dist_opt``;
    the same update). The reference run keeps the replicated optimiser."""
    grad_bucket_elements: int = DEFAULT_BUCKET_ELEMENTS
    """Elements of the distributed optimiser's buckets (Megatron's DDP bucket size, 40M): each bucket of whole
    parameters is reduce-scattered and all-gathered as one collective."""

    def execution_model(self, world: int):
        """(the ``harness.plan.Execution`` the thd / dcp schedules are made for, why): ``synchronous``
        with expert parallelism, ``pipeline`` with stages, else ``independent``."""
        n = self.domain(world)
        if self.pp > 1:
            why = f"{self.pp} stages, {self.pipeline_config().kind}"
            if self.expert_parallel:
                why += (f"; MoE expert parallelism also joins each stage's {n}-rank DP x CP domain in every pass, "
                        "which the pipeline model does not price")
            return Execution.pipeline(self.pp, vpp=self.vpp, schedule=self.pipeline,
                                      chunk_shares=pipeline_shares(self.model, self.pp, self.vpp,
                                                                   self.max_seqlen_per_rank)), why
        if self.expert_parallel:
            return SYNCHRONOUS, f"MoE with expert parallelism over the {n}-rank DP x CP domain"
        what = "MoE without expert parallelism" if MODELS[self.model].experts else "dense model"
        return INDEPENDENT, f"{what}: CP blocks synchronise only their own ranks"

    def model_config(self):
        """The ``ModelConfig`` this run trains: the named model, with ``moe_aux_loss`` when given and its
        ``loss_chunk``."""
        m = MODELS[self.model]
        m = m if self.moe_aux_loss is None else replace(m, aux_loss=float(self.moe_aux_loss))
        return replace(m, loss_chunk=self.loss_chunk) if self.loss_chunk else m

    def pipeline_config(self):
        return PipelineConfig(pp=self.pp, vpp=self.vpp, schedule=self.pipeline, delivery=self.schedule_delivery)

    def bucket(self) -> int:
        """The tokens the thd / dcp micro-batches are padded to a multiple of (``token_bucket`` resolved; 0 = off)."""
        return token_bucket.resolve(self.token_bucket, self.device, self.max_seqlen_per_rank)

    def domain(self, world: int) -> int:
        """DP x CP positions of each stage (of each TP coordinate)."""
        ranks = self.pp * self.tp if isinstance(self.tp, int) and self.tp >= 1 and self.pp >= 1 else 0
        return world // ranks if ranks and world % ranks == 0 else 0

    def validate(self, world: int) -> None:
        if self.model not in MODELS:
            raise LayoutError(f"unknown model {self.model!r}; choose from {', '.join(MODELS)}")
        bad = [x for x in self.layouts if x not in LAYOUTS]
        if bad or not self.layouts:
            raise LayoutError(f"unknown layout(s) {bad or self.layouts!r}; choose from {', '.join(LAYOUTS)}")
        if self.moe_aux_loss is not None:
            a = self.moe_aux_loss
            if isinstance(a, bool) or not isinstance(a, (int, float)) or not a >= 0:
                raise LayoutError(f"moe_aux_loss must be a number >= 0 (or None: the model's own), got {a!r}")
            if a and not MODELS[self.model].experts:
                raise LayoutError(f"moe_aux_loss={a} balances MoE routers and model {self.model!r} has none: use an "
                                  f"MoE model (tiny-moe) or leave it out")
        if (problem := loss_chunk_problem(self.loss_chunk)) is not None:
            raise LayoutError(problem)
        self._check_tp(world)
        self.pipeline_config().validate(world // self.tp, MODELS[self.model].layers)
        self._check_mixer(world)
        self._check_experts(world)
        n = self.domain(world)
        if n < 1 or n & (n - 1):
            what = f"world size {world}" if self.pp == 1 else f"the DP x CP domain of each stage ({world} / pp {self.pp} = {n})"
            raise LayoutError(f"{what} is not a power of two: dynamic CP groups need one (use 1, 2, 4, 8)")
        if self.dtype not in ("float32", "bfloat16"):
            raise LayoutError(f"dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.steps < 1:
            raise LayoutError(f"steps must be >= 1, got {self.steps}")
        if self.weights not in WEIGHT_MODES:
            raise LayoutError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {self.weights!r}")
        try:
            token_bucket.check(self.token_bucket)
        except ValueError as e:
            raise LayoutError(str(e)) from None
        if self.optimizer not in OPTIMIZERS:
            raise LayoutError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")
        if not isinstance(self.grad_bucket_elements, int) or self.grad_bucket_elements < 1:
            raise LayoutError(f"grad_bucket_elements must be an int >= 1, got {self.grad_bucket_elements!r}")
        if comm_type(self.cp_exchange):  # TransformerEngine's CP attention: TE and a CUDA device, or one line
            require_te(self.device)
        elif self.cp_exchange not in EXCHANGES:
            raise LayoutError(f"cp_exchange must be one of {', '.join(EXCHANGES)} or te:<"
                              f"{'|'.join(COMM_TYPES)}>, got {self.cp_exchange!r}")
        elif self.cp_exchange == "a2a":  # the largest CP block is the domain: its (TP rank's) heads must split over it
            m = MODELS[self.model]
            try:
                kv_replicas(m.heads // self.tp, m.kv_heads // self.tp, n)
            except HeadSplitError as e:
                where = f"; with tp={self.tp} each rank's {m.heads // self.tp} of the {m.heads} heads" if self.tp > 1 else ""
                raise LayoutError(f"{e} (the largest CP block of this run: the {n}-rank DP x CP domain{where})") from None
        if self.scheduler not in ALGORITHMS and self.scheduler != UPSTREAM_SCHEDULER:
            raise LayoutError(f"unknown scheduler {self.scheduler!r} for the dcp layout; choose from "
                              f"{', '.join(sorted(ALGORITHMS))} or {UPSTREAM_SCHEDULER} (the installed one's)")
        if self.dcp_padding not in ("local", "domain"):
            raise LayoutError(f"dcp_padding must be 'local' or 'domain', got {self.dcp_padding!r}")
        if self.device not in ("cpu", "cuda"):
            raise LayoutError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.max_seqlen_per_rank < 1 or self.micro_batch_size < 1:
            raise LayoutError(f"max_seqlen_per_rank and micro_batch_size must be >= 1, got "
                              f"{self.max_seqlen_per_rank} and {self.micro_batch_size}")

    def _check_tp(self, world: int) -> None:
        """Tensor parallelism: a positive int dividing the world, a model whose blocks split over it, and the paths
        that run with it (``harness.parallel.tensor_parallel``)."""
        tp = self.tp
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise TensorParallelError(f"tp must be an int >= 1, got {tp!r}")
        m = self.make_vocab_size_divisible_by
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise TensorParallelError(f"make_vocab_size_divisible_by must be an int >= 1, got {m!r}")
        if not isinstance(self.sequence_parallel, bool):
            raise SequenceParallelError(f"sequence_parallel must be True or False, got {self.sequence_parallel!r}")
        if tp == 1:
            if self.sequence_parallel:
                raise SequenceParallelError("sequence parallelism splits token rows over the tensor-parallel ranks, "
                                            "and tp=1: use tp >= 2 with it (--tp 2), or turn it off")
            return
        if world % tp:
            raise TensorParallelError(f"world size {world} is not a multiple of tp={tp}: the world is pp x (DP x CP) x "
                                      f"tp ranks; use a world of a multiple of {tp * self.pp} ranks")
        check_tp_model(MODELS[self.model], tp, repr(self.model))
        if self.expert_parallel and not self.sequence_parallel:
            raise TensorParallelError(f"expert parallelism with tensor parallelism (tp={tp}) needs sequence parallelism, "
                                      "as Megatron requires for MoE with TP (each TP rank dispatches the rows it "
                                      "routes): add --sequence-parallel, or use tp=1 with expert parallelism")
        if comm_type(self.cp_exchange) is not None:
            raise TensorParallelError(f"tensor parallelism (tp={tp}) does not run with the {self.cp_exchange} exchange "
                                      "yet: use tp=1 for it, or the gather / ring / a2a exchange")

    def _check_mixer(self, world: int) -> None:
        """SSM mixer layers shard their heads over a CP block's ranks; dynamic CP forms blocks as large as
        a stage's whole DP x CP domain."""
        m = MODELS[self.model]
        n = self.domain(world)
        tp = self.tp if isinstance(self.tp, int) and self.tp >= 1 and m.ssm_heads % self.tp == 0 else 1
        heads = m.ssm_heads // tp  # a TP rank's heads (a tp that does not divide them is check_tp_model's error)
        if "M" in m.kinds and n and heads % n:
            held = f"{heads} heads of a TP rank" if tp > 1 else f"{m.ssm_heads} heads"
            raise LayoutError(f"model {self.model!r}: its SSM mixers' {held} cannot be split over a CP block of {n} "
                              f"ranks (the DP x CP domain, the largest block dynamic CP forms); use a model with "
                              f"ssm_heads a multiple of {n * tp}, or a domain of ranks dividing {heads}")

    def _check_experts(self, world: int) -> None:
        if not self.expert_parallel:
            return
        m = MODELS[self.model]
        if not m.experts:
            raise LayoutError(f"expert parallelism needs an MoE model; {self.model!r} has no experts: use a model "
                              f"with experts (e.g. tiny-moe) or turn expert parallelism off")

        n = self.domain(world)
        if n:
            check_divisible(m.experts, n, repr(self.model))

    def layout_config(self, world: int):
        """The ``LayoutConfig`` every layout of a run on ``world`` ranks plans with."""

        n, pipe = self.domain(world), self.pipeline_config()
        return LayoutConfig(n_ranks=n, max_seqlen_per_rank=self.max_seqlen_per_rank,
                            static_cp=static_cp_for(longest_sequence(self), n, self.max_seqlen_per_rank),
                            micro_batch_size=self.micro_batch_size, scheduler=self.scheduler,
                            dcp_padding=self.dcp_padding, vpp_group=pipe.vpp_group,
                            execution=self.execution_model(world)[0], expert_parallel=self.expert_parallel,
                            tp_padding=self.tp_padding)

    @property
    def tp_padding(self) -> int:
        """The TP multiple every sequence is padded by (``LayoutConfig.tp_padding``): tp under sequence parallelism."""
        return self.tp if self.sequence_parallel else 1

    def probed_in_fp32(self) -> bool:
        """Whether each layout runs step 1 in fp32 first (``fp32_probe``): bf16 runs, except with TransformerEngine's
        CP attention, whose kernels take half precision only."""
        return self.fp32_probe and self.dtype != "float32" and comm_type(self.cp_exchange) is None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> TrainConfig:
        d = dict(d)
        d["corpus"] = CorpusConfig(**d.get("corpus", {}))
        d["layouts"] = tuple(d.get("layouts", LAYOUTS))
        return cls(**{k: v for k, v in d.items() if k in cls.__dataclass_fields__})


def longest_sequence(cfg: TrainConfig) -> int:
    return max(max(batch_lengths(cfg.corpus, s)) for s in range(cfg.steps))


def model_cost(cfg: TrainConfig) -> CostModel:
    return MODELS[cfg.model].training_cost(name=cfg.model)


PROBE_SUFFIX = "@fp32"
"""The probes of a bf16 run's fp32 step 1 are recorded under ``layout + PROBE_SUFFIX`` (``TrainConfig.fp32_probe``)."""


def execution_line(cfg: TrainConfig, world: int) -> str:
    """The line a run prints: the execution model its schedules are made for, and why."""
    ex, why = cfg.execution_model(world)
    return f"execution model: {ex.describe()} ({why})"
