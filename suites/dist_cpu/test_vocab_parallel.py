"""``harness.parallel.vocab_parallel``: the embedding table and the LM head split by vocabulary rows over the TP ranks
compute what the whole table and head compute.

Judged against the unsplit model in one process (the same seed's weights; ``nn.Embedding`` and ``F.cross_entropy``
over the whole vocabulary): a real gloo world of 2 and 4 TP ranks looks tokens up, runs the final norm, the head and
the loss forward and backward on every rank's shards, and the per-token losses, the hidden states' gradient and the
whole gradients of the table and the head equal the unsplit ones (fp64 weights) - for tokens of every rank's range,
ignored labels (-100) and the range edges (to fp32's rounding: the loss runs in fp32). The loss alone also equals
torch's on random cases with large logits in fp64. A vocabulary tp does not divide, or one padded further (Megatron's
``--make-vocab-size-divisible-by``), trains the unpadded model: the padding's rows are zero and its logits masked, also
where they hold large values. The head and loss over chunks of tokens (``ModelConfig.loss_chunk``) equal them too.
Each vocabulary-parallel catalogue fault breaks it. Training runs
with TP (the vocabulary split too) are in ``suites/convergence/test_tensor_parallel_parity.py``."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from harness.faults import vocab_faults
from harness.jobs.launch import run_on_ranks
from harness.parallel import tensor_parallel as tpm
from harness.parallel.groups import DynamicGroups, ParallelLayout
from harness.parallel.options import TensorParallelError, check_tp_model
from harness.runtime.layers import ShardedCallError
from harness.runtime.model import ModelConfig, TinyLM

pytestmark = pytest.mark.dist_cpu

T = 40


def _tokens(vocab: int, tp: int, multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens and labels that hit every rank's range, both edges of each range (its last real id where padding
    follows), and ignored labels."""
    from harness.parallel.vocab_parallel import padded_vocab

    per = padded_vocab(vocab, tp, multiple) // tp
    edges = [e for r in range(tp) if r * per < vocab for e in (r * per, min((r + 1) * per, vocab) - 1)]
    g = torch.Generator().manual_seed(3)
    tokens = torch.cat([torch.tensor(edges), torch.randint(0, vocab, (T - len(edges),), generator=g)])
    labels = torch.cat([torch.tensor(edges[::-1]), torch.randint(0, vocab, (T - len(edges),), generator=g)])
    labels[5] = labels[17] = -100
    return tokens, labels


def _vocab_world(rank: int, world: int, fault: str | None = None, size: int | None = None, vocab: int = 256,
                 multiple: int = 1, chunk: int = 0) -> dict:
    """Every rank: the unsplit model and its vocabulary shard (``size`` TP ranks a position, default the world; the
    vocabulary padded to a multiple of ``multiple`` x size; the shard's head and loss ``chunk`` tokens at a time,
    ``harness.runtime.chunked_loss``, where given) on the same tokens, the losses, the hidden states' gradient and the
    whole gradients against the unsplit ones."""
    from harness.faults.catalogue import get

    size = size or world
    torch.manual_seed(0)
    c = ModelConfig(layers=1, kv_heads=4, vocab=vocab)
    ref = TinyLM(c).double()
    part = TinyLM(ModelConfig(layers=1, kv_heads=4, vocab=vocab, loss_chunk=chunk)).double()
    part.load_state_dict(ref.state_dict())
    groups = DynamicGroups(ParallelLayout(dp=world // size, cp=1, tp=size), rank)
    tp = tpm.TensorParallel(size, rank % size, groups.tp_group, vocab_multiple=multiple)
    tokens, labels = _tokens(c.vocab, size, multiple)
    real = (labels >= 0).double()
    w = torch.randn(T, c.hidden, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    # the unsplit side: a table lookup, a stand-in for the blocks (x * w), the norm, the head, torch's cross-entropy
    # over the whole vocabulary in fp32 (the model's loss precision)
    ha = ref.embed(tokens) * w
    ha.retain_grad()
    la = F.cross_entropy(ref.head(ref.norm(ha)).float(), labels.clamp_min(0), reduction="none") * real
    la.sum().backward()
    with get(fault).applied() if fault else nullcontext():
        tpm.shard_model(part, tp)
        hb = part.embed_tokens(tokens, tp) * w
        hb.retain_grad()
        lb = part.token_ce(hb, labels, real, tp)
        lb.sum().backward()
    whole = {n: tpm.whole(n, p.grad, c, tp) for n, p in part.named_parameters() if p.grad is not None}
    mine = dict(ref.named_parameters())
    out = {"loss": (la - lb).abs().max().item(), "dh": (ha.grad - hb.grad).abs().max().item(),
           "grads": {n: (g - mine[n].grad).abs().max().item() for n, g in whole.items()},
           "shapes": [tuple(part.embed.weight.shape), tuple(part.head.weight.shape)]}
    groups.destroy()
    return out


@pytest.mark.parametrize("world, vocab, multiple, rows, chunk", [
    (2, 256, 1, 128, 0), (4, 256, 1, 64, 0), (4, 250, 1, 63, 0), (2, 256, 96, 192, 0), (2, 128, 128, 128, 0),
    # the chunked head: a partial last chunk of 40 tokens; 250 ids padded to 384 rows, the last rank's 96 all padding
    # and starting past the vocabulary's end
    (4, 250, 1, 63, 7), (4, 250, 96, 96, 16)],
    ids=["2", "4", "4-odd", "2-padded", "2-shard-of-whole-width", "4-odd-chunked", "4-padding-shard-chunked"])
def test_the_split_vocabulary_equals_the_whole_table_and_head(world, vocab, multiple, rows, chunk, tmp_path):
    for r in run_on_ranks(_vocab_world, world_size=world, tmp_path=tmp_path, args=(None, None, vocab, multiple, chunk),
                          timeout_s=60):
        assert r["shapes"] == [(rows, 64), (rows, 64)], r["shapes"]  # whole() gave back the unpadded gradients
        assert r["loss"] < 1e-6 and r["dh"] < 1e-6, r  # the loss runs in fp32: its sums in another order
        assert set(r["grads"]) == {"embed.weight", "norm.weight", "head.weight"}, r["grads"]
        assert all(v < 1e-6 for v in r["grads"].values()), r["grads"]  # NaN fails


@pytest.mark.parametrize("fault", [f.name for f in vocab_faults.VOCAB_FAULTS])
def test_every_vocabulary_parallel_fault_breaks_the_split_vocabulary(fault, tmp_path):
    """The check above can fail: each catalogue fault of the vocabulary seams moves the losses, the hidden states'
    gradient or a whole gradient off the unsplit model's - on every rank, or (the range from the world rank) on the
    ranks of the second position of two, whose world rank is not their TP rank."""
    got = run_on_ranks(_vocab_world, world_size=4, tmp_path=tmp_path, args=(fault, 2, 251, 96), timeout_s=60)
    off = [not all(v <= 1e-3 for v in [r["loss"], r["dh"], *r["grads"].values()]) for r in got]  # NaN: off
    assert off == ([False, False, True, True] if fault == "vocab-range-from-world-rank" else [True] * 4), got


def test_the_chunked_heads_tp_fault_breaks_the_split_vocabulary(tmp_path):
    """The chunked cases above can fail: the log-sum-exp of each rank's own columns moves every rank's losses."""
    got = run_on_ranks(_vocab_world, world_size=2, tmp_path=tmp_path,
                       args=("chunked-loss-lse-own-columns", None, 250, 1, 7), timeout_s=60)
    assert all(r["loss"] > 1e-2 for r in got), got  # NaN fails


def test_a_split_vocabulary_called_without_its_tensor_parallelism_is_refused():
    c = ModelConfig(layers=1)
    m = TinyLM(c)
    with torch.no_grad():
        m.head.weight.data = tpm.take(m.head.weight.data, tpm.spec("head.weight", c), 2, 0)
    with pytest.raises(ShardedCallError, match="keep 128 of the model's 256 vocabulary rows"):
        m.token_ce(torch.randn(4, c.hidden), torch.zeros(4, dtype=torch.long), torch.ones(4))


def test_a_vocabulary_smaller_than_tp_is_refused_naming_the_fix():
    check_tp_model(ModelConfig(vocab=250, heads=4, kv_heads=4), 4, "'odd'")  # padded to 252
    with pytest.raises(TensorParallelError, match=r"'tiny''s vocab=3 is smaller than tp=4; use a tp of at most 3"):
        check_tp_model(ModelConfig(vocab=3, heads=4, kv_heads=4), 4, "'tiny'")


def _ce_padded_world(rank: int, world: int) -> list[tuple]:
    """Random vocabularies tp does not divide, padded (also further, ``multiple``): the padding columns hold large
    logits, which the loss must ignore; the split loss and the real columns' gradient against torch's cross-entropy
    over the real vocabulary, and the padding columns' gradient zero."""
    from harness.parallel import vocab_parallel as vp

    groups = DynamicGroups(ParallelLayout(dp=1, cp=1, tp=world), rank)
    g = torch.Generator().manual_seed(13)
    worst = []
    for k in range(30):
        multiple = (1, 3)[k % 2]
        tp = tpm.TensorParallel(world, rank, groups.tp_group, vocab_multiple=multiple)
        vocab = int(torch.randint(world + 1, 90, (), generator=g))
        padded = vp.padded_vocab(vocab, world, multiple)
        rows = int(torch.randint(1, 20, (), generator=g))
        logits = torch.randn(rows, padded, generator=g, dtype=torch.float64) * 5
        logits[:, vocab:] = 40.0  # what the padding columns must not contribute
        labels = torch.randint(0, vocab, (rows,), generator=g)
        ref = logits[:, :vocab].clone().requires_grad_()
        F.cross_entropy(ref, labels, reduction="none").sum().backward()
        mine = logits.chunk(world, -1)[rank].clone().requires_grad_()
        got = vp.cross_entropy(mine, labels, vocab, tp)
        got.sum().backward()
        grad = mine.grad.new_empty((world * rows, padded // world))
        torch.distributed.all_gather_into_tensor(grad, mine.grad.contiguous(), group=tp.group)
        whole = torch.cat(grad.chunk(world, 0), -1)
        want = F.cross_entropy(ref.detach(), labels, reduction="none")
        worst.append((vocab, padded, (got - want).abs().max().item(), (whole[:, :vocab] - ref.grad).abs().max().item(),
                      whole[:, vocab:].abs().max().item() if padded > vocab else 0.0))
    groups.destroy()
    return worst


def test_the_padded_vocabularys_logits_are_masked_out_of_the_loss(tmp_path):
    for cases in run_on_ranks(_ce_padded_world, world_size=2, tmp_path=tmp_path, timeout_s=60):
        assert any(p > v for v, p, *_ in cases)  # padding exercised
        assert all(dl < 1e-9 and dg < 1e-9 and pad == 0.0 for _, _, dl, dg, pad in cases), cases


def _ce_cases_world(rank: int, world: int) -> list[tuple]:
    """40 seeded random cases (vocabulary, rows, logit scale up to 80: exp overflows without the maximum, ignored
    labels): the split loss and the whole logits' gradient (each rank's columns gathered) against torch's
    cross-entropy over the whole vocabulary, in fp64."""
    from harness.parallel import vocab_parallel as vp

    groups = DynamicGroups(ParallelLayout(dp=1, cp=1, tp=world), rank)
    tp = tpm.TensorParallel(world, rank, groups.tp_group)
    g = torch.Generator().manual_seed(11)
    worst = []
    for _ in range(40):
        vocab = world * int(torch.randint(1, 24, (), generator=g))
        rows = int(torch.randint(1, 30, (), generator=g))
        scale = float(torch.rand((), generator=g)) * 80
        logits = torch.randn(rows, vocab, generator=g, dtype=torch.float64) * scale
        labels = torch.randint(0, vocab, (rows,), generator=g)
        real = (torch.rand(rows, generator=g) > 0.2).double()
        ref = logits.clone().requires_grad_()
        want = F.cross_entropy(ref, labels, reduction="none") * real
        (want * torch.arange(1.0, rows + 1, dtype=torch.float64)).sum().backward()
        mine = logits.chunk(world, -1)[rank].clone().requires_grad_()
        got = vp.cross_entropy(mine, labels, vocab, tp) * real
        (got * torch.arange(1.0, rows + 1, dtype=torch.float64)).sum().backward()
        grad = mine.grad.new_empty((world * rows, vocab // world))
        torch.distributed.all_gather_into_tensor(grad, mine.grad.contiguous(), group=tp.group)
        whole = torch.cat(grad.chunk(world, 0), -1)
        worst.append((vocab, rows, round(scale, 1), (got - want).abs().max().item(),
                      (whole - ref.grad).abs().max().item(), bool(torch.isfinite(got).all())))
    groups.destroy()
    return worst


def test_the_vocab_parallel_loss_equals_torchs_on_random_cases_and_large_logits(tmp_path):
    for cases in run_on_ranks(_ce_cases_world, world_size=2, tmp_path=tmp_path, timeout_s=60):
        assert all(finite and dl < 1e-9 and dg < 1e-9 for *_, dl, dg, finite in cases), \
            [c for c in cases if not (c[-1] and c[3] < 1e-9 and c[4] < 1e-9)]
