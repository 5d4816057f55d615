"""A trainer of your own, checked by the harness: plain PyTorch behind the stack protocol (``harness.stack``).

This file is what a user writes to have ``dcp-harness verify`` check their trainer: a factory ``make(ctx)`` and
a class with ``name``, ``build(seed)`` and ``step(request)``; ``sharpen(scale)`` (optional) lets bf16 runs check a
step 1 whose attention is sharp enough for position bugs to stand out of bf16's rounding. Nothing here comes from the harness's runtime: the
model, the CP slicing (zig-zag), the K/V exchange (an autograd all-gather in the micro-batch's CP group), the
loss and its token count, the gradient all-reduce, clipping and AdamW are the trainer's own.

    dcp-harness verify docs/examples/own_trainer.py:make --world 2 --steps 2

``make(ctx, bug=...)`` plants one of the integration bugs ``BUGS`` names, to watch the checks catch it:

    dcp-harness verify docs/examples/own_trainer.py:make --world 2 --option bug=local-positions
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.nn.functional import all_gather

from harness.stack import StackContext, StepReport, StepRequest

warnings.filterwarnings("ignore", message=".*torch.distributed.nn.functional.all_gather is deprecated.*")

BUGS = {
    "duplicated-tokens": "every CP rank counts its sequence's whole length in the loss's token count",
    "local-positions": "positions restart at 0 in each CP slice (a wrong RoPE / position offset)",
    "labels-after-split": "labels rolled inside each CP slice instead of before the split",
    "cp-grads-not-reduced": "gradients all-reduced over every other rank only (the ranks of one CP index)",
    "separate-kv-gathers": "K and V exchanged by two autograd all-gathers (torch.distributed.nn): on gloo the key "
                           "gathers' backward receives a non-contiguous gradient and returns it scrambled (torch's "
                           "defect: docs/repro/gloo_all_gather_backward.py); the one gather of stacked K/V gets a "
                           "contiguous one",
}


class TinyCausalLM(nn.Module):
    """Embedding + sinusoidal positions, one causal attention layer, an MLP and the LM head."""

    def __init__(self, vocab: int, hidden: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def positions(self, pos: torch.Tensor) -> torch.Tensor:
        d = self.embed.embedding_dim
        freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32) * (-math.log(10000.0) / d))
        angle = pos.float()[:, None] * freq[None, :]
        return torch.cat([angle.sin(), angle.cos()], dim=-1)

    def forward(self, tokens, pos, gather_kv):
        """Logits of this rank's tokens of one sequence at positions ``pos``; ``gather_kv(k, v, pos)`` returns the
        whole sequence's keys, values and positions (the CP exchange)."""
        x = self.embed(tokens) + self.positions(pos)
        q, k, v = self.qkv(self.norm1(x)).chunk(3, dim=-1)
        k_all, v_all, pos_all = gather_kv(k, v, pos)
        split = lambda t: t.view(t.shape[0], self.heads, -1).transpose(0, 1)  # noqa: E731
        mask = pos_all[None, :] <= pos[:, None]  # causal over the sequence's positions, wherever they live
        a = F.scaled_dot_product_attention(split(q), split(k_all), split(v_all), attn_mask=mask)
        x = x + self.proj(a.transpose(0, 1).reshape(x.shape))
        x = x + self.mlp(self.norm2(x))
        return self.head(x)


def zigzag(n: int, cp: int, cp_rank: int) -> torch.Tensor:
    """Indices of a sequence of ``n`` tokens (padded to a multiple of 2 x cp) that CP rank ``cp_rank`` holds:
    chunks ``cp_rank`` and ``2 cp - 1 - cp_rank`` of ``2 cp``."""
    chunk = -(-n // (2 * cp))
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk)
    second = torch.arange((2 * cp - 1 - cp_rank) * chunk, (2 * cp - cp_rank) * chunk)
    return torch.cat([first, second])


def _gathered(t: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    out = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(out, t, group=group)
    return out


class OwnTrainer:
    name = "own-trainer"

    def __init__(self, ctx: StackContext, bug: str | None = None, lr: float = 3e-3):
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}; choose from {', '.join(BUGS)}")
        self.ctx, self.bug, self.lr = ctx, bug, lr
        self.groups = {}  # (first rank, size) -> process group: every block a schedule can form
        size = 1
        while size <= ctx.world:
            for start in range(0, ctx.world, size):
                self.groups[(start, size)] = dist.new_group(list(range(start, start + size)))
            size *= 2
        # bug "cp-grads-not-reduced": the ranks of one parity (every rank creates both groups, in one order)
        self.parity = [dist.new_group([r for r in range(ctx.world) if r % 2 == k]) for k in range(min(2, ctx.world))]

    def build(self, seed: int) -> None:
        torch.manual_seed(seed)
        self.model = TinyCausalLM(self.ctx.vocab)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=self.lr, betas=(0.9, 0.95))

    def sharpen(self, scale: float) -> None:
        """Scale the query and key projections (the first two thirds of ``qkv``'s rows) by ``scale``."""
        rows = 2 * self.model.embed.embedding_dim
        with torch.no_grad():
            self.model.qkv.weight[:rows] *= scale
            self.model.qkv.bias[:rows] *= scale

    def _sequence(self, tokens: torch.Tensor, group, cp: int, cp_rank: int, gid: int):
        """(cross-entropy of this rank's real tokens, their positions) of one sequence."""
        n = tokens.numel() - 1
        inputs, labels = tokens[:-1], tokens[1:]
        idx = zigzag(n, cp, cp_rank)
        real = idx < n
        safe = idx.clamp(max=n - 1)
        x = inputs[safe]
        y = labels[safe] if self.bug != "labels-after-split" else torch.roll(inputs[safe], -1)
        pos = idx if self.bug != "local-positions" else torch.arange(idx.numel())

        def gather_kv(k, v, p):
            if cp == 1:
                return k, v, p
            if self.bug == "separate-kv-gathers":
                return torch.cat(all_gather(k, group=group)), torch.cat(all_gather(v, group=group)), \
                    torch.cat(_gathered(p, group, cp))
            kv = torch.cat(all_gather(torch.cat([k, v], dim=-1), group=group))  # one collective, one backward
            return *kv.chunk(2, dim=-1), torch.cat(_gathered(p, group, cp))

        logits = self.model(x, pos, gather_kv)
        ce = F.cross_entropy(logits, y, reduction="none")
        return ce[real], idx[real]

    def step(self, request: StepRequest) -> StepReport:
        me, batch = self.ctx.rank, [torch.as_tensor(s, dtype=torch.int64) for s in request.batch]
        mine = request.my_blocks(me)
        count = torch.zeros(1, dtype=torch.float64)
        for _, block in mine:  # the loss divides by the global batch's loss tokens: each rank counts its own
            for g in block.gids:
                n = batch[g].numel() - 1
                count += n if self.bug == "duplicated-tokens" else zigzag(n, block.size, me - block.start).lt(n).sum()
        dist.all_reduce(count)
        total = float(count[0])
        ce_sum = torch.zeros(1, dtype=torch.float64)
        token_losses, cp_groups = [], {}
        for m, block in mine:
            group = self.groups[(block.start, block.size)]
            cp_groups[m] = tuple(dist.get_process_group_ranks(group))
            loss = 0.0
            for g in block.gids:
                ce, pos = self._sequence(batch[g], group, block.size, me - block.start, g)
                loss = loss + ce.sum() / total
                ce_sum += ce.detach().double().sum()
                token_losses += [(g, int(p), float(c)) for p, c in zip(pos, ce.detach())]
            loss.backward()
        params = [p for p in self.model.parameters()]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=self.parity[me % 2] if self.bug == "cp-grads-not-reduced" else None)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        grad_norm = float(torch.linalg.vector_norm(flat, dtype=torch.float64))
        gradients = {n: p.grad.detach().clone() for n, p in self.model.named_parameters()} \
            if "gradients" in request.want else None
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=False)
        dist.all_reduce(ce_sum)
        return StepReport(loss=float(ce_sum[0]) / total, grad_norm=grad_norm, tokens=int(round(total)),
                          gradients=gradients, token_losses=token_losses, cp_groups=cp_groups)


def make(ctx: StackContext, bug: str | None = None, lr: float = 3e-3) -> OwnTrainer:
    return OwnTrainer(ctx, bug, lr)
