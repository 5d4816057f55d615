"""How far a RoPE-offset bug moves step 1 when attention is sharper: the footprint against bf16 rounding.

A standalone measurement on one CPU process (the harness's tiny GPT and THD attention):

    python docs/repro/sharp_attention_rope.py

At initialisation attention logits are near zero, so wrong positions barely change step 1 and a bf16 run's bands
(step-1 gradients 5e-2, token losses 2e-2) let them through; ``converge`` therefore runs step 1 again in fp32
(``TrainConfig.fp32_probe``). A stack that runs bf16 only (megatron-core with TE's attention) cannot. Scaling the query
and key projections by ``s`` scales the logits by ``s^2``: this prints, per ``s``, the bug's relative L2 footprint on
the token losses and the worst parameter's gradient, in fp32 and in bf16, and the clean run's bf16-against-fp32
deviation. The bug numbers each sequence's positions per zig-zag rank of a CP-4 block, as the catalogue's
``rope-positions-per-rank`` does.
"""

from __future__ import annotations

import torch

from harness.runtime.attention import thd_attention
from harness.runtime.model import MODELS, TinyLM

LENGTHS = (320, 200, 120, 64)
CP = 4


def positions(bug: bool) -> torch.Tensor:
    out = []
    for n in LENGTHS:
        if not bug:
            out.append(torch.arange(n))
            continue
        c, p = n // (2 * CP), torch.empty(n, dtype=torch.int64)
        for j in range(2 * CP):  # chunk j lies on rank min(j, 2CP-1-j), numbered from 0 there
            p[j * c:(j + 1) * c] = (0 if j < CP else c) + torch.arange(c)
        out.append(p)
    return torch.cat(out)


def step1(tokens, scale: float, bug: bool, bf16: bool):
    torch.manual_seed(1)
    m = TinyLM(MODELS["tiny-gpt"])
    d = m.c.hidden // m.c.heads
    with torch.no_grad():
        for b in m.blocks:
            b.qkv.weight[:(m.c.heads + m.c.kv_heads) * d] *= scale  # queries and keys
    cu = [0]
    for n in LENGTHS:
        cu.append(cu[-1] + n)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        loss, _, ce = m.token_losses(tokens[:-1], tokens[1:], torch.ones(cu[-1]), positions(bug),
                                     lambda q, k, v: thd_attention(q, k, v, cu), per_token=True)
    loss.backward()
    return ce.double(), {n: p.grad.double().clone() for n, p in m.named_parameters() if p.grad is not None}


def rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main() -> None:
    torch.manual_seed(0)
    tokens = torch.randint(0, MODELS["tiny-gpt"].vocab, (sum(LENGTHS) + 1,))
    print(f"{'scale':>5} | {'bug, fp32: ce / grads':>24} | {'bug, bf16: ce / grads':>24} | {'clean bf16 vs fp32':>22}")
    for s in (1, 2, 4, 8):
        runs = {(bug, bf16): step1(tokens, s, bug, bf16) for bug in (False, True) for bf16 in (False, True)}

        def dev(a, b):
            (ca, ga), (cb, gb) = runs[a], runs[b]
            return rel(ca, cb), max(rel(ga[n], gb[n]) for n in gb)
        f, h, r = dev((True, False), (False, False)), dev((True, True), (False, True)), dev((False, True), (False, False))
        print(f"{s:>5} | {f[0]:10.2e} / {f[1]:10.2e} | {h[0]:10.2e} / {h[1]:10.2e} | {r[0]:9.2e} / {r[1]:9.2e}")


if __name__ == "__main__":
    main()
