"""TransformerEngine's THD context-parallel attention on tail-padded sequences, against exact attention.

A standalone reproduction (TransformerEngine and torch only; no dcp-harness, no megatron-core):

    torchrun --nproc_per_node 4 docs/repro/te_thd_cp_padding.py [--comm p2p] [--head-dim 16]

Each sequence of ``n`` real tokens is padded at its tail to a multiple of ``2 x cp`` and split zig-zag over the CP
ranks (``tex.thd_get_partitioned_indices``), as megatron-core's ``get_batch_on_this_cp_rank`` does. TE's
``DotProductAttention`` (THD, ``padding_causal``) is called in two ways that describe the same causal attention:

- ``padded``: ``cu_seqlens_q/kv`` = the real boundaries, ``cu_seqlens_q/kv_padded`` = the padded ones, distinct
  tensors (megatron-core's ``PackedSeqParams`` with ``cu_seqlens_*_padded``; TE then takes its
  ``pad_between_seqs`` path);
- ``tail``: ``cu_seqlens_q/kv`` = the padded boundaries only: the padding rides along as causal trailing tokens
  that no real token attends to (the harness's own TE path).

Outputs and dq/dk/dv of the real tokens are compared with float32 attention of the real tokens only, in TE's own
bf16 test tolerance (atol = rtol = 2.5e-2; reported as a ratio, > 1 fails); the gradient TE leaves on padding
rows must be zero (the upstream gradient there is zero). Rank 0 prints one row per case; exit 1 when any fails.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

CASES = {
    "aligned": [64],            # no padding at CP 2 or CP 4
    "long": [457],              # 3 padding tokens at CP 4 (chunk 58): one partly padded chunk
    "short-42": [42],           # padded to 48 at CP 4: chunk 6, the last chunk is padding only
    "short-33": [33],           # padded to 40 at CP 4: chunk 5, the last chunk is padding only
    "pack": [33, 457, 42, 64],  # several sequences in one call
}
TOL = 2.5e-2


def ratio(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.numel() == 0:
        return 0.0
    got, want = got.detach().float(), want.detach().float()
    return float(((got - want).abs() / (TOL + TOL * want.abs())).max())


def reference(q, k, v, dout, lens, padded):
    """Float32 causal attention of each sequence's real tokens; (out, dq, dk, dv) on the padded layout (0 on
    padding rows)."""
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    outs, start, pieces = torch.zeros_like(q), 0, []
    for n, p in zip(lens, padded):
        sl = slice(start, start + n)
        rep = q.shape[1] // k.shape[1]
        qs = q[sl].transpose(0, 1)
        ks = k[sl].repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[sl].repeat_interleave(rep, 1).transpose(0, 1)
        o = torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1)
        pieces.append((sl, o))
        start += p
    total = sum((o.float() * dout[sl].float()).sum() for sl, o in pieces)
    total.backward()
    for sl, o in pieces:
        outs[sl] = o.detach()
    return outs.detach(), q.grad, k.grad, v.grad


def run_case(name, lens, cp, group, ranks, style, comm, heads, groups_kv, head_dim):
    import transformer_engine.pytorch as te
    import transformer_engine_torch as tex

    dev = torch.device("cuda")
    padded = [-(-n // (2 * cp)) * 2 * cp for n in lens]
    cu_pad = [0]
    for p in padded:
        cu_pad.append(cu_pad[-1] + p)
    T = cu_pad[-1]
    g = torch.Generator(device=dev).manual_seed(1234 + T)
    q = torch.randn(T, heads, head_dim, device=dev, generator=g).to(torch.bfloat16)
    k = torch.randn(T, groups_kv, head_dim, device=dev, generator=g).to(torch.bfloat16)
    v = torch.randn(T, groups_kv, head_dim, device=dev, generator=g).to(torch.bfloat16)
    dout = torch.randn(T, heads, head_dim, device=dev, generator=g).to(torch.bfloat16)
    real = torch.zeros(T, dtype=torch.bool, device=dev)
    for s, n in zip(cu_pad[:-1], lens):
        real[s:s + n] = True
    dout[~real] = 0
    ref_out, ref_dq, ref_dk, ref_dv = reference(q, k, v, dout, lens, padded)

    cu_pad_t = torch.tensor(cu_pad, dtype=torch.int32, device=dev)
    # with cu_seqlens_*_padded, TE reads cu_seqlens_* as the running sum of the real lengths
    cu_real_t = torch.tensor([0] + list(torch.tensor(lens).cumsum(0).tolist()), dtype=torch.int32, device=dev)
    cp_rank = ranks.index(dist.get_rank())
    idx = tex.thd_get_partitioned_indices(cu_pad_t, T, cp, cp_rank)
    mod = te.DotProductAttention(heads, head_dim, num_gqa_groups=groups_kv, qkv_format="thd",
                                 attn_mask_type="padding_causal")
    mod.set_context_parallel_group(group, ranks, torch.cuda.Stream(), cp_comm_type=comm)
    ql, kl, vl = (t[idx].clone().requires_grad_() for t in (q, k, v))
    longest = max(padded)
    if style == "padded":
        kw = dict(cu_seqlens_q=cu_real_t, cu_seqlens_kv=cu_real_t.clone(), cu_seqlens_q_padded=cu_pad_t,
                  cu_seqlens_kv_padded=cu_pad_t.clone())
    else:
        kw = dict(cu_seqlens_q=cu_pad_t, cu_seqlens_kv=cu_pad_t)
    out = mod(ql, kl, vl, max_seqlen_q=longest, max_seqlen_kv=longest, **kw)
    out = out.view(ql.shape[0], heads, head_dim)
    out.backward(dout[idx])
    torch.cuda.synchronize()
    r = real[idx]
    row = {"case": name, "lens": lens, "cp": cp, "style": style, "comm": comm, "rank": dist.get_rank(),
           "out": ratio(out[r], ref_out[idx][r]), "dq": ratio(ql.grad[r], ref_dq[idx][r]),
           "dk": ratio(kl.grad[r], ref_dk[idx][r]), "dv": ratio(vl.grad[r], ref_dv[idx][r]),
           "pad_grad": float(max(ql.grad[~r].abs().max() if (~r).any() else 0,
                                 kl.grad[~r].abs().max() if (~r).any() else 0,
                                 vl.grad[~r].abs().max() if (~r).any() else 0)),
           "finite": bool(torch.isfinite(out).all() and torch.isfinite(ql.grad).all()
                          and torch.isfinite(kl.grad).all() and torch.isfinite(vl.grad).all())}
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--comm", default="p2p", help="TE cp_comm_type: p2p, all_gather or a2a")
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=16)
    ap.add_argument("--styles", default="padded,tail")
    a = ap.parse_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    rows = []
    for cp in (c for c in (2, 4) if c <= world):
        groups = {}
        for start in range(0, world, cp):  # every rank creates every group, in the same order
            ranks = list(range(start, start + cp))
            groups[tuple(ranks)] = dist.new_group(ranks)
        mine = next(r for r in groups if rank in r)
        for style in a.styles.split(","):
            for name, lens in CASES.items():
                try:
                    rows.append(run_case(name, lens, cp, groups[mine], list(mine), style, a.comm, a.heads,
                                         a.kv_heads, a.head_dim))
                except Exception as e:  # noqa: BLE001 - reported per case, the run goes on
                    rows.append({"case": name, "lens": lens, "cp": cp, "style": style, "comm": a.comm,
                                 "rank": rank, "error": f"{type(e).__name__}: {str(e)[:160]}"})
    every = [None] * world
    dist.all_gather_object(every, rows)
    bad = 0
    if rank == 0:
        print(f"TE THD CP attention, comm {a.comm}, heads {a.heads}/{a.kv_heads}, head_dim {a.head_dim}, "
              f"{world} ranks; ratios to TE's bf16 tolerance (> 1 fails), worst rank")
        print(f"{'case':10} {'cp':>2} {'style':7} {'out':>7} {'dq':>7} {'dk':>7} {'dv':>7} {'pad grad':>9}  verdict")
        keys = sorted({(r["case"], r["cp"], r["style"]) for rs in every for r in rs},
                      key=lambda x: (x[1], x[2], list(CASES).index(x[0])))
        for key in keys:
            rs = [r for rr in every for r in rr if (r["case"], r["cp"], r["style"]) == key]
            if key[1] > world:
                continue
            err = next((r["error"] for r in rs if "error" in r), None)
            if err:
                print(f"{key[0]:10} {key[1]:>2} {key[2]:7} error: {err}")
                bad += 1
                continue
            w = {m: max(r[m] for r in rs) for m in ("out", "dq", "dk", "dv", "pad_grad")}
            ok = all(w[m] <= 1 for m in ("out", "dq", "dk", "dv")) and w["pad_grad"] == 0 and all(r["finite"] for r in rs)
            bad += not ok
            print(f"{key[0]:10} {key[1]:>2} {key[2]:7} {w['out']:7.3f} {w['dq']:7.3f} {w['dk']:7.3f} {w['dv']:7.3f} "
                  f"{w['pad_grad']:9.3g}  {'ok' if ok else 'WRONG'}")
        print(f"{bad} case(s) wrong")
    dist.destroy_process_group()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
