"""megatron-core's own dynamic (hybrid) CP behind the stack protocol: ``dcp-harness verify megatron-core``.

What runs is megatron-core's, end to end, as its training loop drives it:

- the model: ``GPTModel`` with the TransformerEngine layer spec (RoPE, TE's THD attention), a tiny configuration;
- the groups: ``parallel_state.initialize_model_parallel(..., hybrid_context_parallel=True)`` and its
  ``get_hybrid_data_context_parallel_groups``;
- the step: ``get_forward_backward_func()`` -> ``hybrid_context_parallel_forward_backward``, fed the
  ``(samples, sample_id_groups)`` pair its data iterator yields, one group per micro-batch of the harness's
  schedule (the ``balanced`` scheduler, or ``megatron-dev``: the parity mode of megatron's own scheduler);
- the CP slicing: ``megatron.core.utils.get_batch_on_this_cp_rank(..., is_hybrid_cp=True)``;
- the attention's group: ``PackedSeqParams(local_cp_size, cp_group)``, which ``TEDotProductAttention`` hands TE
  per call; the loss: ``GPTModel``'s per-token cross-entropy with ``calculate_per_token_loss``.

The stack reduces the gradients itself (a flat all-reduce over the DP x CP ranks, divided by the tokens megatron
counted), clips and steps AdamW, so what the checks compare is megatron-core's forward and backward. The one-rank
reference is the same model through megatron-core's plain (non-hybrid) schedule, without CP.

``workarounds`` (``--option workarounds=rope-cp-group,cp-stream`` or ``all``) patches upstream defects so a run
can continue past them; the stack's name in the report lists every patch in force (``WORKAROUNDS``;
``docs/upstream-findings.md``). The group each micro-batch reports is read back from TE's attention module after
its forward: the group TE actually ran in, not the one the stack meant.

Needs megatron-core >= 0.19 (Python >= 3.12), TransformerEngine and CUDA: ``preflight`` names what is missing.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from harness.plan.thd import zigzag_index_array
from harness.runtime.te_env import prefer_torch_cudnn
from harness.stack.protocol import StackContext, StackError, StepReport, StepRequest

INSTALL = ('pip install "transformer-engine[pytorch]==2.20.2" "megatron-core==0.19.2" on a CUDA machine with '
           'Python >= 3.12 (the README\'s GPU section)')
WORKAROUNDS = {
    "rope-cp-group": "RoPE of THD packs takes the micro-batch's CP group (packed_seq_params.cp_group); upstream's "
                     "attention passes the model's static CP group (transformer/attention.py), whose size is 1 "
                     "under hybrid CP",
    "cp-stream": "TEDotProductAttention.cp_stream is created before the first forward; upstream creates it only "
                 "when context_parallel_size > 1, which hybrid CP never sets, and hands TE None",
    "tail-padding": "TE's attention receives each sub-sample's padded boundaries as its real ones (the padding rides "
                    "as causal trailing tokens, kept out of the loss by the loss mask) instead of "
                    "cu_seqlens_padded: TE 2.20.2's THD p2p backward on that path corrupts dK / dV where a rank's "
                    "chunk of a sequence is padding only (docs/upstream-findings.md)",
}
COMM_TYPES = ("p2p", "all_gather", "a2a")
"""TE's CP communication types for THD (``--option cp_comm=...``; megatron-core's default is p2p)."""


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def preflight(device: str, world: int, what: str = "verify megatron-core") -> None:
    """``StackError`` (one line: what to install or pass) unless megatron-core's hybrid CP can run here (``what``:
    the command that needs it, for the message)."""
    have = _version("megatron-core")
    if sys.version_info < (3, 12):
        found = f" (found megatron-core {have})" if have else ""
        raise StackError(f"{what} needs megatron-core 0.19, which needs Python >= 3.12; this is Python "
                         f"{sys.version_info.major}.{sys.version_info.minor}{found}: {INSTALL}")
    if have is None:
        raise StackError(f"{what} needs megatron-core: {INSTALL}")
    if tuple(int(x) for x in have.split(".")[:2] if x.isdigit()) < (0, 19):
        raise StackError(f"{what} needs megatron-core >= 0.19, found {have}: {INSTALL}")
    if importlib.util.find_spec("transformer_engine") is None:
        raise StackError(f"{what} needs TransformerEngine (megatron-core's THD CP attention): {INSTALL}")
    if device != "cuda":
        raise StackError(f"{what} runs on CUDA devices only (TransformerEngine); pass --device cuda")
    if torch.cuda.device_count() < world:
        raise StackError(f"--world {world} needs {world} CUDA GPUs; this machine has {torch.cuda.device_count()}: "
                         f"pass --world {max(1, torch.cuda.device_count())}")


def _workarounds(spec) -> tuple[str, ...]:
    if spec in (None, "", "none"):
        return ()
    names = tuple(WORKAROUNDS) if spec == "all" else tuple(x.strip() for x in str(spec).split(",") if x.strip())
    unknown = [n for n in names if n not in WORKAROUNDS]
    if unknown:
        raise StackError(f"unknown megatron-core workaround {unknown[0]!r}; choose from {', '.join(WORKAROUNDS)}, "
                         "all or none")
    return names


def seqlen_bound(padded: int, mode) -> int:
    """The ``max_seqlen`` TE is handed for a sub-sample of ``padded`` tokens: its own (``"own"``), rounded up to a
    power of two (``"pow2"``: few distinct values, so the attention's compiled plans can be reused across sequences),
    or a fixed bound (an int, which must hold it)."""
    if mode == "own":
        return padded
    if mode == "pow2":
        return 1 << max(0, padded - 1).bit_length()
    if padded > mode:
        raise StackError(f"a sub-sample of {padded} tokens exceeds max_seqlen={mode}; raise it or use pow2")
    return mode


def hybrid_groups(layout, world: int, hybrid: bool = True) -> tuple[list[list[list[int]]], dict[int, int]]:
    """A schedule's micro-batches (``Schedule.layout``: blocks of ranks and sequence ids) as megatron-core's
    ``sample_id_groups`` - per group, per rank of the DP x CP domain, the sequence ids it runs, a sequence listed on
    every rank of its block - and each sequence's micro-batch. Micro-batches without work are dropped. Under hybrid
    CP megatron's schedule runs the last group's last sub-sample outside its no-sync context on every rank
    (``hybrid_cp_schedule.py``): the last group must give every rank work, so the last such group moves to the end;
    a schedule with none is a ``StackError``."""
    groups, where = [], {}
    for m, mb in enumerate(layout):
        per_rank = [[] for _ in range(world)]
        for b in mb:
            for g in b.gids:
                where[g] = m
                for r in b.ranks:
                    per_rank[r].append(g)
        if any(per_rank):
            groups.append(per_rank)
    full = [j for j, g in enumerate(groups) if all(g)]
    if hybrid and full and full[-1] != len(groups) - 1:
        groups.append(groups.pop(full[-1]))
    elif hybrid and not full:
        raise StackError("megatron-core's hybrid-CP schedule needs a micro-batch that gives every rank work (it runs "
                         "the last group's last sub-sample on every rank); this schedule has none")
    return groups, where


class MegatronCoreStack:
    """megatron-core's GPTModel and hybrid-CP step (see the module doc)."""

    sequence_passes = True
    """Every sequence of a group is its own forward and backward (``hybrid_context_parallel_forward_backward``)."""
    execution = "synchronous"
    """Every group ends with a barrier of the DP x CP domain (``hybrid_cp_schedule.py``)."""

    def __init__(self, ctx: StackContext, workarounds=None, layers: int = 2, hidden: int = 64, heads: int = 4,
                 kv_heads: int = 2, lr: float = 3e-3, cp_comm: str = "p2p", ffn: int | None = None,
                 max_seqlen="own"):
        preflight(ctx.device, ctx.world)
        if not (max_seqlen in ("own", "pow2") or (isinstance(max_seqlen, int) and max_seqlen > 0)):
            raise StackError(f"max_seqlen={max_seqlen!r}: hand TE each sub-sample's own padded length (own), it "
                             "rounded up to a power of two (pow2), or a fixed bound in tokens (a positive int)")
        self.max_seqlen = max_seqlen
        if cp_comm not in COMM_TYPES:
            raise StackError(f"unknown TE CP communication type cp_comm={cp_comm!r}; choose from {', '.join(COMM_TYPES)}")
        if ctx.dtype != "bfloat16":
            raise StackError(f"megatron-core's THD CP attention (TransformerEngine) runs in bf16, not {ctx.dtype}; "
                             "pass --dtype bfloat16")
        prefer_torch_cudnn()  # before megatron-core imports TE: TE then loads the cuDNN torch runs
        from megatron.core import parallel_state  # lazy: an optional GPU package (preflight named it)

        self.ctx, self.fixes = ctx, _workarounds(workarounds)
        self.shape = dict(layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, lr=lr, ffn=ffn or 4 * hidden)
        self.hybrid, self.cp_comm = ctx.world > 1, cp_comm
        notes = ([f"cp_comm {cp_comm}"] if cp_comm != "p2p" else []) + \
            ([f"workarounds: {', '.join(self.fixes)}"] if self.fixes else [])
        self.name = f"megatron-core {_version('megatron-core')} + TE {_version('transformer-engine')}" + \
            (f" ({'; '.join(notes)})" if notes else "")
        self.ps = parallel_state
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1,
                                                     context_parallel_size=1, hybrid_context_parallel=self.hybrid)
        self._group = None  # the CP group of the micro-batch in flight (the rope-cp-group workaround reads it)
        self._padded: dict[int, int] = {}  # sequence id -> its padded length, this step (set by _groups)
        if "rope-cp-group" in self.fixes:
            self._patch_rope()

    def _patch_rope(self) -> None:
        from megatron.core.transformer import attention  # lazy: as above

        original = attention.apply_rotary_pos_emb
        if getattr(original, "_dcp_harness", False):
            return

        def rope(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None, **kw):
            if cu_seqlens is not None and self._group is not None:
                cp_group = self._group
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale, cp_group=cp_group, **kw)

        rope._dcp_harness = True
        attention.apply_rotary_pos_emb = rope

    def build(self, seed: int) -> None:
        from megatron.core.models.gpt import GPTModel  # lazy: as above
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
        from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
        from megatron.core.transformer.transformer_config import TransformerConfig

        s = self.shape
        torch.manual_seed(seed)
        model_parallel_cuda_manual_seed(seed)
        config = TransformerConfig(
            num_layers=s["layers"], hidden_size=s["hidden"], num_attention_heads=s["heads"],
            num_query_groups=s["kv_heads"], ffn_hidden_size=s["ffn"], hidden_dropout=0.0, attention_dropout=0.0,
            use_cpu_initialization=True, params_dtype=torch.float32, enable_autocast=True,
            autocast_dtype=torch.bfloat16, calculate_per_token_loss=True, hybrid_context_parallel=self.hybrid,
            context_parallel_size=1)
        model = GPTModel(config, get_gpt_layer_with_transformer_engine_spec(), vocab_size=self.ctx.vocab,
                         max_sequence_length=1 << 16, position_embedding_type="rope")
        self.model = model.cuda()
        if "cp-stream" in self.fixes:
            from megatron.core.extensions.transformer_engine import TEDotProductAttention  # lazy: as above

            if TEDotProductAttention.cp_stream is None:
                TEDotProductAttention.cp_stream = torch.cuda.Stream()
        if self.ctx.world > 1:  # CPU initialisation is deterministic; the broadcast only makes it certain
            for p in self.model.parameters():
                dist.broadcast(p.data, 0)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=s["lr"], betas=(0.9, 0.95), weight_decay=0.0)
        self.attention = [m for m in self.model.modules() if type(m).__name__ == "TEDotProductAttention"]
        for m in self.attention:  # what megatron-core hands TE with each micro-batch's group (forward)
            m.cp_comm_type = self.cp_comm

    def sharpen(self, scale: float) -> None:
        """Scale the query and key rows of every layer's ``linear_qkv`` (weight and bias) by ``scale``
        (``harness.stack.protocol``: the sharp step 1); ``StackError`` when the model has none to scale."""
        s = self.shape
        scaled = 0
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name.endswith(("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias")):
                    scale_grouped_qkv(p, s["kv_heads"], s["heads"] // s["kv_heads"], s["hidden"] // s["heads"], scale)
                    scaled += name.endswith("weight")
        if scaled != s["layers"]:
            raise StackError(f"sharpen found {scaled} self_attention.linear_qkv weights in a {s['layers']}-layer "
                             "GPTModel; megatron-core's parameter names changed: update harness.stack.megatron_core")

    # -- samples: one per sequence, megatron's hybrid-CP sub-samples ------------------------------------------
    @staticmethod
    def _sample(seq: np.ndarray, cp: int) -> dict:
        n = len(seq) - 1
        padded = padded_length(n, cp)
        dev = torch.device("cuda")
        tokens = torch.zeros(1, padded, dtype=torch.int64, device=dev)
        labels = torch.zeros(1, padded, dtype=torch.int64, device=dev)
        t = torch.as_tensor(seq, dtype=torch.int64, device=dev)
        tokens[0, :n], labels[0, :n] = t[:-1], t[1:]
        mask = torch.zeros(1, padded, dtype=torch.float32, device=dev)
        mask[0, :n] = 1
        return {"tokens": tokens, "labels": labels, "loss_mask": mask,
                "position_ids": torch.arange(padded, device=dev)[None],
                "cu_seqlens": torch.tensor([0, n], dtype=torch.int32, device=dev),
                "cu_seqlens_padded": torch.tensor([0, padded], dtype=torch.int32, device=dev),
                "max_seqlen": torch.tensor([padded], dtype=torch.int32, device=dev)}

    def _forward(self, record: dict, data_iterator, model):
        """megatron's ``forward_step_func``: one sub-sample, sliced for its CP group by megatron's own function."""
        from megatron.core.packed_seq_params import PackedSeqParams  # lazy: as above
        from megatron.core.utils import get_batch_on_this_cp_rank

        sample = dict(next(data_iterator))
        gid = int(sample.pop("gid"))
        local = int(sample["local_cp_size"].item()) if "local_cp_size" in sample else 1
        if self.hybrid:
            sample = get_batch_on_this_cp_rank(sample, is_hybrid_cp=True,
                                               hybrid_cp_group_func=self.ps.get_hybrid_data_context_parallel_groups)
        group = sample.get("hybrid_cp_group") if local > 1 else None
        self._group = group
        cu, cup = sample["cu_seqlens"], sample["cu_seqlens_padded"]
        padded = self._padded[gid]  # known on the host: reading cup[-1] would synchronise once per sequence
        record["padded"].append((gid, padded, cup[-1]))  # checked once, after the step
        if "tail-padding" in self.fixes:
            cu = cup
        bound = seqlen_bound(padded, self.max_seqlen)
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cup,
                              cu_seqlens_kv_padded=cup, max_seqlen_q=bound, max_seqlen_kv=bound,
                              local_cp_size=local if self.hybrid else None, cp_group=group)
        out = model(sample["tokens"], sample["position_ids"], None, labels=sample["labels"], packed_seq_params=psp)
        held = {getattr(m, "cp_group", None) for m in self.attention}
        used = [tuple(dist.get_process_group_ranks(g)) if g is not None else (self.ctx.rank,) for g in held]
        # TE's attention modules of one forward hold one group; if they do not, report -1 and the ranks of all
        record["groups"][gid] = used[0] if len(used) == 1 else (-1, *sorted({r for u in used for r in u}))
        cp_rank = dist.get_rank(group) if group is not None else 0
        pos = zigzag_index_array(np.array([0, padded]), local, cp_rank)
        return out, partial(self._loss, record, gid, torch.as_tensor(pos), sample["loss_mask"])

    @staticmethod
    def _loss(record: dict, gid: int, pos: torch.Tensor, loss_mask: torch.Tensor, output):
        losses, mask = output.float().reshape(-1), loss_mask.reshape(-1)
        total = (losses * mask).sum()
        tokens = mask.sum()
        record["n"].append(tokens.detach())
        record["ce"].append(total.detach())
        if record["want_tokens"]:  # per-token losses only when asked (step 1): a Python list per token is slow
            keep = mask.bool().cpu()
            record["tokens"] += [(gid, int(p), float(c)) for p, c in zip(pos[keep].tolist(),
                                                                         losses.detach().cpu()[keep].tolist())]
        return total, tokens.to(torch.int), {"lm loss": torch.stack([total.detach(), tokens.float()])}

    def _groups(self, request: StepRequest) -> tuple[list, dict, dict]:
        """(sample_id_groups per micro-batch, every sample by sequence id, sequence id -> micro-batch)."""
        groups, where = hybrid_groups(request.schedule.layout, self.ctx.world, self.hybrid)
        sizes = {g: b.size for mb in request.schedule.layout for b in mb for g in b.gids}
        samples = {g: {**self._sample(request.batch[g], sizes[g]), "gid": g} for g in where}
        self._padded = {g: padded_length(len(request.batch[g]) - 1, sizes[g]) for g in where}
        return groups, samples, where

    def step(self, request: StepRequest) -> StepReport:
        from megatron.core.pipeline_parallel import get_forward_backward_func  # lazy: as above

        me = self.ctx.rank
        groups, samples, where = self._groups(request)
        record = {"groups": {}, "tokens": [], "n": [], "ce": [], "padded": [],
                  "want_tokens": "token_losses" in request.want}
        if self.hybrid:
            data, n = iter([(samples, groups)]), len(groups)
        else:
            order = [g for grp in groups for g in grp[me]]
            data, n = iter([samples[g] for g in order]), len(order)
        self.opt.zero_grad(set_to_none=False)
        get_forward_backward_func()(forward_step_func=partial(self._forward, record), data_iterator=data,
                                    model=self.model, num_microbatches=n, seq_length=0, micro_batch_size=1,
                                    forward_only=False)
        self._group = None
        params = [p for p in self.model.parameters() if p.requires_grad]
        flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().reshape(-1)
                          for p in params])
        zero = torch.zeros((), device="cuda")
        counts = torch.stack([torch.stack(record["n"]).sum() if record["n"] else zero,
                              torch.stack(record["ce"]).sum() if record["ce"] else zero]).double()
        if self.ctx.world > 1:
            dist.all_reduce(flat)
            dist.all_reduce(counts)
        total = float(counts[0])
        check_padded(record["padded"])
        flat /= total
        for p, g in zip(params, flat.split([p.numel() for p in params])):  # the reduced gradients, in place
            p.grad = g.view_as(p).to(p.dtype).clone()
        grad_norm = float(torch.linalg.vector_norm(flat, dtype=torch.float64))
        gradients = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()} \
            if "gradients" in request.want else None
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        self.opt.step()
        cp_groups = {}
        for g, used in record["groups"].items():  # the sequences of one micro-batch ran in one group, or -1
            m = where[g]
            cp_groups[m] = used if cp_groups.get(m, used) == used else (-1, *used)
        return StepReport(loss=float(counts[1]) / total, grad_norm=grad_norm, tokens=int(round(total)),
                          gradients=gradients, token_losses=record["tokens"] if record["want_tokens"] else None,
                          cp_groups=cp_groups,
                          extra={"stack": self.name})

    def close(self) -> None:
        if self.ps.model_parallel_is_initialized():
            self.ps.destroy_model_parallel()


def scale_grouped_qkv(t: torch.Tensor, groups: int, per_group: int, head_dim: int, scale: float) -> None:
    """Scale, in place, the query and key rows of megatron-core's fused QKV projection ``t`` (a weight of rows x
    hidden, or a bias): its rows are ``groups`` query groups of ``per_group`` query heads, one key head and one value
    head, ``head_dim`` rows each (``SelfAttention.get_query_key_value_tensors``: [ng, (np/ng + 2) * hn])."""
    if t.shape[0] != groups * (per_group + 2) * head_dim:
        raise StackError(f"linear_qkv has {t.shape[0]} rows, not {groups} groups x ({per_group} + 2) heads x "
                         f"{head_dim}: megatron-core's QKV layout changed")
    t.view(groups, per_group + 2, head_dim, *t.shape[1:])[:, :per_group + 1] *= scale


def padded_length(n: int, cp: int) -> int:
    """Tokens of a sequence of ``n`` padded for CP ``cp``: unpadded at CP 1, else to a multiple of ``2 cp`` (zig-zag
    halves of equal length on every rank)."""
    return n if cp == 1 else -(-n // (2 * cp)) * 2 * cp


def check_padded(seen: list) -> None:
    """Every sub-sample's padded length as the harness built it equals the ``cu_seqlens_padded[-1]`` megatron-core
    handed the forward (one synchronisation for the whole step); raises ``RuntimeError`` naming the first that
    differs."""
    if not seen:
        return
    got = torch.stack([t.reshape(()).to(torch.int64) for _, _, t in seen]).tolist()
    for (gid, want, _), g in zip(seen, got):
        if g != want:
            raise RuntimeError(f"sequence {gid}: megatron-core's cu_seqlens_padded ends at {g}, the harness padded it "
                               f"to {want}: the sample reached the forward changed")


def make(ctx: StackContext, **options) -> MegatronCoreStack:
    return MegatronCoreStack(ctx, **options)


make.preflight = preflight
