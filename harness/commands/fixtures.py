"""``dcp-harness fixtures``: regenerate the committed fixtures (the Wikipedia length sample)."""

from __future__ import annotations

from harness import cli_types as T
from harness.data.workloads import make_wikipedia_sample

NAME = "fixtures"
HELP = "regenerate committed fixtures"
DESCRIPTION = None


def add_arguments(f) -> None:
    fsub = f.add_subparsers(dest="fixture", required=True)
    fw = fsub.add_parser("wikipedia", help="seeded sample of the Wikipedia document lengths")
    fw.add_argument("--source", required=True, help="wikipedia_doc_lengths.txt.gz (one length per line)")
    fw.add_argument("--n", type=T.SAMPLE, default=65536)
    fw.add_argument("--seed", type=T.SEED, default=0)


def run(a) -> int:
    print(f"wrote {make_wikipedia_sample(a.source, a.n, a.seed)}")
    return 0
