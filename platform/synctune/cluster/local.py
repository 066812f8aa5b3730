"""A local autoscaling Ray cluster: the node types of a cluster-launcher config, launched and
removed by Ray's own autoscaler on this machine, so the whole cluster workflow (slices that add
node types, trials on them, scale-down when idle) runs before any cloud is paid for.

The head is ``ray start --head --autoscaling-config=FILE --block`` on 127.0.0.1, with the
autoscaler v2 that ``ray up`` uses in Ray 2.60 (``RAY_enable_autoscaler_v2=1``). FILE declares
Ray's fake multi-node provider as an ``external`` provider: each node it launches is one more
raylet on this machine with its node type's resources (``RAY_FAKE_CLUSTER=1``,
``use_node_id_as_ip``, no node updaters, the head known by a fixed node id set through
``RAY_OVERRIDE_NODE_ID_FOR_TESTING`` and ``RAY_CLOUD_INSTANCE_ID``). The provider's other form
(``type: fake_multinode``, and Ray's ``AutoscalingCluster``) reads an example file the wheel
does not ship, and ``ray up`` with an ``external`` provider tries to relaunch the head.

What differs from the cloud: a GPU node type becomes a node with as many CPUs as it has GPUs
(its ``synctune-node:<type>`` resource kept), so a search runs on it with a CPU cluster spec
naming that instance type; every node shares this machine's disk and cores.

Everything the head starts stays in the process session of its ``ray start`` (its leader is
recorded with its start time), so :func:`stop_local_cluster` stops exactly those processes and
what they spawned, never another Ray instance on the machine (``ray stop`` would stop them all).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..spec.errors import InfraError, SpecError
from ..spec.files import write_text_atomic
from .config import ConfigReport, check_cluster_config
from .workers import node_type_resource

__all__ = ["LocalCluster", "LOCAL_HOST", "join_loopback", "local_autoscaling_config", "start_local_cluster",
           "running_local_cluster", "stop_local_cluster", "cluster_processes"]

#: Where every process of the local cluster listens.
LOCAL_HOST = "127.0.0.1"
#: Ray's fake multi-node provider, loaded as an ``external`` provider.
PROVIDER_MODULE = "ray.autoscaler._private.fake_multi_node.node_provider.FakeMultiNodeProvider"
#: The head's node id and node type as the fake provider knows them (its FAKE_HEAD_NODE_ID and
#: FAKE_HEAD_NODE_TYPE; the head must start with that id for the autoscaler to match it).
HEAD_NODE_ID = "f" * 51 + "00000"
HEAD_NODE_TYPE = "ray.head.default"
#: Object store per node: the fake nodes share this machine's memory.
OBJECT_STORE_BYTES = 200 * 2**20
#: The record of a running local cluster, in the state folder.
STATE_FILE = "local-cluster.json"


@dataclass(frozen=True, kw_only=True)
class LocalCluster:
    """A local cluster started by :func:`start_local_cluster`, as recorded in its state folder."""

    #: The head's GCS address (``ray.init(address=...)``, ``RAY_ADDRESS`` for a driver).
    address: str
    #: The Ray dashboard (``ray job submit --address``).
    dashboard_url: str
    #: The ``ray start --head`` process: leader of the process session the cluster runs in.
    pid: int
    #: Its start time (seconds since the epoch, as the OS reports it), so a reused pid is not taken for it.
    started: float
    #: Ray's temporary folder of this cluster (its sessions and logs).
    temp_dir: str
    #: The cluster-launcher config the node types came from, and the autoscaling config written from it.
    config: str
    autoscaling_config: str
    #: Whether Ray's token auth is on (clients then set RAY_AUTH_MODE=token).
    token_auth: bool
    #: Node type name -> its resources, min_workers and max_workers as launched here.
    node_types: dict
    idle_timeout_minutes: float

    def to_dict(self) -> dict:
        """Plain data (the state file)."""
        return asdict(self)


def join_loopback(address: str) -> None:
    """Before this process joins a Ray cluster at a loopback address (the local cluster's head
    listens only on 127.0.0.1), make the loopback address this node's: Ray otherwise rewrites
    127.0.0.1 to the machine's own address, where nothing listens. Ray 2.60 decides this by one
    flag, read from the environment when Ray is imported and from its constants module after.
    Other addresses are left alone."""
    host = address.rsplit(":", 1)[0] if ":" in address else ""
    if host not in (LOCAL_HOST, "localhost"):
        return
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    from ray._private import ray_constants

    ray_constants.ENABLE_RAY_CLUSTER = False


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on the loopback address: the head takes each of its ports
    from here, none of Ray's fixed defaults, so another Ray instance on the machine does not
    collide with it (the OS may hand a just-freed port out twice: Ray refuses duplicates)."""
    ports: list[int] = []
    while len(ports) < count:
        with socket.socket() as s:
            s.bind((LOCAL_HOST, 0))
            port = s.getsockname()[1]
        if port not in ports:
            ports.append(port)
    return ports


def local_node_types(report: ConfigReport) -> dict[str, dict]:
    """The worker node types of ``report`` as local nodes: resources (a GPU type's GPUs become
    CPUs; a CPU type keeps the CPUs its config declares, else one), min and max workers."""
    out = {}
    for info in report.node_types:
        cpus = info.devices if info.devices else (info.cpus or 1)
        out[info.name] = {"resources": {"CPU": int(cpus), node_type_resource(info.instance_type): 1},
                          "min_workers": info.min_workers, "max_workers": info.max_workers}
    return out


def local_autoscaling_config(report: ConfigReport, gcs_address: str) -> dict:
    """The autoscaling config the head runs: ``report``'s node types, counts and idle timeout
    on Ray's fake multi-node provider."""
    types: dict[str, dict] = {HEAD_NODE_TYPE: {"resources": {}, "node_config": {}, "max_workers": 0}}
    for name, node in local_node_types(report).items():
        types[name] = {"resources": {**node["resources"], "object_store_memory": OBJECT_STORE_BYTES},
                       "node_config": {}, "min_workers": node["min_workers"], "max_workers": node["max_workers"]}
    return {
        "cluster_name": report.cluster_name or "synctune-local",
        "max_workers": report.max_workers,
        "upscaling_speed": 1.0,
        "idle_timeout_minutes": report.idle_timeout_minutes,
        "provider": {"type": "external", "module": PROVIDER_MODULE, "gcs_address": gcs_address,
                     "head_node_id": HEAD_NODE_ID, "launch_multiple": True, "use_node_id_as_ip": True,
                     "disable_node_updaters": True, "disable_launch_config_check": True},
        "auth": {"ssh_user": "nobody"},
        "available_node_types": types,
        "head_node_type": HEAD_NODE_TYPE,
        "file_mounts": {}, "cluster_synced_files": [], "file_mounts_sync_continuously": False,
        "rsync_exclude": [], "rsync_filter": [], "initialization_commands": [], "setup_commands": [],
        "head_setup_commands": [], "worker_setup_commands": [], "head_start_ray_commands": [],
        "worker_start_ray_commands": [],
    }


def _token_auth() -> bool:
    """Whether the cluster runs with Ray's token auth: as ``RAY_AUTH_MODE`` says where it is set
    (``token``: on), else whenever a token is in ~/.ray/auth_token (as Ray's clients take it)."""
    mode = os.environ.get("RAY_AUTH_MODE")
    if mode:
        return mode == "token"
    return (Path.home() / ".ray" / "auth_token").is_file()


def _temp_dir(state_dir: Path) -> Path:
    # Ray's socket paths must stay short (108 bytes): a fixed short folder per state folder.
    import hashlib

    tag = hashlib.sha256(str(state_dir.resolve()).encode()).hexdigest()[:8]
    return Path("/tmp") / f"synctune-ray-{tag}"


def start_local_cluster(config: str | Path, state_dir: str | Path, *, timeout_s: float = 90.0,
                        log=lambda _message: None) -> LocalCluster:
    """Start the local autoscaling cluster of ``config`` (a cluster-launcher file, checked as
    ``synctune cluster check`` does) and record it in ``state_dir``; returns it once its head
    answers. Worker nodes start at each type's ``min_workers`` and come as slices ask for them."""
    state = Path(state_dir)
    token = _token_auth()
    saved = os.environ.get("RAY_AUTH_MODE")
    if token:  # before Ray is imported here: its clients read the mode once
        os.environ["RAY_AUTH_MODE"] = "token"
    try:
        return _start(config, state, token, timeout_s=timeout_s, log=log)
    except BaseException:
        # Refused or failed: the calling process (a test runner's, a notebook's) keeps its mode,
        # which its own Ray clients and the Ray instances it starts later read.
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved
        raise


def _start(config: str | Path, state: Path, token: bool, *, timeout_s: float, log) -> LocalCluster:
    """:func:`start_local_cluster` once the auth mode is decided."""
    running = running_local_cluster(state)
    if running is not None:
        raise InfraError(f"a local cluster is already running (head {running.address}, pid {running.pid}); "
                         f"stop it first: synctune cluster down --local")
    report = check_cluster_config(config)
    if not report.node_types:
        raise SpecError(f"{config}: available_node_types: no worker node type to launch")
    state.mkdir(parents=True, exist_ok=True)
    port, dashboard_port, client_port, agent, agent_grpc, env_agent, metrics = _free_ports(7)
    gcs_address = f"{LOCAL_HOST}:{port}"
    scaling_file = state / "local-autoscaling.yaml"
    import yaml

    write_text_atomic(scaling_file, yaml.safe_dump(local_autoscaling_config(report, gcs_address), sort_keys=False))
    temp_dir = _temp_dir(state)
    env = dict(os.environ, RAY_enable_autoscaler_v2="1", RAY_FAKE_CLUSTER="1", RAY_USAGE_STATS_ENABLED="0",
               RAY_CLOUD_INSTANCE_ID=HEAD_NODE_ID, RAY_OVERRIDE_NODE_ID_FOR_TESTING=HEAD_NODE_ID,
               RAY_NODE_TYPE_NAME=HEAD_NODE_TYPE,
               # Every node this head's autoscaler launches takes the loopback address, not the
               # machine's: Ray reads this flag to keep a single-machine instance on 127.0.0.1.
               RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    env.pop("RAY_ADDRESS", None)
    if token:
        env["RAY_AUTH_MODE"] = "token"
    head_cpus = int(report.head_cpus) if report.head_cpus is not None else 2
    command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--node-ip-address={LOCAL_HOST}",
               f"--port={port}", f"--dashboard-host={LOCAL_HOST}", f"--dashboard-port={dashboard_port}",
               f"--ray-client-server-port={client_port}", f"--dashboard-agent-listen-port={agent}",
               f"--dashboard-agent-grpc-port={agent_grpc}", f"--runtime-env-agent-port={env_agent}",
               f"--metrics-export-port={metrics}", f"--temp-dir={temp_dir}", f"--num-cpus={head_cpus}",
               f"--object-store-memory={OBJECT_STORE_BYTES}", f"--autoscaling-config={scaling_file}",
               "--disable-usage-stats", "--block"]
    address_file = temp_dir / "ray_current_cluster"
    address_file.unlink(missing_ok=True)
    log_path = state / "local-head.log"
    with open(log_path, "wb") as out:
        proc = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)  # jobs run where `up` ran: their relative paths hold
    import psutil

    cluster = LocalCluster(address=gcs_address, dashboard_url=f"http://{LOCAL_HOST}:{dashboard_port}",
                           pid=proc.pid, started=psutil.Process(proc.pid).create_time(), temp_dir=str(temp_dir),
                           config=str(Path(config).resolve()), autoscaling_config=str(scaling_file),
                           token_auth=token, node_types=local_node_types(report),
                           idle_timeout_minutes=report.idle_timeout_minutes)
    write_text_atomic(state / STATE_FILE, json.dumps(cluster.to_dict(), indent=1) + "\n")
    deadline = time.monotonic() + timeout_s
    while not address_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace").strip().splitlines()[-1:] or ["(no output)"]
            stop_local_cluster(state)
            why = f"exited with status {proc.returncode}" if proc.returncode is not None else \
                f"did not answer within {timeout_s:g} s"
            raise InfraError(f"the local Ray head {why} (log {log_path}): {tail[0][:300]}")
        time.sleep(0.25)
    try:
        _publish_limits(gcs_address, report)
    except Exception as exc:  # noqa: BLE001 - a head that cannot take one key is not usable
        stop_local_cluster(state)
        raise InfraError(f"the local Ray head at {gcs_address} did not take the node types' limits: "
                         f"{type(exc).__name__}: {str(exc)[:300]}") from None
    log(f"head {gcs_address} up (pid {proc.pid})")
    return cluster


def _publish_limits(gcs_address: str, report: ConfigReport) -> None:
    """Publish how many nodes of each instance type the autoscaler may launch
    (:func:`~synctune.cluster.workers.node_type_limits`), so slices ask for every node type's
    resource and an infeasible one is refused before a search spends its budget."""
    from ray._raylet import GcsClient

    from .workers import LIMITS_KEY, LIMITS_NAMESPACE

    limits: dict[str, int] = {}
    for info in report.node_types:
        limits[info.instance_type] = limits.get(info.instance_type, 0) + info.max_workers
    GcsClient(address=gcs_address).internal_kv_put(LIMITS_KEY.encode(), json.dumps(limits).encode(), True,
                                                   LIMITS_NAMESPACE.encode())


def running_local_cluster(state_dir: str | Path) -> LocalCluster | None:
    """The local cluster recorded in ``state_dir`` if its head process still runs, else None
    (a stale record is removed)."""
    path = Path(state_dir) / STATE_FILE
    if not path.is_file():
        return None
    try:
        cluster = LocalCluster(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise SpecError(f"{path}: not a local cluster record ({exc}); remove it") from None
    if not _leader_alive(cluster) and not cluster_processes(cluster):
        path.unlink(missing_ok=True)
        return None
    return cluster


def _leader_alive(cluster: LocalCluster) -> bool:
    import psutil

    try:
        return abs(psutil.Process(cluster.pid).create_time() - cluster.started) < 1.0
    except psutil.Error:
        return False


def cluster_processes(cluster: LocalCluster) -> list:
    """Every process of ``cluster``: those of its head's process session (started after it),
    and their descendants (a job's driver runs in a session of its own); not zombies, which have
    exited and wait only for their parent to reap them."""
    import psutil

    found: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["pid", "create_time"]):
        try:
            if os.getsid(proc.pid) == cluster.pid and proc.info["create_time"] >= cluster.started - 1.0:
                found[proc.pid] = proc
        except (OSError, psutil.Error):
            continue
    for proc in list(found.values()):
        try:
            for child in proc.children(recursive=True):
                found.setdefault(child.pid, child)
        except psutil.Error:
            continue
    return _running(list(found.values()))


def stop_local_cluster(state_dir: str | Path, *, timeout_s: float = 20.0) -> int:
    """Stop the local cluster recorded in ``state_dir`` (its head, the nodes its autoscaler
    launched, their workers and drivers): SIGTERM to the head, which takes its own processes
    down in order; then SIGTERM to whatever remains, and SIGKILL after ``timeout_s``; returns
    how many processes it stopped (0: none was running)."""
    import psutil

    path = Path(state_dir) / STATE_FILE
    if not path.is_file():
        return 0
    try:
        cluster = LocalCluster(**json.loads(path.read_text()))
    except (ValueError, TypeError) as exc:
        raise SpecError(f"{path}: not a local cluster record ({exc}); remove it") from None
    procs = cluster_processes(cluster)
    stopped = len(procs)
    # The head first: under --block it stops the GCS, raylets and the rest in order within a few
    # seconds, where every process signalled at once leaves the GCS running (and the head
    # waiting on it) until the SIGKILL.
    head = [p for p in procs if p.pid == cluster.pid]
    if head:
        try:
            head[0].send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
        if not _wait_gone(head, timeout_s):
            _wait_gone(procs, 2.0)  # its children's last moments
    for sig in (signal.SIGTERM, signal.SIGKILL):
        procs = cluster_processes(cluster)
        if not procs:
            break
        for proc in procs:
            try:
                proc.send_signal(sig)
            except psutil.Error:
                continue
        stopped = max(stopped, len(procs))
        if not _wait_gone(procs, timeout_s if sig == signal.SIGTERM else 5.0):
            break
    left = cluster_processes(cluster)
    if left:
        raise InfraError(f"the local cluster's processes {', '.join(str(p.pid) for p in left[:10])} did not stop")
    path.unlink(missing_ok=True)
    return stopped


def _running(procs: list) -> list:
    """Those of ``procs`` still running: a zombie has exited (only its parent's reaping is left,
    which no signal hastens)."""
    import psutil

    out = []
    for proc in procs:
        try:
            if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc)
        except psutil.Error:
            continue
    return out


def _wait_gone(procs: list, timeout_s: float) -> list:
    """Wait up to ``timeout_s`` for ``procs`` to exit (zombies count as exited); returns those
    still running."""
    deadline = time.monotonic() + timeout_s
    while True:
        alive = _running(procs)
        if not alive or time.monotonic() >= deadline:
            return alive
        time.sleep(0.1)
