"""Router replay under pipeline and context parallelism, checked end to end on every rank.

``replay_check(rank, world, cfg)`` (world = pp x cp x tp, Megatron order: TP fastest, then CP, then PP):

1. Rollout, single process on every rank: the tiny MoE with router weights W0 runs each sample alone
   in ``record`` mode; its routes, ``[tokens, layers, top_k]`` with zero rows for the dense layer, are
   what an inference engine returns.
2. The training model is the same model with its routers perturbed (the rollout/training mismatch
   R3 exists for). Each rank builds its PP stage (``harness.plan.pipeline.layer_ranges``; with ``vpp`` > 1 its
   virtual chunks, interleaved) and runs through the pipeline runtime of training (``harness.train.pipeline``: 1F1B
   or interleaved 1F1B, activations and gradients point to point); the CP ranks of a stage hold zig-zag slices of
   each THD micro-batch and run CP attention in their stage's group. The replay store of a rank is
   filled with ``harness.plan.replay.thd_routes`` for the routers of its stage, keyed by global layer, so the order in
   which the interleaved schedule visits a rank's chunks does not matter (SkyRL refuses VPP: its replay targets go to
   the rank's routers in construction order, from a layer offset that knows no virtual chunk).
   With ``ep`` the experts are sharded over the stage's CP ranks (``harness.parallel.expert_parallel``): the
   tokens go to their replayed experts' owners and back, all-to-all, in every MoE layer. With ``tp`` each block's
   heads and FFN, every expert's FFN and the vocabulary are split over the TP ranks
   (``harness.parallel.tensor_parallel``); with ``sp`` (the default under TP, as SkyRL sets it) the token rows are
   split over them too, each TP rank's router routes its ``T / tp`` rows and its store holds those
   (``harness.plan.replay.sp_rows``); without ``sp`` every TP rank routes, and replays, every row. ``ep`` with ``tp``
   (sequence parallelism only, as Megatron requires for MoE with TP): each TP coordinate's CP ranks own the experts.
3. Checks: (a) in ``replay`` mode every real token's chosen experts at every MoE layer equal the
   rollout's for that (sample, position) - looked up independently through the token's position id (under sequence
   parallelism, the rank's rows' ids);
   (b) in ``free`` mode the perturbed routers choose differently for some tokens; (c) the replayed loss
   and every parameter gradient equal a single-process replayed reference (no PP, no CP, no EP, no TP; under EP
   each expert's gradient is compared on its owner, under TP the whole gradient gathered from the shards).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from harness.data.corpus import CorpusConfig, global_batch
from harness.heartbeat import Heartbeat
from harness.parallel import sequence_parallel as seq_par
from harness.parallel import tensor_parallel as tpm
from harness.parallel.cp_attention import CPAttentionPlan, cp_attention
from harness.parallel.expert_parallel import ExpertDispatch, ExpertShard, TokenSlice, is_expert_param, shard_experts
from harness.parallel.groups import DynamicGroups, ParallelLayout
from harness.plan.pipeline import layer_ranges, routers_on_stage
from harness.plan.replay import sp_rows, thd_routes
from harness.plan.thd import pack, padding_divisor, zigzag_index_array
from harness.runtime.attention import thd_attention
from harness.runtime.model import ModelConfig, TinyLM
from harness.runtime.replay import ReplayStore, Routing
from harness.train import pipeline

MODEL = ModelConfig(experts=4, top_k=2, layers=4, seed=3)
DEFAULT = {"pp": 2, "vpp": 1, "cp": 2, "tp": 1, "sp": None, "ep": False, "sequences": 6, "microbatches": 2,
           "lengths": "uniform:min=8,max=120", "perturb": 0.05, "seed": 0, "device": "cpu", "dtype": "float32"}


def _device(cfg) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cfg["device"] == "cuda" else torch.device("cpu")


def _autocast(cfg):
    return torch.autocast(_device(cfg).type, dtype=torch.bfloat16, enabled=cfg["dtype"] == "bfloat16")


def _batch(cfg):
    seqs = global_batch(CorpusConfig(lengths=cfg["lengths"], sequences_per_batch=cfg["sequences"], seed=cfg["seed"]), 0)
    per = cfg["sequences"] // cfg["microbatches"]
    return seqs, [list(range(m * per, (m + 1) * per)) for m in range(cfg["microbatches"])]


def rollout_routes(model: TinyLM, seqs, cfg=DEFAULT) -> list[np.ndarray]:
    """Per-sample routes ``[T_i, layers, top_k]`` (zero rows for dense layers) from a record pass."""
    out, dev = [], _device(cfg)
    for i, s in enumerate(seqs):
        t = torch.as_tensor(s[:-1], device=dev)
        store = ReplayStore()
        n = len(t)
        with torch.no_grad(), _autocast(cfg):
            model.forward(t, torch.arange(n, device=dev), torch.ones(n, device=dev),
                          lambda q, k, v, n=n: thd_attention(q, k, v, [0, n]),
                          routing=Routing("record", store, microbatch=i))
        r = np.zeros((len(t), model.c.layers, model.c.top_k), dtype=np.int64)
        for layer in model.moe_layers():
            r[:, layer] = store.get(layer, i, 0).cpu().numpy()
        out.append(r)
    return out


def training_model(cfg) -> TinyLM:
    torch.manual_seed(0)
    model = TinyLM(MODEL)
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    with torch.no_grad():
        for layer in model.moe_layers():
            w = model.blocks[layer].mlp.router.weight
            w.add_(torch.randn(w.shape, generator=gen) * cfg["perturb"])
    return model.to(_device(cfg))


def _sp(cfg) -> bool:
    """Whether the token rows are split over the TP ranks (``sp``; None: whenever tp > 1, as SkyRL sets it)."""
    return cfg["tp"] > 1 if cfg["sp"] is None else bool(cfg["sp"]) and cfg["tp"] > 1


def _microbatch(seqs, gids, cp, tp=1, sp=False):
    lens = [len(seqs[g]) - 1 for g in gids]
    p = pack(lens, padding_divisor(cp_size=cp, tp_size=tp, sequence_parallel=sp))
    T = p.total_tokens
    tok, lab, pos, real, owner = (np.zeros(T, np.int64) for _ in range(5))
    for i, g in enumerate(gids):
        a, n = p.cu_seqlens_padded[i], lens[i]
        tok[a:a + n], lab[a:a + n] = seqs[g][:-1], seqs[g][1:]
        pos[a:a + n], real[a:a + n], owner[a:a + n] = np.arange(n), 1, g
    return p, tok, lab, pos, real, owner


def route_columns(stage_ranges: list[tuple[int, int]], routers: list[int]) -> list[int]:
    """The columns of the rollout's ``[tokens, layers, top_k]`` routes that feed a stage's ``routers`` (global layer
    numbers in construction order; the stage builds ``stage_ranges``, one (first layer, count) per virtual chunk): the
    layer numbers themselves, since the routes hold every layer. A seam: ``harness.faults`` re-creates a stage offset
    off by one, and the offset SkyRL derives without the virtual chunk (contiguous layers per stage)."""
    return list(routers)


def _reference(cfg, seqs, mbs, routes, total):
    """Single process, no PP / CP: replayed loss and gradients."""
    model, dev = training_model(cfg), _device(cfg)
    loss = 0.0
    for m, gids in enumerate(mbs):
        p, tok, lab, pos, real, _ = _microbatch(seqs, gids, 1)
        store = ReplayStore()
        rows = thd_routes([routes[g] for g in gids], p.cu_seqlens_padded)
        for layer in model.moe_layers():
            store.put(layer, m, 0, torch.as_tensor(rows[:, layer], device=dev))
        with _autocast(cfg):
            ce, aux = model.token_losses(*(torch.as_tensor(x, device=dev) for x in (tok, lab, real, pos)),
                                         lambda q, k, v, c=p.cu_seqlens_padded: thd_attention(q, k, v, c),
                                         routing=Routing("replay", store, microbatch=m))
        ((ce + aux) / total).backward()
        loss += float((ce + aux).detach())
    return loss / total, {n: _grad(p).clone() for n, p in model.named_parameters()}


def _grad(p: torch.Tensor) -> torch.Tensor:
    """``p``'s gradient, zeros where it has none (an expert no token of a rank reached): every rank then reduces the
    same parameters in the same order, and a parameter the run leaves untouched is compared, not skipped."""
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _microbatch_inputs(cfg, seqs, gids, m, c_rank, routes, stage_ranges, model, mode, dev, t_rank=0):
    """One rank's slice of micro-batch m and its routing (the replay store filled for its routers: under sequence
    parallelism TP rank ``t_rank``'s rows of the CP rank's)."""
    cp, tp, sp = cfg["cp"], cfg["tp"], _sp(cfg)
    p, tok, lab, pos, real, owner = _microbatch(seqs, gids, cp, tp, sp)
    idx = zigzag_index_array(p.cu_seqlens_padded, cp, c_rank)
    t = {k: torch.as_tensor(v[idx], device=dev) for k, v in (("tok", tok), ("lab", lab), ("pos", pos), ("real", real))}
    store = ReplayStore()
    rows = thd_routes([routes[g] for g in gids], p.cu_seqlens_padded, cp, c_rank)
    routed = np.arange(len(idx))  # the rows this rank's routers route
    if sp:
        rows, routed = sp_rows(rows, tp, t_rank), np.array_split(routed, tp)[t_rank]
    routers = routers_on_stage(stage_ranges, model.moe_layers())
    for layer, col in zip(routers, route_columns(stage_ranges, routers), strict=True):
        store.put(layer, m, c_rank, torch.as_tensor(rows[:, col], device=dev))
    routing = Routing(mode, store if mode == "replay" else None, microbatch=m, cp_rank=c_rank)
    return {"t": t, "owner": owner[idx], "routed": routed, "routing": routing,
            "plan": CPAttentionPlan.build(p.cu_seqlens_padded, cp, c_rank, dev),
            "tokens": TokenSlice(tuple(p.cu_seqlens_padded), cp, c_rank)}


def _mismatches(inp, routes) -> tuple[int, int]:
    """Tokens whose chosen experts differ from the rollout's, looked up independently through each
    token's (sample, position); and the tokens checked."""
    t, rows, bad, checked = inp["t"], inp["routed"], 0, 0
    keep = t["real"].bool().cpu().numpy()[rows]
    owner, pos = inp["owner"][rows][keep], t["pos"].cpu().numpy()[rows][keep]
    for layer, chosen in inp["routing"].chosen.items():
        want = np.stack([routes[g][q, layer] for g, q in zip(owner, pos)])
        got = chosen.cpu().numpy()[keep]
        bad += int((np.sort(got, 1) != np.sort(want, 1)).any(1).sum())
        checked += int(keep.sum())
    return bad, checked


def _run(mode, cfg, rank, seqs, mbs, routes, total, groups):
    """Replayed (or free) training of the micro-batches through the pipeline runtime
    (``harness.train.pipeline``: the stages' passes in 1F1B order, CP attention in each stage's group)."""
    pp, vpp, cp, tp = cfg["pp"], cfg["vpp"], cfg["cp"], cfg["tp"]
    layout = groups.layout
    p_rank, c_rank, t_rank = layout.stage(rank), layout.position(rank), layout.tp_rank(rank)
    stage = pipeline.Stage.of(MODEL.layers, pp, vpp, p_rank)
    stage_ranges = layer_ranges(MODEL.layers, pp, vpp_size=vpp)[p_rank]
    model, dev = training_model(cfg), _device(cfg)
    group = groups.group(cp)
    shard = ExpertShard(MODEL.experts, cp, c_rank) if cfg["ep"] else None
    if shard is not None:
        shard_experts(model, shard)
    tp_ops = tpm.TensorParallel(tp, t_rank, groups.tp_group, sequence_parallel=_sp(cfg)) if tp > 1 else None
    if tp_ops is not None:
        tpm.shard_model(model, tp_ops)
    inputs = [_microbatch_inputs(cfg, seqs, gids, m, c_rank, routes, stage_ranges, model, mode, dev, t_rank)
              for m, gids in enumerate(mbs)]
    sums = {"loss": torch.zeros((), dtype=torch.float64, device=dev)}

    def forward(v, m, x):
        inp = inputs[m]
        t, realf = inp["t"], inp["t"]["real"].float()
        attn = lambda q, k, v_, p=inp["plan"]: cp_attention(q, k, v_, p, group)  # noqa: E731
        last = stage.index(v) == stage.num_chunks - 1  # the model's last chunk (under VPP: the last stage's last)
        with _autocast(cfg):
            experts = None if shard is None else ExpertDispatch(shard, group, inp["tokens"])
            h, aux = model.run_layers(model.embed_tokens(t["tok"], tp_ops) if x is None else x, t["pos"], realf, attn,
                                      layers=stage.chunks[v], routing=inp["routing"], experts=experts, tp=tp_ops,
                                      split_in=x is not None, split_out=not last)
            if last:
                h = model.token_ce(h, t["lab"], realf, tp_ops).sum()
        sums["loss"] += float((h + aux).detach()) if last else float(aux.detach())
        return h, aux

    rows = tp if _sp(cfg) else 1  # under sequence parallelism a stage hands on its TP rank's share of the rows
    passes = pipeline.ChunkPasses(forward=forward, num_tokens=lambda m: inputs[m]["t"]["tok"].numel() // rows,
                                  total=total, hidden=MODEL.hidden, device=dev)
    actions = pipeline.actions_for(pipeline.PipelineConfig(pp=pp, vpp=vpp), p_rank, len(mbs)) if pp > 1 else \
        pipeline.single_stage_passes(len(mbs))
    pipeline.run_passes(stage, actions, passes, pipeline.P2P(layout, rank, stage.num_chunks) if pp > 1 else None)
    mismatches, checked = (sum(x) for x in zip(*(_mismatches(inp, routes) for inp in inputs)))
    loss = sums["loss"]
    if tp_ops is not None and tp_ops.sequence_parallel:  # the norms' and routers' gradients of each rank's rows
        seq_par.reduce_grads(list(model.parameters()), tp_ops)
    grads = {n: _grad(q) for n, q in model.named_parameters() if stage.owns(n)}
    for n, g in grads.items():
        if cp > 1 and not (shard is not None and is_expert_param(n)):  # an expert's gradient is whole on its owner
            dist.all_reduce(g, group=group)
    grads = {n: tpm.whole(n, g, MODEL, tp_ops) for n, g in grads.items()}  # TP shards gathered (same order on each)
    dist.all_reduce(loss)
    # CP ranks hold disjoint tokens: the sum is the loss; each TP rank holds its position's whole loss
    return float(loss) / total / tp, grads, mismatches, checked


def replay_check(rank: int, world: int, cfg: dict | None = None) -> dict:
    cfg = {**DEFAULT, **(cfg or {})}
    Heartbeat.from_cfg(cfg, rank).beat(force=True, phase="replay check")
    n = cfg["pp"] * cfg["cp"] * cfg["tp"]
    if n != world:
        raise ValueError(f"pp={cfg['pp']} x cp={cfg['cp']} x tp={cfg['tp']} needs {n} ranks, the world has {world}")
    if cfg["tp"] > 1 and cfg["ep"] and not _sp(cfg):
        raise ValueError("expert parallelism with tensor parallelism needs sequence parallelism (Megatron's rule for "
                         "MoE with TP): use sp=None or True with ep, or tp=1")
    vpp = cfg["vpp"]
    if not isinstance(vpp, int) or isinstance(vpp, bool) or vpp < 1 or (vpp > 1 and cfg["pp"] == 1):
        raise ValueError(f"vpp={vpp!r}: virtual pipeline chunks need an int >= 1, and pp >= 2 when > 1")
    if cfg["sp"] and cfg["tp"] == 1:
        raise ValueError("sp=True splits the token rows over the TP ranks and tp=1: use tp >= 2 with it, or sp=None")
    torch.manual_seed(0)
    seqs, mbs = _batch(cfg)
    routes = rollout_routes(TinyLM(MODEL).to(_device(cfg)), seqs, cfg)
    total = float(sum(len(s) - 1 for s in seqs))
    groups = DynamicGroups(ParallelLayout(dp=1, cp=cfg["cp"], pp=cfg["pp"], tp=cfg["tp"]), rank)
    lay = groups.layout
    ref_loss, ref_grads = _reference(cfg, seqs, mbs, routes, total)
    loss, grads, mism, checked = _run("replay", cfg, rank, seqs, mbs, routes, total, groups)
    _, _, free_mism, free_checked = _run("free", cfg, rank, seqs, mbs, routes, total, groups)
    rel = {n: float((g - ref_grads[n]).norm() / ref_grads[n].norm().clamp_min(1e-30)) for n, g in grads.items()}
    return {"rank": rank, "pp_rank": lay.stage(rank), "cp_rank": lay.position(rank), "tp_rank": lay.tp_rank(rank),
            "sp": _sp(cfg), "dtype": cfg["dtype"], "ep": cfg["ep"],
            "replay_mismatches": mism,
            "tokens_checked": checked, "free_mismatches": free_mism, "free_checked": free_checked,
            "loss": loss, "ref_loss": ref_loss, "grad_rel": rel}
