"""CP sizing and workload (cost) models.

``cp_min(L, max_seqlen_per_rank, min_cp_size)`` is the smallest power-of-two CP size whose ranks can
hold a sequence of ``L`` tokens, ``max_seqlen_per_rank`` tokens each (Megatron's
``dcp_gpus_needed``), never below ``min_cp_size``:

>>> [cp_min(L, 3072) for L in (1, 3072, 3073, 6144, 6145, 12289)]
[1, 1, 2, 2, 4, 8]
>>> cp_min(100, 3072, min_cp_size=2)
2

A ``CostModel`` gives the per-rank time of one sequence run on a CP block of ``s`` ranks::

    seq_cost(L, s) = (quadratic * L**2 + linear * L + constant) / s + cp_comm * L * (s - 1) / s + per_sequence

plus ``per_microbatch`` for every block a rank executes and ``cp_block`` for every block of more than
one rank (``CostModel.block_overhead``). ``CostModel.megatron()`` is upstream's
``L**2 / cp`` estimator; ``CostModel.from_model_shape(...)`` derives the terms (in FLOPs, forward +
backward) from a transformer's shape, so that schedules can optimise real cost.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from harness.plan.errors import NotPowerOfTwoError, PlanInputError


def is_power_of_two(n: int) -> bool:
    return isinstance(n, int) and n >= 1 and n & (n - 1) == 0


def check_power_of_two(name: str, value: int) -> None:
    """Raise ``NotPowerOfTwoError`` naming ``name`` unless ``value`` is a power of two >= 1."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise NotPowerOfTwoError(f"{name} must be an int power of two, got {value!r}")
    if not is_power_of_two(value):
        lo = 1 << (max(value, 1).bit_length() - 1)
        hint = f"{lo} or {lo * 2}" if value > 1 else "1"
        raise NotPowerOfTwoError(
            f"{name}={value} is not a power of two: dynamic-CP process groups exist only for "
            f"power-of-two sizes; use {hint}"
        )


def check_positive_int(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanInputError(f"{name} must be a positive int, got {value!r}")


def check_microbatch_tokens(microbatch_tokens_per_rank: int | None, max_seqlen_per_rank: int) -> int:
    """The capacity of a rank in one micro-batch: ``microbatch_tokens_per_rank`` (an int >= ``max_seqlen_per_rank``:
    a micro-batch holds at least one sequence of a rank's share), or ``max_seqlen_per_rank`` when it is None;
    anything else is a ``PlanInputError`` naming it."""
    if microbatch_tokens_per_rank is None:
        return max_seqlen_per_rank
    if (not isinstance(microbatch_tokens_per_rank, int) or isinstance(microbatch_tokens_per_rank, bool)
            or microbatch_tokens_per_rank < max_seqlen_per_rank):
        raise PlanInputError(f"microbatch_tokens_per_rank must be an int >= max_seqlen_per_rank "
                             f"({max_seqlen_per_rank}), got {microbatch_tokens_per_rank!r}; give at least "
                             f"{max_seqlen_per_rank}, or leave it out for max_seqlen_per_rank")
    return microbatch_tokens_per_rank


def cp_min(L: int, max_seqlen_per_rank: int, min_cp_size: int = 1) -> int:
    """Smallest power of two ``p >= min_cp_size`` with ``p * max_seqlen_per_rank >= L``."""
    if L <= 0:
        raise PlanInputError(f"sequence length must be positive, got {L}")
    p = 1 << (-(-L // max_seqlen_per_rank) - 1).bit_length()  # the power of two >= ceil(L / mslpr)
    return max(p, min_cp_size)


@dataclass(frozen=True, kw_only=True)
class CostModel:
    """Per-rank cost of sequences under CP (arbitrary but consistent units, e.g. FLOPs)."""

    quadratic: float = 1.0
    """Coefficient of L**2 (attention scores and values)."""
    linear: float = 0.0
    """Coefficient of L (projections, MLP, logits)."""
    constant: float = 0.0
    """Per-sequence constant, split across the block like the other terms."""
    cp_comm: float = 0.0
    """Per-token cost of exchanging K/V inside a CP block of s > 1 ranks, scaled by (s-1)/s."""
    per_microbatch: float = 0.0
    """Fixed cost of every block (micro-batch) a rank executes (launches, optimizer-free overhead)."""
    cp_block: float = 0.0
    """Extra fixed cost of every block of s > 1 ranks, whatever its tokens: launching its CP
    collectives (two per layer) and synchronising its ranks at each. Measured on 4 H200s: a CP-2 or
    CP-4 micro-batch costs ~15 ms more than a CP-1 one of any token count (host-bound runtime)."""
    per_sequence: float = 0.0
    """Fixed cost of every sequence on every rank that runs a share of it, not split across its block: a
    stack that runs each sequence as its own forward and backward (megatron-core's hybrid CP runs every
    sub-sample of a group on its own) pays that sequence's launches and synchronisations on each rank of
    its CP group, so a sequence at CP s costs s of them (``bench step --stack megatron-core`` measures it)."""
    name: str = "custom"
    """Short label used in reports."""

    def __post_init__(self) -> None:
        for field in ("quadratic", "linear", "constant", "cp_comm", "per_microbatch", "cp_block", "per_sequence"):
            v = getattr(self, field)
            if not isinstance(v, (int, float)) or not 0 <= v < float("inf"):  # NaN fails both
                raise PlanInputError(f"CostModel.{field} must be a finite number >= 0, got {v!r}")

    @classmethod
    def megatron(cls) -> CostModel:
        """Upstream's scheduler estimate ``L**2 / cp`` (no linear term, no communication)."""
        return cls(quadratic=1.0, name="megatron L^2/cp")

    @classmethod
    def affine_quadratic(cls, a: float, b: float, c: float = 0.0, **kw) -> CostModel:
        """``(a*L**2 + b*L + c) / cp`` (plus optional ``cp_comm`` / ``per_microbatch``)."""
        return cls(quadratic=a, linear=b, constant=c, **{"name": "affine-quadratic", **kw})

    @classmethod
    def from_model_shape(
        cls,
        *,
        num_layers: int,
        hidden_size: int,
        ffn_hidden_size: int,
        num_attention_heads: int,
        num_query_groups: int | None = None,
        causal: bool = True,
        gated_mlp: bool = False,
        vocab_size: int = 0,
        cp_comm_flops_per_byte: float = 0.0,
        dtype_bytes: int = 2,
        per_microbatch_flops: float = 0.0,
        name: str | None = None,
    ) -> CostModel:
        """Training FLOPs (forward + backward = 3x forward) of a GPT-style decoder, per sequence.

        Attention scores and values cost ``4 * L**2 * hidden`` forward per layer (half when causal);
        projections ``2 * L * hidden * (hidden + 2 * kv_hidden)`` (QKV) ``+ 2 * L * hidden**2``
        (output) and the MLP ``2 * L * hidden * ffn * (3 if gated else 2)``; logits
        ``2 * L * hidden * vocab``. ``cp_comm_flops_per_byte`` converts the bytes of K/V that a rank
        of a CP block receives (all-gather forward, reduce-scatter + re-gather backward) into
        FLOP-equivalents: the GPU's FLOP/s divided by the effective CP link bandwidth (0 = free).
        """
        for key, v in (("num_layers", num_layers), ("hidden_size", hidden_size),
                       ("ffn_hidden_size", ffn_hidden_size), ("num_attention_heads", num_attention_heads)):
            check_positive_int(key, v)
        groups = num_attention_heads if num_query_groups is None else num_query_groups
        check_positive_int("num_query_groups", groups)
        if hidden_size % num_attention_heads or num_attention_heads % groups:
            raise PlanInputError(
                f"hidden_size={hidden_size} must be divisible by num_attention_heads="
                f"{num_attention_heads}, which must be divisible by num_query_groups={groups}"
            )
        h, kv = hidden_size, hidden_size // num_attention_heads * groups
        quad = 3 * num_layers * 4 * h * (0.5 if causal else 1.0)
        per_layer = 2 * h * (h + 2 * kv) + 2 * h * h + 2 * h * ffn_hidden_size * (3 if gated_mlp else 2)
        lin = 3 * (num_layers * per_layer + 2 * h * vocab_size)
        kv_bytes = 3 * num_layers * 2 * kv * dtype_bytes
        label = name or f"gpt-{num_layers}l-h{h}-ffn{ffn_hidden_size}"
        return cls(quadratic=float(quad), linear=float(lin), cp_comm=float(kv_bytes * cp_comm_flops_per_byte),
                   per_microbatch=float(per_microbatch_flops), name=label)

    def seq_cost(self, L: int, s: int) -> float:
        """Per-rank cost of a sequence of ``L`` tokens on a CP block of ``s`` ranks."""
        work = (self.quadratic * L * L + self.linear * L + self.constant) / s
        return work + (self.cp_comm * L * (s - 1) / s if s > 1 else 0.0) + self.per_sequence

    def block_overhead(self, s: int) -> float:
        """Fixed cost of one block of ``s`` ranks: ``per_microbatch`` (+ ``cp_block`` when s > 1)."""
        return self.per_microbatch + (self.cp_block if s > 1 else 0.0)

    def seq_area(self, L: int, s: int) -> float:
        """Rank-time the sequence occupies in total: ``s * seq_cost(L, s)``."""
        return s * self.seq_cost(L, s)

    def to_dict(self) -> dict:
        return asdict(self)


def gpt_benchmark_cost() -> CostModel:
    """The benchmark model of Megatron's Dynamic-CP example (12 layers, hidden 2048, FFN 8192,
    16 heads), with K/V exchange priced at 1000 FLOP per byte: an H200 at ~790 TFLOP/s dense bf16
    against an effective ~0.8 TB/s NVLink CP exchange. The ratio is an assumption until measured."""
    return CostModel.from_model_shape(
        num_layers=12, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=16,
        cp_comm_flops_per_byte=1000.0, name="gpt-12l-h2048",
    )
