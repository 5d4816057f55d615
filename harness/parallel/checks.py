"""Checks that run on every rank of a world: shared by the ``dist_cpu`` suites (gloo worlds from
``run_on_ranks``) and the GPU suite (``torchrun -m harness.jobs.entry checks``).

``all_checks(rank, world, cfg)`` runs, in one world (each costs seconds of start-up):
- ``groups``: every dynamic group has exactly the expected ranks (``get_process_group_ranks`` and an
  all-reduce of a one-hot rank vector inside the group);
- ``reroute``: a balanced schedule of random lengths, samples owned round-robin, rerouted with one
  all-to-all: every rank receives exactly its slots' gids with the right contents, and its THD
  micro-batches hold its zig-zag slice with the block's ``local_cp_size``;
- ``attention``: for each micro-batch layout of block sizes (1, 2, 4, mixed), a random pack per
  block; CP attention (forward + backward through the block's group) against single-process full
  attention of the same pack on the same rank: outputs and dq/dk/dv of the rank's slice, for each
  K/V exchange in ``exchanges`` (all-gather, ring and all-to-all).
Results are plain dicts (picklable, JSON-able); tests and the GPU entry judge them.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from harness.heartbeat import Heartbeat
from harness.parallel.cp_attention import CPAttentionPlan, cp_attention
from harness.parallel.groups import DynamicGroups, ParallelLayout
from harness.parallel.reroute import build_microbatches, needed_gids, owners_round_robin, reroute, sample_for
from harness.plan import schedule
from harness.plan.thd import pack, padding_divisor, zigzag_index_array
from harness.runtime.attention import LSE_BACKENDS, thd_attention

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT = {"device": "cpu", "dtype": "float32", "backend": "auto", "ref_backend": None, "heads": 4, "kv_heads": 2,
           "head_dim": 32, "max_seq": 300, "max_seqs": 4, "pack_tokens": None, "seed": 0,
           "layouts": None, "reroute_sequences": 24, "max_seqlen_per_rank": 256, "parallel": None,
           "exchanges": ("gather", "ring", "a2a")}


def default_layouts(world: int) -> list[list[int]]:
    layouts = [[1] * world]
    s = 2
    while s <= world:
        layouts.append([s] * (world // s))
        s *= 2
    if world >= 4:  # mixed sizes in one micro-batch; the second increases left to right (still buddy aligned)
        layouts.append([world // 2] + [1] * (world // 2))
        layouts.append([1] * (world // 2) + [world // 2])
    return layouts


def check_groups(rank: int, world: int, groups: DynamicGroups, device) -> dict:
    out = {}
    for size in groups.sizes:
        g = groups.group(size)
        expect = groups.layout.block_ranks(rank, size)
        onehot = torch.zeros(world, dtype=torch.float64, device=device)
        onehot[rank] = 1.0
        dist.all_reduce(onehot, group=g)
        members = [r for r in range(world) if onehot[r] > 0]
        out[size] = {"ranks": dist.get_process_group_ranks(g), "members": members, "expected": expect,
                     "ok": dist.get_process_group_ranks(g) == members == expect == groups.ranks(size)}
    return out


def check_reroute(rank: int, world: int, groups: DynamicGroups, cfg: dict, device) -> dict:
    layout = groups.layout
    rng = np.random.default_rng(cfg["seed"] + 101)
    mslpr = cfg["max_seqlen_per_rank"]
    lengths = [(int(g), int(L)) for g, L in zip(rng.permutation(1000)[:cfg["reroute_sequences"]],
                                                rng.integers(1, 2 * mslpr, size=cfg["reroute_sequences"]))]
    sched = schedule(lengths, n_ranks=layout.n_positions, max_seqlen_per_rank=mslpr)
    groups.check_schedule(sched)
    owners = owners_round_robin([g for g, _ in lengths], layout.n_positions)
    me = layout.position(rank)
    local = {g: sample_for(g, L, device=device) for g, L in lengths if owners[g] == me}
    got = reroute(local, owners, sched, me, group=groups.group(layout.n_positions))
    expect_gids = needed_gids(sched, me)
    content_ok = all(torch.equal(got[g][k], sample_for(g, sched.lengths[g], device=device)[k])
                     for g in expect_gids for k in got[g])
    mbs = build_microbatches(got, sched, me)
    slices_ok, sizes_ok = True, True
    for mb in mbs:
        block = [b for b in sched.blocks(mb.index) if b.start <= me < b.start + b.size][0]
        sizes_ok &= mb.local_cp_size == block.size and mb.gids == block.gids
        p = pack([sched.lengths[g] for g in block.gids], padding_divisor(cp_size=block.size))
        full = torch.cat([sample_for(g, sched.lengths[g], device=device)["tokens"] for g in block.gids])
        pos = torch.cat([torch.arange(a, a + sched.lengths[g]) for a, g in zip(p.cu_seqlens_padded, block.gids)])
        padded = torch.zeros(p.total_tokens, dtype=torch.int64, device=device)
        padded[pos.to(device)] = full
        idx = torch.as_tensor(zigzag_index_array(p.cu_seqlens_padded, block.size, me - block.start), device=device)
        slices_ok &= torch.equal(mb.data["tokens"], padded[idx]) and mb.cu_seqlens_padded == tuple(p.cu_seqlens_padded)
    return {"gids": list(got), "expected_gids": expect_gids, "content_ok": bool(content_ok),
            "microbatches": len(mbs), "sizes_ok": bool(sizes_ok), "slices_ok": bool(slices_ok)}


def _pack_lengths(rng: np.random.Generator, cfg: dict) -> list[int]:
    if cfg["pack_tokens"]:
        n = int(rng.integers(1, cfg["max_seqs"] + 1))
        cuts = np.sort(rng.choice(np.arange(1, cfg["pack_tokens"]), size=n - 1, replace=False))
        return np.diff(np.concatenate([[0], cuts, [cfg["pack_tokens"]]])).astype(int).tolist()
    return rng.integers(1, cfg["max_seq"] + 1, size=int(rng.integers(1, cfg["max_seqs"] + 1))).tolist()


def _errors(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[float, float]:
    a, b = a.detach().double(), b.detach().double()
    rel = float((a - b).norm() / b.norm().clamp_min(1e-30))
    ratio = float(((a - b).abs() / (atol + rtol * b.abs())).max()) if a.numel() else 0.0
    return rel, ratio


def check_attention(rank: int, world: int, groups: DynamicGroups, cfg: dict, device) -> list[dict]:
    dtype = DTYPES[cfg["dtype"]]
    atol = rtol = cfg.get("atol") or (2.5e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-5)
    H, Hkv, D = cfg["heads"], cfg["kv_heads"], cfg["head_dim"]
    me, results = groups.layout.position(rank), []
    for m, sizes in enumerate(cfg["layouts"] or default_layouts(world)):
        starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
        k = int(np.searchsorted(starts, me, side="right") - 1)
        start, size = int(starts[k]), int(sizes[k])
        rng = np.random.default_rng([cfg["seed"], m, start])
        p = pack(_pack_lengths(rng, cfg), padding_divisor(cp_size=size))
        gen = torch.Generator(device=device).manual_seed(int(rng.integers(1 << 31)))  # same on every rank
        T = p.total_tokens
        q, kk, v, do = (torch.randn(T, h, D, generator=gen, device=device, dtype=torch.float32).to(dtype)
                        for h in (H, Hkv, Hkv, H))
        pad = torch.as_tensor(_padding_mask(p), device=device)
        do[pad] = 0  # as the loss mask does: padding then gets exactly zero gradients (only padding sees padding)
        ref = [t.clone().requires_grad_() for t in (q, kk, v)]
        out_ref = thd_attention(*ref, p.cu_seqlens_padded, backend=cfg["ref_backend"] or cfg["backend"])
        (out_ref.float() * do.float()).sum().backward()
        idx = torch.as_tensor(zigzag_index_array(p.cu_seqlens_padded, size, me - start), device=device)
        group = groups.for_block(start, size)
        harness_run = None
        for exchange in cfg["exchanges"]:
            # ring needs a log-sum-exp backend: the configured one when it has it, else auto (flash on CUDA)
            backend = cfg["backend"] if exchange == "gather" or cfg["backend"] in LSE_BACKENDS else "auto"
            row = {"mb": m, "layout": list(sizes), "block_start": start, "size": size, "tokens": T,
                   "sequences": len(p.cu_seqlens) - 1, "exchange": exchange, "backend": backend,
                   "atol": atol, "rtol": rtol, "expected_rank_sum": float(sum(groups.layout.block_ranks(rank, size)))}
            loc = [t[idx].clone().requires_grad_() for t in (q, kk, v)]
            try:
                plan = CPAttentionPlan.build(p.cu_seqlens_padded, size, me - start, device, exchange=exchange)
                out = cp_attention(*loc, plan, group, backend=backend)
                (out.float() * do[idx].float()).sum().backward()
            except Exception as e:  # noqa: BLE001 - TransformerEngine may refuse a communication type: reported
                if not exchange.startswith("te:"):
                    raise
                results.append({**row, "error": f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"})
                continue
            got = (out, loc[0].grad, loc[1].grad, loc[2].grad)
            errs = {name: _errors(a, b, atol, rtol) for name, a, b in
                    zip(("out", "dq", "dk", "dv"), got, (out_ref[idx], ref[0].grad[idx], ref[1].grad[idx],
                                                         ref[2].grad[idx]))}
            if exchange == "gather":
                harness_run = got
            elif harness_run is not None:  # against the harness's own CP attention of the same slice
                row["vs_gather"] = {name: _errors(a, b, atol, rtol)[1] for name, a, b in
                                    zip(("out", "dq", "dk", "dv"), got, harness_run)}
            local_pad = pad[idx]
            tag = torch.tensor([float(rank)], device=device, dtype=torch.float64)
            dist.all_reduce(tag, group=group)
            results.append({**row, "rel": {n: e[0] for n, e in errs.items()},
                            "tol_ratio": max(e[1] for e in errs.values()), "group_rank_sum": float(tag),
                            "padding_tokens": int(local_pad.sum()),
                            "padding_grad_max": max(float(g[local_pad].abs().max()) if local_pad.any() else 0.0
                                                    for g in got[1:])})
    return results


def _padding_mask(p) -> np.ndarray:
    """True at the pack's padding positions (after each sequence's real tokens, up to its padded end)."""
    mask = np.zeros(p.total_tokens, dtype=bool)
    real = np.diff(p.cu_seqlens)
    for start, end, n in zip(p.cu_seqlens_padded[:-1], p.cu_seqlens_padded[1:], real):
        mask[start + n:end] = True
    return mask


def all_checks(rank: int, world: int, cfg: dict | None = None) -> dict:
    cfg = {**DEFAULT, **(cfg or {})}
    device = torch.device(cfg["device"], torch.cuda.current_device()) if cfg["device"] == "cuda" else torch.device("cpu")
    dp, cp, tp = cfg["parallel"] or (world, 1, 1)  # Megatron order: TP fastest, then CP, then DP
    layout = ParallelLayout(dp=dp, cp=cp, tp=tp)
    if layout.world_size != world:
        raise ValueError(f"parallel (dp, cp, tp) = {cfg['parallel']} needs {layout.world_size} ranks, world has {world}")
    groups = DynamicGroups(layout, rank)
    Heartbeat.from_cfg(cfg, rank).beat(force=True, phase="checks")
    return {"rank": rank, "world": world, "parallel": [dp, cp, tp], "groups": check_groups(rank, world, groups, device),
            "reroute": check_reroute(rank, world, groups, cfg, device),
            "attention": check_attention(rank, layout.n_positions, groups, cfg, device)}
