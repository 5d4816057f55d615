"""Router replay (R3) at run time: a store of expert choices keyed by meaning, and the per-micro-batch
``Routing`` a model's MoE layers consult.

The store maps ``(global layer number, micro-batch, CP rank) -> [tokens, top_k]`` expert ids. Nothing
depends on the order in which routers were constructed (Megatron's ``RouterReplay`` keeps a class-level
list in instantiation order plus a backward FIFO; under pipeline and virtual-pipeline schedules that
order is not layer order). An activation recompute simply looks the same key up again.

``Routing`` modes: ``free`` (ordinary top-k), ``record`` (top-k, stored), ``replay`` (the stored experts
are forced; the gate weights are the softmax of the *live* logits gathered at those experts, so the
router still receives gradients). In every mode the chosen experts are kept in ``chosen`` so callers
can check what was routed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class ReplayError(ValueError):
    """Missing or malformed replay data."""


class ReplayStore:
    def __init__(self):
        self._data: dict[tuple[int, int, int], torch.Tensor] = {}

    def put(self, layer: int, microbatch: int, cp_rank: int, experts_TK: torch.Tensor) -> None:
        if experts_TK.dim() != 2:
            raise ReplayError(f"replay data for layer {layer} must be [tokens, top_k], got {tuple(experts_TK.shape)}")
        self._data[(layer, microbatch, cp_rank)] = experts_TK.to(torch.int64)

    def get(self, layer: int, microbatch: int, cp_rank: int) -> torch.Tensor:
        try:
            return self._data[(layer, microbatch, cp_rank)]
        except KeyError:
            raise ReplayError(f"no replay data for layer {layer}, micro-batch {microbatch}, CP rank {cp_rank} "
                              f"(have {len(self._data)} entries); record a rollout or fill the store from its routes"
                              ) from None

    def keys(self):
        return sorted(self._data)

    def clear(self) -> None:
        self._data.clear()


@dataclass
class Routing:
    mode: str = "free"
    store: ReplayStore | None = None
    microbatch: int = 0
    cp_rank: int = 0
    chosen: dict[int, torch.Tensor] = field(default_factory=dict)

    def __post_init__(self):
        if self.mode not in ("free", "record", "replay"):
            raise ReplayError(f"routing mode must be free, record or replay, got {self.mode!r}")
        if self.mode != "free" and self.store is None:
            raise ReplayError(f"routing mode {self.mode!r} needs a ReplayStore")

    def select(self, layer: int, logits_TX: torch.Tensor, k: int) -> torch.Tensor:
        """Expert ids ``[tokens, k]`` for ``layer`` given the live router logits."""
        if self.mode == "replay":
            idx = self.store.get(layer, self.microbatch, self.cp_rank).to(logits_TX.device)
            if idx.shape != (logits_TX.shape[0], k):
                raise ReplayError(f"layer {layer}: replay data is {tuple(idx.shape)}, the router sees "
                                  f"{logits_TX.shape[0]} tokens x top_k {k}")
            if idx.numel() and (int(idx.max()) >= logits_TX.shape[1] or int(idx.min()) < 0):
                raise ReplayError(f"layer {layer}: replayed expert id outside [0, {logits_TX.shape[1]})")
        else:
            idx = torch.topk(logits_TX.detach(), k, dim=-1).indices
            if self.mode == "record":
                self.store.put(layer, self.microbatch, self.cp_rank, idx)
        self.chosen[layer] = idx
        return idx
