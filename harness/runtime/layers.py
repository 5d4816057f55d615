"""Building blocks of the tiny models (single process, torch): RMSNorm, RoPE tables, the MLPs, the MoE
layer, and ``cp_ops``, the one place every CP-aware module takes its micro-batch's CP operations from.

Shape legend: ``T`` local tokens, ``E`` hidden size, ``H`` query heads, ``Hkv`` key/value heads, ``D``
head dim, ``F`` FFN size, ``X`` experts, ``K`` top-k.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from harness.runtime.balance import BalanceError, seq_aux_loss
from harness.runtime.model_config import ModelConfig
from harness.runtime.weight_cache import linear, weight

Attention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Mixing = Callable[..., torch.Tensor]
"""``mixing(mixer, x_TE, tp=None) -> y_TE``: an SSM mixer applied with the micro-batch's sequence layout and CP
exchange (``harness.runtime.ssm``); ``tp``: the step's tensor parallelism when the mixer keeps a TP shard."""
Experts = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``experts(moe, x_TE, idx_TK, weight_TK) -> y_TE``: an MoE layer's experts applied to the tokens routed to
them, weighted by the gate weights and summed per token. ``None`` (single process): ``local_experts``;
expert parallelism: ``harness.parallel.expert_parallel`` sends each token to the ranks that own its experts
and back."""


def cp_ops(module: nn.Module, attention: Attention | None, mixing: Mixing | None) -> tuple:
    """The CP operations a module uses for this call: exactly the ones it was handed. Modules never keep
    a micro-batch's group (it is inside these callables) between calls; a seam where ``harness.faults``
    re-creates a module that does."""
    return attention, mixing


class TensorParallelOps:
    """What a block split by tensor parallelism calls (``harness.parallel.tensor_parallel.TensorParallel``; the
    runtime sits below the parallel layer and only calls these): ``size``, ``enter(x)`` (a column-parallel matrix's
    input: replicated, its gradient all-reduced; or, with sequence parallelism, every rank's token rows gathered),
    ``leave(y)`` (a row-parallel matrix's partial sums all-reduced, or reduce-scattered by rows), and ``scatter(x)`` /
    ``gather(x)`` where a block stack starts and ends (this rank's token rows / every rank's rows with sequence
    parallelism; ``x`` itself without); with the vocabulary split, ``lookup`` (embedding rows from this rank's shard of
    the table), ``head_input`` (the head's input: its gradient all-reduced) and ``cross_entropy`` (per-token losses
    from this rank's logits of its vocabulary range), or ``head_losses`` (the head and that loss over chunks of tokens,
    ``harness.runtime.chunked_loss``). An MoE block under sequence parallelism also calls
    ``own_rows`` (a mask's rows of this rank), ``gather_choices`` (every rank's expert choices), ``gather_rows`` (every
    rank's gate weights, the gradient reduce-scattered) and ``sum_loss`` (its z-loss summed over the ranks). An SSM
    mixer calls ``channel_sum`` (a per-token sum over channels split by TP: summed over the ranks both ways)."""

    size: int
    sequence_parallel: bool

    def enter(self, x: torch.Tensor) -> torch.Tensor: ...

    def leave(self, y: torch.Tensor) -> torch.Tensor: ...

    def scatter(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather(self, x: torch.Tensor) -> torch.Tensor: ...

    def lookup(self, tokens: torch.Tensor, table: torch.Tensor, vocab: int) -> torch.Tensor: ...

    def head_input(self, h: torch.Tensor) -> torch.Tensor: ...

    def cross_entropy(self, logits: torch.Tensor, labels: torch.Tensor, vocab: int) -> torch.Tensor: ...

    def head_losses(self, h: torch.Tensor, w, labels: torch.Tensor, vocab: int, chunk: int) -> torch.Tensor: ...

    def own_rows(self, x: torch.Tensor) -> torch.Tensor: ...

    def gather_choices(self, idx: torch.Tensor) -> torch.Tensor: ...

    def gather_rows(self, x: torch.Tensor) -> torch.Tensor: ...

    def sum_loss(self, x: torch.Tensor) -> torch.Tensor: ...

    def channel_sum(self, x: torch.Tensor) -> torch.Tensor: ...


class ShardedCallError(TypeError):
    """A block that keeps a tensor-parallel shard was called without its TP operations (it would return partial
    sums)."""


def local_heads(layer: nn.Module, c: ModelConfig, tp=None) -> tuple[int, int]:
    """(query heads, key/value heads) of the attention ``layer`` keeps: all of ``c``'s, or its tensor-parallel shard's
    (``ShardedCallError`` when it keeps a shard and the call brought no ``tp``)."""
    D = c.hidden // c.heads
    H = layer.proj.weight.shape[1] // D
    if H != c.heads and tp is None:
        raise ShardedCallError(f"this attention keeps {H} of the model's {c.heads} heads (a tensor-parallel shard) and "
                               "was called without the step's tensor parallelism: pass tp= to run_layers")
    return H, (layer.qkv.weight.shape[0] // D - H) // 2


_FUSED_RMS_NORM = hasattr(F, "rms_norm")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        if _FUSED_RMS_NORM:  # one kernel each way on CUDA instead of six / ten (launch-bound steps)
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Rotary:
    """RoPE tables of one micro-batch's positions, computed once and shared by every layer:
    ``cos``/``sin`` in fp32 ``[T, 1, D]`` laid out for ``x * cos + rotate_half(x) * sin`` (the
    half-split convention; the same values, bit for bit, as rotating the halves separately)."""

    def __init__(self, pos_T: torch.Tensor, head_dim: int, base: float):
        d = head_dim // 2
        inv = base ** (-torch.arange(d, device=pos_T.device, dtype=torch.float32) / d)
        ang = pos_T.to(torch.float32)[:, None] * inv[None, :]
        cos, sin = ang.cos(), ang.sin()
        self.pos_T = pos_T
        self.cos = torch.cat([cos, cos], dim=-1)[:, None, :]
        self.sin = torch.cat([-sin, sin], dim=-1)[:, None, :]
        self._cast: dict = {}

    def tables(self, dtype):
        if dtype not in self._cast:
            self._cast[dtype] = (self.cos.to(dtype), self.sin.to(dtype))
        return self._cast[dtype]

    def __call__(self, x_THD: torch.Tensor) -> torch.Tensor:
        return _rotate(x_THD, *self.tables(x_THD.dtype))


def _rotate(x_THD, cos, sin):
    """``x * cos + rotate_half(x) * sin`` with ``Rotary``'s tables (sin carries the half's sign)."""
    d = x_THD.shape[-1] // 2
    return x_THD * cos + torch.cat([x_THD[..., d:], x_THD[..., :d]], dim=-1) * sin


def rope(x_THD: torch.Tensor, pos_T: torch.Tensor, base: float) -> torch.Tensor:
    """Rotary embedding by *global* positions (half-split convention)."""
    return Rotary(pos_T, x_THD.shape[-1], base)(x_THD)


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_up = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        g, u = linear(x, weight(self.gate_up.weight)).chunk(2, dim=-1)
        return linear(F.silu(g) * u, weight(self.down.weight))


class GeLUMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn, bias=False)
        self.down = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        return linear(F.gelu(linear(x, weight(self.up.weight)), approximate="tanh"), weight(self.down.weight))


def dense_mlp(c: ModelConfig) -> nn.Module:
    return SwiGLU(c.hidden, c.ffn) if c.mlp == "swiglu" else GeLUMLP(c.hidden, c.ffn)


class MoE(nn.Module):
    def __init__(self, c: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer  # global layer number: the key of replay data
        self.router = nn.Linear(c.hidden, c.experts, bias=False)
        self.experts = nn.ModuleList(dense_mlp(c) for _ in range(c.experts))
        self.top_k, self.z_coef, self.num_experts = c.top_k, c.z_loss, c.experts
        self.aux_coef = c.aux_loss

    def forward(self, x_TE, real_T, routing=None, experts: Experts | None = None, rows=None, balance=None):
        """(output, z-loss + balance loss) of the tokens ``x_TE``. ``rows``: the step's ``TensorParallelOps`` when
        ``x_TE`` holds this TP rank's share of the rows (sequence parallelism): the router routes those rows (its
        logits, choices, gate weights, z-loss and balance statistics are theirs; ``routing`` sees them alone),
        ``experts`` gets every rank's choices (``tp_expert_outputs``) and the losses are summed over the TP ranks
        (``sum_loss``). ``balance``: the micro-batch's sequences (``harness.runtime.balance.SequenceBalance``), needed
        when the model has a load-balancing loss (``ModelConfig.aux_loss``)."""
        # the router runs in at least fp32, also under bf16 autocast (Megatron's moe_router_dtype=fp32):
        # autocast would otherwise run F.linear in bf16 whatever its inputs' dtype. An fp64 model keeps
        # fp64, so the router of an fp64 run is not rounded to fp32 (whose result depends on the batch's
        # row count: a one-token matmul takes another BLAS kernel).
        dt = torch.promote_types(x_TE.dtype, torch.float32)
        with torch.autocast(x_TE.device.type, enabled=False):
            logits_TX = F.linear(x_TE.to(dt), self.router.weight.to(dt))
        if routing is None:
            idx_TK = torch.topk(logits_TX.detach(), self.top_k, dim=-1).indices
        else:
            idx_TK = routing.select(self.layer, logits_TX, self.top_k)
        weight_TK = logits_TX.gather(1, idx_TK).softmax(-1).to(x_TE.dtype)  # live scores: router gets gradients
        split = rows is not None and rows.sequence_parallel
        if split:
            real_T = rows.own_rows(real_T)
        z = (torch.logsumexp(logits_TX, dim=-1).pow(2) * real_T).sum() * self.z_coef  # real tokens only
        if self.aux_coef:
            if balance is None:
                raise BalanceError(f"MoE layer {self.layer} has a load-balancing loss (aux_loss={self.aux_coef}) and "
                                   "was not given its micro-batch's sequences: pass balance=SequenceBalance(...)")
            z = z + seq_aux_loss(logits_TX, idx_TK, real_T, balance.own_rows(rows) if split else balance,
                                 self.aux_coef, self.top_k)
        if split:
            idx_TK = rows.gather_choices(idx_TK)
        out = (local_experts if experts is None else experts)(self, x_TE, idx_TK, weight_TK)
        return out, rows.sum_loss(z) if split else z


def tp_experts(tp, dispatch: Experts | None = None) -> Experts:
    """An MoE layer's experts, each keeping a tensor-parallel shard of its FFN (``tp_expert_outputs``): every expert on
    this process, or with ``dispatch`` (expert parallelism's, ``harness.parallel.expert_parallel``; sequence
    parallelism only) those of the experts' owners in this TP rank's DP x CP domain."""
    if dispatch is not None and not getattr(tp, "sequence_parallel", False):
        raise ValueError("expert parallelism under tensor parallelism needs sequence parallelism (Megatron's rule for "
                         "MoE with TP): each TP rank's gate weights are gathered with a reduce-scattered gradient")

    def experts(moe: MoE, x_TE, idx_TK, weight_TK):
        return tp_expert_outputs(moe, x_TE, idx_TK, weight_TK, tp, dispatch)  # the seam, looked up at each call
    return experts


def tp_expert_outputs(moe: MoE, x_TE, idx_TK, weight_TK, tp, dispatch: Experts | None = None):
    """``tp_experts``' work for one call (a seam: ``harness.faults`` re-creates the gate applied to the partial sums).

    Tensor parallelism alone: the experts read ``tp.enter(x)`` (their input's gradient summed over TP), their partial
    outputs are summed over TP in one ``tp.leave`` and only then weighted by the gate. The router reads the plain rows,
    so its gradient (and the gate's) is the same whole one on every TP rank and enters the rows' gradient once.

    With sequence parallelism ``x_TE`` and ``weight_TK`` hold this rank's rows and ``idx_TK`` every rank's
    (``MoE.forward(rows=)``): the experts run on every rank's rows (``tp.enter``: all-gathered), each output is
    weighted by the all-gathered gate weights (``sp_gates``) and added per token, and the sums are reduce-scattered
    back to this rank's rows (``tp.leave``). Weighting the partial outputs is right here, as the gate weights'
    gather sums their gradient's partial parts over TP on its way back (Megatron's all-gather token dispatcher).

    With expert parallelism (``dispatch``) the gathered rows go to their experts' owners in this TP rank's domain and
    come back weighted (``ExpertDispatch``): each TP rank's owner runs its shard of the expert on the same rows, so the
    weighted partial outputs reduce-scatter to the whole as above."""
    xin = tp.enter(x_TE)
    if dispatch is not None:
        return tp.leave(dispatch(moe, xin, idx_TK, sp_gates(weight_TK, tp)))
    chosen = [(e, *(idx_TK == e).nonzero(as_tuple=True)) for e in range(moe.num_experts)]
    chosen = [(e, tok, slot) for e, tok, slot in chosen if tok.numel()]  # the same on every TP rank
    if getattr(tp, "sequence_parallel", False):
        gates = sp_gates(weight_TK, tp)
        out = xin.new_zeros(xin.shape)
        for e, tok, slot in chosen:
            out = out.index_add(0, tok, moe.experts[e](xin[tok]) * gates[tok, slot, None])
        return tp.leave(out)
    out = torch.zeros_like(x_TE)
    if not chosen:
        return out
    partial = torch.cat([moe.experts[e](xin[tok]) for e, tok, _ in chosen])
    whole = tp.leave(partial).split([tok.numel() for _, tok, _ in chosen])
    for y, (_, tok, slot) in zip(whole, chosen):
        out = out.index_add(0, tok, y * weight_TK[tok, slot, None])
    return out


def sp_gates(weight_TK, tp):
    """Every TP rank's gate weights from this rank's rows (sequence parallelism), their gradient reduce-scattered:
    each rank's gradient of them is a partial sum over the experts' shards (a seam)."""
    return tp.gather_rows(weight_TK)


def local_experts(moe: MoE, x_TE, idx_TK, weight_TK):
    """Every expert of ``moe`` on this process: expert e runs on its tokens (in token order) and adds
    its weighted output into theirs, expert after expert."""
    if len(moe.experts) != moe.num_experts:
        raise ValueError(f"MoE layer {moe.layer} holds {len(moe.experts)} of its {moe.num_experts} experts "
                         "(sharded for expert parallelism): pass the micro-batch's expert dispatch "
                         "(experts=..., harness.parallel.expert_parallel) to run it")
    out = torch.zeros_like(x_TE)
    for e, expert in enumerate(moe.experts):
        tok, slot = (idx_TK == e).nonzero(as_tuple=True)
        if tok.numel():
            out = out.index_add(0, tok, expert(x_TE[tok]) * weight_TK[tok, slot, None])
    return out
