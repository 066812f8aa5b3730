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
