"""A Mamba-2-style selective state-space mixer over a THD pack, with heads sharded over CP ranks.

Shape legend: ``T`` this process's tokens (a rank's zig-zag slice, or the whole pack without CP),
``P`` every token of the pack in pack order, ``E`` hidden size, ``H`` heads (``h`` = H / shards, this
rank's), ``D`` head dim (Mamba's P, renamed: P is the pack here), ``Di`` = H * D, ``N`` state size,
``K`` conv kernel, ``L`` chunk length (``SSMConfig.chunk``), ``G`` chunks of the pack, ``C`` channels.

Per token ``in_proj`` gives z, x (Di) and dt (H), ``bc_proj`` B and C (N). The conv and the scan are causal *per
sequence* and need whole sequences in order, which a zig-zag slice is not; so the ``exchange``
(``ChannelExchange``) trades tokens for channels: x and dt of this rank's heads for every token of
the pack (an all-to-all), B and C for every token (an all-gather: every head reads them). Each rank
then runs the conv and the scan of its heads on the whole pack and trades back; gating, norm and
``out_proj`` are per token again. Every head's work is the single-process work, so CP changes
nothing but which rank does it.

Tensor parallelism (``tp``, ``harness.runtime.layers.TensorParallelOps``; Megatron's Mamba split) gives each TP rank
H / tp heads: its rows of ``in_proj`` (z, x, dt), its channels of the x conv, the norm weight and ``out_proj``'s
columns (row-parallel: its partial sums leave through ``tp.leave``), its heads' dt bias, A and D. B and C (one group,
read by every head) are computed whole on every TP rank from the replicated ``bc_proj`` and conv, so their gradient
on a rank is its heads' share: the trainer sums those parameters' gradients over the TP group
(``harness.parallel.tensor_parallel.partial_over_tp``). The gated RMSNorm spans all Di channels: its sum of squares is
summed over the TP ranks (``tp.channel_sum``, whose gradient is summed too), so a TP run computes the unsplit model.

Scan, per head and sequence, state reset at the sequence's start (``reference_scan`` is the loop):
``s_t = exp(dt_t A) s_{t-1} + dt_t x_t B_t^T``, ``y_t = s_t C_t + D x_t``. ``chunked_scan`` cuts each
sequence into chunks of L tokens from its own start (so a sequence's result does not depend on where
it sits in the pack), computes within a chunk with a decay matrix from a stable segment sum, and
carries the state between chunks sequentially. Padding follows its sequence's real tokens, so a
causal, per-sequence scan cannot let it reach them.

>>> seqs = SequenceLayout((0, 8, 12))          # two sequences, padded to 8 and 4 tokens
>>> mixer = SSMMixer(SSMConfig(hidden=8, heads=2, head_dim=4, state=4, chunk=4))
>>> mixer(torch.randn(12, 8), seqs).shape
torch.Size([12, 8])
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class SSMError(ValueError):
    """Bad SSM input: a config value, a sequence layout, or a shard count that does not fit."""


class SSMConfigError(SSMError):
    """An ``SSMConfig`` field out of range."""


class SSMShardError(SSMError):
    """The heads cannot be split evenly over the exchange's channel shards (CP ranks)."""


@dataclass(frozen=True, kw_only=True)
class SSMConfig:
    hidden: int = 64
    """Hidden size E (the mixer's input and output width)."""
    heads: int = 4
    """SSM heads H; each has its own decay A and step dt; sharded over CP ranks (H % cp == 0)."""
    head_dim: int = 16
    """Channels per head D (Mamba's P); inner width Di = heads * head_dim."""
    state: int = 16
    """State size N of B and C (one group, shared by every head)."""
    conv: int = 4
    """Kernel K of the causal depthwise conv over x, B and C (per sequence)."""
    chunk: int = 64
    """Chunk length L of the chunked scan: work within a chunk is L^2 per head, chunks carry serially."""
    norm: bool = True
    """RMSNorm over Di after the gate ``y * silu(z)`` (per token, so it never crosses ranks)."""
    dt_range: tuple[float, float] = (1e-3, 1e-1)
    """softplus(dt_bias) is initialised log-uniform in this range (Mamba's dt_min, dt_max)."""
    seed: int = 0
    """Parameter initialisation seed (same on every rank)."""

    def __post_init__(self):
        for name in ("hidden", "heads", "head_dim", "state", "conv", "chunk"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SSMConfigError(f"SSMConfig.{name} must be an int >= 1, got {v!r}")
        lo, hi = self.dt_range
        if not 0 < lo <= hi:
            raise SSMConfigError(f"SSMConfig.dt_range must satisfy 0 < min <= max, got {self.dt_range!r}")

    @property
    def inner(self) -> int:
        return self.heads * self.head_dim


class ChannelExchange(Protocol):
    """How the mixer trades a rank's tokens for a share of the channels over the whole pack.

    ``shards`` channel shards (CP ranks), this rank's is ``shard``. Channels handed to
    ``to_channels`` / returned by ``to_tokens`` are shard-major: shard j's channels are contiguous."""

    shards: int
    shard: int

    def to_channels(self, u_TC: torch.Tensor) -> torch.Tensor:
        """``[T, shards * c]`` -> ``[P, c]``: shard ``self.shard`` of every pack token, pack order."""

    def to_tokens(self, y_PC: torch.Tensor) -> torch.Tensor:
        """``[P, c]`` -> ``[T, shards * c]``: the inverse of ``to_channels``."""

    def replicate(self, v_TC: torch.Tensor) -> torch.Tensor:
        """``[T, c]`` -> ``[P, c]``: every token of the pack, every channel, pack order."""


class LocalExchange:
    """One process holding the whole pack: every exchange is the identity."""

    shards, shard = 1, 0

    def _same(self, t: torch.Tensor) -> torch.Tensor:
        return t

    to_channels = to_tokens = replicate = _same


@dataclass(frozen=True)
class ScanPlan:
    """Index tensors of one pack and chunk length (built once, reused by every layer).

    Chunks are ordered chunk-index-major (every sequence's chunk 0 in pack order, then chunk 1, ...),
    so the carry's step k is the next ``sizes[k]`` chunks; ``keep[k]`` picks, among the sequences
    alive at step k - 1, those with a chunk k."""

    grid_GL: torch.Tensor  # pack index of each chunk slot (0 where the slot is past the sequence)
    valid_GL: torch.Tensor  # bool: the slot holds a token of the chunk's sequence
    slot_P: torch.Tensor  # flat slot of each pack token (the inverse of ``grid_GL``)
    sizes: tuple[int, ...]
    keep: tuple[torch.Tensor, ...]


def _build_plan(cu: np.ndarray, chunk: int, device) -> ScanPlan:
    lens = np.diff(cu)
    n_chunks = -(-lens // chunk)
    seq = np.repeat(np.arange(lens.size), n_chunks)
    k = np.arange(seq.size) - np.repeat(np.cumsum(n_chunks) - n_chunks, n_chunks)
    order = np.lexsort((seq, k))  # chunk-index major, then pack order
    seq, k = seq[order], k[order]
    grid = cu[seq][:, None] + k[:, None] * chunk + np.arange(chunk)
    valid = grid < cu[seq + 1][:, None]
    grid = np.where(valid, grid, 0)
    slot = np.empty(int(cu[-1]), dtype=np.int64)
    slot[grid[valid]] = np.flatnonzero(valid)
    keep, alive = [], np.arange(lens.size)
    for step in range(int(n_chunks.max(initial=0))):
        keep.append(np.flatnonzero(n_chunks[alive] > step))
        alive = alive[keep[-1]]
    return ScanPlan(*(torch.as_tensor(a, device=device) for a in (grid, valid, slot)),
                    tuple(len(x) for x in keep), tuple(torch.as_tensor(x, device=device) for x in keep))


@dataclass(frozen=True)
class SequenceLayout:
    """The pack's sequences in pack order by their padded offsets (``cu_seqlens_padded``); padding, if
    any, follows each sequence's real tokens. Caches one ``ScanPlan`` per (chunk, device), so build one
    layout per micro-batch and hand it to every layer."""

    cu_seqlens_padded: tuple[int, ...]
    _cache: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    def __post_init__(self):
        cu = tuple(int(c) for c in self.cu_seqlens_padded)
        if not cu or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            raise SSMError(f"cu_seqlens_padded must start at 0 and never decrease, got {list(cu[:6])}...; "
                           "pass harness.plan.thd.pack(...).cu_seqlens_padded")
        object.__setattr__(self, "cu_seqlens_padded", cu)

    @property
    def total(self) -> int:
        return self.cu_seqlens_padded[-1]

    def plan(self, chunk: int, device) -> ScanPlan:
        """The chunked scan's indices for chunks of ``chunk`` tokens."""
        key = ("plan", chunk, str(torch.device(device)))
        if key not in self._cache:
            self._cache[key] = _build_plan(np.asarray(self.cu_seqlens_padded, dtype=np.int64), chunk, device)
        return self._cache[key]

    def positions(self, device) -> torch.Tensor:
        """``[P]``: each token's position inside its sequence (the conv's per-sequence mask)."""
        key = ("pos", str(torch.device(device)))
        if key not in self._cache:
            cu = np.asarray(self.cu_seqlens_padded, dtype=np.int64)
            self._cache[key] = torch.as_tensor(np.arange(cu[-1]) - np.repeat(cu[:-1], np.diff(cu)), device=device)
        return self._cache[key]


def scan_layout(seqs: SequenceLayout) -> SequenceLayout:
    """The sequences the scan resets its state at: the pack's own (a seam: ``harness.faults`` re-creates
    a kernel fed the pack without its sequence boundaries, whose state runs on into the next sequence)."""
    return seqs


def segsum(a_XL: torch.Tensor) -> torch.Tensor:
    """``out[..., t, s] = sum(a[..., s + 1 : t + 1])`` for s <= t, -inf above the diagonal. Summed
    per (t, s) from a masked cumulative sum, not as ``cumsum[t] - cumsum[s]``: the difference of two
    large negative sums loses the small decays of long chunks."""
    L = a_XL.shape[-1]
    strict = torch.ones(L, L, dtype=torch.bool, device=a_XL.device).tril(-1)
    s = a_XL[..., :, None].expand(*a_XL.shape, L).masked_fill(~strict, 0).cumsum(-2)
    return s.masked_fill(strict.T, -math.inf)


def _carry(states_GhDN: torch.Tensor, decay_Gh: torch.Tensor, plan: ScanPlan) -> torch.Tensor:
    """Each chunk's initial state: zero at a sequence's first chunk, else the previous chunk's final
    state. Sequential over chunk index k, batched over the sequences that have a chunk k."""
    if not plan.keep:
        return states_GhDN
    # split, not slices: each slice's backward would fill a whole [G, h, D, N] (quadratic in G)
    steps = zip(plan.keep, states_GhDN.split(plan.sizes), decay_Gh.split(plan.sizes))
    state, inits = states_GhDN.new_zeros((plan.sizes[0], *states_GhDN.shape[1:])), []
    for k, (keep, new, decay) in enumerate(steps):
        state = state[keep] if k else state
        inits.append(state)
        state = state * decay[:, :, None, None] + new
    return torch.cat(inits)


def chunked_scan(x_PHD, dt_PH, A_H, B_PN, C_PN, D_H, seqs: SequenceLayout, chunk: int) -> torch.Tensor:
    """The selective scan of every sequence (see the module docstring), chunked; returns ``y_PHD``.
    Cost: per head ~P (L D + 2 D N) multiply-adds (within-chunk outputs, chunk states, carried-state
    outputs) plus P L N for C B^T, shared by the heads; P h L decay entries in memory; and
    ceil(longest sequence / L) sequential carry steps of [sequences, h, D, N] each."""
    plan = seqs.plan(chunk, x_PHD.device)
    g = plan.grid_GL
    dt = dt_PH[g] * plan.valid_GL[..., None]  # [G, L, h]; 0 past the sequence: no decay, no input
    xdt = x_PHD[g] * dt[..., None]
    a_GhL = (dt * A_H).transpose(1, 2)
    decay = segsum(a_GhL).exp()  # [G, h, L, L]: decay from slot s to slot t
    B, C = B_PN[g], C_PN[g]
    y = torch.einsum("gts,ghts,gshd->gthd", torch.einsum("gtn,gsn->gts", C, B), decay, xdt)
    states = torch.einsum("ghs,gshd,gsn->ghdn", decay[:, :, -1, :], xdt, B)
    init = _carry(states, a_GhL.sum(-1).exp(), plan)
    y = y + torch.einsum("gtn,ghdn->gthd", C, init) * a_GhL.cumsum(-1).exp().transpose(1, 2)[..., None]
    return y.flatten(0, 1)[plan.slot_P] + D_H[:, None] * x_PHD


def reference_scan(x_PHD, dt_PH, A_H, B_PN, C_PN, D_H, seqs: SequenceLayout) -> torch.Tensor:
    """The scan as a plain loop over tokens, state reset per sequence (the tests' oracle)."""
    cu, ys = seqs.cu_seqlens_padded, []
    for a, b in zip(cu[:-1], cu[1:]):
        s = x_PHD.new_zeros((*x_PHD.shape[1:], B_PN.shape[1]))
        for t in range(a, b):
            s = torch.exp(dt_PH[t] * A_H)[:, None, None] * s + (dt_PH[t][:, None] * x_PHD[t])[..., None] * B_PN[t]
            ys.append(s @ C_PN[t] + D_H[:, None] * x_PHD[t])
    return torch.stack(ys) if ys else x_PHD.clone()


def causal_conv(u_PC, weight_CK, bias_C, seqs: SequenceLayout) -> torch.Tensor:
    """Depthwise causal conv (``nn.Conv1d(groups=C, padding=K - 1)`` then the first P outputs) that
    starts afresh at every sequence: tap j reads ``u[p - j]`` only while p - j is in p's sequence."""
    pos = seqs.positions(u_PC.device)[:, None]
    K, P = weight_CK.shape[1], u_PC.shape[0]
    out = bias_C + u_PC * weight_CK[:, K - 1]
    for j in range(1, K):
        shifted = F.pad(u_PC, (0, 0, j, 0))[:P]
        out = out + shifted.masked_fill(pos < j, 0) * weight_CK[:, K - 1 - j]
    return out


class SSMMixer(nn.Module):
    """The mixer: ``forward(x_TE, seqs, exchange=None) -> [T, E]`` (see the module docstring)."""

    def __init__(self, c: SSMConfig):
        super().__init__()
        self.c, Di, N, H = c, c.inner, c.state, c.heads
        self.in_proj = nn.Linear(c.hidden, 2 * Di + H, bias=False)  # z, x, dt: split by heads under TP
        self.bc_proj = nn.Linear(c.hidden, 2 * N, bias=False)  # B, C: one group, read by every head
        self.conv_x_weight, self.conv_x_bias = nn.Parameter(torch.empty(Di, c.conv)), nn.Parameter(torch.empty(Di))
        self.conv_bc_weight, self.conv_bc_bias = nn.Parameter(torch.empty(2 * N, c.conv)), nn.Parameter(torch.empty(2 * N))
        self.dt_bias, self.A_log, self.D = (nn.Parameter(torch.empty(H)) for _ in range(3))
        self.norm_weight = nn.Parameter(torch.ones(Di)) if c.norm else None
        self.out_proj = nn.Linear(Di, c.hidden, bias=False)
        self._init(torch.Generator().manual_seed(c.seed))

    @torch.no_grad()
    def _init(self, gen: torch.Generator) -> None:
        """Mamba-2's init from one CPU generator (identical weights on every rank and machine)."""
        def uniform(p, lo, hi):
            p.copy_(torch.rand(p.shape, generator=gen) * (hi - lo) + lo)
        self.set_projections(torch.randn(self.projection_shape, generator=gen) * 0.02)
        self.out_proj.weight.copy_(torch.randn(self.out_proj.weight.shape, generator=gen) * 0.02)
        bound = 1 / math.sqrt(self.c.conv)
        for p in (self.conv_x_weight, self.conv_x_bias, self.conv_bc_weight, self.conv_bc_bias):
            uniform(p, -bound, bound)
        lo, hi = (math.log(v) for v in self.c.dt_range)
        uniform(self.dt_bias, lo, hi)
        dt = self.dt_bias.exp().clamp_min(1e-4)
        self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # softplus(dt_bias) = dt
        uniform(self.A_log, 1.0, 16.0)
        self.A_log.log_()
        self.D.fill_(1.0)

    @property
    def projection_shape(self) -> tuple[int, int]:
        """The input projections as one matrix: rows z, x (Di), B, C (N each), dt (H) - Mamba's ``in_proj`` layout,
        which initialisation draws whole (``set_projections``) so that the split into ``in_proj`` and ``bc_proj``
        leaves every weight as it was drawn."""
        return 2 * self.c.inner + 2 * self.c.state + self.c.heads, self.c.hidden

    @torch.no_grad()
    def set_projections(self, w: torch.Tensor) -> None:
        """Set ``in_proj`` (z, x, dt) and ``bc_proj`` (B, C) from one ``projection_shape`` matrix."""
        Di, N = self.c.inner, self.c.state
        self.in_proj.weight.copy_(torch.cat([w[:2 * Di], w[2 * Di + 2 * N:]]))
        self.bc_proj.weight.copy_(w[2 * Di:2 * Di + 2 * N])

    @property
    def local_heads(self) -> int:
        """The heads this module keeps: H, or H / tp of a TP rank's shard."""
        return self.A_log.shape[0]

    def heads_of(self, exchange) -> slice:
        """This shard's heads (of the module's own ``local_heads``); refuses a shard count that does not divide them."""
        H, S = self.local_heads, exchange.shards
        if H % S:
            raise SSMShardError(f"heads H={H} is not divisible by the CP size cp={S}: each CP rank scans "
                                f"H / cp whole heads; choose heads a multiple of {S} or a CP block whose size "
                                f"divides {H}")
        h = H // S
        return slice(exchange.shard * h, (exchange.shard + 1) * h)

    def forward(self, x_TE: torch.Tensor, seqs: SequenceLayout, exchange: ChannelExchange | None = None, tp=None):
        """``tp``: the step's tensor parallelism when the module keeps a TP shard of its heads (module docstring)."""
        ex = exchange or LocalExchange()
        hs = self.heads_of(ex)
        c, S, H = self.c, ex.shards, self.local_heads
        Di = H * c.head_dim
        if H != c.heads and tp is None:
            raise SSMShardError(f"this mixer keeps {H} of {c.heads} heads (a tensor-parallel shard) but was called "
                                "without the step's tensor parallelism: pass tp= (it would return partial sums)")
        xin = x_TE if tp is None else tp.enter(x_TE)
        z, x, dt = self.in_proj(xin).split([Di, Di, H], dim=-1)
        bc = self.bc_proj(xin)
        u = torch.cat([x.unflatten(-1, (S, -1)), dt.unflatten(-1, (S, -1))], dim=-1).flatten(1)  # shard-major
        x_Pc, dt_Ph = ex.to_channels(u).split([Di // S, H // S], dim=-1)
        bc_P = ex.replicate(bc)
        if x_Pc.shape[0] != seqs.total:
            raise SSMError(f"the exchange gave {x_Pc.shape[0]} pack tokens but seqs holds {seqs.total}; build the "
                           "exchange and the SequenceLayout from the same cu_seqlens_padded")
        y_Pc = self._mix(x_Pc, dt_Ph, bc_P, seqs, hs)
        y = ex.to_tokens(y_Pc) * F.silu(z)
        if self.norm_weight is not None and tp is None:
            y = F.rms_norm(y, (c.inner,), self.norm_weight, 1e-6)
        elif self.norm_weight is not None:  # the mean square over every TP rank's channels
            square = tp.channel_sum(y.pow(2).sum(-1, keepdim=True))
            y = y * torch.rsqrt(square / c.inner + 1e-6) * self.norm_weight
        return self.out_proj(y) if tp is None else tp.leave(self.out_proj(y))

    def _mix(self, x_Pc, dt_Ph, bc_P, seqs: SequenceLayout, hs: slice) -> torch.Tensor:
        """Conv and scan of heads ``hs`` over the whole pack (pack order): ``[P, h * D]``. Under bf16
        autocast they run in fp32 (as Mamba's kernels do: a scan's decays compound over thousands of
        steps); the result is cast back to the input's dtype."""
        if torch.is_autocast_enabled(x_Pc.device.type) or x_Pc.dtype in (torch.bfloat16, torch.float16):
            with torch.autocast(x_Pc.device.type, enabled=False):
                return self._mix(x_Pc.float(), dt_Ph.float(), bc_P.float(), seqs, hs).to(x_Pc.dtype)
        c, ch = self.c, slice(hs.start * self.c.head_dim, hs.stop * self.c.head_dim)
        x = F.silu(causal_conv(x_Pc, self.conv_x_weight[ch], self.conv_x_bias[ch], seqs))
        B, C = F.silu(causal_conv(bc_P, self.conv_bc_weight, self.conv_bc_bias, seqs)).split(c.state, dim=-1)
        dt = F.softplus(dt_Ph + self.dt_bias[hs])
        y = chunked_scan(x.unflatten(-1, (-1, c.head_dim)), dt, -self.A_log[hs].exp(), B, C, self.D[hs],
                         scan_layout(seqs), c.chunk)
        return y.flatten(1)
