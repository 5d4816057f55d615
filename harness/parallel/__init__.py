"""The parallel layer: what ranks of a torch.distributed world do together for one micro-batch.

Dynamic DP x CP process groups and their lifecycle (``groups``) and audit (``audit``), rerouting a global
batch to the ranks that run it (``reroute``), CP attention with its K/V exchanges (``cp_attention``,
``ring``, ``ulysses``, ``collectives``), the SSM mixer's token <-> channel exchange (``ssm_cp``), expert parallelism
(``expert_parallel``), the bucketed gradient reducer (``grad_reduce``) and world checks of all of it
(``checks``). Below it: ``harness.plan`` (no torch) and ``harness.runtime`` (single-process torch);
above it: ``harness.train``.
"""
