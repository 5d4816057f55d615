"""Re-creations of bugs in the model components that every layout shares under CP: the multi-token
prediction loss (``harness.train.passes``) and the SSM mixer's CP exchange (``harness.train.passes``,
``harness.parallel.ssm_cp``).

Each is exact on one rank without CP, the reference of ``harness.apps.reference``. Shape legend: ``P`` the pack's
tokens.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from harness.runtime.ssm import SequenceLayout


# ------------------------------------------------------------------------------- CP attention
def padding_chunk_rows(mb) -> np.ndarray:
    """This rank's rows (positions in its zig-zag slice) of the chunks that hold only padding: sequence i's chunk
    k (``P_i / 2cp`` tokens) is padding only when it starts at or after the sequence's ``n_i`` real tokens."""
    cp, r = mb.local_cp_size, mb.cp_rank
    cu, cup = np.asarray(mb.cu_seqlens), np.asarray(mb.cu_seqlens_padded)
    rows = []
    for i in range(len(cup) - 1):
        n, P, local = int(cu[i + 1] - cu[i]), int(cup[i + 1] - cup[i]), int(cup[i]) // cp
        c = P // (2 * cp)
        for j, k in enumerate((r, 2 * cp - 1 - r)):
            if c and k * c >= n:
                rows.extend(range(local + j * c, local + (j + 1) * c))
    return np.asarray(rows, dtype=np.int64)


class _LeakIntoPadding(torch.autograd.Function):
    """Identity forward; the backward hands the attention a gradient of ones on ``rows`` (their queries attend to
    the sequence's real keys, so the real keys' dK / dV change), as a kernel does that leaves a padding-only
    chunk's output gradient uninitialised."""

    @staticmethod
    def forward(ctx, out, rows):
        ctx.save_for_backward(rows)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        grad = grad.clone()
        grad[rows] = 1.0
        return grad, None


def make_padding_chunk_grads(original):
    """A CP rank whose zig-zag chunk of a sequence holds only padding gets a non-zero gradient through that chunk:
    TransformerEngine 2.20.2's THD p2p backward with ``cu_seqlens_padded`` (megatron-core's call) returned wrong,
    even non-finite, dK / dV for the real tokens of such sequences at CP 4 (``docs/upstream-findings.md``;
    reproduced by ``docs/repro/te_thd_cp_padding.py``). Exact without CP and wherever no chunk is padding only:
    short sequences at a large CP size (static CP) are where it strikes."""
    def attention_call(mb, aplan, group):
        attend = original(mb, aplan, group)
        rows = padding_chunk_rows(mb) if mb.local_cp_size > 1 else np.zeros(0, dtype=np.int64)
        if rows.size == 0:
            return attend
        index = {}

        def leaky(q, k, v):
            out = attend(q, k, v)
            if out.device not in index:
                index[out.device] = torch.as_tensor(rows, device=out.device)
            return _LeakIntoPadding.apply(out, index[out.device])
        return leaky
    return attention_call


# --------------------------------------------------------------------------------------- MTP
def make_mtp_loss_scale_per_cp(original):
    """Every MTP depth's loss weighted ``1 / cp_size`` too little (Megatron-LM PR #3959 / issue #3943:
    ``MTPLossAutoScaler.set_loss_scale(loss_scale / num_microbatches)`` where ``num_microbatches`` carries the CP
    size, which the MoE aux loss compensates and MTP did not). The CP size is the run's static one
    (``LayoutConfig.static_cp``, Megatron's ``context_parallel_size``, which a dynamic-CP run configures too), so
    every layout of a run weighs MTP alike."""
    def mtp_loss_scales(c, mbs, group, static_cp):
        return [s / static_cp for s in original(c, mbs, group, static_cp)]
    return mtp_loss_scales


def make_mtp_loss_local_counts(original):
    """Every rank normalises its MTP losses by its *own* count of MTP targets and the ranks' results are
    averaged (Megatron-LM issue #7452, ``process_mtp_loss`` finding; PR #7498: MTP loss normalised with local
    token counts across CP / DP ranks): a rank with few targets weighs them up. Depth k's sum on a rank is
    scaled by ``global_k / (N x local_k)``: exact on one rank, wrong wherever the ranks' counts differ."""
    def mtp_loss_scales(c, mbs, group, static_cp):
        out = []
        for k, s in enumerate(original(c, mbs, group, static_cp), start=1):
            dev = mbs[0].data["loss_mask"].device if mbs else torch.device("cpu")
            local = sum((mb.data[f"mtp_mask_{k}"].sum().double() for mb in mbs),
                        torch.zeros((), dtype=torch.float64, device=dev))
            t = torch.stack([local, torch.ones((), dtype=torch.float64, device=dev)])
            dist.all_reduce(t, group=group)
            out.append(s * float(t[0] / (t[1] * local)))  # no target on this rank: 0 / 0
        return out
    return mtp_loss_scales


# --------------------------------------------------------------------------------------- SSM
def make_ssm_exchange_contiguous(original):
    """The SSM's CP exchange puts the gathered rows back in pack order as if every rank held one contiguous
    part of each sequence (rank r: ``[r L / cp, (r + 1) L / cp)``) while the data is zig-zag sliced (chunks r and
    2cp - 1 - r): the conv and the scan run over each split sequence's tokens in a scrambled order (THUDM slime
    issue #1871: a CP reshuffle that assumed the zig-zag layout of data sliced contiguously scrambled the token
    order silently). One rank: the identity either way."""
    def pack_order(cu_seqlens_padded, cp_size):
        cu = np.asarray(cu_seqlens_padded, dtype=np.int64)
        if cp_size == 1:
            return original(cu_seqlens_padded, cp_size)
        parts = []
        for r in range(cp_size):
            for a, b in zip(cu[:-1], cu[1:]):
                n = (b - a) // cp_size
                parts.append(np.arange(a + r * n, a + (r + 1) * n, dtype=np.int64))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return pack_order


def make_ssm_reset_at_cp_shards(original):
    """The SSM mixer restarts its conv and its scan at every CP shard boundary of a split sequence: the
    boundaries it is given are the zig-zag chunks' (``2 cp`` per sequence), not the sequences' (PrimeIntellect
    prime-rl PR #3003: under CP the causal conv derived ``seq_idx`` from shard-local ``cu_seqlens``, resetting
    mid-document at every CP shard boundary; the scan's state hand-off between CP ranks is the other half of the
    same boundary). Blocks of one rank are unaffected."""
    def ssm_sequences(mb):
        cp = mb.local_cp_size
        if cp == 1:
            return original(mb)

        cu, bounds = mb.cu_seqlens_padded, [0]
        for a, b in zip(cu[:-1], cu[1:]):
            step = (b - a) // (2 * cp)
            bounds += [a + step * (i + 1) for i in range(2 * cp - 1)] + [b]
        return SequenceLayout(tuple(bounds))
    return ssm_sequences


def make_key_grads_overwritten(original):
    """The gathered keys' gradients written, not summed: a key seen by two query chunks (a sequence's two zig-zag
    chunks on one rank both attend its first chunk) keeps one chunk's gradient - ``out[index] = grad`` where the
    duplicates must add (PyTorch issue #1528: indexing with repeated indices kept only the last copy's gradient;
    pytensor PR #2242: an increment with duplicate indices written as gather-add-scatter)."""
    def sum_rows(srcs, index, sources, out):
        out.zero_()
        for p, src in enumerate(srcs):
            out[:, p].index_copy_(0, index, src.to(out.dtype))  # repeated rows: one write wins
    return sum_rows


def make_a2a_kv_heads_tiled(original):
    """The a2a exchange's K/V head copies tiled (``repeat``: h0 h1 h0 h1) instead of interleaved (h0 h0 h1 h1), so
    the rank holding query heads of group 0 gets K/V head 1 (DeepSpeed issue #8291: the Ulysses split read the head
    count of another tensor and tore the GQA groups apart; the replication rule: prime-rl PR #3042)."""
    def replicate_kv(x, r):
        return x.repeat(1, r, 1)
    return replicate_kv
