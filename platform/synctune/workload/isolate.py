"""A user's workload checked where its code can be bounded and cleaned up: a child process in a
session of its own that imports the code, calls the factory and extracts the model spec (one real
step), then reports back and is taken down with everything it started.

The user's code is untrusted: in the command's own process, ``sys.exit(0)`` at import would end
the command with status 0 as if it had succeeded, a factory that never returns would hang it,
and a thread or process the import starts would keep it alive or outlive it. In the child, every
way out (an exception, ``SystemExit``, ``KeyboardInterrupt``, the process dying, the time running
out, a thread or process left running) is one :class:`SpecError` naming the workload and the
step: import, factory, spec extraction or loss. The command keeps the spec and the workload's
name and batch size, and never imports the user's code itself; trial workers import it in
processes the trial launcher owns.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from ..spec.errors import SpecError
from ..spec.model import ModelSpec

__all__ = ["CHECK_TIMEOUT_S", "CheckedWorkload", "STEPS", "check_workload", "stop_process_group"]

#: How long the check may take when the command has no trial timeout of its own: the default
#: trial timeout (``TrialConfig.timeout_s``).
CHECK_TIMEOUT_S = 900.0
#: The steps of a check, in order, as the errors name them.
STEPS = {"import": "importing the workload", "factory": "calling the factory",
         "spec extraction": "extracting the model spec", "loss": "computing the loss"}


@dataclass(frozen=True, kw_only=True)
class CheckedWorkload:
    """What the check of a workload found: its model spec, name and per-replica batch."""

    spec: ModelSpec
    name: str
    batch_size: int


def stop_process_group(proc: subprocess.Popen, *, grace_s: float = 5.0) -> None:
    """Stop ``proc`` (started with ``start_new_session=True``) and every process of its tree and
    of its session: SIGTERM, then SIGKILL to whatever is left after ``grace_s``.

    The tree is collected before any signal, so a child that made a session of its own and is
    orphaned by its parent's exit is still found."""
    import psutil

    try:
        root = psutil.Process(proc.pid)
        members = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        members = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and os.getsid(p.pid) == proc.pid and p not in members:
                members.append(p)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
        for p in members:
            try:
                p.send_signal(sig)
            except psutil.Error:
                pass
        _gone, members = psutil.wait_procs(members, timeout=grace_s if sig == signal.SIGTERM else 10.0)
        if not members:
            break
    try:
        proc.wait(timeout=10.0)
    except subprocess.TimeoutExpired:  # pragma: no cover - SIGKILL was sent
        pass


#: How the checking process starts: ``python -c`` (and ``-m``) put the current folder first on
#: ``sys.path``, where a user's ``tokenize.py`` would be imported instead of Python's by synctune
#: or torch; it is dropped before anything is imported (the workload is found by its location).
_CHILD_BOOT = ("import sys\nif sys.path and sys.path[0] == '': del sys.path[0]\nimport runpy; "
               "runpy.run_module('synctune.workload._check_child', run_name='__main__', alter_sys=True)")


def check_workload(path: str, root: str, *, timeout_s: float = CHECK_TIMEOUT_S) -> CheckedWorkload:
    """Import workload ``path`` (``package.module:factory`` or ``file.py:factory``, relative
    files looked up in the current folder and ``root``), call its factory and extract its model
    spec, in a child process bounded by ``timeout_s``; every failure is one :class:`SpecError`
    naming ``path`` and the step. Nothing the child started survives the call."""
    where = f"workload {path!r}"
    package_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([package_root, *filter(None, [env.get("PYTHONPATH")])])
    read_fd, write_fd = os.pipe()
    # The user's prints go to a file, shown after a successful check (stdout may carry the
    # command's JSON; a failure is one line).
    output = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen([sys.executable, "-c", _CHILD_BOOT, path, root, str(write_fd)],
                                stdin=subprocess.PIPE, stdout=output, stderr=output, env=env,
                                pass_fds=(write_fd,), start_new_session=True)
    except OSError as exc:
        os.close(read_fd)
        os.close(write_fd)
        output.close()
        raise SpecError(f"{where}: cannot start a process to check it: {exc}") from None
    os.close(write_fd)
    step, result, buffer = "import", None, b""
    deadline = time.monotonic() + timeout_s
    try:
        with os.fdopen(read_fd, "rb", buffering=0) as pipe:
            while result is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise SpecError(f"{where}: {STEPS[step]} did not finish within {timeout_s:g} s (the trial's "
                                    f"timeout); stopped it")
                ready, _, _ = select.select([pipe], [], [], min(left, 0.5))
                chunk = pipe.read(65536) if ready else b""
                if ready and not chunk:  # the child closed its end: it ended
                    proc.wait()
                    if proc.returncode < 0:
                        how = f"was killed by {signal.Signals(-proc.returncode).name}"
                    else:
                        how = f"exited with status {proc.returncode}"
                    raise SpecError(f"{where}: the process checking it {how} while {STEPS[step]} (did the code "
                                    f"call os._exit or crash?)")
                buffer += chunk
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    message = json.loads(line)
                    if "step" in message:
                        step = message["step"]
                    elif "error" in message:
                        raise SpecError(message["error"])
                    else:
                        result = message
    finally:
        stop_process_group(proc)
        proc.stdin.close()
    output.seek(0)
    printed = output.read()
    output.close()
    if printed:
        sys.stderr.write(printed.decode(errors="replace"))
        sys.stderr.flush()
    return CheckedWorkload(spec=ModelSpec.from_dict(result["spec"], where=where), name=result["name"],
                           batch_size=result["batch_size"])
