"""``dcp-harness faults``: the fault catalogue, every re-created bug run with its seam replaced; each must be caught."""

from __future__ import annotations

from pathlib import Path

from harness.io import writable
from harness.paths import REPORTS
from harness.report.faults_report import console

NAME = "faults"
HELP = "run the fault catalogue: every re-created bug must be caught"
DESCRIPTION = ("Run every scenario clean (no check may fire), then every fault of the catalogue (harness.faults) "
               "with its seam replaced; print which check caught it, where, with what margin. Exit 1 if a fault is "
               "missed or a clean run alarms.")


def add_arguments(f) -> None:
    f.add_argument("--only", nargs="+", metavar="NAME", default=None, help="run only these faults")
    f.add_argument("--list", action="store_true", help="list the faults (name, layer, check, source) and exit")
    f.add_argument("--json", type=Path, default=None, help="result JSON (default reports/faults.json)")
    f.add_argument("--html", type=Path, default=None, help="HTML report (default reports/faults.html)")


def run(a) -> int:
    # the catalogue's seams live in the torch runtime (~1 s to import): only this command pays for it
    from harness.faults import FAULTS, select
    from harness.faults.run import run_catalogue, verdict, write  # lazy: torch, as above

    if a.list:
        for f in FAULTS:
            print(f"{f.name:36s} {f.layer:10s} {f.check:20s} {f.source}")
        return 0
    faults = select(a.only)
    json_path, html_path = writable(a.json or REPORTS / "faults.json"), writable(a.html or REPORTS / "faults.html")
    print(f"dcp-harness faults: {len(faults)} faults; clean runs first, then each fault with its seam replaced")
    result = run_catalogue([f.name for f in faults])
    print()
    print(console(result))
    write(result, json_path, html_path)
    print(f"wrote {json_path} and {html_path}")
    return 0 if verdict(result) else 1
