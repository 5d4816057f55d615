"""The ``Schedule`` type: micro-batch x DP x CP position -> global ids.

A micro-batch is a list of CP *blocks* in position order. A block is a run of ``size`` consecutive
positions that all pack the same sequences (``gids``, in the same order) into one THD buffer and
each hold a 1/size zig-zag slice of it; ``size`` is their ``local_cp_size``.

``Schedule.microbatches`` is Megatron's ``sample_id_groups`` shape (micro-batch -> slot -> gids),
built fresh on every access so that no two slots share a list object (upstream's ``[[]] * N``
aliasing cannot happen here):

>>> s = Schedule.from_blocks([[Block(0, 2, (7,)), Block(2, 1, (3, 4)), Block(3, 1, (5,))]],
...                          lengths=[(7, 300), (3, 90), (4, 60), (5, 100)], n_ranks=4,
...                          max_seqlen_per_rank=200)
>>> s.microbatches
[[[7], [7], [3, 4], [5]]]
>>> s.local_cp_size(0)
[2, 2, 1, 1]
>>> s.packed_tokens(0)
[150.0, 150.0, 150.0, 100.0]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.plan.cost import CostModel
from harness.plan.execution import INDEPENDENT, Execution
from harness.plan.lengths import normalize_lengths
from harness.plan.padding import SequencePadding


@dataclass(frozen=True)
class Block:
    """``size`` positions starting at ``start`` that share one packed THD buffer of ``gids``."""

    start: int
    size: int
    gids: tuple[int, ...]

    @property
    def ranks(self) -> range:
        return range(self.start, self.start + self.size)


def blocks_from_slots(slots: list[list[int]]) -> list[Block]:
    """Split one micro-batch's slots into maximal runs of identical slot lists (empty slots -> size-1
    blocks with no gids). The result describes the layout as given; ``validate`` judges it."""
    out: list[Block] = []
    for p, slot in enumerate(slots):
        ids = tuple(slot)
        if out and ids and out[-1].gids == ids and out[-1].start + out[-1].size == p:
            last = out.pop()
            out.append(Block(last.start, last.size + 1, ids))
        else:
            out.append(Block(p, 1, ids))
    return out


def layout_from_sizes(groups: list[tuple[int, list[int]]]) -> tuple[Block, ...]:
    """Place ``(size, gids)`` groups left to right, in the order given."""
    blocks, pos = [], 0
    for size, gids in groups:
        blocks.append(Block(pos, size, tuple(gids)))
        pos += size
    return tuple(blocks)


@dataclass(frozen=True, eq=False)
class Schedule:
    """A global batch's dynamic-CP schedule. Build with ``from_blocks`` or ``from_microbatches``."""

    layout: tuple[tuple[Block, ...], ...]
    lengths: dict[int, int]
    n_ranks: int
    max_seqlen_per_rank: int
    min_cp_size: int = 1
    vpp_group: int | None = None
    algorithm: str = "custom"
    cost: CostModel = field(default_factory=CostModel.megatron)
    execution: Execution = INDEPENDENT
    """The execution model the schedule was made for; ``simulate`` / ``quality`` / ``stats`` judge it by this
    one unless told otherwise (``harness.plan.execution``)."""
    microbatch_tokens_per_rank: int | None = None
    """Tokens a rank may hold in one micro-batch over its block's sequences; None: ``max_seqlen_per_rank``, which
    always bounds each sequence (its ``cp_min``). Larger for a stack that runs every sequence of a micro-batch as
    its own forward and backward (megatron-core's hybrid CP)."""
    padding: SequencePadding | None = None
    """How the runtime pads each sequence of a block (``harness.plan.padding``): capacity holds padded tokens; None:
    ``lengths`` are what the ranks hold (already padded, or a runtime that does not pad)."""

    @property
    def capacity(self) -> int:
        """Tokens a rank may hold in one micro-batch (``microbatch_tokens_per_rank`` or ``max_seqlen_per_rank``)."""
        return self.microbatch_tokens_per_rank or self.max_seqlen_per_rank

    @classmethod
    def from_blocks(cls, layout, *, lengths, **kw) -> Schedule:
        pairs = normalize_lengths(lengths)
        return cls(tuple(tuple(mb) for mb in layout), dict(pairs), **kw)

    @classmethod
    def from_microbatches(cls, microbatches: list[list[list[int]]], *, lengths, **kw) -> Schedule:
        return cls.from_blocks([blocks_from_slots(mb) for mb in microbatches], lengths=lengths, **kw)

    # -- Megatron's view ------------------------------------------------------------------------
    @property
    def microbatches(self) -> list[list[list[int]]]:
        return [[list(b.gids) for b in mb for _ in range(b.size)] for mb in self.layout]

    @property
    def num_microbatches(self) -> int:
        return len(self.layout)

    def blocks(self, m: int) -> tuple[Block, ...]:
        return self.layout[m]

    def local_cp_size(self, m: int) -> list[int]:
        return [b.size for b in self.layout[m] for _ in range(b.size)]

    def block_tokens(self, block: Block) -> int:
        return sum(self.lengths[g] for g in block.gids)

    def packed_tokens(self, m: int) -> list[float]:
        """Per-rank tokens of micro-batch ``m``: the block's tokens / its size (before padding)."""
        out: list[float] = []
        for b in self.layout[m]:  # each block's tokens once, then one entry per rank of it
            out += [self.block_tokens(b) / b.size] * b.size
        return out

    def block_cost(self, block: Block, cost: CostModel | None = None) -> float:
        c = cost or self.cost
        return sum(c.seq_cost(self.lengths[g], block.size) for g in block.gids) + c.block_overhead(block.size)

    def load(self, m: int, cost: CostModel | None = None) -> list[float]:
        """Estimated per-rank load of micro-batch ``m`` under ``cost`` (default: the schedule's)."""
        out: list[float] = []
        for b in self.layout[m]:  # each block's cost once, then one entry per rank of it
            out += [self.block_cost(b, cost)] * b.size
        return out

    def cp_size_of(self) -> dict[int, int]:
        """gid -> the size of the block that runs it."""
        return {g: b.size for mb in self.layout for b in mb for g in b.gids}

    # -- serialisation ----------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "algorithm": self.algorithm,
            "n_ranks": self.n_ranks,
            "max_seqlen_per_rank": self.max_seqlen_per_rank,
            "min_cp_size": self.min_cp_size,
            "vpp_group": self.vpp_group,
            "cost": self.cost.to_dict(),
            "execution": self.execution.to_dict(),
            **({"microbatch_tokens_per_rank": self.microbatch_tokens_per_rank}
               if self.microbatch_tokens_per_rank else {}),
            **({"padding": self.padding.to_dict()} if self.padding else {}),
            "lengths": [[g, L] for g, L in self.lengths.items()],
            "microbatches": [
                [{"start": b.start, "size": b.size, "gids": list(b.gids)} for b in mb] for mb in self.layout
            ],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schedule:
        layout = [[Block(b["start"], b["size"], tuple(b["gids"])) for b in mb] for mb in d["microbatches"]]
        return cls.from_blocks(
            layout, lengths=[tuple(p) for p in d["lengths"]], n_ranks=d["n_ranks"],
            max_seqlen_per_rank=d["max_seqlen_per_rank"], min_cp_size=d["min_cp_size"],
            vpp_group=d["vpp_group"], algorithm=d["algorithm"], cost=CostModel(**d["cost"]),
            execution=Execution.from_dict(d["execution"]) if "execution" in d else INDEPENDENT,
            microbatch_tokens_per_rank=d.get("microbatch_tokens_per_rank"),
            padding=SequencePadding(**d["padding"]) if d.get("padding") else None,
        )
