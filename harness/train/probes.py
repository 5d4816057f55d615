"""Probes of a training run for the fault catalogue's checks (``TrainConfig.probes``).

On every rank, per layout: at the first step, every real token the rank trained as (gid, position in
its sequence, cross-entropy) - read from the micro-batch's ``seq`` and ``position_ids`` columns, which
travel with the token, so a token is attributed to where it came from whatever the runtime did to it -
and every parameter's reduced gradient before and after clipping; after every step, the reduced gradient norm and a digest of the parameters
(replicas must stay identical; under expert parallelism the replicated ones: each expert has one owner). The records are small for the tiny models (~0.5 MB a rank).
"""

from __future__ import annotations

import hashlib

import torch

from harness.parallel.expert_parallel import is_expert_param
from harness.parallel.tensor_parallel import whole
from harness.train.records import load  # noqa: F401 - re-exported


class StepProbe:
    """Every real token's (gid, position in its sequence, cross-entropy) of one step on one rank."""

    def __init__(self):
        self.parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def add(self, mb, ce_T: torch.Tensor) -> None:
        real = mb.data["loss_mask"].bool()
        self.parts.append((mb.data["seq"][real].cpu(), mb.data["position_ids"][real].cpu(), ce_T[real].double().cpu()))

    def result(self) -> dict:
        """``seq``, ``pos``, ``ce``: one entry per real token this rank trained (lists, in rank order)."""
        if not self.parts:
            return {"seq": [], "pos": [], "ce": []}
        seq, pos, ce = (torch.cat(x) for x in zip(*self.parts))
        return {"seq": seq.tolist(), "pos": pos.tolist(), "ce": ce.tolist()}


def param_digest(model, skip=None, tp=None) -> str:
    """A digest of ``model``'s parameters (those whose name ``skip`` accepts left out); under tensor parallelism
    (``tp``) of the whole parameters, gathered from the TP ranks' shards (collective)."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters()):
        if skip is not None and skip(name):
            continue
        h.update(name.encode())
        h.update(whole(name, p.detach(), model.c, tp).cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def whole_grads(model, tp=None) -> dict:
    """Every parameter's gradient (fp64 numpy), under tensor parallelism gathered whole from the TP ranks' shards
    (collective: every TP rank of the stage calls it)."""
    return {n: whole(n, p.grad.detach(), model.c, tp).cpu().double().numpy().copy()
            for n, p in model.named_parameters() if p.grad is not None}


class Probes:
    """What one rank records while training one layout (see the module doc)."""

    def __init__(self, sequence_steps: int = 1, stage: int = 0, sharded: bool = False, shared: bool = False):
        """``sharded``: experts are sharded over the ranks (expert parallelism): the digests cover the
        replicated parameters only. ``shared``: this rank holds the embedding a pipeline's first and last stages share
        (``harness.train.shared_embedding``): after every step a digest of it too (``embedding``)."""
        self.sequence_steps, self.stage, self.sharded, self.shared = sequence_steps, stage, sharded, shared
        self.embedding: list[str] = []
        self.sequences: list[dict] = []
        self.grads: dict[str, list] | None = None
        self.clipped: dict[str, list] | None = None
        self.grad_norms: list[float] = []
        self.digests: list[str] = []

    def step(self, step: int, batch) -> StepProbe | None:
        if step >= self.sequence_steps:
            return None
        probe = StepProbe()
        self.sequences.append({"step": step, "lengths": {g: len(x) - 1 for g, x in enumerate(batch)}, "probe": probe})
        return probe

    def after_reduce(self, step: int, model, grad_norm: float, tp=None) -> None:
        """``tp``: the run's tensor parallelism (the gradients are recorded whole, gathered from the shards)."""
        self.grad_norms.append(grad_norm)
        if step == 0:
            self.grads = whole_grads(model, tp)

    def after_clip(self, step: int, model, tp=None) -> None:
        if step == 0:
            self.clipped = whole_grads(model, tp)

    def after_update(self, step: int, model, tp=None) -> None:
        if self.shared:
            self.embedding.append(param_digest(model, skip=lambda name: name != "embed.weight"))
        if self.sharded:
            self.digests.append(param_digest(model, skip=is_expert_param, tp=tp))
        else:
            self.digests.append(param_digest(model, tp=tp))

    def result(self) -> dict:
        return {"sequences": [{"step": s["step"], "lengths": s["lengths"], **s["probe"].result()}
                              for s in self.sequences],
                "grads": self.grads, "clipped": self.clipped, "grad_norms": self.grad_norms, "digests": self.digests, "stage": self.stage,
                "embedding": self.embedding}

    def portable(self) -> dict:
        """``result`` with the gradients as nested lists: what a job returns through JSON when its ranks share no
        folder (a multi-node run)."""
        full = self.result()
        for kind in ("grads", "clipped"):
            if full[kind] is not None:
                full[kind] = {n: g.tolist() for n, g in full[kind].items()}
        return full

    def save(self, path) -> dict:
        """Write the large records (step-1 tokens and gradients) to ``path`` (``.npz``) and return the small
        ones (gradient norms, digests, stage) with ``"file"``; ``load`` puts them back together. A job that
        reports through JSON (``converge``) ships probes this way."""
        import numpy as np

        full = self.result()
        arrays = {}
        for i, s in enumerate(full["sequences"]):
            for key in ("seq", "pos", "ce"):
                arrays[f"seq{i}:{key}"] = np.asarray(s[key], dtype=np.float64 if key == "ce" else np.int64)
        for kind in ("grads", "clipped"):
            for name, g in (full[kind] or {}).items():
                arrays[f"{kind}:{name}"] = g
        np.savez(path, **arrays)
        return {"file": str(path), "grad_norms": self.grad_norms, "digests": self.digests, "stage": self.stage,
                "embedding": self.embedding, "sequences": [{"step": s["step"], "lengths": s["lengths"]} for s in full["sequences"]]}
