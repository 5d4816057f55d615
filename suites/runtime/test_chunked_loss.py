"""``harness.runtime.chunked_loss``: the LM head and its cross-entropy over chunks of tokens compute what the whole
head and ``F.cross_entropy`` compute.

Judged against the plain head (``F.linear`` then torch's cross-entropy, differentiated by autograd): per-token losses
and the gradients of the head's input and weight, under per-token upstream gradients that differ (zeros included, as
padding gives), for every chunk size (one token, a partial last chunk, one chunk, more than the tokens), a padded
vocabulary, bf16 autocast, and the step's fused weight mode (the gradient added into ``main_grad``). The model with a
loss chunk trains the gradients of the model without. Under tensor parallelism:
``suites/dist_cpu/test_vocab_parallel.py``; training runs: ``suites/convergence/test_tensor_parallel_parity.py``."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from harness.faults.catalogue import get
from harness.runtime import chunked_loss as cl
from harness.runtime.model import ModelConfig, TinyLM
from harness.runtime.weight_cache import FusedWeight


def _plain(h, w, labels, g, vocab=None):
    """Losses and (h, w) gradients of the plain head: the whole logits in fp32, padding columns dropped."""
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    logits = F.linear(h, w).float()
    vocab = vocab or w.shape[0]
    loss = F.cross_entropy(logits[:, :vocab], labels, reduction="none")
    (loss * g).sum().backward()
    return loss.detach(), h.grad, w.grad


def _chunked(h, w, labels, g, chunk, vocab=None):
    h, w = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    loss = cl.head_losses(h, w, labels, chunk, vocab=vocab)
    (loss * g).sum().backward()
    return loss.detach(), h.grad, w.grad


def _case(T, E, V, seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(T, E, generator=gen) * 2
    w = torch.randn(V, E, generator=gen)
    labels = torch.randint(0, V, (T,), generator=gen)
    g = torch.rand(T, generator=gen) * (torch.rand(T, generator=gen) > 0.3)  # some tokens weigh 0 (padding)
    return h, w, labels, g


def _close(a, b, tol=2e-5):
    """Each pair within ``tol`` of the reference's largest magnitude (at least 1); NaN fails, empty pairs pass."""
    return all(x.shape == y.shape and (x.numel() == 0 or ((x - y).abs().max() / y.abs().max().clamp_min(1.0)).item()
                                       < tol) for x, y in zip(a, b, strict=True))


@given(T=st.integers(0, 70), E=st.integers(1, 24), V=st.integers(1, 90), chunk=st.integers(1, 80),
       seed=st.integers(0, 2**16))
def test_the_chunked_head_equals_the_whole_head(T, E, V, chunk, seed):
    h, w, labels, g = _case(T, E, V, seed)
    got, want = _chunked(h, w, labels, g, chunk), _plain(h, w, labels, g)
    assert got[0].shape == (T,) and got[0].dtype == torch.float32
    assert _close(got, want), (T, E, V, chunk)


@pytest.mark.parametrize("chunk", [1, 7, 40, 41, 500])
def test_every_chunk_size_and_a_padded_vocabulary(chunk):
    """Columns from ``vocab`` on are padding (large values the loss must ignore): the loss over the real columns,
    and no gradient into the padding's rows."""
    h, w, labels, g = _case(41, 8, 30, 1)
    w[25:] = 0.0
    h2 = h.clone()
    h2[:, 0] = 30.0  # padding rows (zero) get logit 0; real rows get large ones: the mask must matter
    w2 = w.clone()
    w2[25:, 0] = 5.0  # the padding's logits large
    labels = labels % 25
    got = _chunked(h2, w2, labels, g, chunk, vocab=25)
    want = _plain(h2, w2, labels, g, vocab=25)
    assert _close(got[:2], want[:2])
    assert got[2][25:].abs().max().item() == 0.0 and _close([got[2][:25]], [want[2][:25]])


def test_the_chunked_head_under_bf16_autocast_is_within_bf16_rounding_of_the_whole_head():
    h, w, labels, g = _case(64, 32, 50, 2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = _chunked(h, w, labels, g, 10)
        want = _plain(h, w, labels, g)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    assert _close(got, want, tol=3e-2)


def test_the_fused_weight_mode_adds_the_weight_gradient_into_main_grad():
    """As ``fused_linear``: the gradient goes into the weight's fp32 ``main_grad`` (added to what it held), the copy
    gets a zero broadcast to its shape."""
    h, w, labels, g = _case(33, 16, 40, 3)
    copy = w.clone().requires_grad_()
    main_grad = torch.full_like(w, 0.5)
    hh = h.clone().requires_grad_()
    (cl.head_losses(hh, FusedWeight(copy, main_grad), labels, 8) * g).sum().backward()
    want = _plain(h, w, labels, g)
    assert _close([hh.grad, main_grad - 0.5], [want[1], want[2]])
    assert copy.grad is not None and copy.grad.abs().max().item() == 0.0


def test_a_model_with_a_loss_chunk_trains_the_gradients_of_the_model_without():
    torch.manual_seed(0)
    c = ModelConfig(layers=1, vocab=96)
    whole, chunked = TinyLM(c), TinyLM(ModelConfig(layers=1, vocab=96, loss_chunk=5))
    chunked.load_state_dict(whole.state_dict())
    gen = torch.Generator().manual_seed(4)
    h = torch.randn(23, c.hidden, generator=gen)
    labels = torch.randint(0, 96, (23,), generator=gen)
    real = (torch.rand(23, generator=gen) > 0.25).float()
    a, b = whole.token_ce(h, labels, real), chunked.token_ce(h, labels, real)
    a.sum().backward()
    b.sum().backward()
    assert (a - b).abs().max().item() < 1e-5
    for (n, p), q in zip(whole.named_parameters(), chunked.parameters(), strict=True):
        if p.grad is not None:
            assert (p.grad - q.grad).abs().max().item() < 1e-5, n


def test_the_catalogues_upstream_fault_breaks_the_chunked_head():
    """The check above can fail: with every token scaled by the first's upstream gradient the input's gradient is
    off wherever tokens weigh differently."""
    h, w, labels, g = _case(30, 8, 20, 5)
    with get("chunked-loss-scalar-upstream-grad").applied():
        got = _chunked(h, w, labels, g, 7)
    assert not _close(got[1:], _plain(h, w, labels, g)[1:])


@pytest.mark.parametrize("chunk, match", [(0, "chunk=0 must be an int >= 1"), (True, "chunk=True must be"),
                                          (2.0, "chunk=2.0 must be")])
def test_a_bad_chunk_is_refused_naming_it(chunk, match):
    h, w, labels, _ = _case(4, 2, 3, 0)
    with pytest.raises(cl.ChunkedLossError, match=match):
        cl.head_losses(h, w, labels, chunk)


def test_mismatched_shapes_and_a_shard_without_its_group_are_refused():
    h, w, labels, _ = _case(4, 2, 3, 0)
    with pytest.raises(cl.ChunkedLossError, match=r"h must be T x E and labels T: got h \(4, 2\), labels \(3,\)"):
        cl.head_losses(h, w, labels[:3], 2)
    with pytest.raises(cl.ChunkedLossError, match="start=3 names a vocabulary shard"):
        cl.head_losses(h, w, labels, 2, start=3)


@pytest.mark.parametrize("bad", [-100, 3])
def test_a_label_outside_the_vocabulary_is_an_error_not_a_silent_loss(bad):
    """torch's cross-entropy refuses such an id; the chunked head would otherwise give that token the log-sum-exp alone
    (its target logit never found)."""
    h, w, labels, _ = _case(4, 2, 3, 0)
    labels[2] = bad
    with pytest.raises(RuntimeError, match=r"labels must be token ids in \[0, 3\): clamp or mask"):
        cl.head_losses(h, w, labels, 2)


@pytest.mark.parametrize("bad", [-1, True, 1.5])
def test_model_and_train_configs_refuse_a_bad_loss_chunk(bad):
    from harness.train.config import LayoutError, TrainConfig

    for error, make in ((ValueError, lambda: ModelConfig(loss_chunk=bad)),
                        (LayoutError, lambda: TrainConfig(loss_chunk=bad).validate(1))):
        with pytest.raises(error, match=rf"loss_chunk must be an int >= 0 .* got {bad!r}$"):
            make()


def test_a_compiled_model_with_a_loss_chunk_is_refused_naming_the_fix():
    m = TinyLM(ModelConfig(layers=1, loss_chunk=8))
    with pytest.raises(ValueError, match="use loss_chunk=0 with a compiled model"):
        m.compile_blocks("inductor")
    m.compile_blocks(None)  # eager stays allowed
