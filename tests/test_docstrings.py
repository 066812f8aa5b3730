"""Public names say what they are: every public class and function of every public module of the
package, and every public method and property of those classes, has a docstring (its own, or the
one it overrides: ``inspect.getdoc`` follows the class's bases). Dataclass fields are documented
in their class's docstring."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import synctune



def undocumented() -> list[str]:
    """Every public name of the package without a docstring, as ``module.name[.member]``."""
    missing = []
    for info in pkgutil.walk_packages(synctune.__path__, "synctune."):
        if any(part.startswith("_") for part in info.name.split(".")[1:]):
            continue
        module = importlib.import_module(info.name)
        for name, obj in vars(module).items():
            if name.startswith("_") or getattr(obj, "__module__", None) != info.name:
                continue
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            if not inspect.getdoc(obj):
                missing.append(f"{info.name}.{name}")
            if not inspect.isclass(obj):
                continue
            fields = {f.name for f in dataclasses.fields(obj)} if dataclasses.is_dataclass(obj) else set()
            for member, raw in vars(obj).items():
                if member.startswith("_") or member in fields:
                    continue
                if not (inspect.isfunction(raw) or isinstance(raw, (property, classmethod, staticmethod))):
                    continue
                if isinstance(raw, property):  # its own docstring, or the property it overrides
                    doc = raw.__doc__ or next((vars(base)[member].__doc__ for base in obj.__mro__[1:]
                                               if member in vars(base) and vars(base)[member].__doc__), None)
                else:
                    doc = inspect.getdoc(getattr(obj, member))
                if not doc:
                    missing.append(f"{info.name}.{name}.{member}")
    return missing


def test_public_names_are_documented():
    missing = undocumented()
    assert missing == [], "\n".join(missing)
