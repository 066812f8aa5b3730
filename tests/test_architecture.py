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


def import_graph(package: Path | None = None, *, annotations: bool = True) -> dict[str, set[str]]:
    """File -> the files of ours it imports (deferred imports included; annotations-only ones,
    under ``if TYPE_CHECKING:``, unless ``annotations`` is False): ``from .pkg import name``
    points at the file ``name`` when it is a module, else at ``pkg``'s ``__init__``."""
    package = package or PACKAGE
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        skip = set() if annotations else _type_checking_lines(tree)
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
    """No two files import each other, directly or around a circle, annotation-only imports
    (``if TYPE_CHECKING:``) included: a circle a type checker needs is a circle of the design."""
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
    (fake / "engine" / "typed.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                              "    from .alone import y\n")
    (fake / "engine" / "alone.py").write_text("from .measure import x\nfrom .typed import z\n")
    assert sorted(import_cycles(import_graph(fake))) == [["synctune.engine.alone", "synctune.engine.typed"],
                                                         ["synctune.engine.measure", "synctune.engine.trial"]]
    assert import_cycles(import_graph(fake, annotations=False)) == [["synctune.engine.measure",
                                                                     "synctune.engine.trial"]]


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


#: The runtimes' modules (DESIGN.md "runtime"): the interface, the registry, one module per runtime.
RUNTIME_HOMES = {"engine/runtime.py", "engine/runtimes.py", "engine/tuning.py", "engine/composed.py", "engine/ddp.py",
                 "engine/fsdp.py", "engine/fsdp_plans.py", "engine/horovod.py", "engine/tensorflow.py"}
#: Below the engine, a dataset row names its runtime and nothing more: the simulators learn from,
#: and the dataset dashboard ranks, the rows the engine ran (what the replay models), kept by
#: that name, once each.
RUNTIME_ROW_FILTERS = {"simulator/base.py": 1, "report/dataset.py": 1}


def runtime_name_comparisons(package: Path | None = None, names: set[str] | None = None) -> dict[str, list[str]]:
    """File -> each comparison of a runtime (an expression naming ``runtime``, or a ``.name``)
    with a registered runtime's name."""
    if names is None:
        from synctune.engine.runtimes import RUNTIMES

        names = set(RUNTIMES)
    package = package or PACKAGE
    found: dict[str, list[str]] = {}
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Compare):
                continue
            strings = {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
            others = [ast.unparse(x) for x in (node.left, *node.comparators) if not isinstance(x, ast.Constant)]
            if strings & names and any("runtime" in o.lower() or o.endswith(".name") for o in others):
                found.setdefault(rel, []).append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_runtimes_are_decided_in_their_modules_only():
    """Outside the runtimes' modules no file compares a runtime with a runtime's name: what differs
    between runtimes is a class attribute or method of each (labels, tuning spaces, memory
    layout, training-file format, what it runs); the rows' filters below the engine are counted."""
    found = runtime_name_comparisons()
    for rel in RUNTIME_HOMES:
        found.pop(rel, None)
    grown = {rel: hits for rel, hits in found.items() if len(hits) > RUNTIME_ROW_FILTERS.get(rel, 0)}
    assert grown == {}, "\n".join(h for hits in grown.values() for h in hits)


def test_the_runtime_name_check_sees_attributes_keys_and_variables(tmp_path):
    import textwrap

    fake = tmp_path / "synctune"
    (fake / "cli").mkdir(parents=True)
    (fake / "cli" / "bad.py").write_text(textwrap.dedent("""
        def f(chosen, record, runtime, fmt):
            if chosen.runtime.name == "ddp" or record["runtime"] != "engine":
                pass
            return runtime in ("fsdp", "horovod"), fmt == "ddp", chosen.kind == "ddp"
    """))
    hits = runtime_name_comparisons(fake, {"engine", "ddp", "fsdp", "horovod"})["cli/bad.py"]
    assert len(hits) == 3, hits


#: Where a synchronizer kind's meaning lives (DESIGN.md "plan kind"): its class in the strategy
#: layer, and the registry of each layer's part of it (the simulators': a folder, a module per kind).
KIND_HOMES = {"strategy/kinds.py", "engine/kinds.py", "simulator/kinds/", "search/kinds.py"}
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
    """Outside the kinds' homes no file asks which kind a synchronizer is."""
    found = {rel: hits for rel, hits in kind_dispatch().items()
             if not any(rel == home or (home.endswith("/") and rel.startswith(home)) for home in KIND_HOMES)}
    assert found == {}, "\n".join(h for hits in found.values() for h in hits)


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
        from ..engine.fsdp import _check_plan, plan_from_config
        from synctune.spec._util import LIMITS
        from .search import _private_here
        from ..engine import units
    """))
    found = private_imports(fake)
    assert len(found) == 2 and "_check_plan" in found[0] and "_util" in found[1], found
