"""The training runtime: layouts (bshd, thd, dcp) planned per global batch (``layouts``), the step and its
loop (``trainer``, configured by ``config``), the per-micro-batch passes (``passes``), the pipeline
(``pipeline``), the probes the checks read (``probes``) and router replay end to end (``replay``).
It builds on ``harness.parallel``; jobs (``harness.jobs``) launch it and apps (``harness.apps``) judge it.
"""
