"""dcp-harness: verification and benchmark harness for dynamic context parallelism.

Layers (each imports only the ones above it):
  harness.plan     pure Python + numpy: schedules, validators, cost models, THD math
  harness.upstream adapters that run installed upstream implementations (megatron-core)
  harness.bench    benchmarks (print a table, write JSON under reports/)
  harness.report   HTML / markdown reports
"""

__version__ = "0.1.0"
