"""The child process of :func:`~synctune.workload.isolate.check_workload`: imports the user's
workload, calls its factory and extracts its model spec, writing each step, then the result or
the error, to the pipe its parent reads (a module of its own: it imports ``define``, which
imports ``isolate``)."""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from typing import Any

from ..spec.errors import SpecError
from .isolate import STEPS

# How long a process the user's step left (a DataLoader worker) may take to exit by itself.
_SETTLE_S = 2.0




def _describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r})"
    if isinstance(exc, KeyboardInterrupt):
        return "it raised KeyboardInterrupt"
    text = " ".join(str(exc).split())
    return f"it raised {type(exc).__name__}" + (f": {text[:300]}" if text else "")


def _left_running(where: str, step: str) -> str | None:
    """What ``step`` left running that would keep a worker alive or outlive it, if anything."""
    import psutil

    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread() and t.is_alive()
               and not t.daemon]
    if threads:
        return (f"{where}: {STEPS[step]} left a non-daemon thread running ({', '.join(threads[:3])}): a worker "
                f"running it would never exit; make it a daemon thread or join it before returning")
    gc.collect()  # a DataLoader iterator dropped: its workers are told to stop
    deadline = time.monotonic() + _SETTLE_S
    children = psutil.Process().children(recursive=True)
    while children and time.monotonic() < deadline:
        time.sleep(0.05)
        children = [c for c in children if c.is_running() and c.status() != psutil.STATUS_ZOMBIE]
    if children:
        names = ", ".join(f"pid {c.pid}" for c in children[:3])
        return (f"{where}: {STEPS[step]} left {len(children)} child process(es) running ({names}): every worker "
                f"would leave them behind; stop them before returning")
    return None


def _child(path: str, root: str, fd: int) -> None:
    """Check ``path`` and write the steps, then the result or the error, to ``fd`` as JSON lines."""
    import dataclasses

    from .define import _DEFINITIONS, ImportedWorkload, WorkloadDefinition, _import_factory

    where = f"workload {path!r}"
    out = os.fdopen(fd, "w", buffering=1)
    step = "import"

    def enter(name: str) -> None:
        nonlocal step
        step = name
        out.write(json.dumps({"step": name}) + "\n")

    def finish(message: dict) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()
        # Stay until the parent has taken the tree down (or is gone): what the user's code
        # started is found as this process's descendants only while it lives.
        try:
            sys.stdin.buffer.read()
        finally:
            # Not a normal exit: the user's atexit hooks and non-daemon threads would run or wait.
            os._exit(0)

    try:
        enter("import")
        factory = _import_factory(path, root)
        problem = _left_running(where, "import")
        if problem:
            finish({"error": problem})
        enter("factory")
        definition = factory()
        if not isinstance(definition, WorkloadDefinition):
            finish({"error": f"{where}: the factory returned {type(definition).__name__}; it must return "
                             f"synctune.workload.define(...)"})
        problem = _left_running(where, "factory")
        if problem:
            finish({"error": problem})
        user_loss = definition.loss

        def loss(model: Any, batch: tuple) -> Any:
            enter("loss")
            value = user_loss(model, batch) if user_loss is not None else model(*batch)
            enter("spec extraction")
            return value

        _DEFINITIONS[(path, root)] = dataclasses.replace(definition, loss=loss)
        enter("spec extraction")
        workload = ImportedWorkload(path, root)
        from .extract import workload_spec

        spec = workload_spec(workload)
        problem = _left_running(where, "spec extraction")
        if problem:
            finish({"error": problem})
        finish({"spec": spec.to_dict(), "name": definition.name, "batch_size": definition.batch_size})
    except SpecError as exc:
        finish({"error": f"{where}: {exc}" if not str(exc).startswith(where) else str(exc)})
    except BaseException as exc:  # noqa: BLE001 - the user's code: every way out is one error
        finish({"error": f"{where}: {STEPS[step]}: {_describe(exc)}"})


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
