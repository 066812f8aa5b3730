"""The lab's network: one Linux network namespace per emulated node, joined through a bridge
that lives in a namespace of its own, each node's link shaped with ``tc`` (egress on the
node's side, ingress on the switch's side of its veth pair) and optionally delayed.

Nothing outside the lab's namespaces is created or changed: veth pairs are made directly
between the switch namespace and a node namespace, addresses live inside them, and ``down``
deletes the namespaces (which deletes everything in them), after stopping any process still
running inside. Namespaces persist only until reboot (they live in /run), like the state file.
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from ..spec.cluster import ClusterSpec
from ..spec.errors import InfraError, SpecError
from ..spec.files import parse_json, write_text_atomic
from .cpu import make_node_cgroups, remove_cgroups

__all__ = ["LabNetwork", "lab_prefix", "lab_up", "lab_down", "lab_status", "lab_attach", "check_lab_support",
           "IFNAME", "PROBE_ADDRESS"]

#: The interface of a node inside its namespace.
IFNAME = "eth0"
_SUBNET = "10.213.0"
#: Address of the calibration probe on the lab's bridge (in the switch namespace).
PROBE_ADDRESS = f"{_SUBNET}.2"


def lab_prefix() -> str:
    """Prefix of the lab's namespace names (``SYNCTUNE_LAB_PREFIX``, default ``stlab``): tests
    use their own, so they never touch a lab someone brought up."""
    prefix = os.environ.get("SYNCTUNE_LAB_PREFIX", "stlab")
    if not prefix.replace("-", "").isalnum() or len(prefix) > 20:
        raise SpecError(f"SYNCTUNE_LAB_PREFIX: expected letters, digits and '-', at most 20, got {prefix!r}")
    return prefix


def _state_file() -> Path:
    return Path("/run/synctune-lab") / f"{lab_prefix()}.json"


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run(list(args), capture_output=True, text=True)
    if check and done.returncode != 0:
        message = (done.stderr or done.stdout).strip().splitlines()
        raise InfraError(f"lab: `{' '.join(args)}` failed: {message[0] if message else f'status {done.returncode}'}")
    return done


def check_lab_support() -> None:
    """Raise one clear :class:`InfraError` unless namespaces can be made here (root, ip, tc)."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise InfraError(f"the lab needs iproute2 ({' and '.join(missing)} not found; apt-get install iproute2)")
    if os.geteuid() != 0:
        raise InfraError("the lab needs root to create network namespaces (run as root, or in a container with "
                        "CAP_NET_ADMIN and CAP_SYS_ADMIN)")


def _namespaces() -> list[str]:
    done = _run("ip", "netns", "list", check=False)
    names = [line.split()[0] for line in done.stdout.splitlines() if line.strip()]
    return sorted(n for n in names if n.startswith(lab_prefix() + "-"))


def _node_ns(index: int) -> str:
    return f"{lab_prefix()}-n{index}"


def _switch_ns() -> str:
    return f"{lab_prefix()}-sw"


def tbf_burst_bytes(mbit: float) -> int:
    """The token bucket of a link shaped to ``mbit``: what it sends at once, after an idle spell,
    faster than its rate. tbf needs a bucket of at least one (GSO-sized) packet and enough for the
    kernel's timer granularity: 10 ms worth of rate, never under 128 KiB."""
    return max(128 * 1024, int(mbit * 1e6 / 8 / 100))


def _shape(ns: str, dev: str, mbit: float, latency_ms: float) -> None:
    tbf = ["tbf", "rate", f"{mbit:.3f}mbit", "burst", str(tbf_burst_bytes(mbit)), "latency", "200ms"]
    if latency_ms > 0:
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
             f"{latency_ms}ms", "limit", "100000")
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "parent", "1:", "handle", "2:", *tbf)
    else:
        _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", *tbf)


class LabNetwork(dict):
    """Node name -> ``{"netns", "address", "ifname"}`` (and ``"cgroup"`` for a node with a CPU
    share): where each node of a lab cluster lives (what the engine's launchers need to run that
    node's workers inside it, at its speed)."""


def lab_up(cluster: ClusterSpec, *, latency_ms: float = 0.0) -> dict[str, Any]:
    """Create the lab for ``cluster`` (a lab preset); stale lab namespaces are removed first.
    Returns the state written to /run/synctune-lab."""
    check_lab_support()
    if not all(n.instance_type.startswith("lab-") for n in cluster.nodes):
        raise SpecError(f"cluster {cluster.name!r} is not a lab cluster (lab presets: synctune clusters | grep lab-)")
    if not (0 <= latency_ms <= 1000):
        raise SpecError(f"--latency-ms: expected 0..1000, got {latency_ms}")
    stale = _namespaces()
    if stale:
        lab_down()
    switch = _switch_ns()
    nodes = []
    try:
        _run("ip", "netns", "add", switch)
        _run("ip", "-n", switch, "link", "set", "lo", "up")
        _run("ip", "-n", switch, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", switch, "link", "set", "br0", "up")
        # The calibration probe's address: on the bridge, so it reaches each node through that
        # node's shaped link and nothing else.
        _run("ip", "-n", switch, "addr", "add", f"{PROBE_ADDRESS}/24", "dev", "br0")
        for i, node in enumerate(cluster.nodes):
            ns, port, address = _node_ns(i), f"s{i}", f"{_SUBNET}.{10 + i}"
            _run("ip", "netns", "add", ns)
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            _run("ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name", IFNAME, "netns", ns)
            _run("ip", "-n", switch, "link", "set", port, "master", "br0")
            _run("ip", "-n", switch, "link", "set", port, "up")
            _run("ip", "-n", ns, "addr", "add", f"{address}/24", "dev", IFNAME)
            _run("ip", "-n", ns, "link", "set", IFNAME, "up")
            mbit = node.nic_gbps * 1000.0
            _shape(ns, IFNAME, mbit, latency_ms)       # the node's egress
            _shape(switch, port, mbit, latency_ms)     # the node's ingress
            nodes.append({"node": node.name, "netns": ns, "address": address, "ifname": IFNAME, "rate_mbit": mbit})
        groups = make_node_cgroups(cluster, lab_prefix())
        for entry in nodes:
            if entry["node"] in groups:
                entry["cgroup"] = groups[entry["node"]]
                entry["cpu_share"] = cluster.node(entry["node"]).cpu_share
    except BaseException:
        lab_down()
        raise
    state = {"prefix": lab_prefix(), "preset": cluster.name, "cluster_hash": cluster.hash, "scale": cluster.scale,
             "latency_ms": latency_ms, "nodes": nodes, "switch": switch,
             "created_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
             "removed_stale": stale}
    path = _state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps(state, indent=1))
    return state


def lab_down() -> list[str]:
    """Remove every namespace of this lab prefix (stopping processes left inside) and the state
    file; returns the namespaces removed. Safe to call when nothing is up."""
    removed = []
    for ns in _namespaces():
        pids = _run("ip", "netns", "pids", ns, check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        _run("ip", "netns", "del", ns)
        removed.append(ns)
    removed.extend(remove_cgroups(lab_prefix()))
    _state_file().unlink(missing_ok=True)
    return removed


def lab_status() -> dict[str, Any]:
    """What is up: the state file (if any), the namespaces that exist, and whether they agree."""
    state = parse_json(_state_file().read_bytes(), str(_state_file()), InfraError) if _state_file().exists() else None
    present = _namespaces() if shutil.which("ip") else []
    expected = sorted([n["netns"] for n in state["nodes"]] + [state["switch"]]) if state else []
    qdiscs = {}
    if state:
        for n in state["nodes"]:
            out = _run("ip", "netns", "exec", n["netns"], "tc", "qdisc", "show", "dev", IFNAME, check=False).stdout
            qdiscs[n["netns"]] = " | ".join(line.strip() for line in out.splitlines())
    return {"state": state, "namespaces": present, "healthy": bool(state) and present == expected,
            "stale": bool(present) and present != expected, "qdiscs": qdiscs}


def lab_attach(cluster: ClusterSpec) -> LabNetwork:
    """The lab network of ``cluster``, which must be the preset the lab is up with."""
    status = lab_status()
    state = status["state"]
    if not state or not status["healthy"]:
        what = "is not up" if not status["namespaces"] else "is in a broken state (synctune lab down, then up)"
        raise SpecError(f"cluster {cluster.name!r} runs in the lab, which {what}: synctune lab up {cluster.name}")
    names = [n.name for n in cluster.nodes]
    if state["preset"] != cluster.name or [n["node"] for n in state["nodes"]] != names:
        raise SpecError(f"the lab is up with {state['preset']!r}, not {cluster.name!r}: "
                        f"synctune lab up {cluster.name} (it replaces the running lab)")
    return LabNetwork({n["node"]: {"netns": n["netns"], "address": n["address"], "ifname": n["ifname"],
                                   **({"cgroup": n["cgroup"]} if n.get("cgroup") else {})}
                       for n in state["nodes"]})
