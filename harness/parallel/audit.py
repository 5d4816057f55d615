"""The group audit: before a step runs, every rank checks that the process group it will hand to each
micro-batch's CP-aware calls holds exactly the ranks of that micro-batch's block.

A wrong group is the dynamic-CP bug that hangs or silently mixes data: a group kept from the previous
micro-batch, the static CP group passed where the micro-batch's dynamic one belongs (Megatron-LM
PR #6821, issue #5352), a group that was not restored after a forward (PR #2000, ``attention.py``).
The verdicts are exchanged over the DP x CP ranks (one small all-reduce per step, between the hosts - over
gloo where the device backend is NCCL, so the host never waits for the device; the details only when one failed), so every rank raises the same ``GroupAuditError`` before any collective runs on a wrong
group: the job fails at once instead of hanging.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class GroupAuditError(RuntimeError):
    """A micro-batch's CP-aware calls would get a process group other than its block's.

    Attributes: ``rank``, ``microbatch``, ``got`` (the group's ranks), ``want`` (the block's ranks);
    the training loop adds ``step`` and ``layout``."""

    def __init__(self, rank: int, microbatch: int, got, want: list[int]):
        self.rank, self.microbatch = rank, microbatch
        self.got, self.want = got if isinstance(got, str) else list(got), list(want)
        held = got if isinstance(got, str) else f"holds ranks {list(got)}"
        held = "is a destroyed group (kept across a re-initialisation)" if isinstance(got, str) else held
        super().__init__(f"group audit: rank {rank}, micro-batch {microbatch}: the CP group handed to attention "
                         f"{held}, the micro-batch's block is ranks {list(want)}; a CP group must be looked up per "
                         f"micro-batch from its block (a group kept from an earlier micro-batch or re-initialisation, "
                         f"or the static CP group, is wrong)")


def block_ranks(groups, mb) -> list[int]:
    """Global ranks of the block that ``mb`` (this rank's share of a micro-batch) runs on."""
    lay = groups.layout
    t = lay.tp_rank(groups.rank)
    return [lay.rank_of(p, t, lay.stage(groups.rank)) for p in range(mb.block_start, mb.block_start + mb.local_cp_size)]


def audit_groups(groups, mbs, chosen, everyone) -> None:
    """Raise ``GroupAuditError`` on every rank when any rank's ``chosen[m]`` is not the group of
    ``mbs[m]``'s block (see the module doc)."""
    start_audit(groups, mbs, chosen, everyone)()


def start_audit(groups, mbs, chosen, everyone):
    """``audit_groups`` in two halves: compare this rank's groups and start the all-reduce of the verdicts now;
    the returned function waits for it and raises ``GroupAuditError`` on every rank (call it before the first
    collective on a chosen group). In between the host goes on preparing the step."""
    mine = None
    for mb, g in zip(mbs, chosen):
        want = block_ranks(groups, mb)
        try:
            got = dist.get_process_group_ranks(g)
        except (KeyError, ValueError, RuntimeError):  # not a live group: destroyed, or never one of ours
            got = "a destroyed group"
        if got != want:
            mine = (groups.rank, mb.index, got, want)
            break
    host = getattr(groups, "host", None)  # NCCL: the verdicts go over gloo, so waiting syncs no device stream
    dev = torch.device("cpu") if host is not None or not mbs else mbs[0].data["tokens"].device
    flag = torch.tensor([0.0 if mine is None else 1.0], device=dev)
    work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=everyone if host is None else host, async_op=True)

    def check() -> None:
        work.wait()
        if flag.item() == 0:
            return
        verdicts: list = [None] * dist.get_world_size(everyone)
        dist.all_gather_object(verdicts, mine, group=everyone if host is None else host)
        rank, m, got, want = min((v for v in verdicts if v), key=lambda v: (v[1], v[0]))
        raise GroupAuditError(rank, m, got, want)

    return check


class CallAuditError(GroupAuditError):
    """A module ran a CP operation (and its group) of another micro-batch than the one being computed:
    it kept the operations of an earlier call (``harness.train.passes``)."""

    def __init__(self, rank: int, microbatch: int, used: int, got: list[int], want: list[int]):
        self.used = used
        RuntimeError.__init__(self, f"group audit: rank {rank}, micro-batch {microbatch}: a CP call ran with micro-batch "
                                    f"{used}'s operations (its group: ranks {list(got)}; this micro-batch's block: "
                                    f"ranks {list(want)}); modules must take their CP operations per call, never keep them")
        self.rank, self.microbatch, self.got, self.want = rank, microbatch, list(got), list(want)


class TPGroupAuditError(GroupAuditError):
    """A rank's tensor-parallel group is not the TP ranks of its (stage, position) (``audit_tp_group``)."""

    def __init__(self, rank: int, got, want: list[int]):
        RuntimeError.__init__(self, f"group audit: rank {rank}: the TP group holds ranks {list(got) if not isinstance(got, str) else got}, "
                                    f"the TP ranks of its position are {list(want)}; the world's ranks are laid out TP "
                                    f"fastest (tp-cp-ep-dp-pp): a TP group is consecutive ranks")
        self.rank, self.microbatch, self.got, self.want = rank, None, got if isinstance(got, str) else list(got), list(want)


def audit_tp_group(groups) -> None:
    """Raise ``TPGroupAuditError`` on every rank when any rank's tensor-parallel group (``groups.tp_group``) is not the
    ranks of its stage and position at every TP coordinate; nothing at tp = 1. Once per layout's run, over the whole
    world (the TP groups themselves cannot be trusted to carry the verdict)."""
    lay, rank = groups.layout, groups.rank
    if lay.tp == 1:
        return
    want = [lay.rank_of(lay.position(rank), t, lay.stage(rank)) for t in range(lay.tp)]
    try:
        got = dist.get_process_group_ranks(groups.tp_group)
    except (KeyError, ValueError, RuntimeError, AttributeError):
        got = "no live group"
    verdicts: list = [None] * dist.get_world_size()
    dist.all_gather_object(verdicts, None if got == want else (rank, got, want))
    bad = [v for v in verdicts if v]
    if bad:
        raise TPGroupAuditError(*min(bad, key=lambda v: v[0]))

