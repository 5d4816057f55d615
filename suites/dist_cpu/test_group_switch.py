"""CP groups are passed, switched, restored and destroyed, never kept: attention, multi-token prediction
and the SSM mixer driven with group A, then group B, then no group (an evaluation pass) each use exactly
the group of the call; dynamic groups are created, destroyed and created again in one process without
leaking; a destroyed group is refused by the group audit."""

from __future__ import annotations

import pytest
import torch

from harness.jobs.launch import run_on_ranks

pytestmark = pytest.mark.dist_cpu

MODEL = dict(layers=4, pattern="M*M-", mtp_depth=1)  # a mixer, attention, a mixer, an MLP; one MTP block


def _pass(model, groups, rank, size: int | None, used: list) -> float:
    """One forward of a 2-sequence pack through every layer and the MTP block, in a CP block of ``size``
    ranks (None: each rank alone, an evaluation pass); records the group of every CP call."""
    from harness.parallel.cp_attention import CPAttentionPlan, cp_attention
    from harness.parallel.ssm_cp import CPChannelExchange
    from harness.plan.thd import pack, padding_divisor, zigzag_index_array
    from harness.runtime.model import Rotary
    from harness.runtime.ssm import SequenceLayout

    cp = size or 1
    pos_in_block = groups.layout.position(rank) % cp
    group = groups.for_block(groups.layout.position(rank) // cp * cp, cp) if size else None
    p = pack([24, 40], padding_divisor(cp_size=cp))
    idx = torch.as_tensor(zigzag_index_array(p.cu_seqlens_padded, cp, pos_in_block))
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (p.total_tokens,), generator=gen)[idx]
    positions = torch.cat([torch.arange(b - a) for a, b in zip(p.cu_seqlens_padded, p.cu_seqlens_padded[1:])])[idx]
    plan = CPAttentionPlan.build(p.cu_seqlens_padded, cp, pos_in_block, "cpu")
    exchange = CPChannelExchange(group, cp, pos_in_block, p.cu_seqlens_padded, "cpu") if cp > 1 else None
    seqs = SequenceLayout(tuple(p.cu_seqlens_padded))

    def attention(q, k, v):
        used.append(("attention", group))
        return cp_attention(q, k, v, plan, group)

    def mixing(mixer, x):
        used.append(("mixing", group))
        return mixer(x, seqs, exchange)

    rot = Rotary(positions, model.c.hidden // model.c.heads, model.c.rope_base)
    real = torch.ones(len(tokens))
    with torch.no_grad():
        h, _ = model.run_layers(model.embed(tokens), rot, real, attention, mixing=mixing)
        h = model.mtp_hidden(1, h, tokens, rot, real, attention, mixing)
    return float(h.double().sum())


def switch_world(rank: int, world: int, fault: str | None) -> dict:
    import torch.distributed as dist  # noqa: F401 - the world is initialised by run_on_ranks

    from harness.faults.catalogue import get
    from harness.parallel.groups import DynamicGroups, ParallelLayout, live_groups
    from harness.runtime.model import ModelConfig, TinyLM

    torch.manual_seed(0)
    model = TinyLM(ModelConfig(**MODEL))
    before = live_groups()
    groups = DynamicGroups(ParallelLayout(dp=world, cp=1), rank)
    created = live_groups()
    out = {"calls": []}
    ctx = get(fault).applied() if fault else __import__("contextlib").nullcontext()
    with ctx:
        for size in (2, 4, None):
            used: list = []
            _pass(model, groups, rank, size, used)
            out["calls"].append({"size": size, "groups": [None if g is None else id(g) for _, g in used],
                                 "kinds": sorted({k for k, _ in used}),
                                 "own": None if size is None else id(groups.group(size))})
    groups.destroy()
    destroyed = live_groups()
    again = DynamicGroups(ParallelLayout(dp=world, cp=1), rank)
    recreated = live_groups()
    t = torch.ones(1)
    dist_ok = __import__("torch.distributed", fromlist=["all_reduce"])
    dist_ok.all_reduce(t, group=again.group(world))
    again.destroy()
    out.update(before=before, created=created, destroyed=destroyed, recreated=recreated, after=live_groups(),
               sum=float(t))
    try:
        groups.group(2)
        out["reuse"] = "allowed"
    except ValueError as e:
        out["reuse"] = str(e)
    return out


def test_each_call_uses_exactly_its_own_group_and_groups_do_not_leak(tmp_path):
    results = run_on_ranks(switch_world, world_size=4, tmp_path=tmp_path, args=(None,), timeout_s=120)
    for r in results:
        a, b, none = r["calls"]
        assert a["kinds"] == b["kinds"] == ["attention", "mixing"]  # both mixers, the attention, the MTP block
        assert set(a["groups"]) == {a["own"]} and set(b["groups"]) == {b["own"]} and a["own"] != b["own"]
        assert set(none["groups"]) == {None}  # the evaluation pass ran without any group
        assert r["created"] > r["before"] and r["destroyed"] == r["before"] == r["after"]
        assert r["recreated"] == r["created"] and r["sum"] == 4.0
        assert "destroyed" in r["reuse"]


def test_a_module_that_keeps_its_group_is_visible_here_too(tmp_path):
    """The same drive with the catalogue's ``module-keeps-cp-group`` fault: pass B (CP=4) runs the mixer
    on pass A's CP=2 exchange and group, which cannot take the CP=4 slice: the job fails on every rank
    with an error naming the mismatch instead of training on the wrong group."""
    from harness.jobs.launch import RankFailure

    with pytest.raises(RankFailure, match=r"to_channels expects \[32, channels\], got \[16, \d+\]; the pack "
                                          r"has 64 tokens over cp=2 ranks"):
        run_on_ranks(switch_world, world_size=4, tmp_path=tmp_path, args=("module-keeps-cp-group",), timeout_s=120)
