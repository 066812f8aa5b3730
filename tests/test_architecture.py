"""The module table of DESIGN.md, held: every import of every module of the package is parsed
and checked against the layers it may use. An upward or sideways import fails here, naming the
file, the line and the rule."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "platform" / "synctune"

#: layer -> the layers of ours it may import (DESIGN.md "Module boundaries").
ALLOWED = {
    "spec": set(),
    "strategy": {"spec"},
    "models": {"spec"},
    "workload": {"spec", "models"},
    "engine": {"spec", "strategy"},
    "simulator": {"spec", "strategy"},
    "search": {"spec", "strategy"},
    "data": {"spec", "strategy"},
    "cluster": {"spec", "engine", "workload"},
    "lab": {"spec", "engine"},  # the engine's calibration probes (engine/probes.py), shared with cluster
    "run": {"spec", "strategy", "models", "workload", "engine", "simulator", "search", "data", "cluster", "lab"},
    "report": {"spec", "strategy", "data", "simulator"},
    "cli": {"spec", "strategy", "models", "workload", "engine", "simulator", "search", "data", "cluster", "lab",
            "run", "report"},
}
TOP_LEVEL = {"__init__", "__main__"}
# ``stats`` (search figures, paired speed-ups with intervals) imports nothing of ours and every
# layer may import it: the engine's confirmation, the search, the reports.
ALLOWED = {layer: allowed | {"stats"} for layer, allowed in ALLOWED.items()} | {"stats": set()}


def _layer_of(path: Path) -> str:
    rel = path.relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks: annotations only, no runtime dependency."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def _imported_layers(path: Path) -> list[tuple[int, str]]:
    """(line, layer) of every import of another synctune layer in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    skip = _type_checking_lines(tree)
    rel = path.relative_to(PACKAGE)
    package_parts = ["synctune", *rel.parts[:-1]]
    out = []
    for node in ast.walk(tree):
        if node.lineno in skip if hasattr(node, "lineno") else False:
            continue
        targets: list[list[str]] = []
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - node.level + 1]
                module = base + (node.module.split(".") if node.module else [])
                targets = [module] if node.module else [module + [alias.name] for alias in node.names]
            elif node.module:
                targets = [node.module.split(".")]
        for parts in targets:
            if parts and parts[0] == "synctune" and len(parts) > 1:
                out.append((node.lineno, parts[1]))
    return out


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        layer = _layer_of(path)
        if layer in TOP_LEVEL:
            continue
        assert layer in ALLOWED, f"{path}: module {layer!r} is not in DESIGN.md's module table"
        for line, target in _imported_layers(path):
            is_module = (PACKAGE / target).is_dir() or (PACKAGE / f"{target}.py").is_file()
            if target == layer or target in TOP_LEVEL or not is_module:  # not a module: synctune/__init__'s
                continue
            if target not in ALLOWED[layer]:
                found.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {layer} imports {target} "
                             f"(allowed: {', '.join(sorted(ALLOWED[layer])) or 'nothing of ours'})")
    return found


def test_every_layer_imports_only_what_the_module_table_allows():
    assert violations() == []


def test_the_checker_sees_relative_absolute_and_deferred_imports(tmp_path, monkeypatch):
    """The checker itself can fail: a lower layer importing upward, in each spelling, is caught."""
    import textwrap

    fake = tmp_path / "synctune"
    for layer in ("engine", "models", "search", "data", "run"):
        (fake / layer).mkdir(parents=True)
    (fake / "engine" / "bad.py").write_text(textwrap.dedent("""
        from ..models.zoo import model_spec
        import synctune.search.algorithm
        def later():
            from synctune.data import TrialDataset
        from typing import TYPE_CHECKING
        if TYPE_CHECKING:
            from ..run import search
    """))
    monkeypatch.setattr(__import__(__name__), "PACKAGE", fake)
    found = violations()
    assert len(found) == 3 and all("engine imports" in f for f in found)
    assert {f.split(" imports ")[1].split()[0] for f in found} == {"models", "search", "data"}


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path | None = None) -> dict[str, set[str]]:
    """File -> the files of ours it imports (deferred imports included, annotations-only ones
    not): ``from .pkg import name`` points at the file ``name`` when it is a module, else at
    ``pkg``'s ``__init__``."""
    package = package or PACKAGE
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = _type_checking_lines(tree)
        here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        edges: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            if isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in files)
            elif isinstance(node, ast.ImportFrom):
                base = ".".join(here[: len(here) - node.level + 1] + (node.module.split(".") if node.module else [])) \
                    if node.level else node.module
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    edges.add(target if target in files else base)
        graph[name] = {e for e in edges if e in files and e != name}
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one file (Tarjan): each is a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_circle_of_imports_between_files():
    assert import_cycles(import_graph()) == []


def test_the_cycle_finder_sees_a_circle_through_a_deferred_import(tmp_path):
    import textwrap

    fake = tmp_path / "synctune"
    (fake / "engine").mkdir(parents=True)
    (fake / "__init__.py").write_text("")
    (fake / "engine" / "__init__.py").write_text("")
    (fake / "engine" / "trial.py").write_text("from .measure import x\n")
    (fake / "engine" / "measure.py").write_text(textwrap.dedent("""
        def later():
            from . import trial
    """))
    (fake / "engine" / "alone.py").write_text("from .measure import x\n")
    assert import_cycles(import_graph(fake)) == [["synctune.engine.measure", "synctune.engine.trial"]]


def test_runtimes_are_registered_and_not_dispatched_by_name_elsewhere():
    """DESIGN.md "runtime": one interface, one module each, one registry. Every Runtime subclass
    is registered, each in a module of its own; no file outside the registry dispatches on a
    runtime's plain-data ``kind``."""
    from synctune.engine.runtime import Runtime
    from synctune.engine.runtimes import RUNTIMES

    def concrete(cls):
        for sub in cls.__subclasses__():
            yield from ([sub] if "name" in vars(sub) else []) + list(concrete(sub))

    classes = {cls.name: cls for cls in concrete(Runtime)}
    assert classes == RUNTIMES
    modules = [cls.__module__ for cls in RUNTIMES.values()]
    assert len(set(modules)) == len(modules), modules
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "runtimes.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare):
                text = ast.unparse(node)
                if ('["kind"]' in text or ".get('kind')" in text) and any(f"'{n}'" in text for n in RUNTIMES):
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {text}")
    assert found == []


#: Where a synchronizer kind's meaning lives (DESIGN.md "plan kind"): its class in the strategy
#: layer, and the registry of each layer's part of it (the simulators': a folder, a module per kind).
KIND_HOMES = {"strategy/kinds.py", "engine/kinds.py", "simulator/kinds/"}
#: Files that still decide by a kind themselves, and how often: the samplers' and local searches'
#: draws and moves, and the runtimes that translate kinds into another framework's (FSDP2, torch
#: DDP for apply). A count may fall, never rise, and no other file may start.
KIND_DISPATCH_LEFT = {
    "engine/fsdp.py": 3, "run/apply.py": 1, "search/local_search.py": 8, "search/moves.py": 2, "search/sampler.py": 6,
}
_SYNC_CLASSES = {"PSSynchronizer", "AllReduceSynchronizer", "AllGatherSynchronizer", "SFBSynchronizer",
                 "ShardSynchronizer"}
_KIND_NAMES = {"ps", "allreduce", "allgather", "sfb", "shard"}
_KIND_CODE_NAMES = {"KIND_PS", "KIND_AR", "KIND_AG", "KIND_SFB", "KIND_SHARD"}


def kind_dispatch(package: Path | None = None) -> dict[str, list[str]]:
    """File -> each place it decides by a synchronizer kind: ``isinstance`` on a synchronizer
    class, a comparison of a ``kind`` (attribute, key or variable) with a kind's name, or a
    comparison with a kind code."""
    package = package or PACKAGE
    found: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            hit = False
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance" \
                    and len(node.args) == 2:
                hit = bool({n.id for n in ast.walk(node.args[1]) if isinstance(n, ast.Name)} & _SYNC_CLASSES)
            elif isinstance(node, ast.Compare):
                text = ast.unparse(node)
                names = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
                strings = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
                hit = bool(names & _KIND_CODE_NAMES) or ("kind" in text and bool(strings & _KIND_NAMES))
            if hit:
                found.setdefault(rel, []).append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_kinds_are_decided_in_their_homes_only():
    """Outside the kinds' homes no file asks which kind a synchronizer is; the files listed as
    not moved yet do no more of it than they did."""
    found = {rel: hits for rel, hits in kind_dispatch().items()
             if not any(rel == home or (home.endswith("/") and rel.startswith(home)) for home in KIND_HOMES)}
    grown = {rel: hits for rel, hits in found.items() if len(hits) > KIND_DISPATCH_LEFT.get(rel, 0)}
    assert grown == {}, "\n".join(h for hits in grown.values() for h in hits)


def test_the_kind_check_sees_isinstance_names_and_codes(tmp_path):
    import textwrap

    fake = tmp_path / "synctune"
    (fake / "search").mkdir(parents=True)
    (fake / "search" / "bad.py").write_text(textwrap.dedent("""
        def f(sync, shard, b):
            if isinstance(sync, (AllReduceSynchronizer, int)):
                pass
            if shard.synchronizer.kind == "ps" or sync["kind"] in ("sfb",):
                pass
            return b.kind == KIND_AR, sync.kind == "other", shard.compressor.kind == "none"
    """))
    hits = kind_dispatch(fake)["search/bad.py"]
    assert len(hits) == 4, hits


def private_imports(package: Path | None = None) -> list[str]:
    """Every import of a private name (or from a private module) of another layer."""
    package = package or PACKAGE
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        layer = rel.parts[0] if len(rel.parts) > 1 else rel.stem
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                parts = list(rel.parts[:-1])[:len(rel.parts) - node.level] + (node.module.split(".") if node.module
                                                                               else [])
            elif node.module and node.module.split(".")[0] == "synctune":
                parts = node.module.split(".")[1:]
            else:
                continue
            if not parts or parts[0] == layer:
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private or any(p.startswith("_") and p != "__init__" for p in parts[1:]):
                found.append(f"{rel}:{node.lineno}: from {'.' * node.level}{node.module or ''} import "
                             f"{', '.join(a.name for a in node.names)}")
    return found


def test_no_layer_imports_another_layers_private_names():
    assert private_imports() == []


def test_the_private_import_check_sees_names_and_modules(tmp_path):
    import textwrap

    fake = tmp_path / "synctune"
    for layer in ("engine", "run", "spec"):
        (fake / layer).mkdir(parents=True)
    (fake / "run" / "bad.py").write_text(textwrap.dedent("""
        from ..engine.fsdp import _check_plan, fsdp_plan
        from synctune.spec._util import LIMITS
        from .search import _private_here
        from ..engine import units
    """))
    found = private_imports(fake)
    assert len(found) == 2 and "_check_plan" in found[0] and "_util" in found[1], found
