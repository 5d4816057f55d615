"""Model configurations: ``ModelConfig`` (one frozen dataclass for every model the harness trains)
and ``MODELS``, the named ones (``dcp-harness converge --model NAME``)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from harness.plan.cost import CostModel
from harness.plan.pipeline import model_split


def loss_chunk_problem(value) -> str | None:
    """What is wrong with a ``loss_chunk`` (the message each configuration raises in its own error type), or None."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        return (f"loss_chunk must be an int >= 0 (tokens per chunk of the loss head; 0 = the whole logits at once), "
                f"got {value!r}")
    return None


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    vocab: int = 256
    """Vocabulary size."""
    hidden: int = 64
    """Hidden size E."""
    layers: int = 2
    """Transformer layers."""
    heads: int = 4
    """Query heads H."""
    kv_heads: int = 2
    """Key/value heads (GQA when < heads)."""
    ffn: int = 128
    """MLP inner size F (per expert for MoE)."""
    mlp: str = "swiglu"
    """``swiglu`` (gated, 3 matmuls) or ``gelu`` (2 matmuls, Megatron's GPT default)."""
    experts: int = 0
    """Experts per MoE layer; 0 = dense model."""
    top_k: int = 2
    """Experts per token."""
    z_loss: float = 1e-3
    """Router z-loss coefficient (MoE only)."""
    aux_loss: float = 0.0
    """Coefficient of the routers' sequence-level load-balancing loss (MoE only; Megatron's ``seq_aux_loss``:
    ``harness.runtime.balance``); 0 = none."""
    rope_base: float = 10000.0
    seed: int = 0
    """Parameter initialisation seed (same on every rank)."""
    pattern: str = ""
    """Hybrid layer pattern, one character per layer (Megatron's ``hybrid_override_pattern``): ``M``
    an SSM mixer layer, ``*`` an attention layer, ``-`` an MLP layer; empty = every layer a transformer
    block (attention + MLP)."""
    ssm_heads: int = 4
    """SSM heads of a mixer layer (sharded over a CP block's ranks: a multiple of the largest block)."""
    ssm_head_dim: int = 16
    """Channels per SSM head."""
    ssm_state: int = 16
    """SSM state size N."""
    ssm_chunk: int = 64
    """Chunk length of the chunked scan."""
    mtp_depth: int = 0
    """Multi-token prediction depth D (DeepSeek-V3 / Megatron MTP): D extra blocks, block k combining
    the hidden state with the embedding of token i + k to predict token i + k + 1; 0 = none."""
    mtp_weight: float = 0.3
    """The MTP losses' weight: loss = LM loss + mtp_weight / D x the sum of the D MTP losses."""
    loss_chunk: int = 0
    """Tokens per chunk of the LM head and its cross-entropy (``harness.runtime.chunked_loss``: the logits are never
    whole, their gradient formed chunk by chunk in the backward; the head's GEMM runs twice); 0 = the whole logits at
    once. An execution choice, like ``ssm_chunk``: the losses and gradients are the same up to rounding."""

    def __post_init__(self):
        if self.hidden % self.heads or self.heads % self.kv_heads:
            raise ValueError(f"hidden={self.hidden} must be divisible by heads={self.heads}, "
                             f"which must be divisible by kv_heads={self.kv_heads}")
        if self.mlp not in MLPS:
            raise ValueError(f"mlp={self.mlp!r} is not one of {', '.join(MLPS)}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, experts={self.experts}]")
        if not isinstance(self.mtp_depth, int) or self.mtp_depth < 0:
            raise ValueError(f"mtp_depth={self.mtp_depth!r} must be an int >= 0 (0 = no multi-token prediction)")
        if isinstance(self.aux_loss, bool) or not (isinstance(self.aux_loss, (int, float)) and self.aux_loss >= 0):
            raise ValueError(f"aux_loss={self.aux_loss!r} must be a number >= 0 (0 = no load-balancing loss)")
        if self.aux_loss and not self.experts:
            raise ValueError(f"aux_loss={self.aux_loss} balances MoE routers and this model has none: use experts > 0 "
                             f"or aux_loss=0")
        if (problem := loss_chunk_problem(self.loss_chunk)) is not None:
            raise ValueError(problem)
        if not self.mtp_weight >= 0:
            raise ValueError(f"mtp_weight={self.mtp_weight!r} must be >= 0")
        small = {k: getattr(self, k) for k in ("ssm_heads", "ssm_head_dim", "ssm_state", "ssm_chunk")
                 if getattr(self, k) < 1}
        if small:
            raise ValueError(f"{', '.join(f'{k}={v}' for k, v in small.items())}: SSM sizes must be >= 1")
        if self.pattern:
            bad = sorted(set(self.pattern) - set(LAYER_KINDS))
            if bad or len(self.pattern) != self.layers:
                raise ValueError(f"pattern={self.pattern!r} must have one of {', '.join(map(repr, LAYER_KINDS))} per "
                                 f"layer ({self.layers} layers)" + (f"; unknown {bad}" if bad else ""))
            if self.experts:
                raise ValueError("a hybrid pattern has no MoE layers: use experts=0 with pattern")

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def kinds(self) -> str:
        """One character per layer: ``B`` a transformer block, else the pattern's kind."""
        return self.pattern or "B" * self.layers

    def training_cost(self, **kw) -> CostModel:
        """The scheduler's FLOP cost model of this model (``CostModel.from_model_shape``): a gated MLP
        for ``swiglu``, ``top_k`` experts' MLPs per token for MoE; ``kw`` adds its other options. A
        hybrid model is priced as its attention layers (the only quadratic part) plus as many MLPs as it
        has MLP and mixer layers (the mixers' linear work is of the same order)."""
        layers = self.kinds.count("B") + self.kinds.count("*") + self.mtp_depth
        return CostModel.from_model_shape(
            num_layers=max(layers, 1), hidden_size=self.hidden,
            ffn_hidden_size=self.ffn * (self.top_k if self.experts else 1) * max(
                1, round((self.kinds.count("B") + self.kinds.count("-") + self.kinds.count("M")) / max(layers, 1))),
            num_attention_heads=self.heads, num_query_groups=self.kv_heads, gated_mlp=self.mlp == "swiglu",
            vocab_size=self.vocab, **kw)

    def moe_layers(self) -> list[int]:
        """Global layers with an MoE block: all but the first (dense) one, for an MoE config."""
        return list(range(1, self.layers)) if self.experts else []

    def layer_flops(self, i: int, seq_len: int) -> float:
        """Forward FLOPs per token of global layer ``i`` (matrix products, and causal attention's scores and
        values at sequence length ``seq_len``; ``i >= layers``: MTP depth ``i - layers + 1``, a dense block
        plus its 2E -> E combining projection)."""
        h, d = self.hidden, self.hidden // self.heads
        attention = 2 * h * (self.heads + 2 * self.kv_heads) * d + 2 * self.heads * d * h + 2 * h * seq_len
        mlp = 2 * h * self.ffn * (3 if self.mlp == "swiglu" else 2)
        if i >= self.layers:
            return 2 * (2 * h) * h + attention + mlp
        kind = self.kinds[i]
        if kind == "B":
            moe = i in self.moe_layers()
            return attention + (mlp * self.top_k + 2 * h * self.experts if moe else mlp)
        if kind == "*":
            return attention
        if kind == "-":
            return mlp
        di, n = self.ssm_heads * self.ssm_head_dim, self.ssm_state  # "M": the mixer's projections
        return 2 * h * (2 * di + 2 * n + self.ssm_heads) + 2 * di * h

    def chunk_shares(self, pp: int, vpp: int = 1, seq_len: int = 256) -> tuple[float, ...]:
        """Each pipeline model chunk's forward FLOPs per token (``c = v * pp + s``, the order of
        ``harness.plan.Execution.pipeline(chunk_shares=)``): its layers under the runtime's split
        (``harness.plan.pipeline.model_split``), and on the last chunk the LM head and the MTP blocks (each
        with its own logits through the shared head). The embedding costs no FLOPs and is not priced. With the
        even shares a chunk holding the head is priced like the others although it does more: on tiny-gpt at
        two stages the second stage does ~1.4x the first's work."""
        ranges = model_split(self.layers, pp, vpp)
        shares = [0.0] * (pp * vpp)
        for s, chunks in enumerate(ranges):
            for v, (start, n) in enumerate(chunks):
                shares[v * pp + s] = float(sum(self.layer_flops(i, seq_len) for i in range(start, start + n)))
        head = 2 * self.hidden * self.vocab
        shares[-1] += head + sum(self.layer_flops(self.layers + k, seq_len) + head for k in range(self.mtp_depth))
        return tuple(shares)


def pipeline_shares(model: str, pp: int, vpp: int, max_seqlen_per_rank: int) -> tuple[float, ...]:
    """The chunk shares a training config's pipeline is planned and simulated with: ``MODELS[model]``'s
    ``chunk_shares`` with attention priced at half a rank's capacity (``max_seqlen_per_rank // 2`` tokens)."""
    return MODELS[model].chunk_shares(pp, vpp, max(1, max_seqlen_per_rank // 2))


MLPS = ("swiglu", "gelu")
LAYER_KINDS = ("M", "*", "-")

MODELS = {
    "tiny-gpt": ModelConfig(),
    "tiny-moe": ModelConfig(experts=4, top_k=2, layers=3),
    # the model of Megatron's Dynamic-CP benchmark (examples/dynamic_context_parallel): 12 layers,
    # hidden 2048, FFN 8192 (GeLU), 16 heads (MHA); for ``dcp-harness bench step``
    "gpt-12l-h2048": ModelConfig(vocab=32000, hidden=2048, layers=12, heads=16, kv_heads=16, ffn=8192, mlp="gelu"),
    # the same with 8 experts of FFN 4096 per MoE layer, top-2 (the dense model's active FFN FLOPs per token); for
    # ``bench step --ep`` (experts sharded over the domain)
    "moe-12l-h2048": ModelConfig(vocab=32000, hidden=2048, layers=12, heads=16, kv_heads=16, ffn=4096, mlp="gelu",
                                 experts=8, top_k=2),
    # tiny GPT with one multi-token-prediction block
    "tiny-gpt-mtp": ModelConfig(mtp_depth=1),
    # mixer, attention, mixer, MLP: a Mamba-style hybrid (Megatron's hybrid_override_pattern "M*M-")
    "tiny-hybrid": ModelConfig(layers=4, pattern="M*M-"),
}
