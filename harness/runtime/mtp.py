"""Multi-token prediction (DeepSeek-V3; Megatron's MTP): depth k of D predicts token i + k + 1.

Block k combines the previous depth's hidden state h^{k-1} (h^0: the last layer's output, before the
final norm) with the embedding of token i + k: ``h'_i = proj([norm(h^{k-1}_i); norm(emb(t_{i+k}))])``,
runs one transformer block over the sequence (same positions, same causal attention and CP plan), and
the model's head predicts ``t_{i+k+1}``. The shifted inputs ``t_{i+k}``, labels ``t_{i+k+1}`` and masks
(the last k positions of a sequence have no target) are made *per sequence before the CP split*
(``harness.train.trainer``): a shift after the split would cross chunk and sequence boundaries.

The embedding is the model's own (``TinyLM.embed``), shared as in DeepSeek-V3 and Megatron, and so is the output
head. A pipeline keeps MTP on its last stage and the embedding on its first: the last stage looks tokens up in a
replica of the first stage's table, whose gradient joins the first stage's before the data-parallel reduction and
which is refreshed from the first stage after every update (``harness.train.shared_embedding``).
"""

from __future__ import annotations

import torch
import torch.nn as nn

from harness.runtime import layers
from harness.runtime.layers import Attention, RMSNorm, Rotary
from harness.runtime.model_config import ModelConfig


class MTPLayer(nn.Module):
    def __init__(self, c: ModelConfig, depth: int, block: nn.Module):
        super().__init__()
        self.depth = depth
        self.norm_h, self.norm_e = RMSNorm(c.hidden), RMSNorm(c.hidden)
        self.combine = nn.Linear(2 * c.hidden, c.hidden, bias=False)
        self.block = block

    def forward(self, h_TE, emb_TE, rot: Rotary, real_T, attention: Attention, mixing=None, tp=None):
        """This depth's hidden states (before the final norm), from the previous depth's and the embedding of the
        tokens it is shifted to (the model's shared table). ``tp``: the step's tensor parallelism (the block split,
        the combine replicated; with sequence parallelism the block runs on this rank's token rows, as the trunk's)."""
        attention, mixing = layers.cp_ops(self, attention, mixing)
        x = self.combine(torch.cat([self.norm_h(h_TE), self.norm_e(emb_TE)], dim=-1))
        if tp is None:
            return self.block(x, rot, real_T, attention, mixing=mixing)[0]
        x, _ = self.block(tp.scatter(x), rot, real_T, attention, mixing=mixing, tp=tp)  # rows split as in run_layers
        return tp.gather(x)
