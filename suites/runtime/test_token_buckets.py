"""``build_microbatches(token_multiple=...)``: every rank's slice is a multiple of the bucket, the
real tokens and the zig-zag structure are untouched, and the loss does not change (the extra padding
is masked and attends only within the last sequence, after its real tokens)."""

from __future__ import annotations

import numpy as np
import pytest

from harness.parallel.reroute import RerouteError, build_microbatches, sample_for
from harness.plan.layout import Block, Schedule
from harness.plan.thd import whole_chunks
from harness.runtime.attention import DeviceChunks, chunk_attention
from harness.runtime.model import MODELS, TinyLM

LENGTHS = {0: 37, 1: 5, 2: 120, 3: 64, 4: 3, 5: 90}


def _schedule():
    blocks = [[Block(0, 1, (0, 1)), Block(1, 1, (4,)), Block(2, 2, (2, 3))], [Block(0, 4, (5,))]]
    return Schedule.from_blocks(blocks, lengths=list(LENGTHS.items()), n_ranks=4, max_seqlen_per_rank=128,
                                algorithm="test")


@pytest.mark.parametrize("multiple", [2, 16, 64])
def test_every_rank_slice_is_a_multiple_and_the_real_tokens_stay(multiple):
    sched = _schedule()
    samples = {g: sample_for(g, L, vocab=256) for g, L in LENGTHS.items()}
    real: dict = {}  # (micro-batch, block start) -> [plain, bucketed] real tokens over the block's ranks
    for position in range(4):
        plain = build_microbatches(samples, sched, position)
        bucketed = build_microbatches(samples, sched, position, token_multiple=multiple)
        for a, b in zip(plain, bucketed):
            T = b.data["tokens"].numel()
            assert T % multiple == 0 and T >= a.data["tokens"].numel()
            assert T - a.data["tokens"].numel() < multiple  # the next multiple, not more
            assert b.cu_seqlens == a.cu_seqlens  # real lengths unchanged
            assert b.cu_seqlens_padded[:-1] == a.cu_seqlens_padded[:-1]  # only the last sequence grows
            last = b.cu_seqlens_padded[-1] - b.cu_seqlens_padded[-2]
            assert last % (2 * b.local_cp_size if b.local_cp_size > 1 else 1) == 0  # zig-zag still slices it
            r = real.setdefault((a.index, a.block_start), [0, 0])
            r[0] += int(a.data["loss_mask"].sum())
            r[1] += int(b.data["loss_mask"].sum())
    # the zig-zag chunks of the grown sequence move, so a rank's share may change; the block's does not
    assert all(p == b for p, b in real.values()) and len(real) == 4


def test_the_loss_of_a_bucketed_micro_batch_is_the_loss_of_the_plain_one():
    model = TinyLM(MODELS["tiny-gpt"])
    sched = Schedule.from_blocks([[Block(0, 1, (0, 1, 2))]], lengths=[(g, LENGTHS[g]) for g in (0, 1, 2)],
                                 n_ranks=1, max_seqlen_per_rank=256, algorithm="test")
    samples = {g: sample_for(g, LENGTHS[g], vocab=256) for g in (0, 1, 2)}
    losses = []
    for multiple in (0, 64):
        (mb,) = build_microbatches(samples, sched, 0, token_multiple=multiple)
        chunks = DeviceChunks.build(whole_chunks(np.asarray(mb.cu_seqlens_padded)), "cpu")
        d = mb.data
        ce, _ = model.token_losses(d["tokens"], d["labels"], d["loss_mask"], d["position_ids"],
                                   lambda q, k, v, c=chunks: chunk_attention(q, k, v, c))
        losses.append((ce.item(), d["tokens"].numel()))
    assert losses[1][1] == 192 and losses[0][1] == 162
    assert losses[1][0] == pytest.approx(losses[0][0], rel=1e-6)


@pytest.mark.parametrize("bad", [-1, 3, 2.0])
def test_bad_multiples_are_refused(bad):
    with pytest.raises(RerouteError, match="token_multiple"):
        build_microbatches({}, _schedule(), 0, token_multiple=bad)


def test_the_verified_step_takes_the_measured_steps_bucket():
    """``converge`` / the nightly (``TrainConfig``) and ``bench step`` resolve ``auto`` alike: 64 on CUDA when it
    divides the pack, off on the CPU; an explicit 0 stays 0 through the CLI; the reference run never pads."""
    from harness.apps import reference
    from harness.apps.converge import config_from_args
    from harness.bench.step.config import StepBenchConfig
    from harness.cli import parser
    from harness.train.config import TrainConfig

    for device, m, want in [("cuda", 512, 64), ("cuda", 1000, 0), ("cpu", 512, 0)]:
        train = TrainConfig(device=device, max_seqlen_per_rank=m)
        assert (train.token_bucket, train.bucket()) == ("auto", want)
        assert StepBenchConfig(device=device, max_seqlen_per_rank=m).bucket() == want
        assert reference.config(train).bucket() == 0
    assert reference.config(TrainConfig(token_bucket=16)).bucket() == 0
    for argv, want in [([], "auto"), (["--token-bucket", "0"], 0), (["--token-bucket", "16"], 16)]:
        assert config_from_args(parser().parse_args(["converge", *argv])).token_bucket == want, argv
