"""Users' own workloads: ``define`` what a trial needs, expose it from a factory, name the
factory by an import path (``package.module:factory`` or ``path/to/file.py:factory``).

A factory is a function without arguments returning :func:`define`'s result::

    # my_job.py
    import synctune.workload as sw

    def workload():
        return sw.define(
            name="digits-mlp",
            model=lambda: MLP(),                                   # built on the current device
            batch=lambda batch_size, rank, generator: make_batch(batch_size, rank, generator),
            optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
            loss=lambda model, batch: F.cross_entropy(model(batch[0]), batch[1]),
            batch_size=32,
        )

``synctune trial --workload my_job.py:workload`` and ``workload: my_job.py:workload`` in an
experiment then run it. The factory is called once in every process that needs it (each
worker imports the file or module itself: nothing but the import path travels), so the
functions it returns need not be picklable.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..spec.checks import LIMITS, in_range
from ..spec.errors import SpecError
from ..spec.files import MAX_NAME_LENGTH, check_path
from ..spec.model import ModelSpec
from .base import Workload

__all__ = ["WorkloadDefinition", "define", "ImportedWorkload", "load_definition"]


@dataclass(frozen=True, kw_only=True)
class WorkloadDefinition:
    """What a user's factory returns (see :func:`define`)."""

    name: str
    model: Callable[[], Any]
    batch_size: int
    batch: Callable[[int, int, Any], tuple] | None = None
    loader: Callable[[int, int, int], Iterable[tuple]] | None = None
    optimizer: Callable[[list], Any] | None = None
    loss: Callable[[Any, tuple], Any] | None = None
    family: str = ""

    def __post_init__(self) -> None:
        where = f"workload {str(self.name)[:60]!r}"
        if not (isinstance(self.name, str) and 0 < len(self.name) <= MAX_NAME_LENGTH and self.name.isprintable()
                and "/" not in self.name):
            raise SpecError(f"workload: name: expected a non-empty name without '/' of at most {MAX_NAME_LENGTH} "
                            f"characters, got {str(self.name)[:60]!r}")
        if not callable(self.model):
            raise SpecError(f"{where}: model: expected a function that builds the nn.Module")
        if (self.batch is None) == (self.loader is None):
            raise SpecError(f"{where}: give exactly one of batch (batch_size, rank, generator -> tuple of tensors) "
                            f"and loader (batch_size, rank, world -> iterable of such tuples)")
        for key in ("batch", "loader", "optimizer", "loss"):
            value = getattr(self, key)
            if value is not None and not callable(value):
                raise SpecError(f"{where}: {key}: expected a function, got {type(value).__name__}")
        if not in_range(self.batch_size, 1, LIMITS["batch"]):
            raise SpecError(f"{where}: batch_size: expected an integer from 1 to {LIMITS['batch']}, "
                            f"got {self.batch_size!r}")


def define(*, name: str, model: Callable[[], Any], batch_size: int, batch: Callable | None = None,
           loader: Callable | None = None, optimizer: Callable | None = None, loss: Callable | None = None,
           family: str = "") -> WorkloadDefinition:
    """Describe a workload.

    - ``model()``: a new ``nn.Module``, built on the current default device (the engine calls
      it inside ``with torch.device(...)``; the spec is traced on the ``meta`` device when the
      model allows it);
    - ``batch(batch_size, rank, generator)``: one replica's batch, a tuple of tensors (drawn
      with ``generator`` for reproducible trials), or ``loader(batch_size, rank, world)``: an
      iterable of such tuples (a DataLoader over this rank's part of the data);
    - ``optimizer(params)``: the optimizer over the parameters a rank updates (default: the
      trial's SGD or Adam);
    - ``loss(model, batch)``: the scalar mean loss (default: ``model(*batch)``);
    - ``batch_size``: the per-replica batch.
    """
    return WorkloadDefinition(name=name, model=model, batch_size=batch_size, batch=batch, loader=loader,
                              optimizer=optimizer, loss=loss, family=family)


def _imported_names(file: Path) -> set[str]:
    """The top-level modules ``file`` imports by absolute name (``import x.y``, ``from x import
    y``), read without running it; none when it does not parse (importing it will say why)."""
    import ast

    try:
        tree = ast.parse(file.read_bytes(), str(file))
    except (SyntaxError, ValueError, OSError):
        return set()
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def _sibling(folder: Path, name: str) -> Path | None:
    """The module ``name`` in ``folder`` (``name.py`` or a package ``name/``), if there is one."""
    for candidate in (folder / f"{name}.py", folder / name / "__init__.py"):
        if candidate.is_file():
            return candidate if candidate.name != "__init__.py" else candidate.parent
    return None


def _importable_elsewhere(name: str, folder: Path) -> bool:
    """Whether ``name`` is Python's own module or one already importable from outside ``folder``."""
    if name in getattr(sys, "stdlib_module_names", ()) or name in sys.builtin_module_names:
        return True
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    origin = getattr(spec, "origin", None) if spec is not None else None
    locations = list(getattr(spec, "submodule_search_locations", None) or []) + ([origin] if origin else [])
    return bool(locations) and not any(str(loc).startswith(str(folder) + os.sep) for loc in locations)


def _check_shadowing(path: str, file: Path, folder: Path, names: Iterable[str]) -> None:
    """Refuse, in one line, a workload that imports a module of its folder named like one of
    Python's (or an installed one): its folder comes after them on ``sys.path`` (so it cannot
    change what synctune and torch import), which makes Python's the one it would get."""
    for name in sorted(names):
        mine = _sibling(folder, name)
        if mine is not None and _importable_elsewhere(name, folder):
            raise SpecError(f"workload {path!r}: {file.name} imports {name!r}, and {mine} has the name of Python's "
                            f"(or an installed) module {name!r}, which is the one imported; rename {mine.name}")


def _add_to_path(folder: str) -> None:
    """Make ``folder``'s modules importable after everything already importable: a user's
    ``tokenize.py`` or ``queue.py`` there never replaces Python's in synctune's, torch's or the
    workload's own imports."""
    if folder not in sys.path:
        sys.path.append(folder)


# Resolved once per process: path -> (definition, spec); (name, batch size) as a check in a
# child process found them (the process that checked never imports the user's code itself).
_DEFINITIONS: dict[tuple[str, str], WorkloadDefinition] = {}
_SPECS: dict[tuple[str, str], ModelSpec] = {}
_CHECKED: dict[tuple[str, str], tuple[str, int]] = {}


def _import_factory(path: str, root: str) -> Any:
    target, sep, attr = path.rpartition(":")
    if not sep or not target or not attr.isidentifier():
        raise SpecError(f"workload {path!r}: expected package.module:factory or path/to/file.py:factory")
    if target.endswith(".py"):
        file = Path(check_path(target, f"workload {path[:100]!r}: file"))
        candidates = [file] if file.is_absolute() else [Path.cwd() / file, Path(root) / file]
        found = next((c for c in candidates if c.is_file()), None)
        if found is None:
            where = "" if file.is_absolute() else f" (looked in {' and '.join(dict.fromkeys([str(Path.cwd()), root]))})"
            raise SpecError(f"workload {path!r}: no such file {target}{where}")
        found = found.resolve()
        name = "synctune_workload_" + hashlib.sha256(str(found.resolve()).encode()).hexdigest()[:16]
        module = sys.modules.get(name)
        if module is None:
            folder = found.parent
            _check_shadowing(path, found, folder, _imported_names(found))
            _add_to_path(str(folder))  # so the file can import its neighbours
            spec = importlib.util.spec_from_file_location(name, found)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except (Exception, SystemExit) as exc:  # the user's file; Ctrl-C and SIGTERM go through
                del sys.modules[name]
                how = (f"it called sys.exit({exc.code!r})" if isinstance(exc, SystemExit)
                       else f"{type(exc).__name__}: {str(exc)[:300]}")
                raise SpecError(f"workload {path!r}: importing {found} failed: {how}") from None
    else:
        top = target.split(".")[0]
        mine = _sibling(Path(root), top)
        if mine is not None and _importable_elsewhere(top, Path(root)):
            raise SpecError(f"workload {path!r}: {mine} has the name of Python's (or an installed) module {top!r}, "
                            f"which is the one imported; rename it")
        try:
            module = importlib.import_module(target)
        except ModuleNotFoundError:
            _add_to_path(root)  # where the job was started (a worker's cwd may differ)
            try:
                module = importlib.import_module(target)
            except Exception as exc:  # noqa: BLE001 - whatever the user's module raises on import
                raise SpecError(f"workload {path!r}: cannot import module {target!r}: {type(exc).__name__}: "
                                f"{str(exc)[:300]}") from None
        except Exception as exc:  # noqa: BLE001
            raise SpecError(f"workload {path!r}: importing module {target!r} failed: {type(exc).__name__}: "
                            f"{str(exc)[:300]}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise SpecError(f"workload {path!r}: {target} has no function {attr!r}")
    return factory


def load_definition(path: str, root: str | None = None) -> WorkloadDefinition:
    """Import ``path`` (``package.module:factory`` or ``file.py:factory``) and call the factory."""
    root = root or os.getcwd()
    key = (path, root)
    if key not in _DEFINITIONS:
        factory = _import_factory(path, root)
        try:
            definition = factory()
        except SpecError as exc:
            raise SpecError(f"workload {path!r}: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - the user's factory
            raise SpecError(f"workload {path!r}: the factory raised {type(exc).__name__}: {str(exc)[:300]}") from None
        if not isinstance(definition, WorkloadDefinition):
            raise SpecError(f"workload {path!r}: the factory returned {type(definition).__name__}; it must return "
                            f"synctune.workload.define(...)")
        _DEFINITIONS[key] = definition
    return _DEFINITIONS[key]


@dataclass(frozen=True)
class ImportedWorkload(Workload):
    """A user's workload, by import path. Only the path (and the folder the job started in)
    travels to workers; each resolves it itself."""

    path: str
    root: str = field(default_factory=os.getcwd)

    @property
    def definition(self) -> WorkloadDefinition:
        """The user's definition, imported into this process on first use and cached per path and
        folder (:func:`load_definition`); :meth:`check` gets the model spec without importing the
        user's code here."""
        return load_definition(self.path, self.root)

    @property
    def name(self) -> str:  # type: ignore[override]
        checked = _CHECKED.get((self.path, self.root))
        return checked[0] if checked else self.definition.name

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        checked = _CHECKED.get((self.path, self.root))
        return checked[1] if checked else self.definition.batch_size

    def check(self, timeout_s: float | None = None) -> ModelSpec:
        """The model spec, extracted in a child process bounded by ``timeout_s`` (default
        :data:`~synctune.workload.isolate.CHECK_TIMEOUT_S`) and taken down with whatever the
        user's code started (:func:`~synctune.workload.isolate.check_workload`); this process
        does not import the code. Every failure is one :class:`SpecError` naming the step."""
        key = (self.path, self.root)
        if key not in _SPECS:
            from .isolate import CHECK_TIMEOUT_S, check_workload

            checked = check_workload(self.path, self.root, timeout_s=timeout_s or CHECK_TIMEOUT_S)
            _CHECKED[key] = (checked.name, checked.batch_size)
            _SPECS[key] = checked.spec
        return _SPECS[key]

    @property
    def source(self) -> str:  # type: ignore[override]
        return self.path

    def build_model(self) -> Any:
        return self.definition.model()

    def make_batch(self, batch_size: int, *, rank: int, generator: Any, device: Any) -> tuple:
        d = self.definition
        if d.batch is not None:
            batch = d.batch(batch_size, rank, generator)
        else:
            import torch.distributed as dist

            world = dist.get_world_size() if dist.is_initialized() else 1
            batch = next(iter(d.loader(batch_size, rank, world)))
        return _on_device(batch, device, self.path)

    def batches(self, batch_size: int, rank: int, world: int, seed: int = 0):
        """The loader's epochs one after another, or the batch function's batches."""
        d = self.definition
        if d.loader is None:
            yield from super().batches(batch_size, rank, world, seed)
            return
        while True:
            empty = True
            for batch in d.loader(batch_size, rank, world):
                empty = False
                yield _on_device(batch, "cpu", self.path)
            if empty:
                raise SpecError(f"workload {self.path!r}: loader({batch_size}, {rank}, {world}) gave no batch")

    def loss(self, model: Any, batch: tuple) -> Any:
        d = self.definition
        return d.loss(model, batch) if d.loss is not None else model(*batch)

    def make_optimizer(self, params: list, *, name: str = "sgd", lr: float = 0.01) -> Any:
        d = self.definition
        return d.optimizer(params) if d.optimizer is not None else super().make_optimizer(params, name=name, lr=lr)

    def spec(self) -> ModelSpec:
        key = (self.path, self.root)
        if key not in _SPECS:
            from .extract import workload_spec

            _SPECS[key] = workload_spec(self)
        return _SPECS[key]


def _on_device(batch: Any, device: Any, path: str) -> tuple:
    import torch

    if isinstance(batch, torch.Tensor):
        batch = (batch,)
    if not isinstance(batch, (tuple, list)) or not all(isinstance(t, torch.Tensor) for t in batch):
        raise SpecError(f"workload {path!r}: batch: expected a tuple of tensors, got {type(batch).__name__}")
    return tuple(t.to(device) for t in batch)
