"""Check that every torch name synctune uses exists in the installed torch, without running it.

    python3 scripts/torch_names.py [FOLDER ...]   # default: platform/synctune tests benchmarks examples scripts

Run it with the oldest torch synctune declares (docs/guides/testing.md, "The oldest torch"):
the tests run on the CPU there, and this also covers what only a GPU machine runs (CUDA
branches, the gpu tier). For each Python file it parses the imports of torch modules and the
attribute chains rooted at them (``dist.reduce_scatter_tensor``, ``torch.cuda.max_memory_allocated``),
resolves each in the installed torch, and checks the keyword arguments of the calls it can
resolve against the callee's signature (a keyword a newer torch added). It prints each name
that does not resolve and each keyword the callee does not take, with file:line, and exits 1
if there is any. Names reached through objects (a tensor's or a module's methods) are not seen:
the tests cover those.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib
import sys
import warnings

ROOT = pathlib.Path(__file__).resolve().parents[1]
DEFAULT = ["platform/synctune", "tests", "benchmarks", "examples", "scripts"]


def resolve(dotted: str) -> tuple[bool, str, object]:
    """(found, the longest prefix that resolved or the first missing part, the object)."""
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except Exception:
            continue
        for j, part in enumerate(parts[i:]):
            if not hasattr(obj, part):
                return False, ".".join(parts[: i + j + 1]), None
            obj = getattr(obj, part)
        return True, dotted, obj
    return False, dotted, None


def _chain(node: ast.AST) -> list[str] | None:
    names = []
    while isinstance(node, ast.Attribute):
        names.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return [node.id, *reversed(names)]
    return None


def _aliases(tree: ast.AST) -> tuple[dict[str, str], list[tuple[str, int]]]:
    """Local names bound to torch modules or objects, and the imported names with their lines."""
    alias: dict[str, str] = {}
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    alias[a.asname or "torch"] = a.name if a.asname else "torch"
                    imported.append((a.name, node.lineno))
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "torch":
            for a in node.names:
                alias[a.asname or a.name] = f"{node.module}.{a.name}"
                imported.append((f"{node.module}.{a.name}", node.lineno))
    return alias, imported


def check_file(path: pathlib.Path) -> list[str]:
    """Problems of one file, as ``file:line: message`` lines."""
    try:
        tree = ast.parse(path.read_text())
    except SyntaxError:
        return []
    alias, imported = _aliases(tree)
    path = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    problems = []
    for name, line in imported:
        ok, missing, _ = resolve(name)
        if not ok:
            problems.append(f"{path}:{line}: {missing} does not exist")
    for node in ast.walk(tree):
        chain = _chain(node) if isinstance(node, ast.Attribute) else None
        if chain and chain[0] in alias:
            ok, missing, _ = resolve(".".join([alias[chain[0]], *chain[1:]]))
            if not ok:
                problems.append(f"{path}:{node.lineno}: {missing} does not exist")
        if isinstance(node, ast.Call) and node.keywords:
            chain = _chain(node.func)
            if not chain or chain[0] not in alias:
                continue
            dotted = ".".join([alias[chain[0]], *chain[1:]])
            ok, _, obj = resolve(dotted)
            try:
                params = inspect.signature(obj).parameters if ok and callable(obj) else None
            except (TypeError, ValueError):
                params = None
            if params is None or any(p.kind is p.VAR_KEYWORD for p in params.values()):
                continue
            for kw in node.keywords:
                if kw.arg and kw.arg not in params:
                    problems.append(f"{path}:{node.lineno}: {dotted} takes no keyword {kw.arg!r}")
    return problems


def main(argv: list[str]) -> int:
    warnings.filterwarnings("ignore")
    import torch

    folders = argv or DEFAULT
    files = sorted(p for f in folders for p in (ROOT / f).rglob("*.py"))
    problems = sorted(set(line for p in files for line in check_file(p)))
    for line in problems:
        print(line)
    print(f"torch {torch.__version__}: {len(files)} files, {len(problems)} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
