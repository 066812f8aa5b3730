"""How a user names a model: a zoo name, a model spec file, or a workload import path, read
into a :class:`ModelSource` that gives the model spec and, when the model can run, the workload.

Telling the three apart reads nothing and imports nothing (no torch, no user code): a command
can check what it was given before any slow work. The spec is extracted, the spec file read and
the user's code imported only when :meth:`ModelSource.spec` or :meth:`ModelSource.workload` is
called; every failure there is one :class:`SpecError` naming the file or import path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from ..models.zoo import MODELS
from ..spec.errors import SpecError
from ..spec.files import check_path, read_json, read_yaml
from ..spec.model import ModelSpec
from .base import Workload
from .keras import KERAS_ZOO

__all__ = ["ModelSource", "model_source", "SOURCE_KINDS", "SPEC_FILE_SUFFIXES"]

#: What a :class:`ModelSource` can be: a zoo model (PyTorch or Keras), a model spec file, a
#: user's workload by import path.
SOURCE_KINDS = ("zoo", "spec-file", "import-path")
#: Suffixes of model spec files (JSON as ``synctune models NAME --json`` writes it, or YAML).
SPEC_FILE_SUFFIXES = (".json", ".yaml", ".yml")

FORMS = "a zoo model, a model spec file (.json, .yaml) or a workload import path (package.module:factory, " \
        "path/to/file.py:factory)"


def _zoo_names() -> str:
    return ", ".join([*MODELS, *KERAS_ZOO])


@dataclass(frozen=True, kw_only=True)
class ModelSource:
    """A model as the user named it (``text``), of one of :data:`SOURCE_KINDS`.

    ``root`` is the folder a relative workload file is also looked up in (default: the current
    one), as for :class:`~synctune.workload.ImportedWorkload`."""

    text: str
    kind: str
    root: str = field(default_factory=os.getcwd)

    def __post_init__(self) -> None:
        if self.kind not in SOURCE_KINDS:
            raise SpecError(f"model source: kind: expected one of {', '.join(SOURCE_KINDS)}, got {self.kind!r}")
        if not isinstance(self.text, str) or not self.text.strip():
            raise SpecError(f"model source: text: expected {FORMS}, got {self.text!r}")

    @property
    def runnable(self) -> bool:
        """Whether a trial can run it (a spec file describes a model but cannot train it)."""
        return self.kind != "spec-file"

    def workload(self) -> Workload:
        """The workload (nothing is imported or run yet: :meth:`Workload.spec` does that)."""
        if not self.runnable:
            raise SpecError(f"{self.text}: a model spec file describes a model, it cannot run one; give a zoo "
                            f"model (`synctune models` lists them) or a workload (package.module:factory, "
                            f"file.py:factory)")
        from .zoo import resolve_workload

        if self.kind == "import-path":
            from .define import ImportedWorkload

            return ImportedWorkload(self.text, self.root)
        return resolve_workload(self.text)

    def spec(self) -> ModelSpec:
        """The model spec: read from the file, or extracted from the workload (a user's workload
        is imported, and one forward and backward pass run, in a child process bounded by the
        default trial timeout: :meth:`~synctune.workload.ImportedWorkload.check`)."""
        if self.kind == "import-path":
            return self.workload().check()
        if self.kind != "spec-file":
            return self.workload().spec()
        path = Path(self.text)
        if path.suffix.lower() in (".yaml", ".yml"):
            data = read_yaml(path, "model spec")
        else:
            data = read_json(path, "model spec")
        return ModelSpec.from_dict(data, where=str(path))


def model_source(text: str, *, root: str | None = None) -> ModelSource:
    """What ``text`` names, told apart without reading or importing anything:

    - a zoo model by name (``cnn-small``, ``keras-cnn-small``);
    - a model spec file: a name ending in .json, .yaml or .yml, or any other existing file
      (read as JSON);
    - a workload import path, ``package.module:factory`` or ``path/to/file.py:factory``.

    Anything else is one :class:`SpecError` saying which forms are accepted."""
    if not isinstance(text, str) or not text.strip():
        raise SpecError(f"expected {FORMS}, got {str(text)[:60]!r}")
    root = root or os.getcwd()
    if text in MODELS or text in KERAS_ZOO:
        return ModelSource(text=text, kind="zoo", root=root)
    path = Path(check_path(text, "model"))  # every form names a file or module: one the file system can hold
    if path.suffix.lower() in SPEC_FILE_SUFFIXES:
        return ModelSource(text=text, kind="spec-file", root=root)
    if ":" in text:
        target, _sep, attr = text.rpartition(":")
        if not target or not attr.isidentifier():
            raise SpecError(f"workload {text[:100]!r}: expected package.module:factory or path/to/file.py:factory")
        return ModelSource(text=text, kind="import-path", root=root)
    if path.suffix.lower() == ".py":
        raise SpecError(f"{text[:100]}: name the factory in the file that returns synctune.workload.define(...), "
                        f"as {text[:100]}:FACTORY (e.g. {path.name}:workload)")
    if path.is_file():
        return ModelSource(text=text, kind="spec-file", root=root)
    raise SpecError(f"unknown model {text[:60]!r}: not in the zoo ({_zoo_names()}), nor a model spec file "
                    f"(.json, .yaml), nor a workload import path (package.module:factory, file.py:factory)")
