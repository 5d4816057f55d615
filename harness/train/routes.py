"""The MoE routes of a training step, for the tie-aware convergence rule (``harness.apps.converge``).

Hard top-k routing is discontinuous: two layouts whose hidden states differ by rounding route a token differently
once its k-th and (k+1)-th router logits are within that rounding of each other (a near-tie), and from then on their
trajectories separate. Whether and where that happened is read here rather than assumed:

- ``StepRoutes`` records, for every MoE layer and every ``BLOCK`` consecutive positions of every sequence of the
  global batch (a cell), a digest of the routes its real tokens took (the sum of a hash of (sequence, position,
  expert set) over the tokens: independent of how a layout packs, slices or orders them) and the smallest top-k
  margin of those tokens (the k-th logit minus the (k+1)-th);
  ``reduce`` sums the digests and takes the smallest margins over the world, so every rank holds the step's whole
  picture whatever its CP, pipeline or expert layout.
- ``first_difference`` compares two layouts' recorded steps: the first step whose routes differ, the cells that
  differ there and the margins in each. A difference at near-ties only is rounding; one at a token far from a tie
  is a routing bug. A cell's smallest margin bounds its flipped token's from below, so the cells are kept small: a
  sequence's smallest margin over hundreds of tokens is itself near a tie often enough to hide a bug.

The recorder stands in for ``harness.runtime.replay.Routing`` (its ``select``): the expert choice is the plain
``torch.topk`` of the free router, unchanged.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.distributed as dist

from harness.train.records import BLOCK, MAX_CELLS, first_difference  # noqa: F401 - re-exported

_P = 2_147_483_647  # 2^31 - 1: every product below stays under 2^62 in int64
_A, _B, _C = 1_000_003, 998_244_353 % _P, 1_234_567_891 % _P


def _hash(seq: torch.Tensor, pos: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """A hash in [0, 2^31) of each token's (sequence, position, expert-set code), in int64 without overflow."""
    h = (seq % _P * _A + pos % _P) % _P
    h = (h * _B + code % _P) % _P
    return (h * _C + 12_345) % _P


class StepRoutes:
    """One step's routes on one rank (see the module doc): ``digest[layer, cell]`` (int64) and ``margin[layer, cell]``
    (float64; +inf where no token of the cell reached the layer), cell ``sequence x blocks + position // BLOCK`` for
    sequences of at most ``longest`` tokens."""

    def __init__(self, layers: int, sequences: int, longest: int, device):
        self.blocks = max(1, -(-longest // BLOCK))
        cells = sequences * self.blocks
        self.digest = torch.zeros(layers, cells, dtype=torch.int64, device=device)
        self.margin = torch.full((layers, cells), float("inf"), dtype=torch.float64, device=device)

    def recorder(self, mb, tp=None) -> RouteRecorder:
        """The routing object a micro-batch's forward hands the model (``harness.runtime.layers.MoE``). With sequence
        parallelism (``tp``) the router routes this TP rank's rows only, and the recorder records those (every TP rank
        records its own; without it the TP ranks route every row alike and the first records them)."""
        cols = mb.data["seq"], mb.data["position_ids"], mb.data["loss_mask"].bool()
        if tp is not None and tp.sequence_parallel:
            cols = tuple(tp.own_rows(t) for t in cols)
        return RouteRecorder(self, *cols)

    def add(self, layer: int, idx_TK: torch.Tensor, logits_TX: torch.Tensor, seq_T, pos_T, real_T) -> None:
        if not 0 <= layer < self.digest.shape[0]:
            raise ValueError(f"MoE layer {layer} is outside the model's {self.digest.shape[0]} layers")
        idx, logits, seq, pos = idx_TK[real_T], logits_TX[real_T], seq_T[real_T], pos_T[real_T]
        if not seq.numel():
            return
        experts, k = logits.shape[1], idx.shape[1]
        kth = logits.gather(1, idx).amin(1)
        if k < experts:
            rest = logits.scatter(1, idx, float("-inf")).amax(1)
            margin = (kth - rest).double()
        else:  # every expert is chosen: no tie can change the set
            margin = torch.full_like(kth, float("inf"), dtype=torch.float64)
        code = torch.zeros_like(seq)
        for col in idx.sort(dim=1).values.unbind(1):  # the set, whatever topk's order
            code = (code * experts + col) % _P
        if int(pos.max()) >= self.blocks * BLOCK:
            raise ValueError(f"a token at position {int(pos.max())} is past the longest sequence the routes were "
                             f"sized for ({self.blocks * BLOCK} positions)")
        cell = seq * self.blocks + torch.div(pos, BLOCK, rounding_mode="floor")
        self.digest[layer].index_add_(0, cell, _hash(seq, pos, code))
        self.margin[layer].scatter_reduce_(0, cell, margin, "amin")

    def reduce(self, group=None) -> StepRoutes:
        """Sum the digests and take the smallest margins over ``group`` (default: the world)."""
        dist.all_reduce(self.digest, group=group)
        dist.all_reduce(self.margin, op=dist.ReduceOp.MIN, group=group)
        return self

    def summary(self) -> tuple[str, float | None]:
        """(a digest of the whole step's routes, the step's smallest top-k margin; None where no choice could
        tie): what a metrics row carries."""
        d = hashlib.sha256(self.digest.cpu().numpy().tobytes()).hexdigest()[:16]
        m = float(self.margin.min())
        return d, m if np.isfinite(m) else None


class RouteRecorder:
    """``harness.runtime.replay.Routing``'s ``select`` for free routing that records each choice into ``StepRoutes``."""

    def __init__(self, routes: StepRoutes, seq_T, pos_T, real_T):
        self.routes, self.seq, self.pos, self.real = routes, seq_T, pos_T, real_T

    def select(self, layer: int, logits_TX: torch.Tensor, k: int) -> torch.Tensor:
        idx = torch.topk(logits_TX.detach(), k, dim=-1).indices
        self.routes.add(layer, idx, logits_TX.detach(), self.seq, self.pos, self.real)
        return idx


class RouteLog:
    """Every step's routes of one layout: ``digests`` (int64) / ``margins`` (float32) as [steps, layers, cells]."""

    def __init__(self):
        self.digests: list[np.ndarray] = []
        self.margins: list[np.ndarray] = []
        self.blocks = 1

    def append(self, routes: StepRoutes) -> None:
        self.digests.append(routes.digest.cpu().numpy().copy())
        self.margins.append(routes.margin.cpu().numpy().astype(np.float32))
        self.blocks = routes.blocks

    def arrays(self) -> dict:
        return {"digests": np.stack(self.digests) if self.digests else np.zeros((0, 0, 0), np.int64),
                "margins": np.stack(self.margins) if self.margins else np.zeros((0, 0, 0), np.float32),
                "blocks": np.asarray(self.blocks)}
