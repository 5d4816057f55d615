"""The model side of a training step's passes: micro-batch m through one of the rank's model chunks.

Per micro-batch the CP operations are built once - the attention (its plan and the block's group), the
SSM mixing (``harness.runtime.ssm`` with the pack's sequence layout and the block's
``harness.parallel.ssm_cp.CPChannelExchange``), the RoPE tables - and handed to the model on every call.
A module must use the ones of the micro-batch it is running: each operation checks, before any
collective, that it belongs to the current micro-batch (the call audit); a module that kept an earlier
micro-batch's operations (and group) stops every rank at once with ``CallAuditError`` (a ``GroupAuditError``).

The last chunk computes the LM loss and, with multi-token prediction, depth k's loss on the columns
made per sequence before the CP split (``mtp_columns``): ``loss = LM + mtp_weight / D x sum_k MTP_k``.

The functions marked as seams are looked up when a pass runs; ``harness.faults`` replaces one for the
length of a run to re-create a real integration bug.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from harness.parallel.audit import CallAuditError, block_ranks
from harness.parallel.cp_attention import CPAttentionPlan, cp_attention
from harness.parallel.expert_parallel import ExpertDispatch, TokenSlice
from harness.parallel.reroute import ThdMicroBatch
from harness.parallel.ssm_cp import CPChannelExchange
from harness.runtime.balance import BalanceError, SequenceBalance
from harness.runtime.model import Rotary
from harness.runtime.ssm import SequenceLayout
from harness.train import pipeline


# ---------------------------------------------------------------------------------------- seams
def rope_positions(mb: ThdMicroBatch) -> torch.Tensor:
    """RoPE position ids of the rank's slice: each token's position in *its sequence* (carried from
    the sample through padding and the zig-zag slice), not its place in the rank's buffer."""
    return mb.data["position_ids"]


def labels_for(mb: ThdMicroBatch) -> torch.Tensor:
    """Next-token labels of the rank's slice, shifted per sequence *before* the CP split."""
    return mb.data["labels"]


def attention_plan(mb: ThdMicroBatch, device, exchange: str) -> CPAttentionPlan:
    """The CP attention plan of a micro-batch: its sequences' boundaries (``cu_seqlens_padded``)."""
    return CPAttentionPlan.build(mb.cu_seqlens_padded, mb.local_cp_size, mb.cp_rank, device, exchange=exchange)


def attention_call(mb: ThdMicroBatch, aplan: CPAttentionPlan, group):
    """The attention every layer of micro-batch ``mb`` calls: ``(q, k, v) -> out`` on the rank's slice, run with
    the micro-batch's plan and CP group (a seam: ``harness.faults`` re-creates a CP kernel whose padding-only
    chunk hands gradients back to the real keys)."""
    return lambda q, k, v: cp_attention(q, k, v, aplan, group)


def mtp_columns(mb: ThdMicroBatch, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Depth k's input tokens ``t_{i+k}``, labels ``t_{i+k+1}`` and mask on the rank's slice: shifted
    per sequence before the CP split (``harness.train.trainer``), so they travel with their tokens."""
    return mb.data[f"mtp_tokens_{k}"], mb.data[f"mtp_labels_{k}"], mb.data[f"mtp_mask_{k}"]


def mtp_loss_scales(c, mbs: list[ThdMicroBatch], group, static_cp: int) -> list[float]:
    """The weight of each MTP depth's summed cross-entropy in the loss: ``mtp_weight / D`` for every depth. The
    summed loss is divided by the global batch's token count like the LM loss (``harness.train.trainer``), so the
    weights depend neither on the run's static CP size ``static_cp`` nor on how the step's micro-batches ``mbs``
    spread the tokens over the DP x CP ranks of ``group`` (a seam: ``harness.faults`` re-creates both mistakes)."""
    return [c.mtp_weight / c.mtp_depth] * c.mtp_depth if c.mtp_depth else []


def ssm_sequences(mb: ThdMicroBatch) -> SequenceLayout:
    """The sequences the SSM mixer's conv and scan run over: the pack's own (``cu_seqlens_padded``), whole, on
    every CP size - the exchange hands each rank its heads of every token (a seam: ``harness.faults`` re-creates
    a mixer that restarts at the CP shards' boundaries)."""
    return SequenceLayout(tuple(mb.cu_seqlens_padded))


def balance_sequences(mb: ThdMicroBatch) -> tuple[torch.Tensor, int]:
    """Each of the rank's tokens' sequence in the pack (``0 .. S - 1``, pack order) and S: the sequences an MoE
    router's load-balancing loss balances one by one (a seam: ``harness.faults`` re-creates the pack taken for one
    sequence, Megatron-LM issue #6108)."""
    seq = mb.data["seq"]
    gids = torch.as_tensor(mb.gids, dtype=seq.dtype, device=seq.device)
    order = torch.argsort(gids)
    pos = torch.searchsorted(gids[order], seq).clamp_max(len(mb.gids) - 1)
    if not torch.equal(gids[order][pos], seq):  # a token of no sequence of the pack would join a neighbour's counts
        raise BalanceError(f"micro-batch {mb.index}: some tokens carry a sequence id outside its pack {mb.gids}")
    return order[pos], len(mb.gids)


def balance_group(ops: MicroBatchOps, m: int):
    """The group over which the routers' balance counts of micro-batch m are summed: the micro-batch's CP block, whose
    ranks hold its sequences' other tokens; None on one rank (a seam: ``harness.faults`` re-creates the static TP x CP
    group Megatron's routers summed over until its dynamic CP's fix, PR #3791)."""
    return ops.cp_groups[m] if ops.mbs[m].local_cp_size > 1 else None


def balance_tp_group(ops: MicroBatchOps):
    """Under sequence parallelism the TP group, over which the routers' balance counts are summed too: a sequence's
    rows are split over the TP ranks (a seam: ``harness.faults`` re-creates each TP rank balancing the sequences' tokens
    of its own rows, Megatron-LM PR #5996); None otherwise (every TP rank routes every row)."""
    return ops.tp.group if ops.tp is not None and ops.tp.sequence_parallel else None


# ---------------------------------------------------------------------------------- operations
class MicroBatchOps:
    """The CP operations of every micro-batch of one step on one rank, built once per micro-batch,
    each checking that it runs for the micro-batch being computed (the call audit)."""

    def __init__(self, model, groups, mbs, cp_groups, device, exchange: str, experts=None, tp=None):
        self.model, self.groups, self.mbs, self.cp_groups = model, groups, mbs, cp_groups
        self.device, self.exchange, self.current, self._cache = device, exchange, None, {}
        self.shard, self._dispatch = experts, {}  # expert parallelism: this rank's ExpertShard (else None)
        self._balance: dict[int, SequenceBalance] = {}
        self.tp = tp
        """The step's tensor parallelism (``harness.parallel.tensor_parallel.TensorParallel``), or None: the same
        for every micro-batch (its group is the rank's TP coordinate's, not a CP block's)."""

    def balance(self, m: int) -> SequenceBalance | None:
        """Micro-batch m's sequences for the MoE routers' load-balancing loss (``harness.runtime.balance``): the counts
        are summed over ``balance_group`` and ``balance_tp_group``; None when the model has no such loss."""
        if not self.model.c.aux_loss:
            return None
        if m not in self._balance:
            seq, n = balance_sequences(self.mbs[m])
            group = balance_group(self, m)
            tp = balance_tp_group(self)

            def reduce(stats, m=m, group=group, tp=tp):
                self._audit(m)
                for g in (group, tp):
                    if g is not None:
                        dist.all_reduce(stats, group=g)
                return stats
            self._balance[m] = SequenceBalance(seq, n, reduce if group is not None or tp is not None else None)
        return self._balance[m]

    def experts(self, m: int):
        """The expert dispatch of micro-batch m over the stage's DP x CP group (``harness.parallel.expert_parallel``),
        or None without expert parallelism (every expert on this rank)."""
        if self.shard is None:
            return None
        if m not in self._dispatch:
            mb = self.mbs[m]
            self._dispatch[m] = ExpertDispatch(self.shard, self.groups.group(self.shard.size),
                                               TokenSlice(tuple(mb.cu_seqlens_padded), mb.local_cp_size, mb.cp_rank),
                                               before=lambda m=m: self._audit(m))
        return self._dispatch[m]

    def of(self, m: int):
        """(attention, mixing, RoPE tables, real-token mask) of micro-batch m."""
        if m not in self._cache:
            mb, group = self.mbs[m], self.cp_groups[m]
            aplan = attention_plan(mb, self.device, self.exchange)
            attend = attention_call(mb, aplan, group)

            def attention(q, k, v, m=m):
                self._audit(m)
                return attend(q, k, v)

            built: list = []  # the SSM mixing's layout and exchange, built at its first call (SSM models only)

            def mixing(mixer, x, tp=None, m=m, mb=mb, group=group):
                self._audit(m)
                if not built:
                    built.extend((ssm_sequences(mb), None if mb.local_cp_size == 1 else CPChannelExchange(
                        group, mb.local_cp_size, mb.cp_rank, mb.cu_seqlens_padded, self.device)))
                return mixer(x, *built) if tp is None else mixer(x, *built, tp=tp)

            c = self.model.c
            self._cache[m] = (attention, mixing, Rotary(rope_positions(mb), c.hidden // c.heads, c.rope_base),
                              mb.data["loss_mask"].to(torch.float32))
        return self._cache[m]

    def prepare(self) -> MicroBatchOps:
        """Build every micro-batch's operations now (their plans' host work and copies before the first pass)."""
        for m in range(len(self.mbs)):
            self.of(m)
        return self

    def _audit(self, m: int) -> None:
        if m != self.current:  # every rank runs the same micro-batches in the same order: all raise here
            mb_now, mb_used = self.mbs[self.current], self.mbs[m]
            raise CallAuditError(self.groups.rank, self.current, m, block_ranks(self.groups, mb_used),
                                 block_ranks(self.groups, mb_now))


def model_passes(model, stage: pipeline.Stage, ops: MicroBatchOps, dtype: str, total: float, sums: dict,
                 probe=None, mtp_scales=None, routes=None) -> pipeline.ChunkPasses:
    """``ChunkPasses`` of a step: embedding on model chunk 0, the rank's layers of each chunk, the LM
    head (and the MTP depths, weighted by ``mtp_scales``: ``mtp_loss_scales``) on the last chunk. ``sums``
    collects the detached CE, MTP and aux sums. ``dtype``: ``float32``, or ``bfloat16`` (autocast). A compiled
    dense model on one chunk runs as one compiled call with the loss head inside (``TinyLM.token_losses``)
    unless per-token losses are probed. ``routes``: a ``harness.train.routes.StepRoutes`` that records the MoE
    layers' routes of every micro-batch (the tie-aware convergence rule), or None."""
    autocast = torch.autocast(ops.device.type, dtype=torch.bfloat16, enabled=dtype == "bfloat16")
    c = model.c
    if mtp_scales is None:
        mtp_scales = [c.mtp_weight / c.mtp_depth] * c.mtp_depth if c.mtp_depth else []
    fused = stage.num_chunks == 1 and probe is None and not c.mtp_depth and model.fuses_loss()

    def forward(v, m, x):
        ops.current = m
        attention, mixing, rot, real = ops.of(m)
        mb = ops.mbs[m]
        with autocast:
            if fused:
                ce, aux = model.token_losses(mb.data["tokens"], labels_for(mb), mb.data["loss_mask"], rot, attention)
                sums["ce"].add_(ce.detach().double())
                return ce, aux
            first, last = pipeline.pre_process(stage, v), stage.index(v) == stage.num_chunks - 1
            if first:
                x = model.embed_tokens(mb.data["tokens"], ops.tp)
            # sequence parallelism: between model chunks (pipeline stages) a rank's share of the rows travels
            routing = None if routes is None else routes.recorder(mb, ops.tp)
            h, aux = model.run_layers(x, rot, real, attention, layers=stage.chunks[v], mixing=mixing,
                                      experts=ops.experts(m), routing=routing, tp=ops.tp, split_in=not first,
                                      split_out=not last, balance=ops.balance(m))
            if last:
                h = _losses(model, mb, h, rot, real, attention, mixing, sums, probe, mtp_scales, ops.tp)
        sums["aux"].add_(aux.detach().double())
        return h, aux

    rows = ops.tp.size if ops.tp is not None and ops.tp.sequence_parallel else 1  # the rows a stage hands on
    return pipeline.ChunkPasses(forward=forward, num_tokens=lambda m: ops.mbs[m].data["tokens"].numel() // rows,
                                total=total, hidden=model.c.hidden, device=ops.device)


def _losses(model, mb, h, rot, real, attention, mixing, sums, probe, scales, tp=None):
    """The summed loss the backward starts from: LM cross-entropy plus the MTP depths', depth k weighted by
    ``scales[k - 1]``."""
    ce_T = model.token_ce(h, labels_for(mb), real, tp)
    if probe is not None:
        probe.add(mb, ce_T.detach())
    loss = ce_T.sum()
    sums["ce"].add_(loss.detach().double())
    depth = model.c.mtp_depth
    for k in range(1, depth + 1):
        tokens_k, labels_k, mask_k = mtp_columns(mb, k)
        real_k = mask_k.to(torch.float32)
        h = model.mtp_hidden(k, h, tokens_k, rot, real_k, attention, mixing, tp=tp)
        ce_k = model.token_ce(h, labels_k, real_k, tp).sum()
        sums["mtp"][k - 1].add_(ce_k.detach().double())
        loss = loss + scales[k - 1] * ce_k
    return loss
