"""Run a function on N local worker processes joined in a torch.distributed process group.

The caller never hangs: every wait is bounded. A worker that raises, dies (killed, crashed)
or a group that outlives ``timeout_s`` ends the run with a :class:`WorkerFailure` whose
``status`` is ``failed``, ``oom`` or ``timeout`` and whose message says which rank and why;
all other workers are then killed.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import pickle
import queue
import signal
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

__all__ = ["WorkerFailure", "run_local", "cpu_of_rank", "free_port", "report", "classify_error", "enter_netns", "join_cgroup",
           "peer_interface"]


class WorkerFailure(Exception):
    """A run that ended without every rank's result."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def classify_error(exc: BaseException) -> str:
    """``oom``, ``timeout`` or ``failed`` for an exception raised inside a worker."""
    text = f"{type(exc).__name__}: {exc}".lower()
    if isinstance(exc, MemoryError) or "out of memory" in text:
        return "oom"
    if "timed out" in text or "timeout" in text and ("gloo" in text or "nccl" in text or "wait" in text):
        return "timeout"
    return "failed"


_REPORTER: Callable[[Any], None] | None = None


def report(message: Any) -> None:
    """Send a progress message from inside a worker to the launcher (no-op when none listens)."""
    if _REPORTER is not None:
        _REPORTER(message)


def enter_netns(netns: str) -> None:
    """Move the calling thread into the network namespace ``netns`` (a name under /run/netns or
    a path). Sockets it opens afterwards live there; existing ones (pipes to the launcher,
    Ray's connections) keep working. Python 3.11 has no os.setns, hence ctypes."""
    import ctypes

    path = netns if netns.startswith("/") else f"/run/netns/{netns}"
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(path, os.O_RDONLY)
    try:
        if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
            err = ctypes.get_errno()
            raise OSError(err, f"setns({path}): {os.strerror(err)}")
    finally:
        os.close(fd)


def join_cgroup(path: str) -> None:
    """Move the calling process (all its threads) into the cgroup at ``path``: a lab node's CPU
    quota group (``synctune.lab.cpu``), so this worker computes at that node's speed."""
    try:
        with open(os.path.join(path, "cgroup.procs"), "w") as fh:
            fh.write(str(os.getpid()))
    except OSError as exc:
        raise RuntimeError(f"cannot join the lab node's CPU group {path} ({exc.strerror or exc}); "
                           f"synctune lab down, then up") from None


def peer_interface() -> tuple[str, str]:
    """(interface name, IPv4 address) this worker reaches its peers through, for runtimes that
    open their own connections (Horovod's gloo wants the name, TensorFlow's gRPC the address):
    a lab worker's shaped link (``GLOO_SOCKET_IFNAME``), else the route towards rank 0
    (``SYNCTUNE_MASTER_ADDR``, which the launchers set; loopback on one machine)."""
    import socket

    import psutil

    addrs = psutil.net_if_addrs()
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        ip = next((a.address for a in addrs.get(ifname, []) if a.family == socket.AF_INET), None)
        if ip:
            return ifname, ip
    master = os.environ.get("SYNCTUNE_MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, 9))  # no packet is sent: this only asks the kernel for the route's source
        ip = s.getsockname()[0]
    for name, entries in addrs.items():
        if any(a.address == ip for a in entries):
            return name, ip
    raise RuntimeError(f"no network interface holds {ip}, this worker's address towards {master}")


def rank_networks(cluster, replicas, node_net) -> list[dict[str, str]] | None:
    """Per rank, where its worker runs: ``{"netns", "ifname", "master"}`` (and ``"cgroup"``, a
    lab node's CPU quota group, where it has one) from a node network (node name -> ``{"netns",
    "address", "ifname"[, "cgroup"]}``, e.g. a lab's), or None without one."""
    if not node_net:
        return None
    master = node_net[cluster.node_of(replicas[0]).name]["address"]
    out = []
    for device in replicas:
        net = node_net[cluster.node_of(device).name]
        out.append({"netns": net["netns"], "ifname": net["ifname"], "master": master,
                    **({"cgroup": net["cgroup"]} if net.get("cgroup") else {})})
    return out


def _die_with_parent(parent: int) -> None:
    """Ask Linux to kill this worker when its parent dies, however it dies (even SIGKILL, which
    runs no cleanup): orphaned workers would hold ports, memory and a lab namespace."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the launcher's own cleanup still applies
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(1)


def _die_with_launcher(launcher: int) -> None:
    """A forked worker's parent is the fork server, and the server outlives its launcher while
    any worker it forked lives (each holds the server's end of the launcher's pipe): so the
    worker watches the launcher itself, and dies the moment it exits, however it exits."""
    import select
    import threading

    try:
        watched = os.pidfd_open(launcher)  # pidfd_open(2), Linux 5.3: readable when the process exits
    except ProcessLookupError:  # the launcher is already gone
        os._exit(1)

    def watch() -> None:
        select.select([watched], [], [])  # readable once the launcher has exited
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="synctune-launcher-watch", daemon=True).start()


def _entry(rank: int, world: int, port: int, backend: str, fn, args, q, collective_timeout_s: float,
           threads: int | None, env: dict[str, str], net: dict[str, str] | None = None,
           parent: int | None = None, cpu: int | None = None, launcher_env: dict[str, str] | None = None) -> None:
    global _REPORTER
    if launcher_env is not None:
        # Forked from the fork server: its environment is the one the server started with; the
        # worker's is the launcher's as of this run, as a fresh interpreter's would be.
        os.environ.clear()
        os.environ.update(launcher_env)
    if parent is not None and launcher_env is not None:
        _die_with_parent(os.getppid())  # the fork server
        _die_with_launcher(parent)
    elif parent is not None:
        _die_with_parent(parent)
    if os.environ.pop(_SAFE_PATH_MARK, None):
        os.environ.pop("PYTHONSAFEPATH", None)  # set for this start only: the user's own processes go as usual
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})  # before torch starts its threads: they inherit it
    os.environ.update(env)
    master = "127.0.0.1"
    if net:
        # The worker of an emulated node: its traffic leaves through that node's shaped link.
        enter_netns(net["netns"])
        os.environ["GLOO_SOCKET_IFNAME"] = net["ifname"]
        # A namespace has no name service: c10d warns on every connection that it cannot
        # resolve the peer's hostname. Harmless; keep the output readable.
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
        master = net["master"]
        if net.get("cgroup"):
            join_cgroup(net["cgroup"])  # a lab node of a given compute speed: its CPU quota
    os.environ["SYNCTUNE_MASTER_ADDR"] = master  # where rank 0 serves runtimes' rendezvous (Horovod)
    import torch
    import torch.distributed as dist

    if threads:
        torch.set_num_threads(threads)
    _REPORTER = lambda msg: q.put(("progress", rank, msg))  # noqa: E731
    code = 0
    try:
        dist.init_process_group(backend, init_method=f"tcp://{master}:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=collective_timeout_s))
        value = fn(rank, world, *args)
        # torch.save, not the queue's pickler: tensors would otherwise travel as shared-memory
        # handles that die with this process. The launcher loads with weights_only=True.
        buf = io.BytesIO()
        torch.save(value, buf)
        q.put(("result", rank, buf.getvalue()))
    except BaseException as exc:  # noqa: BLE001 - everything is reported to the launcher
        q.put(("error", rank, classify_error(exc), f"{type(exc).__name__}: {exc}", traceback.format_exc()))
        code = 1
    finally:
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    q.close()
    q.join_thread()
    sys.exit(code)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        hint = " (possibly out of memory)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exited with status {code}"


def _dead_peer(procs, failed_rank: int, results: dict, grace_s: float = 1.0) -> str | None:
    """Describe a rank other than ``failed_rank`` that was killed or crashed (waiting up to ``grace_s``)."""
    until = time.monotonic() + grace_s
    while True:
        for rank, p in enumerate(procs):
            if rank != failed_rank and rank not in results and p.exitcode not in (None, 0, 1):
                return f"rank {rank} {_describe_exit(p.exitcode)}"
        if time.monotonic() > until:
            return None
        time.sleep(0.05)


def cpu_of_rank(rank: int) -> int:
    """The CPU a pinned rank runs on: the ``rank``-th of those this process may use, cyclically.
    Unpinned, which workers share a core changes with every process group (the scheduler's
    choice) and persists through a trial: trials of the same strategy then differ more than
    their iterations do (measured in experiments/findings/repeat_noise.py)."""
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[rank % len(cpus)]


def run_local(fn: Callable[..., Any], world_size: int, args: tuple = (), *, backend: str = "gloo",
              timeout_s: float = 600.0, collective_timeout_s: float = 120.0,
              on_progress: Callable[[int, Any], None] | None = None, threads: int | None = None,
              env: dict[str, str] | None = None, nets: list[dict[str, str]] | None = None,
              pin_cpus: bool = False) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` new processes; return results by rank.

    ``nets`` (from :func:`rank_networks`) runs each rank inside its node's network namespace.
    ``pin_cpus`` binds rank r to the r-th CPU this process may use (modulo their number), so
    which workers share a core is the same in every group (:func:`cpu_of_rank`).

    ``fn`` and ``args`` must be picklable (a module-level function); its result may hold tensors,
    lists, dicts and plain values (what ``torch.load(weights_only=True)`` accepts). Raises
    :class:`WorkerFailure` on the first error, death or timeout.

    Workers start as :func:`_start_method` says: forked from a server that has imported torch, or
    a fresh interpreter each. Rank 0 serves the rendezvous on a port probed free before the
    workers start; another socket can take it meanwhile (fresh interpreters take seconds to
    import torch), so a run whose rank 0 finds its port taken (before any rank ran ``fn``)
    starts again on another, up to three times.
    """
    for attempt in range(_PORT_TRIES):
        port = free_port()
        try:
            return _run_group(fn, world_size, args, port, backend=backend, timeout_s=timeout_s,
                              collective_timeout_s=collective_timeout_s, on_progress=on_progress,
                              threads=threads, env=env, nets=nets, pin_cpus=pin_cpus)
        except WorkerFailure as exc:
            if attempt + 1 == _PORT_TRIES or not _port_taken(exc, port):
                raise


_PORT_TRIES = 3


def _port_taken(exc: WorkerFailure, port: int) -> bool:
    """Whether ``exc`` is rank 0 failing to listen on the rendezvous ``port`` (c10d's TCPStore
    names it), not on a port of its own inside ``fn`` (a runtime's server): only then has no rank
    run ``fn`` yet."""
    return (exc.message.startswith("rank 0: DistNetworkError: ") and "EADDRINUSE" in exc.message
            and f"port: {port}," in exc.message)


def _call_pickled(rank: int, world: int, call: bytes) -> Any:
    # ``call`` never touches a file: the launcher pickled it in this run and it reaches its own
    # worker over multiprocessing's pipe, the trust multiprocessing's own unpickling of the
    # function and arguments had before (and still has under spawn).
    fn, args = pickle.loads(call)
    return fn(rank, world, *args)


# Variables read when torch and the libraries under it load, not when they are used: a worker
# forked from the server has them as the server had them when it started.
_IMPORT_TIME_ENV = ("TORCH_", "PYTORCH_", "OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "LD_", "PYTHON", "MALLOC_",
                    "CUDA_", "NVIDIA_")
_FORK_SERVER_ENV: dict[str, str] | None = None  # those variables as the fork server started with them
_FORK_SERVER_CPUS: set[int] | None = None  # the CPUs the fork server may run on (its workers too)


#: Set beside PYTHONSAFEPATH by :func:`_worker_start` (not by the user): a worker drops both.
_SAFE_PATH_MARK = "SYNCTUNE_SAFE_PATH_SET"


#: Longest name of a Unix socket (``sun_path``, less its NUL): multiprocessing's fork server
#: listens on one in its temporary folder.
_UNIX_PATH_MAX = 107
#: The launcher's own temporary folder (:func:`_launcher_temp`), once made.
_LAUNCHER_TEMP: Path | None = None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _launcher_temp() -> Path | None:
    """``<temporary folder>/synctune-<uid>/launcher-<pid>``: where this launcher, its fork
    server, its workers and multiprocessing's resource tracker keep their temporary files (``pymp-*``).

    A launcher killed with SIGKILL runs no cleanup, and multiprocessing's folders would stay in
    the temporary folder for ever; here they stay in this folder, which the next launcher removes
    once this process is gone (and this one removes at a normal exit). None, and the usual
    places, where the folder is not safely ours (made by another user, a link)."""
    global _LAUNCHER_TEMP
    if _LAUNCHER_TEMP is not None:
        return _LAUNCHER_TEMP
    import shutil
    import stat
    import tempfile

    base = Path(tempfile.gettempdir()) / f"synctune-{os.getuid()}"
    if len(os.fsencode(str(base / f"launcher-{os.getpid()}"))) + len("/pymp-xxxxxxxx/listener-xxxxxxxx") > _UNIX_PATH_MAX:
        return None  # the fork server's socket in there would have a name too long to listen on
    try:
        base.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(base)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return None
        for old in base.glob("launcher-*"):
            pid = old.name.removeprefix("launcher-")
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
        mine = base / f"launcher-{os.getpid()}"
        mine.mkdir(mode=0o700, exist_ok=True)
    except OSError:
        return None
    import multiprocessing.util

    # After multiprocessing's own finalizers (priority -100 removes its pymp folder in here).
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(str(mine),), kwargs={"ignore_errors": True},
                                  exitpriority=-200)
    _LAUNCHER_TEMP = mine
    return mine


@contextlib.contextmanager
def _worker_start():
    """Start interpreters (workers, the fork server, multiprocessing's resource tracker) that do
    not put their current folder first on ``sys.path``, and keep their temporary files in the
    launcher's own folder (:func:`_launcher_temp`).

    Multiprocessing starts them with ``python -c``, which puts the current folder first, before
    it imports ``pickle``, ``socket`` and the rest of itself: a user's ``pickle.py`` or
    ``queue.py`` in the folder the command runs in would be imported instead of Python's
    (``PYTHONSAFEPATH``, Python 3.11 and later). The worker then takes ``sys.path`` from its
    launcher."""
    temp = _launcher_temp()
    saved = {k: os.environ.get(k) for k in ("PYTHONSAFEPATH", _SAFE_PATH_MARK, "TMPDIR")}
    if "PYTHONSAFEPATH" not in os.environ:
        os.environ.update({"PYTHONSAFEPATH": "1", _SAFE_PATH_MARK: "1"})
    if temp is not None:
        os.environ["TMPDIR"] = str(temp)
        import multiprocessing.process
        import multiprocessing.util
        import tempfile

        if multiprocessing.process.current_process()._config.get("tempdir") is None:
            before, tempfile.tempdir = tempfile.tempdir, str(temp)
            try:
                multiprocessing.util.get_temp_dir()  # the launcher's own pymp folder, made in there
            finally:
                tempfile.tempdir = before
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _import_time_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith(_IMPORT_TIME_ENV)}


def _start_method(backend: str, nets, env: dict[str, str] | None, pin_cpus: bool = False):
    """How the workers start, and the environment a forked one takes: (context, environment or None).

    On a CPU-only machine, outside a lab node, workers are forked from multiprocessing's fork
    server (Python's ``multiprocessing`` documentation, "Contexts and start methods") with torch
    already imported: a fresh interpreter spends seconds of CPU importing torch, which a group
    of workers on a few cores would wait for on every run. They start a fresh interpreter
    (``spawn``) where a forked one would not be the same: a lab node's worker sets an
    import-time variable before it imports torch; a launcher whose import-time variables changed
    since the server started would get workers loaded with the old ones; workers bound to CPUs
    other than the server's (``pin_cpus``; a launcher whose own CPUs changed since would get
    workers on the server's): torch's OpenMP runtime counts the CPUs it may use when torch loads
    and spins its threads by that count (the GNU libgomp manual, ``GOMP_SPINCOUNT``), so a forked
    worker pinned to one CPU with two threads runs an iteration many times slower than a fresh
    one; and on a machine with an NVIDIA device (``/dev/nvidiactl``) CUDA workers start fresh
    (the forked path is not tried with CUDA).
    ``SYNCTUNE_WORKER_START=spawn`` asks for fresh interpreters everywhere
    (``benchmarks/launcher_start.py`` compares the two).
    """
    import multiprocessing as mp
    import multiprocessing.forkserver

    global _FORK_SERVER_ENV, _FORK_SERVER_CPUS
    chosen = os.environ.get("SYNCTUNE_WORKER_START", "auto")
    if chosen not in ("auto", "spawn"):
        from ..spec.errors import SpecError

        raise SpecError(f"SYNCTUNE_WORKER_START={chosen!r}: 'auto' (fork where the same) or 'spawn' (a fresh "
                        f"interpreter per worker); unset it for the default")
    if (chosen == "spawn" or backend != "gloo" or nets or os.path.exists("/dev/nvidiactl") or pin_cpus
            or not hasattr(os, "pidfd_open")):  # a forked worker watches its launcher through a pidfd
        return mp.get_context("spawn"), None
    ctx = mp.get_context("forkserver")
    if _FORK_SERVER_ENV is None:
        ctx.set_forkserver_preload(["torch", "torch.distributed"])
        multiprocessing.forkserver.ensure_running()  # now, with the environment recorded here
        _FORK_SERVER_ENV = _import_time_env(dict(os.environ))
        _FORK_SERVER_CPUS = os.sched_getaffinity(0)
    if (_import_time_env({**os.environ, **(env or {})}) != _FORK_SERVER_ENV
            or os.sched_getaffinity(0) != _FORK_SERVER_CPUS):
        return mp.get_context("spawn"), None
    return ctx, dict(os.environ)


def _run_group(fn, world_size: int, args: tuple, port: int, *, backend: str, timeout_s: float,
               collective_timeout_s: float, on_progress, threads: int | None, env: dict[str, str] | None,
               nets: list[dict[str, str]] | None, pin_cpus: bool) -> list[Any]:
    with _worker_start():  # the fork server and multiprocessing's resource tracker start here too
        ctx, launcher_env = _start_method(backend, nets, env, pin_cpus)
        import multiprocessing.resource_tracker

        multiprocessing.resource_tracker.ensure_running()
    if launcher_env is not None:
        # Multiprocessing's pickler passes tensors as shared-memory file descriptors, and a fork
        # server takes at most 256 per process (a conformance run's inputs are more): by value.
        fn, args = _call_pickled, (pickle.dumps((fn, args), protocol=pickle.HIGHEST_PROTOCOL),)
    q = ctx.Queue()
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, fn, args, q, collective_timeout_s,
                                              threads, dict(env or {}), nets[r] if nets else None, os.getpid(),
                                              cpu_of_rank(r) if pin_cpus else None, launcher_env),
                         daemon=True)
             for r in range(world_size)]
    with _worker_start():
        for p in procs:
            p.start()
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    dead_since: dict[int, float] = {}
    try:
        while len(results) < world_size:
            try:
                msg = q.get(timeout=0.1)
            except queue.Empty:
                msg = None
            if msg is not None:
                kind, rank = msg[0], msg[1]
                if kind == "result":
                    import torch

                    results[rank] = torch.load(io.BytesIO(msg[2]), weights_only=True)
                elif kind == "progress":
                    if on_progress is not None:
                        on_progress(rank, msg[2])
                elif kind == "error":
                    dead = _dead_peer(procs, rank, results)
                    if dead is not None:
                        # A peer's death surfaces on the others as transport errors: name the cause.
                        raise WorkerFailure("failed", f"{dead}; rank {rank} then failed: {msg[3][:300]}")
                    raise WorkerFailure(msg[2], f"rank {rank}: {msg[3]}" + (msg[4] if os.environ.get("SYNCTUNE_DEBUG") else ""))
                continue
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if rank in results or p.exitcode is None:
                    continue
                # A worker that exited may still have its last message in the queue: allow it a moment.
                first = dead_since.setdefault(rank, now)
                if p.exitcode != 0 or now - first > 5.0:
                    raise WorkerFailure("failed", f"rank {rank} {_describe_exit(p.exitcode)} before reporting a "
                                                  f"result")
            if now > deadline:
                raise WorkerFailure("timeout", f"no result from rank(s) "
                                               f"{sorted(set(range(world_size)) - set(results))} after {timeout_s:g} s")
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=10)
        q.close()
        q.cancel_join_thread()
    return [results[r] for r in range(world_size)]
