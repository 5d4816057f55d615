"""The harness's import direction, read from the source with ``ast`` (nothing here imports it):
reports read results and never import a benchmark, and no module reaches, by an import inside a
function or an ``__import__("...")`` call, a module that imports it back - the ways an import cycle
is hidden instead of broken (``harness.bench.step`` and its report, ``harness.apps.nightly``).

Imports inside functions are fine for what they are for: keeping torch, matplotlib and the
distributed runtime out of modules that do not need them at import time."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HARNESS = ROOT / "harness"


def _name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_name(p): p for p in sorted(HARNESS.rglob("*.py"))}


def _resolve(base: str, names: list[str]) -> set[str]:
    """What ``from base import names`` (or ``import base`` when ``names`` is empty) loads of the harness."""
    if base not in MODULES:
        return set()
    return {base} | {f"{base}.{n}" for n in names if f"{base}.{n}" in MODULES}


def _literal(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


class _Imports(ast.NodeVisitor):
    """One module's imports of harness modules: ``top`` run when it is imported, ``deferred`` inside
    functions, ``dunder`` by ``__import__``/``importlib.import_module`` with a literal name."""

    def __init__(self, module: str):
        self.module, self.depth = module, 0
        self.package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        self.top: set[str] = set()
        self.deferred: set[str] = set()
        self.dunder: set[str] = set()

    def _add(self, targets: set[str]) -> None:
        (self.deferred if self.depth else self.top).update(targets)

    def visit_FunctionDef(self, node):
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node):
        test = ast.unparse(node.test)
        if test in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):  # never runs
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node):
        for alias in node.names:
            self._add(_resolve(alias.name, []))

    def visit_ImportFrom(self, node):
        base = node.module or ""
        if node.level:
            anchor = self.package.split(".")[: len(self.package.split(".")) - (node.level - 1)]
            base = ".".join(anchor + ([base] if base else []))
        self._add(_resolve(base, [a.name for a in node.names]))

    def visit_Call(self, node):
        fn = ast.unparse(node.func)
        name = _literal(node.args[0]) if node.args else None
        if fn in ("__import__", "importlib.import_module", "import_module") and name is not None:
            fromlist = next((kw.value for kw in node.keywords if kw.arg == "fromlist"), None)
            if fromlist is None and fn == "__import__" and len(node.args) > 3:
                fromlist = node.args[3]
            names = [_literal(e) for e in getattr(fromlist, "elts", [])]
            targets = _resolve(name, [n for n in names if n])
            self.dunder.update(targets)
            self.deferred.update(targets)
        self.generic_visit(node)


def _scan() -> dict[str, _Imports]:
    out = {}
    for module, path in MODULES.items():
        v = _Imports(module)
        v.visit(ast.parse(path.read_text(), filename=str(path)))
        out[module] = v
    return out


IMPORTS = _scan()


def _loads(target: str, importer: str) -> set[str]:
    """Importing ``target`` also runs its packages' ``__init__`` - except those the importer is
    already inside (they are initialised before it)."""
    parts = target.split(".")
    chain = {".".join(parts[:k]) for k in range(1, len(parts) + 1)}
    mine = {".".join(importer.split(".")[:k]) for k in range(1, len(importer.split(".")) + 1)}
    return {m for m in chain - mine if m in MODULES}


def _reaches(start: str, goal: str, *, deferred: bool) -> list[str] | None:
    """A chain of imports from ``start`` to ``goal`` (module-level ones, and with ``deferred`` the
    ones inside functions too), or None."""
    seen, todo = {start: [start]}, [start]
    while todo:
        m = todo.pop()
        edges = IMPORTS[m].top | (IMPORTS[m].deferred if deferred else set())
        for t in sorted(set().union(*(_loads(e, m) for e in edges)) if edges else ()):
            if t == goal:
                return seen[m] + [t]
            if t not in seen:
                seen[t] = seen[m] + [t]
                todo.append(t)
    return None


def test_the_scan_sees_the_harness():
    assert "harness.bench.step" in MODULES and "harness.report.step_report" in MODULES
    assert "harness.report.step_tables" in IMPORTS["harness.report.step_report"].top
    assert "harness.bench.step.config" in IMPORTS["harness.bench.step"].top
    assert "harness.golden" in IMPORTS["harness.apps.nightly"].top


def test_reports_never_import_a_benchmark():
    """Reports read results (a summary, a JSON file); the benchmark may render its report, never the reverse."""
    bad = {m: sorted(t for t in v.top | v.deferred if t == "harness.bench" or t.startswith("harness.bench."))
           for m, v in IMPORTS.items() if m.startswith("harness.report")}
    assert not {m: t for m, t in bad.items() if t}


def test_no_import_is_hidden_in_a_dunder_import_call():
    """``__import__("harness.x")`` says what ``import harness.x`` says, out of sight of tools and
    readers (``harness.jobs.entry`` imports its jobs by a name from a table: not a literal, allowed)."""
    assert not {m: sorted(v.dunder) for m, v in IMPORTS.items() if v.dunder}


def test_no_deferred_import_reaches_a_module_that_imports_it_back():
    """An import inside a function (or an ``__import__`` call) of a module that imports the caller
    back, at module level or inside its own functions, hides a cycle: break it by moving what both
    need to a module below them."""
    cycles = []
    for m, v in IMPORTS.items():
        for t in sorted(v.deferred - v.top):
            back = _reaches(t, m, deferred=True)
            if back:
                cycles.append(f"{m} -> (in a function) {' -> '.join(back)}")
    assert not cycles, "\n".join(cycles)


def test_the_bench_step_pair_and_nightly_have_no_cycle_at_all():
    """The two cycles this check was written for, spelled out: neither side reaches the other's
    importer back by any import."""
    assert _reaches("harness.report.step_report", "harness.bench.step", deferred=True) is None
    assert _reaches("harness.report.step_tables", "harness.bench.step", deferred=True) is None
    assert _reaches("harness.golden", "harness.apps.nightly", deferred=True) is None


LAYERS = (
    ("base", ("harness", "harness.io", "harness.paths", "harness.finite", "harness.heartbeat", "harness.golden")),
    ("plan", ("harness.plan",)),
    ("upstream", ("harness.upstream",)),
    ("data", ("harness.data",)),
    ("report", ("harness.report",)),
    ("runtime", ("harness.runtime",)),
    ("parallel", ("harness.parallel",)),
    ("train", ("harness.train",)),
    ("stack", ("harness.stack",)),
    ("jobs", ("harness.jobs",)),
    ("faults", ("harness.faults",)),
    ("bench", ("harness.bench",)),
    ("apps", ("harness.apps",)),
    ("front", ("harness.cli", "harness.cli_types", "harness.commands", "harness.__main__", "harness.pytest_plugin",
               "harness.testing")),
)
"""The rooms of the harness, lowest first: a module may import its own room and the rooms below it, never one
above (top-level imports, imports inside functions and ``__import__`` alike). The reports read results: they
sit below the runtime and import nothing of it."""


def _layer(module: str) -> int:
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or (p != "harness" and module.startswith(p + "."))) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} is in no room of LAYERS: add it"
    return best[0]


def test_every_module_is_in_a_room_and_imports_only_its_room_and_below():
    up = []
    for m, v in IMPORTS.items():
        mine = _layer(m)
        for t in sorted(v.top | v.deferred | v.dunder):
            if _layer(t) > mine:
                up.append(f"{m} ({LAYERS[mine][0]}) imports {t} ({LAYERS[_layer(t)][0]})")
    assert not up, "\n".join(up)


def test_no_folder_is_named_like_build_output():
    """Packaging tools and code-map tools skip ``dist``, ``build`` and the like as generated."""
    generated = {"dist", "build", "out", "target", "output", "gen", "generated"}
    assert not [p for p in HARNESS.rglob("*") if p.is_dir() and p.name in generated]
