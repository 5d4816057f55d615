"""What megatron-core's attention receives before and after the stack's ``sharpen`` (one rank, torchrun):

    python -m torch.distributed.run --nproc_per_node 1 suites/gpu/megatron_sharpen_probe.py SCALE

builds ``harness.stack.megatron_core.MegatronCoreStack``'s model, runs one THD sequence through it, records the
query, key and value every ``TEDotProductAttention`` gets (after RoPE), sharpens the model by SCALE and runs the same
sequence again; prints one JSON line: the attention calls of a forward, and per tensor of the first layer (whose
input sharpening does not change) the largest deviation of (sharpened / SCALE^k) from the plain run relative to the
plain run's largest value, k = 1 for queries and keys, 0 for values.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist


def main() -> None:
    scale = float(sys.argv[1])
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from megatron.core.packed_seq_params import PackedSeqParams

    from harness.stack.megatron_core import MegatronCoreStack
    from harness.stack.protocol import StackContext

    stack = MegatronCoreStack(StackContext(rank=0, world=1, device="cuda", dtype="bfloat16", vocab=64))
    seen: list[list[torch.Tensor]] = []

    def grab(module, args, kwargs):
        q, k, v = (kwargs.get(n, a) for n, a in zip(("query", "key", "value"), args[:3]))
        seen[-1].append([q.detach().float().clone(), k.detach().float().clone(), v.detach().float().clone()])

    def run() -> list:
        seen.append([])
        n = 96
        tokens = torch.randint(0, 64, (1, n), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
        cu = torch.tensor([0, n], dtype=torch.int32, device="cuda")
        psp = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu,
                              cu_seqlens_kv_padded=cu, max_seqlen_q=n, max_seqlen_kv=n)
        with torch.no_grad():
            stack.model(tokens, torch.arange(n, device="cuda")[None], None, packed_seq_params=psp)
        return seen[-1]

    stack.build(0)
    hooks = [m.register_forward_pre_hook(grab, with_kwargs=True) for m in stack.attention]
    plain = run()
    stack.sharpen(scale)
    sharp = run()
    for h in hooks:
        h.remove()
    out = {"scale": scale, "layers": len(plain)}
    for i, name in enumerate(("query", "key", "value")):
        k = 0 if name == "value" else 1
        p, s = plain[0][i], sharp[0][i]
        out[name] = float(((s / scale ** k) - p).abs().max() / p.abs().max().clamp_min(1e-30))
    print(json.dumps(out), flush=True)
    stack.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
