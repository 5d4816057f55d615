"""Re-creations of MoE load-balancing loss bugs (``harness.runtime.balance``: the routers' sequence-level balance loss)
and their catalogue entries, judged in scenario ``train-ep`` (the tiny MoE with its experts over the 4-rank domain and
a balance loss, dynamic CP with blocks of 1, 2 and 4 ranks) and ``train-sp`` (2 TP ranks a position, their token rows
split). Each is exact where a rank holds each of its micro-batch's sequences alone (one sequence, CP 1, no sequence
parallelism), so only packs of several sequences, CP blocks of several ranks and split rows show them.
"""

from __future__ import annotations

import torch

from harness.faults.fault import Fault


def make_pack_as_one_sequence(original):
    """A THD pack's tokens all taken for one sequence: the balance counts and probabilities of every sequence of the
    pack pooled (Megatron-LM issue #6108: with variable-length packs ``tokens_per_sample`` is None, the router sees a
    batch of one and ``seq_aux_loss`` balances the flattened pack as one sequence; PR #6115 derives each token's
    sequence from ``cu_seqlens``)."""
    def balance_sequences(mb):
        seq, _ = original(mb)
        return torch.zeros_like(seq), 1
    return balance_sequences


def make_static_group(original):
    """The balance counts summed over the static TP x CP group instead of the micro-batch's CP block (Megatron-LM PR
    #3791, "Fixes seq_load_balancing_loss ... Regular training uses tp_cp_group which is incorrect for Dynamic CP as
    we may have multiple sub-sequences running independently inside a TPxCP group"; PR #7146 reduces over the runtime
    CP group). The trainer's parallel layout has CP 1 (the dynamic domain is its DP), so each rank counts only its
    own share of a sequence that a larger block splits."""
    def balance_group(ops, m):
        cp = ops.groups.layout.cp
        return ops.groups.group(cp) if cp > 1 else None
    return balance_group


def make_sp_rows_alone(original):
    """Under sequence parallelism each TP rank balances the sequences' tokens of its own rows: the counts not summed
    over the TP group, so a sequence whose rows the split cuts is balanced by halves (Megatron-LM PR #5996: the
    sequence-parallel scatter splits the flat pack into shards that straddle samples, and a local reshape "cannot
    reconstruct a sample that SP has split across ranks"; the fix scatters each token to its global sample)."""
    def balance_tp_group(ops):
        return None
    return balance_tp_group


BALANCE_FAULTS = [
    Fault(name="moe-balance-pack-as-one-sequence", title="the balance loss takes a THD pack for one sequence",
          source="Megatron-LM issue #6108 / PR #6115: seq_aux_loss on variable-length packs (no tokens_per_sample) "
                 "balanced the flattened pack as one sequence",
          url="https://github.com/NVIDIA/Megatron-LM/issues/6108", layer="model",
          seam="harness.train.passes:balance_sequences", make=make_pack_as_one_sequence, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-ep"),
    Fault(name="moe-balance-counts-static-group", title="balance counts summed over the static TP x CP group",
          source="Megatron-LM PR #3791 (item 4) / PR #7146: the sequence-level balance loss reduced over tp_cp_group, "
                 "wrong under dynamic CP, whose blocks run their own sequences inside it",
          url="https://github.com/NVIDIA/Megatron-LM/pull/3791", layer="model",
          seam="harness.train.passes:balance_group", make=make_static_group, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-ep"),
    Fault(name="moe-balance-sp-rows-alone", title="under SP each TP rank balances its own rows' tokens",
          source="Megatron-LM PR #5996: seq_aux_loss with packed sequences and sequence parallelism; the SP shards "
                 "straddle samples and a local reshape cannot rebuild a sample split across TP ranks",
          url="https://github.com/NVIDIA/Megatron-LM/pull/5996", layer="model",
          seam="harness.train.passes:balance_tp_group", make=make_sp_rows_alone, check="step1-gradients",
          expect=r"step-1 gradient of .* differs", scenario="train-sp"),
]
