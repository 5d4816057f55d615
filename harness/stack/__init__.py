"""The stack protocol: what a training stack provides for the harness's checks (``harness.stack.protocol``), the
harness's runtime behind it (``harness.stack.runtime``), the driver that runs a stack on every rank
(``harness.stack.drive``) and the checks of its reports (``harness.stack.checks``)."""

from harness.stack.protocol import WANTS, Stack, StackContext, StackError, StepReport, StepRequest

__all__ = ["WANTS", "Stack", "StackContext", "StackError", "StepReport", "StepRequest"]
