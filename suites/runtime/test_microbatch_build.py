"""``build_microbatches``: each rank's micro-batch columns equal a plain reference built sequence by sequence -
every sample padded to its packed width (padding: the column's pad value, ``position_ids`` counting on, ``seq``
the sequence's gid), the pack cut into ``2 x cp`` chunks per sequence and rank ``r`` keeping chunks ``r`` and
``2 cp - 1 - r`` - for any lengths, block shapes, padding mode and token bucket."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.parallel.reroute import RerouteError, build_microbatches, mtp_keys, pad_value, sample_for
from harness.plan.layout import Block, Schedule


def _reference(samples, gids, cu_padded, size, rank, keys):
    """The columns of ``rank``'s slice, list by list (shares nothing with the builder but the pack's widths)."""
    full = {k: [] for k in keys + ("seq",)}
    for i, g in enumerate(gids):
        width = cu_padded[i + 1] - cu_padded[i]
        for k in keys:
            vals = samples[g][k].tolist()
            extra = width - len(vals)
            full[k] += vals + (list(range(len(vals), width)) if k == "position_ids" else [pad_value(k)] * extra)
        full["seq"] += [g] * width
    keep = []
    for i in range(len(gids)):
        start, width = cu_padded[i], cu_padded[i + 1] - cu_padded[i]
        if size == 1:
            keep += list(range(start, start + width))
            continue
        c = width // (2 * size)
        keep += list(range(start + rank * c, start + (rank + 1) * c))
        keep += list(range(start + (2 * size - 1 - rank) * c, start + (2 * size - rank) * c))
    return {k: [v[j] for j in keep] for k, v in full.items()}


@st.composite
def _batches(draw):
    """A schedule over 4 ranks: per micro-batch, blocks of sizes 1, 2 or 4 tiling the ranks, 1-3 sequences each."""
    tilings = [(1, 1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2), (2, 2), (4,)]
    layout, lengths, gid = [], [], 0
    for _ in range(draw(st.integers(1, 3))):
        blocks, start = [], 0
        for size in draw(st.sampled_from(tilings)):
            n = draw(st.integers(1, 3))
            gids = tuple(range(gid, gid + n))
            lengths += [(g, draw(st.integers(1, 40))) for g in gids]
            blocks.append(Block(start, size, gids))
            start, gid = start + size, gid + n
        layout.append(blocks)
    return Schedule.from_blocks(layout, lengths=lengths, n_ranks=4, max_seqlen_per_rank=200, algorithm="test")


@settings(max_examples=60, deadline=None)
@given(_batches(), st.sampled_from(["local", "domain", "fixed"]), st.sampled_from([0, 1, 2, 16]),
       st.booleans())
def test_every_rank_slice_equals_the_sequence_by_sequence_reference(sched, padding, multiple, mtp):
    keys = ("tokens", "labels", "loss_mask", "position_ids") + (mtp_keys(1) if mtp else ())
    samples = {}
    for g, L in sched.lengths.items():
        s = sample_for(g, L, vocab=97)
        for k in keys[4:]:  # extra columns travel like the others (multi-token prediction's)
            s[k] = (s["tokens"] * 3 + len(k)) % 97
        samples[g] = s
    fixed = 8 * -(-max(sched.lengths.values()) // 8) if padding == "fixed" else 0
    for position in range(4):
        mbs = build_microbatches(samples, sched, position, padding=padding, fixed_length=fixed,
                                 token_multiple=0 if padding == "fixed" else multiple)
        for mb in mbs:
            want = _reference(samples, mb.gids, mb.cu_seqlens_padded, mb.local_cp_size, mb.cp_rank, keys)
            assert list(mb.data) == list(keys) + ["seq"]
            for k, v in want.items():
                assert mb.data[k].dtype == torch.int64 and mb.data[k].tolist() == v, (k, mb.index, position)
            widths = [b - a for a, b in zip(mb.cu_seqlens_padded, mb.cu_seqlens_padded[1:])]
            real = [b - a for a, b in zip(mb.cu_seqlens, mb.cu_seqlens[1:])]
            assert real == [sched.lengths[g] for g in mb.gids] and all(w >= n for w, n in zip(widths, real))


def test_a_sample_that_disagrees_with_the_schedule_is_named(monkeypatch):
    sched = Schedule.from_blocks([[Block(0, 1, (0, 1))]], lengths=[(0, 5), (1, 7)], n_ranks=1,
                                 max_seqlen_per_rank=64, algorithm="test")
    samples = {0: sample_for(0, 5), 1: sample_for(1, 6)}  # gid 1 is a token short
    with pytest.raises(RerouteError, match=r"'tokens' do not match the schedule's lengths: \(gid, shape\) \[\(1, \(6,\)\)\]"):
        build_microbatches(samples, sched, 0)
    samples = {0: sample_for(0, 6), 1: sample_for(1, 6)}  # one too long, one too short: the total still matches
    with pytest.raises(RerouteError, match=r"\[\(0, \(6,\)\), \(1, \(6,\)\)\]"):
        build_microbatches(samples, sched, 0)
    monkeypatch.setattr("harness.parallel.reroute.block_sequences", lambda block, position: ())
    with pytest.raises(RerouteError, match="micro-batch 0's block at position 0 packs no sequence"):
        build_microbatches({0: sample_for(0, 5), 1: sample_for(1, 7)}, sched, 0)


@settings(max_examples=60, deadline=None)
@given(_batches(), st.sampled_from(["local", "domain", "fixed"]), st.sampled_from([0, 2, 6, 16]),
       st.sampled_from([2, 4]))
def test_sequence_parallel_padding_splits_every_ranks_rows_evenly_over_tp(sched, padding, multiple, tp):
    """With sequence parallelism every rank's token rows split evenly over its ``tp`` TP ranks (each sequence, the
    fixed length and the token bucket's growth padded to multiples of ``tp``), and the columns are still the
    sequence-by-sequence reference's."""
    keys = ("tokens", "labels", "loss_mask", "position_ids")
    samples = {g: sample_for(g, L, vocab=97) for g, L in sched.lengths.items()}
    fixed = 8 * -(-max(sched.lengths.values()) // 8) if padding == "fixed" else 0
    for position in range(4):
        mbs = build_microbatches(samples, sched, position, padding=padding, fixed_length=fixed, tp_size=tp,
                                 sequence_parallel=True, token_multiple=0 if padding == "fixed" else multiple)
        for mb in mbs:
            assert mb.data["tokens"].numel() % tp == 0, (mb.index, position, mb.cu_seqlens_padded)
            want = _reference(samples, mb.gids, mb.cu_seqlens_padded, mb.local_cp_size, mb.cp_rank, keys)
            assert all(mb.data[k].tolist() == v for k, v in want.items())
