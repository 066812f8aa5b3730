"""Checking a Ray cluster-launcher config (``cluster.yaml``) offline, against Ray's own schema
and against the cluster spec an experiment needs (AutoDist §2.1: the resource spec is an
input of the strategy search, so the cluster must be able to take that shape).

Ray does the schema part (``prepare_config`` fills in the provider's defaults as ``ray up``
does, ``validate_config`` applies ``ray-schema.json``); the rest is synctune's contract with
the config: every worker node type names its instance type with one unit of
``synctune-node:<type>``, and the head advertises none (it runs the search driver).
"""

from __future__ import annotations

import copy
import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..spec.files import read_yaml
from ..spec.cluster import INSTANCE_TYPES, ClusterSpec
from ..spec.errors import SpecError
from .workers import NODE_TYPE_PREFIX, node_type_resource

__all__ = ["NodeTypeInfo", "ConfigReport", "check_cluster_config"]


@dataclass(frozen=True)
class NodeTypeInfo:
    """A worker node type of the config, as synctune sees it."""

    name: str
    instance_type: str
    min_workers: int
    max_workers: int
    devices: int | None  # GPUs per node (from the config, else the catalog); None if unknown
    cpus: float | None = None  # the CPUs its resources declare (None: Ray detects them on the node)


@dataclass
class ConfigReport:
    """What :func:`check_cluster_config` found: the node types, the experiment's needs
    (instance type -> nodes) and warnings that do not stop a launch."""

    path: str
    cluster_name: str
    head_type: str
    max_workers: int
    node_types: list[NodeTypeInfo]
    needs: dict[str, int] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    #: How long a worker node may sit idle before the autoscaler removes it.
    idle_timeout_minutes: float = 5.0
    #: The CPUs the head node type declares (None: Ray detects them).
    head_cpus: float | None = None


def _ray_validate(raw: dict, where: str) -> dict:
    """``raw`` with Ray's defaults filled in, checked against Ray's cluster schema, offline.

    Ray 2.60 has no public call for this: its SDK's ``bootstrap_config`` fills the config in
    with the cloud provider (credentials, IAM roles, key pairs), and ``fillout_defaults`` is
    only the first of ``prepare_config``'s steps and validates nothing. ``prepare_config`` and
    ``validate_config`` are what ``ray up`` runs before it contacts the provider, so the
    private module is the only offline way; constraints.txt pins Ray 2.60 and
    ``tests/test_cluster_config.py`` fails on an upgrade that moves them."""
    import jsonschema

    try:
        from ray.autoscaler._private.util import prepare_config, validate_config
    except ImportError as exc:
        raise SpecError(f"{where}: cannot check the config with this Ray (synctune needs Ray 2.60's "
                        f"ray.autoscaler._private.util): {exc}") from None

    quiet = logging.getLogger("ray.autoscaler._private.util")
    level = quiet.level
    quiet.setLevel(logging.WARNING)  # "setting max workers for head node type to 0" on every call
    try:
        prepared = prepare_config(copy.deepcopy(raw))
        validate_config(prepared)
    except jsonschema.ValidationError as exc:
        at = ".".join(str(p) for p in exc.absolute_path) or "(top level)"
        raise SpecError(f"{where}: {at}: {exc.message.splitlines()[0]} (Ray's cluster schema)") from None
    except (KeyError, ValueError, TypeError, RuntimeError) as exc:
        raise SpecError(f"{where}: Ray rejects the config: {type(exc).__name__}: {exc}") from None
    finally:
        quiet.setLevel(level)
    return prepared


def check_cluster_config(path: str | Path, cluster: ClusterSpec | None = None) -> ConfigReport:
    """Validate ``path`` offline; with ``cluster``, also check its node types can form it.

    Raises :class:`SpecError` with one line naming the file, the key and what was expected.
    """
    where = str(path)
    raw = read_yaml(path, "cluster config", aliases=True)
    if not isinstance(raw, dict):
        raise SpecError(f"{where}: expected a mapping of keys, got {type(raw).__name__}")
    prepared = _ray_validate(raw, where)
    head = prepared["head_node_type"]
    types = prepared["available_node_types"]
    provider = prepared.get("provider", {}).get("type")
    infos: list[NodeTypeInfo] = []
    head_cpus = None
    for name, spec in types.items():
        key = f"available_node_types.{name}.resources"
        resources = spec.get("resources") or {}
        typed = sorted(k for k in resources if k.startswith(NODE_TYPE_PREFIX))
        if name == head:
            head_cpus = resources.get("CPU")
            if typed:
                raise SpecError(f"{where}: {key}: the head node type runs the search driver and must not "
                                f"advertise {typed[0]!r} (trial slices would be placed on it)")
            continue
        if len(typed) != 1:
            raise SpecError(f"{where}: {key}: expected exactly one '{NODE_TYPE_PREFIX}<instance type>: 1' entry "
                            f"naming the node type (AWS reports a T4 for both g4dn types, so the GPU cannot tell "
                            f"them apart), got {dict(resources)}")
        if resources[typed[0]] != 1:
            raise SpecError(f"{where}: {key}: {typed[0]}: expected 1 (one unit per node, so two slices' nodes "
                            f"never share a machine), got {resources[typed[0]]!r}")
        instance_type = typed[0][len(NODE_TYPE_PREFIX):]
        launched = (spec.get("node_config") or {}).get("InstanceType")
        if provider == "aws" and launched != instance_type:
            raise SpecError(f"{where}: available_node_types.{name}.node_config.InstanceType: expected "
                            f"{instance_type!r} (the type its resource {typed[0]!r} names), got {launched!r}")
        devices = resources.get("GPU")
        if devices is None and instance_type in INSTANCE_TYPES:
            devices = INSTANCE_TYPES.get(instance_type).num_devices
        infos.append(NodeTypeInfo(name, instance_type, int(spec.get("min_workers", 0)),
                                  int(spec.get("max_workers", 0)), devices, resources.get("CPU")))
    report = ConfigReport(where, prepared.get("cluster_name", ""), head, int(prepared.get("max_workers", 0)), infos,
                          idle_timeout_minutes=float(prepared.get("idle_timeout_minutes", 5)), head_cpus=head_cpus)
    _security_warnings(prepared, report)
    if cluster is not None:
        _check_needs(cluster, report)
    return report


def _check_needs(cluster: ClusterSpec, report: ConfigReport) -> None:
    needs = Counter(node.instance_type for node in cluster.nodes)
    report.needs = dict(needs)
    offered = {t: [i for i in report.node_types if i.instance_type == t] for t in needs}
    for instance_type, count in needs.items():
        providers = offered[instance_type]
        if not providers:
            have = ", ".join(sorted({i.instance_type for i in report.node_types})) or "none"
            raise SpecError(f"{report.path}: available_node_types: cluster {cluster.name!r} needs {count} node(s) of "
                            f"type {instance_type!r}, but no node type advertises "
                            f"{node_type_resource(instance_type)!r} (node types offer: {have})")
        limit = sum(i.max_workers for i in providers)
        if limit < count:
            names = ", ".join(i.name for i in providers)
            raise SpecError(f"{report.path}: available_node_types.{providers[0].name}.max_workers: cluster "
                            f"{cluster.name!r} needs {count} node(s) of type {instance_type!r}, but {names} allow(s) "
                            f"at most {limit}")
    for node in cluster.nodes:
        small = [i for i in offered[node.instance_type] if i.devices is not None and i.devices < node.num_devices]
        if small and len(small) == len(offered[node.instance_type]):
            raise SpecError(f"{report.path}: available_node_types.{small[0].name}.resources: node {node.name!r} of "
                            f"cluster {cluster.name!r} needs {node.num_devices} GPU(s), the node type has "
                            f"{small[0].devices}")
    total = sum(needs.values())
    if report.max_workers < total:
        raise SpecError(f"{report.path}: max_workers: cluster {cluster.name!r} needs {total} worker nodes, "
                        f"the config allows at most {report.max_workers}")


def _security_warnings(prepared: dict[str, Any], report: ConfigReport) -> None:
    start = " ".join(prepared.get("head_start_ray_commands") or [])
    if "--dashboard-host=0.0.0.0" in start or "--dashboard-host 0.0.0.0" in start:
        report.warnings.append("head_start_ray_commands: the dashboard listens on 0.0.0.0; bind it to 127.0.0.1 "
                               "and use `ray dashboard cluster.yaml` (SSH port forwarding)")
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        if "RAY_AUTH_MODE=token" not in " ".join(prepared.get(key) or []):
            report.warnings.append(f"{key}: Ray's token auth is not switched on (export RAY_AUTH_MODE=token "
                                   f"before `ray start`)")
    if "mlflow server" in start and "--host 0.0.0.0" in start:
        report.warnings.append("head_start_ray_commands: the MLflow server listens on 0.0.0.0; bind it to 127.0.0.1")
