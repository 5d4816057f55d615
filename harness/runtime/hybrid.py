"""The layers of a hybrid model (Megatron's ``hybrid_override_pattern``): an SSM mixer layer (``M``),
an attention layer (``*``) and an MLP layer (``-``), each a pre-norm residual ``x + f(norm(x))``.

Every layer takes the micro-batch's CP operations per call - ``attention`` (its plan and group inside)
and ``mixing`` (``mixing(mixer, x)``: the SSM mixer with the micro-batch's sequence layout and CP
exchange) - through ``harness.runtime.layers.cp_ops``, and keeps neither between calls; and ``tp``, the step's
tensor parallelism when the layer keeps a TP shard (the mixer's heads, the attention's heads, the MLP's FFN:
``harness.parallel.tensor_parallel``). Returns (hidden states, aux loss) like ``harness.runtime.model.Block``.
Shape legend as in ``layers``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from harness.runtime import layers
from harness.runtime.layers import Attention, Mixing, RMSNorm, Rotary, dense_mlp
from harness.runtime.model_config import ModelConfig
from harness.runtime.ssm import SSMConfig, SSMMixer
from harness.runtime.weight_cache import linear, weight


def self_attention(layer: nn.Module, c: ModelConfig, x_TE, rot: Rotary, attention: Attention, tp=None):
    """``x + proj(attention(rope(q), rope(k), v))`` with the layer's ``norm1``, ``qkv`` and ``proj``
    (the attention half of a transformer block). ``tp``: the call's tensor parallelism (``layers.TensorParallelOps``)
    when the layer keeps a shard of its heads."""
    D = c.hidden // c.heads
    H, Hkv = layers.local_heads(layer, c, tp)
    h = layer.norm1(x_TE)
    q, k, v = linear(h if tp is None else tp.enter(h), weight(layer.qkv.weight)).split([H * D, Hkv * D, Hkv * D], dim=-1)
    o = linear(attention(rot(q.view(-1, H, D)), rot(k.view(-1, Hkv, D)), v.view(-1, Hkv, D)).reshape(q.shape[0], -1),
               weight(layer.proj.weight))  # q's rows: every token's, also where x_TE holds a sequence-parallel share
    return x_TE + (o if tp is None else tp.leave(o))


def ssm_config(c: ModelConfig) -> SSMConfig:
    return SSMConfig(hidden=c.hidden, heads=c.ssm_heads, head_dim=c.ssm_head_dim, state=c.ssm_state,
                     chunk=c.ssm_chunk, seed=c.seed)


class MixerLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        self.norm1, self.mixer = RMSNorm(c.hidden), SSMMixer(ssm_config(c))

    def forward(self, x_TE, rot, real_T, attention=None, routing=None, mixing: Mixing | None = None, tp=None):
        _, mixing = layers.cp_ops(self, attention, mixing)
        if mixing is None:
            raise ValueError("an SSM mixer layer needs the micro-batch's mixing (its sequence layout and CP "
                             "exchange): pass mixing= to run_layers")
        h = self.norm1(x_TE)
        y = mixing(self.mixer, h) if tp is None else mixing(self.mixer, h, tp=tp)
        return x_TE + y, x_TE.new_zeros((), dtype=torch.float32)


class AttentionLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.c = c
        D = c.hidden // c.heads
        self.norm1 = RMSNorm(c.hidden)
        self.qkv = nn.Linear(c.hidden, (c.heads + 2 * c.kv_heads) * D, bias=False)
        self.proj = nn.Linear(c.heads * D, c.hidden, bias=False)

    def forward(self, x_TE, rot, real_T, attention: Attention, routing=None, mixing=None, tp=None):
        attention, _ = layers.cp_ops(self, attention, mixing)
        return self_attention(self, self.c, x_TE, rot, attention, tp), x_TE.new_zeros((), dtype=torch.float32)


class MLPLayer(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.norm2, self.mlp = RMSNorm(c.hidden), dense_mlp(c)

    def forward(self, x_TE, rot, real_T, attention=None, routing=None, mixing=None, tp=None):
        h = self.norm2(x_TE)
        y = self.mlp(h) if tp is None else tp.leave(self.mlp(tp.enter(h)))
        return x_TE + y, x_TE.new_zeros((), dtype=torch.float32)


HYBRID_LAYERS = {"M": MixerLayer, "*": AttentionLayer, "-": MLPLayer}
