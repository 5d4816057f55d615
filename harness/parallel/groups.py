"""Dynamic DP x CP process groups: every buddy-aligned power-of-two block of the DP x CP positions.

World layout (Megatron's default order ``tp-cp-ep-dp-pp``, TP fastest, then CP, then DP, PP slowest):
``rank = tp_rank + tp * position + tp * dp * cp * stage`` with ``position = dp_index * cp + cp_index``
in ``[0, dp * cp)``. Each pipeline stage has its own DP x CP domain; for each (stage, TP coordinate)
the domain's ranks are ``[rank_of(p, tp_rank, stage) for p in range(dp * cp)]``, and the groups of
size ``s`` are their consecutive chunks ``[k*s, (k+1)*s)`` - exactly the blocks a valid schedule may
use. Size ``dp * cp`` is the stage's DP x CP group itself. A position's ranks across the stages (its
pipeline) exchange activations and gradients.

>>> layout = ParallelLayout(dp=2, cp=2, tp=2)
>>> layout.world_size, layout.position(5), layout.dp_cp_ranks(1)
(8, 2, [1, 3, 5, 7])
>>> layout.block_ranks(rank=5, size=2)
[5, 7]
>>> pp = ParallelLayout(dp=2, cp=1, pp=2)
>>> pp.world_size, pp.stage(3), pp.position(3), pp.pipeline_ranks(1)
(4, 1, 1, [1, 3])
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.plan.errors import PlanInputError
from harness.plan.layout import Schedule


class GroupError(PlanInputError):
    """A schedule block has no matching process group."""


@dataclass(frozen=True)
class ParallelLayout:
    dp: int
    """Data-parallel replicas."""
    cp: int
    """Static context-parallel size (dynamic blocks range over dp * cp positions)."""
    tp: int = 1
    """Tensor-parallel size (fastest-varying rank coordinate)."""
    pp: int = 1
    """Pipeline stages (slowest-varying rank coordinate)."""

    def __post_init__(self):
        for name in ("dp", "cp", "tp", "pp"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise PlanInputError(f"ParallelLayout.{name} must be a positive int, got {v!r}")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    @property
    def n_positions(self) -> int:
        return self.dp * self.cp

    def position(self, rank: int) -> int:
        return rank // self.tp % self.n_positions

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def stage(self, rank: int) -> int:
        return rank // (self.tp * self.n_positions)

    def rank_of(self, position: int, tp_rank: int = 0, stage: int = 0) -> int:
        return tp_rank + self.tp * (position + self.n_positions * stage)

    def dp_cp_ranks(self, tp_rank: int, stage: int = 0) -> list[int]:
        return [self.rank_of(p, tp_rank, stage) for p in range(self.n_positions)]

    def block_ranks(self, rank: int, size: int) -> list[int]:
        start = self.position(rank) // size * size
        return [self.rank_of(p, self.tp_rank(rank), self.stage(rank)) for p in range(start, start + size)]

    def pipeline_ranks(self, rank: int) -> list[int]:
        """The ranks of every stage at ``rank``'s position and TP coordinate (its pipeline)."""
        return [self.rank_of(self.position(rank), self.tp_rank(rank), s) for s in range(self.pp)]


def tp_group_ranks(layout: ParallelLayout, position: int, stage: int) -> list[int]:
    """The global ranks of the tensor-parallel group at ``position`` of ``stage``: TP is the fastest coordinate
    (Megatron's ``tp-cp-ep-dp-pp``), so they are consecutive. A seam: ``harness.faults`` re-creates a builder that
    assumed another rank order."""
    return [layout.rank_of(position, t, stage) for t in range(layout.tp)]


def check_block(start: int, size: int, sizes: list[int], where: str = "block") -> None:
    """Raise ``GroupError`` unless ``[start, start + size)`` is one of the dynamic groups."""
    if size not in sizes:
        raise GroupError(f"{where}: block of size {size} at position {start} has no process group "
                         f"(created sizes: {sizes})")
    if start % size:
        raise GroupError(f"{where}: block of size {size} starts at position {start}, not a multiple "
                         f"of {size}: no process group holds exactly its ranks")


def lookup(groups: DynamicGroups, size: int):
    """This rank's live group of ``size`` positions in ``groups`` (a seam: ``harness.faults``
    re-creates a registry that outlived a re-initialisation, PR #2000's ``_DYNAMIC_DP_CP_GROUPS``)."""
    if groups.destroyed:
        raise GroupError("these dynamic groups were destroyed; create new ones (DynamicGroups(...)) after a "
                         "re-initialisation")
    if size not in groups._mine:
        raise GroupError(f"no dynamic group of size {size}; created sizes are {groups.sizes}")
    return groups._mine[size][0]


def live_groups() -> int:
    """Process groups torch.distributed holds right now (the default group included)."""
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


class DynamicGroups:
    """Create (collectively, on every rank, in one fixed order) all dynamic DP x CP groups.

    ``group(size)`` is this rank's group of ``size`` positions; ``for_block(block)`` checks that a
    schedule block is one of them and returns it; ``check_schedule(schedule)`` checks every block.
    Sizes below ``min_cp_size`` are not created (as upstream). ``destroy()`` releases every group it
    created (each rank, its own handles; a destroyed group is unknown to torch.distributed, so the group
    audit refuses it); the training runtime creates and destroys them around each layout, as a training
    framework re-initialises between runs."""

    def __init__(self, layout: ParallelLayout, rank: int, *, min_cp_size: int = 1, backend: str | None = None):
        import torch.distributed as dist

        n = layout.n_positions
        if n & (n - 1):
            raise GroupError(f"dp * cp = {n} is not a power of two: dynamic CP needs power-of-two blocks")
        self.layout, self.rank = layout, rank
        self.sizes = [s for s in (1 << i for i in range(n.bit_length())) if s >= min_cp_size]
        self._mine: dict[int, tuple[object, list[int]]] = {}
        self._created: list = []
        self.destroyed = False
        for stage in range(layout.pp):
            for size in self.sizes:
                for t in range(layout.tp):
                    for k in range(n // size):
                        ranks = [layout.rank_of(p, t, stage) for p in range(k * size, (k + 1) * size)]
                        group = dist.new_group(ranks, backend=backend)
                        self._created.append(group)
                        if rank in ranks:
                            self._mine[size] = (group, ranks)
        self.host = None
        """This rank's DP x CP domain as a gloo group when the default backend is not gloo (NCCL): the group
        audit's verdicts travel between the hosts there, so the host never waits for the device."""
        if dist.get_backend() != "gloo":
            for stage in range(layout.pp):
                for t in range(layout.tp):
                    ranks = [layout.rank_of(p, t, stage) for p in range(n)]
                    group = dist.new_group(ranks, backend="gloo")
                    self._created.append(group)
                    if rank in ranks:
                        self.host = group
        self.tp_group = None
        """This rank's tensor-parallel group (every TP rank of its stage and position), when tp > 1."""
        if layout.tp > 1:
            for stage in range(layout.pp):
                for p in range(n):
                    ranks = tp_group_ranks(layout, p, stage)
                    group = dist.new_group(ranks, backend=backend)
                    self._created.append(group)
                    if rank in ranks:
                        self.tp_group = group
        self.pipeline = None  # this rank's pipeline group (all stages at its position), when pp > 1
        if layout.pp > 1:
            for t in range(layout.tp):
                for p in range(n):
                    ranks = [layout.rank_of(p, t, s) for s in range(layout.pp)]
                    group = dist.new_group(ranks, backend=backend)
                    self._created.append(group)
                    if rank in ranks:
                        self.pipeline = group
        if dist.get_backend() == "gloo":
            # gloo connects a group's full mesh in new_group: a rank that left right after (an error before any
            # collective) would close its sockets while a peer still connects, failing the peer's new_group
            dist.barrier()

    def group(self, size: int):
        return lookup(self, size)

    def destroy(self) -> None:
        """Release every group this object created (idempotent)."""
        import torch.distributed as dist

        for g in self._created:
            if g is not None and g != dist.GroupMember.NON_GROUP_MEMBER:
                dist.destroy_process_group(g)
        self._created, self.destroyed = [], True

    def ranks(self, size: int) -> list[int]:
        self.group(size)
        return list(self._mine[size][1])

    def _check_block(self, start: int, size: int, where: str) -> None:
        check_block(start, size, self.sizes, where)

    def check_schedule(self, schedule: Schedule) -> None:
        if schedule.n_ranks != self.layout.n_positions:
            raise GroupError(f"schedule has {schedule.n_ranks} positions, the DP x CP domain has "
                             f"{self.layout.n_positions}")
        for m, mb in enumerate(schedule.layout):
            for b in mb:
                self._check_block(b.start, b.size, f"micro-batch {m}")

    def for_block(self, start: int, size: int):
        """This rank's group for a block ``[start, start + size)`` of positions that contains it."""
        self._check_block(start, size, "block")
        pos = self.layout.position(self.rank)
        if not start <= pos < start + size:
            raise GroupError(f"rank {self.rank} (position {pos}) is not in block [{start}, {start + size})")
        return self.group(size)
