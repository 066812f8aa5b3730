"""Lab nodes of different compute speed: one cgroup (v1 ``cpu`` controller) per lab node whose
``cpu_share`` is set, its CFS quota the node's share of a core times its workers.

A g3-like lab node's workers may use a quarter of a core each and a g4dn-like node's half
(``spec.cluster.LAB_G3_SHARE``): with every quota binding (the shares of all workers add up to
less than the machine's cores), a g3 worker computes at half a g4dn worker's speed whatever the
others do, which is what a mixed g3/g4dn cluster looks like to a data-parallel job (TAG §2.1).
Workers join their node's cgroup when they start (``synctune.engine.local.join_cgroup``, the
launchers' side); ``lab down`` moves
anything left back to the root cgroup and removes the groups.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..spec.cluster import ClusterSpec
from ..spec.errors import InfraError

__all__ = ["CPU_ROOT", "PERIOD_US", "check_cpu_quota_support", "make_node_cgroups", "remove_cgroups",
           "cgroup_quota"]

#: Where the cgroup v1 ``cpu`` controller is mounted.
CPU_ROOT = Path(os.environ.get("SYNCTUNE_CGROUP_CPU", "/sys/fs/cgroup/cpu"))
#: The CFS period of the lab's groups (100 ms, the kernel's default).
PERIOD_US = 100_000


def check_cpu_quota_support() -> None:
    """Raise one clear :class:`InfraError` unless lab cgroups with CPU quotas can be made here."""
    if not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        raise InfraError(f"lab nodes of different speeds need the cgroup v1 cpu controller at {CPU_ROOT} "
                         f"(cpu.cfs_quota_us not found; cgroup v2-only hosts are not supported)")
    if not os.access(CPU_ROOT, os.W_OK):
        raise InfraError(f"lab nodes of different speeds need write access to {CPU_ROOT} (run as root)")


def _group(prefix: str, index: int) -> Path:
    return CPU_ROOT / f"{prefix}-n{index}"


def make_node_cgroups(cluster: ClusterSpec, prefix: str) -> dict[str, str]:
    """One cgroup per node of ``cluster`` with a ``cpu_share``, its quota that share times the
    node's workers; node name -> cgroup path. Nodes without a share run unlimited."""
    shares = [n.cpu_share for n in cluster.nodes if n.cpu_share is not None]
    if not shares:
        return {}
    check_cpu_quota_support()
    cores = os.cpu_count() or 1
    wanted = sum(n.cpu_share * n.num_devices for n in cluster.nodes if n.cpu_share is not None)
    if wanted > cores:
        # Quotas that cannot all be granted at once stop being the limit: contention is, and
        # the speeds would no longer follow the shares.
        raise InfraError(f"cluster {cluster.name!r}: its workers' CPU shares add up to {wanted:g} cores and this "
                         f"machine has {cores}; the quotas would not hold")
    out = {}
    for i, node in enumerate(cluster.nodes):
        if node.cpu_share is None:
            continue
        path = _group(prefix, i)
        path.mkdir(exist_ok=True)
        (path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
        (path / "cpu.cfs_quota_us").write_text(str(int(round(node.cpu_share * node.num_devices * PERIOD_US))))
        out[node.name] = str(path)
    return out


def cgroup_quota(path: str | Path) -> float:
    """A group's CPU quota in cores (quota / period; -1 quota: unlimited, returned as inf)."""
    quota = int((Path(path) / "cpu.cfs_quota_us").read_text())
    period = int((Path(path) / "cpu.cfs_period_us").read_text())
    return float("inf") if quota < 0 else quota / period


def remove_cgroups(prefix: str) -> list[str]:
    """Remove every lab cgroup of ``prefix``, moving processes still inside to the root group
    first (a cgroup with members cannot be removed); returns the groups removed."""
    if not CPU_ROOT.is_dir():
        return []
    removed = []
    for path in sorted(CPU_ROOT.glob(f"{prefix}-n*")):
        if not path.is_dir():
            continue
        try:
            for pid in (path / "cgroup.procs").read_text().split():
                try:
                    (CPU_ROOT / "cgroup.procs").write_text(pid)
                except OSError:  # exited meanwhile
                    pass
            path.rmdir()
            removed.append(str(path))
        except OSError as exc:
            raise InfraError(f"lab: cannot remove the CPU group {path} ({exc.strerror or exc})") from None
    return removed
