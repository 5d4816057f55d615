"""``dcp-harness bench padding`` and ``bench thd``: the CPU benchmarks whose only option is ``--out``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from harness.bench import padding as padding_bench
from harness.bench import thd as thd_bench
from harness.commands.common import add_out


@dataclass(frozen=True)
class OutOnly:
    """A command (``harness.commands``) that runs ``main(out=...)``, its JSON ``reports/<name>`` by default."""

    NAME: str
    HELP: str
    main: Callable[..., int]
    json: str
    DESCRIPTION: str | None = None

    def add_arguments(self, p) -> None:
        add_out(p, self.json)

    def run(self, a) -> int:
        return self.main(out=a.out)


padding = OutOnly("padding", "step-wise RL batches: two-segment vs unified padding, builder speed", padding_bench.main,
                  "bench_padding.json")
thd = OutOnly("thd", "zig-zag index computation speed (CPU)", thd_bench.main, "bench_thd.json")
