"""The SSM mixer in one process: the chunked scan equals the token loop, the conv and the scan start
afresh at every sequence, padding never reaches real tokens, gradients are right, heads shard
cleanly, and bad input is refused with a typed error naming the value."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from harness.plan.thd import pack
from harness.runtime.ssm import (
    LocalExchange,
    SequenceLayout,
    SSMConfig,
    SSMConfigError,
    SSMError,
    SSMMixer,
    SSMShardError,
    causal_conv,
    chunked_scan,
    reference_scan,
    segsum,
)

SMALL = SSMConfig(hidden=12, heads=4, head_dim=3, state=5, conv=4, chunk=4)


def scan_inputs(P: int, H: int = 3, D: int = 4, N: int = 5, dtype=torch.float64, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)  # noqa: E731
    dt = torch.rand(P, H, generator=gen, dtype=dtype) * 0.9 + 0.05
    A = -(torch.rand(H, generator=gen, dtype=dtype) * 3 + 0.1)
    return r(P, H, D), dt, A, r(P, N), r(P, N), r(H)


def rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


LAYOUTS = [(0, 5), (0, 8, 20, 21, 24), (0, 0, 7, 7, 40), (0, 64, 67)]


@pytest.mark.parametrize("dtype, tol", [(torch.float64, 1e-13), (torch.float32, 1e-6)])
@pytest.mark.parametrize("cu", LAYOUTS)
@pytest.mark.parametrize("chunk", [1, 3, 4, 16, 64])
def test_chunked_scan_equals_the_token_loop(cu, chunk, dtype, tol):
    """Lengths that are and are not multiples of the chunk, empty sequences, several per pack."""
    args = scan_inputs(cu[-1], dtype=dtype, seed=len(cu) + chunk)
    seqs = SequenceLayout(cu)
    assert rel(chunked_scan(*args, seqs, chunk), reference_scan(*args, seqs)) <= tol


def test_chunked_scan_gradients_equal_the_token_loops():
    seqs = SequenceLayout((0, 9, 10, 23))
    a = [t.requires_grad_() for t in scan_inputs(23)]
    b = [t.detach().clone().requires_grad_() for t in a]
    w = torch.randn(23, 3, 4, dtype=torch.float64)
    (chunked_scan(*a, seqs, 4) * w).sum().backward()
    (reference_scan(*b, seqs) * w).sum().backward()
    for x, y in zip(a, b):
        assert rel(x.grad, y.grad) <= 1e-12


def test_gradcheck_of_the_scan_and_of_the_mixer():
    seqs = SequenceLayout((0, 5, 7))
    args = tuple(t.requires_grad_() for t in scan_inputs(7, H=2, D=2, N=3))
    assert torch.autograd.gradcheck(lambda *t: chunked_scan(*t, seqs, 3), args)
    mixer = SSMMixer(SSMConfig(hidden=4, heads=2, head_dim=2, state=3, conv=3, chunk=3)).double()
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: mixer(t, seqs), (x,))


def test_segsum_is_exact_on_long_chunks():
    """Summed per (t, s), not as a difference of cumulative sums: tiny decays after large ones survive."""
    a = torch.tensor([-1e4] * 8 + [-1e-6] * 8, dtype=torch.float32)
    s = segsum(a)
    assert s[15, 14].item() == pytest.approx(-1e-6, rel=1e-5)
    assert s[3, 5].item() == float("-inf") and s[4, 4].item() == 0.0


def test_conv_restarts_at_every_sequence():
    cu = (0, 3, 11, 12)
    u, w, b = torch.randn(12, 6, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64), torch.randn(6)
    got = causal_conv(u, w, b.double(), SequenceLayout(cu))
    for lo, hi in zip(cu[:-1], cu[1:]):
        want = F.conv1d(u[lo:hi].T[None], w[:, None, :], b.double(), padding=3, groups=6)[0, :, :hi - lo].T
        assert torch.allclose(got[lo:hi], want, rtol=0, atol=1e-13)


def test_a_pack_of_two_equals_each_sequence_alone():
    """The state and the conv reset at a sequence start that is not on a chunk boundary of the pack."""
    mixer = SSMMixer(SMALL).double()
    x = torch.randn(5 + 11, 12, dtype=torch.float64)
    both = mixer(x, SequenceLayout((0, 5, 16)))
    assert rel(both[:5], mixer(x[:5], SequenceLayout((0, 5)))) <= 1e-14
    assert rel(both[5:], mixer(x[5:], SequenceLayout((0, 11)))) <= 1e-14
    assert rel(both[5:], mixer(x, SequenceLayout((0, 16)))[5:]) > 1e-3  # without the reset it differs


@pytest.mark.parametrize("divisor", [4, 8])
def test_padding_never_reaches_real_tokens(divisor):
    lengths = [5, 9, 3]
    mixer = SSMMixer(SMALL)
    real = torch.randn(sum(lengths), 12)
    outs = []
    for d in (1, divisor):
        p = pack(lengths, d)
        x = torch.randn(p.total_tokens, 12) * 100  # padding rows: anything finite
        idx = torch.cat([torch.arange(a, a + L) for a, L in zip(p.cu_seqlens_padded, lengths)])
        x[idx] = real
        outs.append(mixer(x, SequenceLayout(p.cu_seqlens_padded))[idx])
    assert rel(outs[1], outs[0]) <= 1e-6


class _OneShard:
    """A one-process stand-in for shard ``shard`` of ``shards`` holding the whole pack: its heads'
    channels in, zeros for the other shards' channels out."""

    def __init__(self, shards: int, shard: int):
        self.shards, self.shard = shards, shard

    def to_channels(self, u_TC):
        return u_TC.unflatten(1, (self.shards, -1))[:, self.shard]

    def to_tokens(self, y_PC):
        out = y_PC.new_zeros((y_PC.shape[0], self.shards, y_PC.shape[1]))
        return out.index_copy(1, torch.tensor([self.shard]), y_PC[:, None]).flatten(1)

    def replicate(self, v_TC):
        return v_TC


@pytest.mark.parametrize("shards", [2, 4])
def test_sharded_heads_add_up_to_the_whole_mixer(shards):
    """Without the norm the output is linear in y: the shards' outputs sum to the unsharded one, so
    every shard picks its own heads' conv, dt, A and D."""
    mixer = SSMMixer(SSMConfig(hidden=12, heads=4, head_dim=3, state=5, chunk=4, norm=False)).double()
    seqs, x = SequenceLayout((0, 6, 17)), torch.randn(17, 12, dtype=torch.float64)
    parts = sum(mixer(x, seqs, _OneShard(shards, j)) for j in range(shards))
    assert rel(parts, mixer(x, seqs, LocalExchange())) <= 1e-13


def test_init_is_seeded_and_dt_lies_in_range():
    a, b, c = SSMMixer(SMALL), SSMMixer(SMALL), SSMMixer(SSMConfig(seed=1))
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters()))
    assert not torch.equal(a.A_log, SSMMixer(SSMConfig(**{**SMALL.__dict__, "seed": 1})).A_log)
    dt = F.softplus(c.dt_bias)
    assert ((dt >= 1e-3 * 0.999) & (dt <= 1e-1 * 1.001)).all() and (c.A_log.exp() >= 1).all()


@pytest.mark.parametrize("kw, words", [({"heads": 0}, ["heads", "0"]), ({"chunk": 2.5}, ["chunk", "2.5"]),
                                       ({"conv": True}, ["conv", "True"]),
                                       ({"dt_range": (0.1, 0.01)}, ["dt_range", "0.1"])])
def test_bad_configs_are_refused_naming_the_value(kw, words):
    with pytest.raises(SSMConfigError) as e:
        SSMConfig(**kw)
    assert all(w in str(e.value) for w in words)


def test_heads_that_do_not_divide_over_cp_are_refused_with_the_fix():
    with pytest.raises(SSMShardError, match=r"H=4 .*cp=3.*multiple of 3") as e:
        SSMMixer(SMALL)(torch.randn(8, 12), SequenceLayout((0, 8)), _OneShard(3, 0))
    assert isinstance(e.value, ValueError)


def test_bad_layouts_and_token_counts_are_refused():
    with pytest.raises(SSMError, match=r"start at 0"):
        SequenceLayout((1, 4))
    with pytest.raises(SSMError, match=r"never decrease.*\[0, 5, 3\]"):
        SequenceLayout((0, 5, 3))
    with pytest.raises(SSMError, match=r"gave 8 pack tokens but seqs holds 10"):
        SSMMixer(SMALL)(torch.randn(8, 12), SequenceLayout((0, 10)))
