"""Tiny GPT and tiny MoE for convergence comparisons (single process; attention is injected).

Shape legend: ``T`` local tokens (a rank's zig-zag slice of a THD micro-batch), ``E`` hidden size,
``H`` query heads, ``Hkv`` key/value heads, ``D`` head dim, ``F`` FFN size, ``X`` experts, ``K`` top-k.

The model sees only a rank's tokens and their *global* position ids (RoPE uses them, so a zig-zag
slice is rotated exactly like the unsharded sequence). Everything but attention is per token, so the
caller passes ``attention(q_THD, k_THD, v_THD) -> o_THD`` for the current micro-batch (CP attention
with its block's group, or single-process THD attention).

Hybrid models (``ModelConfig.pattern``: SSM mixer, attention and MLP layers, ``harness.runtime.hybrid``)
and multi-token prediction (``ModelConfig.mtp_depth``, ``harness.runtime.mtp``) build on the same
pieces (``harness.runtime.layers``). Every CP-aware layer takes the micro-batch's ``attention`` and
``mixing`` per call.

MoE: the first layer is dense, the others route each token to its top-k experts (softmax over the
top-k logits; the router computes in fp32, like Megatron's ``moe_router_dtype=fp32``). The router's auxiliary loss is the per-token z-loss ``mean(logsumexp(logits)^2)``
summed over tokens: a load-balancing loss computed per micro-batch would depend on how a layout
groups tokens and break the layouts' exact equivalence (upstream noted the same gap for Dynamic CP).
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.runtime import layers
from harness.runtime.chunked_loss import head_losses
from harness.runtime.hybrid import HYBRID_LAYERS, self_attention
from harness.runtime.layers import (  # noqa: F401 - re-exported: the model's public pieces
    Attention,
    GeLUMLP,
    Mixing,
    MoE,
    RMSNorm,
    Rotary,
    ShardedCallError,
    SwiGLU,
    _rotate,
    cp_ops,
    dense_mlp,
    rope,
)
from harness.runtime.model_config import MLPS, MODELS, ModelConfig  # noqa: F401 - re-exported
from harness.runtime.mtp import MTPLayer
from harness.runtime.options import COMPILE_SCOPES
from harness.runtime.weight_cache import linear, weight

# ---------------------------------------------------------------- compiled block segments
# A dense block is attention plus two per-token segments: (norm, QKV projection, RoPE) before it and
# (output projection, residual, norm, MLP, residual) after it. ``TinyLM.compile_blocks`` runs the
# per-token work between two attentions through ``torch.compile`` as *one* segment (block i's tail
# and block i+1's head, ``<mlp>+attn_inputs``; the last tail takes the loss head, ``<mlp>+head``),
# so a model of L layers makes L + 1 compiled calls per forward (and as many backward) instead of
# 2L + 1: on an H200 the host pays ~0.25 ms of wrapper time per compiled call, and the step is
# host-bound. Attention and its collectives stay eager between segments. The functions take the
# weights as arguments, so one compiled graph serves every layer. Same maths as ``Block.forward``;
# only the rounding of fused bf16 elementwise chains differs (Inductor computes them in fp32).


def _attn_inputs(x_TE, norm_w, qkv_w, cos, sin, eps: float, heads: int, kv_heads: int):
    D = cos.shape[-1]
    h = F.rms_norm(x_TE, (x_TE.shape[-1],), norm_w, eps)
    q, k, v = linear(h, qkv_w).split([heads * D, kv_heads * D, kv_heads * D], dim=-1)
    cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # as ``Rotary.tables``: fp32 tables cast to the activations' dtype
    return _rotate(q.view(-1, heads, D), cos, sin), _rotate(k.view(-1, kv_heads, D), cos, sin), v.view(-1, kv_heads, D)


def _gelu_out(x_TE, o_THD, proj_w, norm_w, up_w, down_w, eps: float):
    x_TE = x_TE + linear(o_THD.reshape(x_TE.shape[0], -1), proj_w)
    h = F.rms_norm(x_TE, (x_TE.shape[-1],), norm_w, eps)
    return x_TE + linear(F.gelu(linear(h, up_w), approximate="tanh"), down_w)


def _swiglu_out(x_TE, o_THD, proj_w, norm_w, gate_up_w, down_w, eps: float):
    x_TE = x_TE + linear(o_THD.reshape(x_TE.shape[0], -1), proj_w)
    g, u = linear(F.rms_norm(x_TE, (x_TE.shape[-1],), norm_w, eps), gate_up_w).chunk(2, dim=-1)
    return x_TE + linear(F.silu(g) * u, down_w)


def _head_losses(h_TE, norm_w, head_w, labels_T, real_T, eps: float):
    logits = linear(F.rms_norm(h_TE, (h_TE.shape[-1],), norm_w, eps), head_w).float()
    return (F.cross_entropy(logits, labels_T.clamp_min(0), reduction="none") * real_T).sum()


def _tail_then_attn_inputs(tail):
    """One segment: ``tail`` (a block's output projection + MLP, ``_gelu_out`` / ``_swiglu_out``),
    then the next block's ``_attn_inputs``; returns (hidden states, q, k, v)."""
    def segment(x_TE, o_THD, proj_w, norm2_w, w1, down_w, eps2: float, *next_inputs):
        x_TE = tail(x_TE, o_THD, proj_w, norm2_w, w1, down_w, eps2)
        return (x_TE, *_attn_inputs(x_TE, *next_inputs))
    return segment


def _tail_then_head(tail):
    """One segment: ``tail``, then the loss head (``_head_losses``); returns the summed loss."""
    def segment(x_TE, o_THD, proj_w, norm2_w, w1, down_w, eps2: float, *head):
        return _head_losses(tail(x_TE, o_THD, proj_w, norm2_w, w1, down_w, eps2), *head)
    return segment


_TAILS = {"gelu": _gelu_out, "swiglu": _swiglu_out}
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune-no-cudagraphs")
_SEGMENTS = {"attn_inputs": _attn_inputs, "head": _head_losses, **_TAILS,
             **{f"{k}+attn_inputs": _tail_then_attn_inputs(f) for k, f in _TAILS.items()},
             **{f"{k}+head": _tail_then_head(f) for k, f in _TAILS.items()}}
_compiled_segments: dict = {}


def _chain_body(x_TE, layers, head):
    """Blocks ``layers`` (``(attention inputs, MLP kind, tail weights)`` each) with the attention as
    ``harness.runtime.opaque.opaque_attention``, as one function for ``torch.compile``
    (``scope="chain"``): the segments' maths, in the same order, between the same attentions."""
    # lazy: as in compiled_chain (opaque records the dispatch state at its first import)
    from harness.runtime.opaque import opaque_attention

    q, k, v = _attn_inputs(x_TE, *layers[0][0])
    for j, (_, kind, tail) in enumerate(layers):
        o = opaque_attention(q, k, v)
        if j + 1 < len(layers):
            x_TE, q, k, v = _tail_then_attn_inputs(_TAILS[kind])(x_TE, o, *tail, *layers[j + 1][0])
        elif head is not None:
            return _tail_then_head(_TAILS[kind])(x_TE, o, *tail, *head)
        else:
            x_TE = _TAILS[kind](x_TE, o, *tail)
    return x_TE


_SEGMENTS["chain"] = _chain_body


def compiled_segment(name: str, backend: str, mode: str | None = None):
    """The ``torch.compile`` of segment ``name`` (one per process, backend and mode; shapes that
    vary, e.g. the token count, become dynamic after their first change). ``mode="reduce-overhead"``
    replays each call as a CUDA graph, recorded once per token count."""
    key = (name, backend, mode)
    if key not in _compiled_segments:
        _compiled_segments[key] = torch.compile(_SEGMENTS[name], backend=backend, mode=mode)
    return _compiled_segments[key]


class Block(nn.Module):
    def __init__(self, c: ModelConfig, moe: bool, layer: int = 0):
        super().__init__()
        self.c = c
        D = c.hidden // c.heads
        self.norm1, self.norm2 = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.qkv = nn.Linear(c.hidden, (c.heads + 2 * c.kv_heads) * D, bias=False)
        self.proj = nn.Linear(c.heads * D, c.hidden, bias=False)
        self.mlp = MoE(c, layer) if moe else dense_mlp(c)
        self.compiled: str | None = None  # a torch.compile backend (``TinyLM.compile_blocks``) or eager
        self.compile_mode: str | None = None
        self.compile_scope: str = "segments"

    def forward(self, x_TE, pos_T, real_T, attention: Attention, routing=None, mixing=None, experts=None, tp=None,
                balance=None):
        """``pos_T``: global position ids, or a ``Rotary`` of them (shared by the layers). ``experts``: the
        micro-batch's expert dispatch (``layers.Experts``; None: every expert here). ``tp``: the step's tensor
        parallelism (``layers.TensorParallelOps``) when the block keeps a shard of its heads and FFN. ``balance``: the
        micro-batch's sequences for an MoE block's load-balancing loss (``harness.runtime.balance``)."""
        c, D = self.c, self.c.hidden // self.c.heads
        rot = pos_T if isinstance(pos_T, Rotary) else Rotary(pos_T, D, c.rope_base)
        attention, _ = layers.cp_ops(self, attention, mixing)
        if self.compiled and not isinstance(self.mlp, MoE):
            if tp is not None:
                raise ValueError("compiled blocks run without tensor parallelism: compile_blocks(None) for tp > 1")
            return self._compiled_forward(x_TE, rot, attention)
        x_TE = self_attention(self, c, x_TE, rot, attention, tp)
        if isinstance(self.mlp, MoE):
            if tp is not None:  # expert tensor parallelism: each expert's FFN split over the TP ranks
                experts = layers.tp_experts(tp, experts)
            h, z = self.mlp(self.norm2(x_TE), real_T, routing, experts, rows=tp, balance=balance)
            return x_TE + h, z
        if tp is None:
            return x_TE + self.mlp(self.norm2(x_TE)), x_TE.new_zeros((), dtype=torch.float32)
        return x_TE + tp.leave(self.mlp(tp.enter(self.norm2(x_TE)))), x_TE.new_zeros((), dtype=torch.float32)

    def _compiled_forward(self, x_TE, rot: Rotary, attention: Attention):
        x_TE = compiled_chain([self], x_TE, rot, attention, self.compiled, self.compile_mode,
                              scope=self.compile_scope)
        return x_TE, x_TE.new_zeros((), dtype=torch.float32)

    def tail_weights(self) -> tuple[str, tuple]:
        """(MLP kind, the weights and eps of the segment after attention) for the compiled chain."""
        w1 = self.mlp.gate_up.weight if isinstance(self.mlp, SwiGLU) else self.mlp.up.weight
        return ("swiglu" if isinstance(self.mlp, SwiGLU) else "gelu",
                (weight(self.proj.weight), self.norm2.weight, weight(w1), weight(self.mlp.down.weight), self.norm2.eps))


def compiled_chain(blocks: list[Block], x_TE, rot: Rotary, attention: Attention, backend: str, mode: str | None,
                   head: tuple | None = None, scope: str = "segments"):
    """Dense ``blocks`` (consecutive) through compiled segments, one per stretch between attentions
    (see above): returns the hidden states, or with ``head = (norm_w, head_w, labels_T, real_T, eps)``
    the loss head's summed cross-entropy computed in the last segment. ``scope="chain"``: all of it
    as one compiled call, the attentions inside as opaque operators (``harness.runtime.opaque``)."""
    if not blocks:
        raise ValueError("compiled_chain needs at least one block")
    c = blocks[0].c

    def inputs(b: Block) -> tuple:
        return (b.norm1.weight, weight(b.qkv.weight), rot.cos, rot.sin, b.norm1.eps, c.heads, c.kv_heads)

    if scope == "chain":
        # lazy: opaque defines its operators on first use (the chain scope only)
        from harness.runtime.opaque import attending

        layers = [(inputs(b), *b.tail_weights()) for b in blocks]
        with attending(attention):
            return compiled_segment("chain", backend, mode)(x_TE, layers, _head_weights(head))

    q, k, v = compiled_segment("attn_inputs", backend, mode)(x_TE, *inputs(blocks[0]))
    for j, b in enumerate(blocks):
        o = attention(q, k, v)
        kind, tail = b.tail_weights()
        if j + 1 < len(blocks):
            x_TE, q, k, v = compiled_segment(f"{kind}+attn_inputs", backend, mode)(x_TE, o, *tail,
                                                                                 *inputs(blocks[j + 1]))
        elif head is not None:
            return compiled_segment(f"{kind}+head", backend, mode)(x_TE, o, *tail, *_head_weights(head))
        else:
            x_TE = compiled_segment(kind, backend, mode)(x_TE, o, *tail)
    return x_TE


def _head_weights(head: tuple | None) -> tuple | None:
    """The loss head's arguments with the LM head matrix taken through ``weight()`` here, at its point of use: a
    step copy's backward node runs in the order of its creation, so a copy made before the blocks' would hand the
    head's gradient (the last parameters: the gradient reducer's first bucket) over only at the end of the
    backward, and no bucket could be reduced while the backward runs."""
    if head is None:
        return None
    norm_w, head_w, *rest = head
    return (norm_w, weight(head_w), *rest)


class TinyLM(nn.Module):
    """Tiny GPT (``experts == 0``) or MoE: embedding, blocks, final RMSNorm, untied LM head."""

    def __init__(self, c: ModelConfig, device=None):
        """``device=None``: build on the CPU with a device-independent init (bit-identical weights
        on every machine; the convergence goldens rely on it). ``device``: build there directly with
        the same distribution drawn from that device's generator (fast for large models, e.g.
        benchmarks; the weights then depend on the device)."""
        super().__init__()
        self.c = c
        with torch.device(device or "cpu"):
            self.embed = nn.Embedding(c.vocab, c.hidden)
            self.blocks = nn.ModuleList(self._layer(c, i) for i in range(c.layers))
            self.mtp = nn.ModuleList(MTPLayer(c, k, Block(c, moe=False, layer=c.layers + k - 1))
                                     for k in range(1, c.mtp_depth + 1))
            self.norm = RMSNorm(c.hidden)
            self.head = nn.Linear(c.hidden, c.vocab, bias=False)
        gen = torch.Generator(device=device or "cpu").manual_seed(c.seed)
        with torch.no_grad():
            for name, p in sorted(self.named_parameters()):
                if p.dim() > 1 and not name.endswith("mixer.bc_proj.weight"):  # drawn with its in_proj, below
                    std = 0.02 / math.sqrt(2 * c.layers) if name.endswith(("proj.weight", "down.weight")) else 0.02
                    if name.endswith("mixer.in_proj.weight"):  # an SSM mixer's projections, drawn as one matrix
                        mixer = self.get_submodule(name.removesuffix(".in_proj.weight"))
                        mixer.set_projections(torch.randn(mixer.projection_shape, generator=gen, device=p.device) * std)
                    else:
                        p.copy_(torch.randn(p.shape, generator=gen, device=p.device) * std)

    def _layer(self, c: ModelConfig, i: int) -> nn.Module:
        kind = c.kinds[i]
        return Block(c, moe=i in self.moe_layers(), layer=i) if kind == "B" else HYBRID_LAYERS[kind](c)

    def moe_layers(self) -> list[int]:
        """Global layers with an MoE block (``ModelConfig.moe_layers``: all but the first, for an MoE config)."""
        return self.c.moe_layers()

    def run_layers(self, x, pos_T, real_T, attention: Attention, layers=None, routing=None, mixing=None,
                   experts=None, tp=None, split_in: bool = False, split_out: bool = False, balance=None):
        """Apply blocks ``layers`` (global numbers; default all) to hidden states ``x``; returns
        (hidden states, aux loss of those blocks). Pipeline stages call this with their range.
        ``mixing``: the micro-batch's SSM mixing (hybrid models). ``experts``: the micro-batch's expert
        dispatch (MoE models under expert parallelism, ``harness.parallel.expert_parallel``). ``tp``: the step's
        tensor parallelism (``layers.TensorParallelOps``; dense blocks split by
        ``harness.parallel.tensor_parallel.shard_model``). With sequence parallelism the blocks run on this rank's
        token rows: ``x`` whole rows, scattered here, unless ``split_in`` (it already holds this rank's rows: a
        pipeline stage's input from the previous stage); the output gathered to whole rows unless ``split_out`` (a
        stage that hands its rows on). Without sequence parallelism both are ignored. ``balance``: the micro-batch's
        sequences (``harness.runtime.balance.SequenceBalance``; MoE models with a load-balancing loss)."""
        aux = torch.zeros((), device=x.device)
        if not isinstance(pos_T, Rotary):
            pos_T = Rotary(pos_T, self.c.hidden // self.c.heads, self.c.rope_base)
        layers = list(range(self.c.layers) if layers is None else layers)
        if self._chained(layers):
            if tp is not None:
                raise ValueError("compiled blocks run without tensor parallelism: compile_blocks(None) for tp > 1")
            return compiled_chain([self.blocks[i] for i in layers], x, pos_T, attention, self.compiled,
                                  self.compile_mode, scope=self.compile_scope), aux
        extra = {} if experts is None else {"experts": experts}  # MoE blocks only (hybrid layers have no experts)
        if balance is not None:
            extra["balance"] = balance
        if tp is not None:  # every kind of layer keeps its TP shard (``harness.parallel.tensor_parallel``)
            extra["tp"] = tp
            x = x if split_in else tp.scatter(x)  # sequence parallelism: this rank's token rows between the matrices
        for i in layers:
            x, a = self.blocks[i](x, pos_T, real_T, attention, routing, mixing=mixing, **extra)
            aux = aux + a
        return (x if tp is None or split_out else tp.gather(x)), aux

    def mtp_hidden(self, k: int, h_TE, tokens_T, rot: Rotary, real_T, attention: Attention, mixing=None, tp=None):
        """Depth k's hidden states (``harness.runtime.mtp``) from depth k - 1's (``h_TE``), the tokens looked up in the
        model's embedding (shared with the trunk; on a pipeline's last stage a replica, ``harness.train.shared_embedding``)."""
        return self.mtp[k - 1](h_TE, self.embed_tokens(tokens_T, tp), rot, real_T, attention, mixing, tp=tp)

    def fuses_loss(self) -> bool:
        """Whether ``token_losses`` runs the whole model and its loss head as one compiled chain (compiled,
        every block dense)."""
        return self._chained(list(range(self.c.layers)))

    def _chained(self, layers: list[int]) -> bool:
        """Whether ``layers`` run as one compiled chain (compiled, dense, at least one)."""
        return bool(self.compiled and layers and all(isinstance(self.blocks[i], Block)
                                                     and not isinstance(self.blocks[i].mlp, MoE) for i in layers))

    def compile_blocks(self, backend: str | None = "inductor", mode: str | None = None,
                       scope: str = "segments") -> TinyLM:
        """Run the dense blocks' per-token segments and the loss head through ``torch.compile``
        (``backend``; ``None`` = eager again). Attention, its collectives and MoE blocks stay eager.
        Meant for the GPU step benchmark, where the eager model is launch-bound (one micro-batch of
        2048 tokens enqueues ~1000 kernels); the convergence layouts and goldens run eager.
        ``mode="reduce-overhead"`` (CUDA): each segment call replays a CUDA graph recorded per token
        count (pad micro-batches to few counts: ``build_microbatches(token_multiple=...)``); the
        parameters are marked static so the graphs read them in place (swap weights with ``copy_``).
        ``scope="chain"``: every run of consecutive dense blocks (with the loss head after the last
        block) is *one* compiled call, the attentions inside it opaque operators
        (``harness.runtime.opaque``): 2 compiled calls per micro-batch instead of 2 (L + 1); not
        with CUDA graphs (the attention's collectives and host-side plans cannot be recorded)."""
        if backend is not None and not isinstance(backend, str):
            raise TypeError(f"backend must be a torch.compile backend name or None, got {backend!r}")
        if mode not in COMPILE_MODES:
            raise ValueError(f"mode must be one of {COMPILE_MODES}, got {mode!r}")
        if scope not in COMPILE_SCOPES:
            raise ValueError(f"scope must be one of {COMPILE_SCOPES}, got {scope!r}")
        if backend and self.c.loss_chunk:
            raise ValueError(f"loss_chunk={self.c.loss_chunk} runs the loss head over chunks of tokens eagerly, and "
                             "compile_blocks compiles the head whole: use loss_chunk=0 with a compiled model, or "
                             "compile_blocks(None)")
        if scope == "chain" and mode == "reduce-overhead":
            raise ValueError("scope='chain' cannot be recorded as CUDA graphs (mode='reduce-overhead'): the "
                             "attention inside runs collectives and host-side plans; use scope='segments' for "
                             "CUDA graphs or another mode for the chain")
        if backend and mode == "reduce-overhead":
            for p in self.parameters():
                torch._dynamo.mark_static_address(p, guard=False)
        self.compiled, self.compile_mode = backend, (mode if backend else None)
        self.compile_scope = scope if backend else "segments"
        for b in self.blocks:
            if isinstance(b, Block):
                b.compiled, b.compile_mode, b.compile_scope = self.compiled, self.compile_mode, self.compile_scope
        return self

    compiled: str | None = None
    compile_mode: str | None = None
    compile_scope: str = "segments"

    def loss_from_hidden(self, h, labels_T, real_T):
        """Sum of masked next-token cross-entropies from the last block's hidden states."""
        if self.compiled:
            head = compiled_segment("head", self.compiled, self.compile_mode)
            return head(h, self.norm.weight, weight(self.head.weight), labels_T, real_T, self.norm.eps)
        return self.token_ce(h, labels_T, real_T).sum()

    def token_ce(self, h, labels_T, real_T, tp=None):
        """Masked next-token cross-entropy of every local token (eager; padding gives 0). ``tp``: the step's tensor
        parallelism when the head keeps a shard of the vocabulary (``layers.TensorParallelOps``)."""
        h, chunk = self.norm(h), self.c.loss_chunk
        if not self._vocab_split(tp):
            if chunk:  # the head and its loss over chunks of tokens: never the whole logits
                return head_losses(h, weight(self.head.weight), labels_T.clamp_min(0), chunk) * real_T
            logits = linear(h, weight(self.head.weight)).float()
            return F.cross_entropy(logits, labels_T.clamp_min(0), reduction="none") * real_T
        if chunk:
            return tp.head_losses(tp.head_input(h), weight(self.head.weight), labels_T.clamp_min(0), self.c.vocab,
                                  chunk) * real_T
        logits = linear(tp.head_input(h), weight(self.head.weight)).float()
        return tp.cross_entropy(logits, labels_T.clamp_min(0), self.c.vocab) * real_T

    def embed_tokens(self, tokens_T, tp=None):
        """The tokens' embedding rows (``tp``: the step's tensor parallelism when the table keeps a vocabulary shard)."""
        return tp.lookup(tokens_T, self.embed.weight, self.c.vocab) if self._vocab_split(tp) else self.embed(tokens_T)

    def _vocab_split(self, tp) -> bool:
        """Whether the embedding / head keep a tensor-parallel shard of the vocabulary (``ShardedCallError`` when they
        do and the call brought no ``tp``). A shard is marked by ``tensor_parallel.shard_model`` (``tensor_parallel``):
        a padded vocabulary's shard can hold as many rows as the whole vocabulary."""
        marked = bool(getattr(self.head.weight, "tensor_parallel", False))
        if not marked and self.head.weight.shape[0] == self.c.vocab:
            return False
        if tp is None:
            raise ShardedCallError(f"the embedding and LM head keep {self.head.weight.shape[0]} of the model's "
                                   f"{self.c.vocab} vocabulary rows (a tensor-parallel shard) and were called without "
                                   "the step's tensor parallelism: pass tp=")
        return True

    def forward(self, tokens_T, pos_T, real_T, attention: Attention, routing=None):
        """Hidden states of the local tokens and the auxiliary (router z) loss summed over real
        tokens (``real_T`` = 1 for tokens of a sequence, 0 for padding)."""
        x, aux = self.run_layers(self.embed_tokens(tokens_T), pos_T, real_T, attention, routing=routing)
        return self.norm(x), aux

    def token_losses(self, tokens_T, labels_T, mask_T, pos_T, attention: Attention, routing=None,
                     per_token: bool = False):
        """(sum of masked next-token cross-entropies over the local tokens, aux loss); ``mask_T``
        marks the real tokens (padding has mask 0). ``routing``: a ``harness.runtime.replay.Routing``.
        ``per_token=True`` (eager models): also each local token's cross-entropy, detached, as a third
        element (the sum is the same expression either way)."""
        if per_token:
            if self.compiled:
                raise ValueError("per_token=True needs the eager model (compile_blocks(None))")
            real = mask_T.to(torch.float32)
            x, aux = self.run_layers(self.embed_tokens(tokens_T), pos_T, real, attention, routing=routing)
            ce_T = self.token_ce(x, labels_T, real)
            return ce_T.sum(), aux, ce_T.detach()
        if self.compile_mode == "reduce-overhead":
            torch.compiler.cudagraph_mark_step_begin()  # one micro-batch = one generation of the graphs
        real = mask_T.to(torch.float32)
        if self._chained(list(range(self.c.layers))):  # the loss head joins the last compiled segment
            rot = pos_T if isinstance(pos_T, Rotary) else Rotary(pos_T, self.c.hidden // self.c.heads,
                                                                 self.c.rope_base)
            ce = compiled_chain(list(self.blocks), self.embed_tokens(tokens_T), rot, attention, self.compiled,
                                self.compile_mode, head=(self.norm.weight, self.head.weight, labels_T, real,
                                                         self.norm.eps), scope=self.compile_scope)
            return ce, torch.zeros((), device=ce.device)
        x, aux = self.run_layers(self.embed_tokens(tokens_T), pos_T, real, attention, routing=routing)
        return self.loss_from_hidden(x, labels_T, real), aux
