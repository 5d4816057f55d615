"""The runtime's choices that a run's configuration names, without torch: a launching process validates a
configuration before any rank starts (``harness.train.config``, ``harness.bench.step.config``). The modules that
implement them re-export them."""

WEIGHT_MODES = ("cached", "fused", "per-call")
"""How a step takes its matrix weights (``--weights``; ``harness.runtime.weight_cache.MODES``): ``cached``: one copy
per step and in-place accumulation (``harness.runtime.weight_cache``); ``fused``: the copies, and the weight-gradient
GEMM accumulating into ``.grad`` itself (``harness.runtime.fused_linear``; within bf16 rounding of the others, not bit
for bit); ``per-call``: autocast's cast at every call and autograd's accumulation."""

COMPILE_SCOPES = ("segments", "chain")
"""What ``torch.compile`` covers (``harness.runtime.model.COMPILE_SCOPES``): each layer's segments between the
attention calls, or the whole chain of a micro-batch with the attention as one opaque operator."""
