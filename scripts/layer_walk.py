"""Walk one command through the layers: every call from a function of one synctune layer into a
function of a layer it may not import (DESIGN.md's module table) is a climb back up.

    python3 scripts/layer_walk.py search EXPERIMENT.yaml   # any synctune command line

It runs the command in this process under ``sys.setprofile`` (the driver's process: trials on
worker processes are not traced) and prints each distinct climb (caller -> callee, with the
functions) and their count. Calls into what the caller was handed are reported apart: a
callable the caller holds (a callback such as the CLI's ``on_trial``, a predicate such as a
memory budget's ``fits``), a method of an object it holds (a workload's factories, a simulator
behind the search's ``SimulatorProtocol``, a memory check), directly in a local name or as an
attribute of one (``self.simulator``), and an iterator (``<genexpr>``): a layer calling what it
was given is not a dependency on the layer that wrote it (the import graph, held by
tests/test_architecture.py, is the dependency).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "platform"))
sys.path.insert(0, str(ROOT / "tests"))

from test_architecture import ALLOWED  # noqa: E402  (the table the test holds)

PACKAGE = str(ROOT / "platform" / "synctune")


def layer_of(filename: str) -> str | None:
    if not filename.startswith(PACKAGE):
        return None
    rel = Path(filename).relative_to(PACKAGE)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _holds(frame, code) -> bool:
    """Whether ``frame`` holds, in a local name or as an attribute of one, the function whose code
    is ``code`` or an object with a method of that code (what the caller was handed)."""

    def runs(value) -> bool:
        func = getattr(value, "__func__", value)
        if getattr(func, "__code__", None) is code:
            return True
        for cls in type(value).__mro__:
            member = vars(cls).get(code.co_name)
            member = getattr(member, "fget", member)  # a property
            if getattr(getattr(member, "__func__", member), "__code__", None) is code:
                return True
        return False

    for value in frame.f_locals.values():
        if runs(value) or any(runs(v) for v in getattr(value, "__dict__", {}).values()):
            return True
    return False


def main(argv: list[str]) -> int:
    from synctune.cli import main as cli_main

    climbs: dict[tuple, int] = {}
    handed: dict[tuple, int] = {}

    def profile(frame, event, _arg):
        if event != "call":
            return
        callee = layer_of(frame.f_code.co_filename)
        caller_frame = frame.f_back
        if callee is None or caller_frame is None:
            return
        caller = layer_of(caller_frame.f_code.co_filename)
        if caller is None or caller == callee or callee in ("__init__", "__main__"):
            return
        if callee in ALLOWED.get(caller, set()):
            return
        key = (caller, caller_frame.f_code.co_name, callee, frame.f_code.co_name)
        name = frame.f_code.co_name
        target = handed if name.startswith("<") or _holds(caller_frame, frame.f_code) else climbs
        target[key] = target.get(key, 0) + 1

    sys.setprofile(profile)
    try:
        code = cli_main(argv)
    finally:
        sys.setprofile(None)
    print(f"exit status {code}")
    print(f"climbs back up: {len(climbs)}")
    for (a, fa, b, fb), n in sorted(climbs.items()):
        print(f"  {a}.{fa} -> {b}.{fb} ({n}x)")
    print(f"callbacks handed down and called: {len(handed)}")
    for (a, fa, b, fb), n in sorted(handed.items()):
        print(f"  {a}.{fa} -> {b}.{fb} ({n}x)")
    return 0 if not climbs else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
