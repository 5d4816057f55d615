"""The tie-aware MoE rule: routes recorded per (layer, sequence, position block) whatever the layout, the first
route difference of two runs found and judged (a near-tie flipped by rounding, or a routing bug), and the per-step
loss rule's span set from it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from harness.apps import converge, route_rule
from harness.train.routes import BLOCK, RouteLog, StepRoutes, first_difference
from harness.train.trainer import TrainConfig

LAYERS, SEQS, LONGEST = 3, 4, 40


def _tokens(n=60, experts=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, SEQS, (n,), generator=g)
    pos = torch.randint(0, LONGEST, (n,), generator=g)
    logits = torch.randn(n, experts, generator=g)
    return seq, pos, logits


def _record(seq, pos, logits, parts=1, layer=1, k=2, real=None):
    """The routes of these tokens recorded as ``parts`` ranks would (each its share), summed as ``reduce`` does."""
    real = torch.ones_like(seq, dtype=torch.bool) if real is None else real
    total = StepRoutes(LAYERS, SEQS, LONGEST, "cpu")
    for idx in np.array_split(np.random.default_rng(1).permutation(len(seq)), parts):
        idx = torch.as_tensor(idx)
        r = StepRoutes(LAYERS, SEQS, LONGEST, "cpu")
        r.recorder(type("MB", (), {"data": {"seq": seq[idx], "position_ids": pos[idx],
                                            "loss_mask": real[idx].long()}})).select(layer, logits[idx], k)
        total.digest += r.digest
        total.margin = torch.minimum(total.margin, r.margin)
    return total


def test_the_record_does_not_depend_on_how_tokens_are_split_or_ordered():
    seq, pos, logits = _tokens()
    one, four = _record(seq, pos, logits), _record(seq, pos, logits, parts=4)
    assert torch.equal(one.digest, four.digest) and torch.equal(one.margin, four.margin)
    assert one.digest[1].count_nonzero() > 0 and one.digest[0].count_nonzero() == 0  # only the layer that routed
    # the smallest margin of a cell is its tokens' k-th minus (k+1)-th logit, smallest
    top = logits.topk(3, dim=1).values
    cell = (seq * one.blocks + pos // BLOCK)
    for c in cell.unique():
        assert one.margin[1, c].item() == pytest.approx((top[cell == c, 1] - top[cell == c, 2]).min().item())


def test_padding_is_not_recorded_and_a_changed_route_changes_only_its_cell():
    seq, pos, logits = _tokens()
    real = torch.ones_like(seq, dtype=torch.bool)
    real[:5] = False
    base = _record(seq, pos, logits, real=real)
    assert torch.equal(base.digest, _record(seq, pos, logits + 100 * (~real)[:, None] * torch.randn(logits.shape),
                                            real=real).digest)  # what padding routes to is not part of it
    flipped = logits.clone()
    t = 7
    flipped[t] = flipped[t].flip(0)  # another expert set for one token
    other = _record(seq, pos, flipped, real=real)
    changed = (base.digest != other.digest).nonzero().tolist()
    assert changed == [[1, int(seq[t]) * base.blocks + int(pos[t]) // BLOCK]]


def _log(steps):
    log = RouteLog()
    for s in steps:
        log.append(s)
    return log.arrays()


def test_first_difference_names_the_step_the_cells_and_their_margins():
    seq, pos, logits = _tokens()
    near = logits.clone()
    top2 = near.topk(3, dim=1)
    t = 3  # make token t a near-tie (k-th and (k+1)-th logits 1e-5 apart), then flip it
    near[t, top2.indices[t, 2]] = near[t, top2.indices[t, 1]] - 1e-5
    flipped = near.clone()
    flipped[t, top2.indices[t, 2]] += 2e-5
    a = _log([_record(seq, pos, near), _record(seq, pos, near), _record(seq, pos, near)])
    b = _log([_record(seq, pos, near), _record(seq, pos, flipped), _record(seq, pos, near)])
    assert first_difference(a, a) is None
    d = first_difference(b, a)
    assert d["step"] == 1 and d["count"] == 1
    layer, s, p, ref_m, own_m = d["cells"][0]
    assert (layer, s, p) == (1, int(seq[t]), int(pos[t]) // BLOCK * BLOCK)
    assert ref_m == pytest.approx(1e-5, rel=0.1) and d["worst_margin"] <= 2e-5
    with pytest.raises(ValueError, match="different shapes"):
        first_difference(b, {"digests": np.zeros((3, 2, 2), np.int64), "margins": np.zeros((3, 2, 2))})


def test_the_rule_is_strict_everywhere_while_routes_agree_and_names_a_routing_bug():
    seq, pos, logits = _tokens()
    same = _log([_record(seq, pos, logits)] * 3)
    span, checks = route_rule.judge("dcp vs bshd", same, same, "float32", 20)
    assert span == (None, "MoE routing") and checks == []  # every step strict, not only the first 20
    near = logits.clone()
    top = near.topk(3, dim=1).indices
    near[0, top[0, 2]] = near[0, top[0, 1]] - 1e-5
    tie = near.clone()
    tie[0, top[0, 2]] += 2e-5
    span, checks = route_rule.judge("dcp vs bshd", _log([_record(seq, pos, near), _record(seq, pos, tie)]),
                                    _log([_record(seq, pos, near)] * 2), "float32", 20)
    assert span == (1, "MoE routing") and [c["pass"] for c in checks] == [True]
    assert "routes equal until step 2, then differ only at near-ties" in checks[0]["target"]
    bug = logits.clone()
    bug[:, [0, 1, 2, 3]] = bug[:, [3, 2, 1, 0]]  # every token to other experts: far from any tie
    span, checks = route_rule.judge("dcp vs bshd", _log([_record(seq, pos, bug)]), _log([_record(seq, pos, logits)]),
                                    "float32", 20)
    assert span == (20, "MoE routing") and [c["pass"] for c in checks] == [False]
    assert "routes differ at step 1 where no top-k choice was near a tie" in checks[0]["target"]
    assert route_rule.judge("x", same, None, "float32", 20) == ((20, "MoE routing"), [])  # no record: fixed span
    assert route_rule.judge("x", same, same, "bfloat16", 20) == ((20, "MoE routing"), [])  # bf16: fixed span


def test_evaluate_holds_an_moe_layout_with_bshds_routes_to_every_step():
    """Under the fixed rule a deviation after step 20 passes; with routes equal to bshd's at every step it fails,
    and with a near-tie flip at step 5 the strict span ends there."""
    seq, pos, logits = _tokens()
    same = _log([_record(seq, pos, logits)] * 30)
    base = [5.0 - 0.01 * i for i in range(30)]
    late = base[:25] + [x + 3e-5 for x in base[25:]]
    rows = {k: [{"step": i, "loss": v} for i, v in enumerate(c)] for k, c in {"bshd": base, "dcp": late}.items()}
    cfg = TrainConfig(model="tiny-moe", steps=30)
    fixed = {c["target"]: c["pass"] for c in converge.evaluate(rows, cfg, 4, "cpu")}
    assert fixed["dcp vs bshd: max |delta loss| (first 20 steps) <= 1e-05"]
    judged = {c["target"]: c["pass"] for c in converge.evaluate(rows, cfg, 4, "cpu",
                                                                 routes={"bshd": same, "dcp": same})}
    assert judged == {"dcp vs bshd: max |delta loss| <= 1e-05": False}
    near = logits.clone()
    top = near.topk(3, dim=1).indices
    near[0, top[0, 2]] = near[0, top[0, 1]] - 1e-5
    tie = near.clone()
    tie[0, top[0, 2]] += 2e-5
    flip = _log([_record(seq, pos, near)] * 5 + [_record(seq, pos, tie)] * 25)
    early = base[:6] + [x + 3e-5 for x in base[6:]]  # separates after the flip, as a flipped trajectory does
    rows["dcp"] = [{"step": i, "loss": v} for i, v in enumerate(early)]
    judged = {c["target"]: c["pass"] for c in converge.evaluate(
        rows, cfg, 4, "cpu", routes={"bshd": _log([_record(seq, pos, near)] * 30), "dcp": flip})}
    assert judged["dcp vs bshd: max |delta loss| (first 5 steps) <= 1e-05"]
    assert judged["dcp vs bshd: last-10-step mean loss within 1% (MoE routing)"]
    assert all(judged.values()), judged


def test_every_comparisons_first_difference_is_recorded_whatever_the_precision():
    seq, pos, logits = _tokens()
    other = logits.clone()
    other[:, [0, 1, 2, 3]] = other[:, [3, 2, 1, 0]]
    same, moved = _log([_record(seq, pos, logits)] * 2), _log([_record(seq, pos, logits), _record(seq, pos, other)])
    d = route_rule.differences({"bshd": same, "thd": same, "dcp": moved}, same, "reference")
    assert set(d) == {"thd vs bshd", "dcp vs bshd", "bshd vs reference", "thd vs reference", "dcp vs reference"}
    assert d["thd vs bshd"] is None and d["dcp vs bshd"]["step"] == d["dcp vs reference"]["step"] == 1
    assert route_rule.differences({}, None, "reference") == {}
    assert set(route_rule.differences({"bshd": same, "dcp": moved}, None, "reference")) == {"dcp vs bshd"}
