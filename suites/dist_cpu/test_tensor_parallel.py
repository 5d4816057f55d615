"""``harness.parallel.tensor_parallel``: a block split over TP ranks computes what the whole block computes.

Judged against the unsplit model in one process (the same seed's weights, autograd over whole matrices): the shards
reassemble exactly (hypothesis over split layouts), a real gloo world of 2 and 4 TP ranks runs a dense block forward
and backward to the unsplit block's outputs and gradients, and the squared gradient norm counts each shard once and
each replicated parameter once. Training runs with TP are in ``suites/convergence/test_tensor_parallel_parity.py``."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.jobs.launch import run_on_ranks
from harness.parallel import tensor_parallel as tpm
from harness.parallel.groups import DynamicGroups, ParallelLayout
from harness.runtime.layers import Rotary, ShardedCallError
from harness.runtime.model import MODELS, Block, ModelConfig, TinyLM
from harness.runtime.ssm import SequenceLayout, SSMShardError
from harness.train.config import TrainConfig
from harness.train.layouts import LayoutError

pytestmark = pytest.mark.dist_cpu


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 3), st.lists(st.integers(1, 4), min_size=1, max_size=3), st.integers(0, 1),
       st.integers(1, 5), st.integers(0, 2**16))
def test_every_shard_reassembles_the_whole_tensor(log_tp, units, dim, other, seed):
    tp = 1 << (log_tp - 1)
    segments = [u * tp for u in units]
    shape = [sum(segments), other] if dim == 0 else [other, sum(segments)]
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    parts = [tpm.take(t, (dim, segments), tp, r) for r in range(tp)]
    assert all(p.is_contiguous() and p.shape[dim] == sum(segments) // tp for p in parts)
    assert torch.equal(tpm.assemble(parts, (dim, segments)), t)
    if tp > 1:  # each rank keeps its own piece of every segment (the q, k and v heads of one QKV matrix)
        first = t.narrow(dim, 0, segments[0]).chunk(tp, dim)[1]
        assert torch.equal(parts[1].narrow(dim, 0, units[0]), first)


def test_the_split_parameters_are_the_blocks_matrices_and_the_vocabulary():
    c = MODELS["tiny-gpt-mtp"]
    split = sorted(n for n, _ in TinyLM(c).named_parameters() if tpm.spec(n, c) is not None)
    assert split == sorted([f"blocks.{i}.{w}" for i in range(c.layers) for w in
                            ("qkv.weight", "proj.weight", "mlp.gate_up.weight", "mlp.down.weight")] +
                           [f"mtp.0.block.{w}" for w in ("qkv.weight", "proj.weight", "mlp.gate_up.weight",
                                                          "mlp.down.weight")] + ["embed.weight", "head.weight"])
    assert tpm.spec("mtp.0.combine.weight", c) is None and tpm.spec("norm.weight", c) is None
    assert tpm.spec("embed.weight", c) == tpm.spec("head.weight", c) == (0, [c.vocab])


@pytest.mark.parametrize("cfg, world, match", [
    ({"tp": 3}, 6, r"heads=4 is not a multiple of tp=3"),
    ({"tp": 2}, 6, r"world size 6 is not a multiple|not a power of two"),
    ({"tp": 2, "model": "tiny-moe", "expert_parallel": True}, 4,
     r"expert parallelism with tensor parallelism \(tp=2\) needs sequence parallelism.*add --sequence-parallel"),
    ({"tp": 2, "model": "tiny-hybrid"}, 8,
     r"SSM mixers' 2 heads of a TP rank cannot be split over a CP block of 4 ranks.*ssm_heads a multiple of 8"),
    ({"tp": 8, "model": "tiny-hybrid"}, 8, r"heads=4 is not a multiple of tp=8"),
    ({"tp": 2, "cp_exchange": "te:p2p"}, 4, r"does not run with the te:p2p exchange"),
    ({"tp": 2, "cp_exchange": "a2a"}, 8, r"heads=2 is not a multiple of cp_size=4.*with tp=2 each rank's 2 of the 4 heads"),
    ({"tp": 0}, 4, r"tp must be an int >= 1, got 0"),
])
def test_configurations_tensor_parallelism_cannot_run_are_refused_with_the_fix(cfg, world, match):
    with pytest.raises(LayoutError, match=match):
        TrainConfig(**cfg).validate(world)


def test_the_hybrids_mixers_split_by_heads_and_their_b_c_parameters_are_summed_over_tp():
    c = MODELS["tiny-hybrid"]
    Di, H = c.ssm_heads * c.ssm_head_dim, c.ssm_heads
    want = {"in_proj.weight": (0, [Di, Di, H]), "conv_x_weight": (0, [Di]), "conv_x_bias": (0, [Di]),
            "norm_weight": (0, [Di]), "out_proj.weight": (1, [Di]), "dt_bias": (0, [H]), "A_log": (0, [H]),
            "D": (0, [H]), "bc_proj.weight": None, "conv_bc_weight": None, "conv_bc_bias": None}
    names = [n for n, _ in TinyLM(c).named_parameters() if n.startswith("blocks.0.mixer.")]
    assert sorted(n.removeprefix("blocks.0.mixer.") for n in names) == sorted(want)
    for n in names:
        assert tpm.spec(n, c) == want[n.removeprefix("blocks.0.mixer.")], n
        assert tpm.partial_over_tp(n) == (want[n.removeprefix("blocks.0.mixer.")] is None)
    assert tpm.spec("blocks.1.qkv.weight", c) is not None and tpm.spec("blocks.3.mlp.up.weight", c) is not None
    mixer = TinyLM(c).blocks[0].mixer
    with torch.no_grad():
        mixer.A_log.data = mixer.A_log.data[:2]
    with pytest.raises(SSMShardError, match="keeps 2 of 4 heads .* pass tp="):
        mixer(torch.randn(8, c.hidden), SequenceLayout((0, 8)))


def test_a_sharded_block_called_without_its_tensor_parallelism_is_refused():
    c = ModelConfig()
    b = Block(c, moe=False)
    with torch.no_grad():
        b.qkv.weight.data = tpm.take(b.qkv.weight.data, tpm.spec("qkv.weight", c), 2, 0)
        b.proj.weight.data = tpm.take(b.proj.weight.data, tpm.spec("proj.weight", c), 2, 0)
    x, pos = torch.randn(8, c.hidden), torch.arange(8)
    with pytest.raises(ShardedCallError, match="keeps 2 of the model's 4 heads"):
        b(x, pos, torch.ones(8), lambda q, k, v: q)


def _causal(q, k, v):
    """Plain causal attention of one sequence (GQA: K/V heads repeated)."""
    rep = q.shape[1] // k.shape[1]
    qh, kh, vh = q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1), v.repeat_interleave(rep, 1).transpose(0, 1)
    return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, is_causal=True).transpose(0, 1)


def split_pair(c, rank: int, world: int, **block) -> tuple:
    """(the whole fp64 ``Block(c, **block)``, a copy keeping TP rank ``rank``'s shards, its ``TensorParallel``, the
    groups): the same seed's weights in both."""
    torch.manual_seed(0)
    ref, part = Block(c, **block).double(), Block(c, **block).double()
    part.load_state_dict(ref.state_dict())
    groups = DynamicGroups(ParallelLayout(dp=1, cp=1, tp=world), rank)
    with torch.no_grad():
        for name, p in part.named_parameters():
            if (how := tpm.spec(name, c)) is not None:
                p.data = tpm.take(p.data, how, world, rank)
                setattr(p, tpm.MARK, True)
    return ref, part, tpm.TensorParallel(world, rank, groups.tp_group), groups


def _block_world(rank: int, world: int) -> dict:
    """Every rank: the whole block (same seed) and its TP shard on the same tokens; outputs, whole gradients and the
    squared norm of the sharded block's gradients, against the whole block's."""
    c = ModelConfig(heads=4, kv_heads=4, ffn=128) if world == 4 else ModelConfig()
    ref, part, tp, groups = split_pair(c, rank, world, moe=False)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(12, c.hidden, generator=g, dtype=torch.float64)
    w = torch.randn(12, c.hidden, generator=g, dtype=torch.float64)
    rot, real = Rotary(torch.arange(12), c.hidden // c.heads, c.rope_base), torch.ones(12)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, _ = ref(xa, rot, real, _causal)
    yb, _ = part(xb, rot, real, _causal, tp=tp)
    (ya * w).sum().backward()
    (yb * w).sum().backward()
    grads = {n: (tpm.whole(n, p.grad, c, tp) - dict(ref.named_parameters())[n].grad).abs().max().item()
             for n, p in part.named_parameters()}
    sq = tpm.square_norm(list(part.parameters()), tp).item()
    want = sum(p.grad.pow(2).sum().item() for p in ref.parameters())
    groups.destroy()
    return {"out": (ya - yb).abs().max().item(), "dx": (xa.grad - xb.grad).abs().max().item(), "grads": grads,
            "norm": abs(sq - want) / want}


@pytest.mark.parametrize("world", [2, 4])
def test_a_split_block_equals_the_whole_block_forward_and_backward(world, tmp_path):
    for r in run_on_ranks(_block_world, world_size=world, tmp_path=tmp_path, timeout_s=60):
        assert r["out"] < 1e-12 and r["dx"] < 1e-12, r
        assert all(v < 1e-12 for v in r["grads"].values()), r["grads"]  # NaN fails (max would skip it)
        assert r["norm"] < 1e-12, r


def _planted_world(rank: int, world: int, which: str) -> float:
    """The split block's output deviation with ``enter`` or ``leave`` replaced by the identity."""
    from harness.faults.seam import replaced

    with replaced(f"harness.parallel.tensor_parallel:{which}", lambda orig: (lambda x, tp: x)):
        r = _block_world(rank, world)
    return max(r["out"], r["dx"])


@pytest.mark.parametrize("which", ["enter", "leave"])
def test_either_collective_left_out_breaks_the_split_block(which, tmp_path):
    """The check above can fail: without ``leave`` the outputs are partial sums, without ``enter`` the input's
    gradient is one shard's share."""
    devs = run_on_ranks(_planted_world, world_size=2, tmp_path=tmp_path, args=(which,), timeout_s=60)
    assert min(devs) > 1e-3, devs


def test_the_tp_group_audit_names_a_group_of_another_rank_order(tmp_path):
    got = run_on_ranks(_audit_world, world_size=4, tmp_path=tmp_path, timeout_s=60)
    assert got[0] == got[3] and "the TP group holds ranks [0, 2], the TP ranks of its position are [0, 1]" in got[0]


def _audit_world(rank: int, world: int) -> str:
    from harness.faults.seam import replaced
    from harness.faults.tp_faults import make_tp_group_position_fastest
    from harness.parallel.audit import TPGroupAuditError, audit_tp_group

    layout = ParallelLayout(dp=2, cp=1, tp=2)
    clean = DynamicGroups(layout, rank)
    audit_tp_group(clean)  # the right groups pass
    assert dist.get_process_group_ranks(clean.tp_group) == [rank - rank % 2, rank - rank % 2 + 1]
    clean.destroy()
    with replaced("harness.parallel.groups:tp_group_ranks", make_tp_group_position_fastest):
        bad = DynamicGroups(layout, rank)
    try:
        audit_tp_group(bad)
    except TPGroupAuditError as e:
        return str(e)
    finally:
        bad.destroy()
    return "no error"
