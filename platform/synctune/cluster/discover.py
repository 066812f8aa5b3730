"""A cluster spec from a running Ray cluster (the other direction of :mod:`.workers`).

Nodes count when they advertise ``synctune-node:<instance type>``; a catalog type brings its
catalog fields (links, device model), its device count comes from what the node reports
(GPUs, or CPUs for CPU node types). Types outside the catalog get the device kind and count
the node reports and nominal link speeds, and the description says so.
"""

from __future__ import annotations

from typing import Any

from ..spec.cluster import INSTANCE_TYPES, ClusterSpec, NodeSpec
from ..spec.errors import SpecError
from .workers import NODE_TYPE_PREFIX

__all__ = ["cluster_spec_from_ray", "cluster_spec_from_nodes"]


def cluster_spec_from_nodes(nodes: list[dict[str, Any]], name: str = "ray-cluster") -> ClusterSpec:
    """Build a spec from ``ray.nodes()`` entries (alive ones, typed ones only)."""
    typed = []
    for node in nodes:
        if not node.get("Alive"):
            continue
        resources = node.get("Resources", {})
        kinds = [k[len(NODE_TYPE_PREFIX):] for k in resources if k.startswith(NODE_TYPE_PREFIX)]
        if kinds:
            typed.append((kinds[0], node.get("NodeManagerAddress", ""), node.get("NodeID", ""), resources))
    if not typed:
        raise SpecError("no alive Ray node advertises a 'synctune-node:<instance type>' resource; start worker "
                        "nodes with it (cluster.yaml does; by hand: ray start --resources "
                        "'{\"synctune-node:g4dn.12xlarge\": 1}')")
    nominal = []
    specs = []
    for i, (kind, ip, _id, res) in enumerate(sorted(typed, key=lambda t: t[:3])):
        gpus = int(res.get("GPU", 0))
        if kind in INSTANCE_TYPES:
            it = INSTANCE_TYPES.get(kind)
            fields = {k: getattr(it, k) for k in ("device_kind", "device_model", "nic_gbps", "single_flow_gbps",
                                                  "intra_node_gbps", "device_memory_bytes")}
        else:
            nominal.append(kind)
            accel = next((k.split(":", 1)[1] for k in res if k.startswith("accelerator_type:")), None)
            fields = {"device_kind": "gpu" if gpus else "cpu", "device_model": accel or ("gpu" if gpus else "cpu"),
                      "nic_gbps": 10.0, "single_flow_gbps": 10.0, "intra_node_gbps": 10.0 if not gpus else 80.0,
                      "device_memory_bytes": 0}
        count = gpus if fields["device_kind"] == "gpu" else int(res.get("CPU", 0))
        if count < 1:
            raise SpecError(f"Ray node {ip} ({kind}) reports no {'GPU' if fields['device_kind'] == 'gpu' else 'CPU'}")
        specs.append(NodeSpec(name=f"node{i}", instance_type=kind, num_devices=count, **fields))
    description = f"derived from a running Ray cluster ({len(specs)} typed node(s))"
    if nominal:
        description += f"; nominal link speeds for {', '.join(sorted(set(nominal)))} (not in the catalog)"
    return ClusterSpec(name=name, nodes=tuple(specs), description=description)


def cluster_spec_from_ray(name: str = "ray-cluster") -> ClusterSpec:
    """The spec of the Ray cluster this process is connected to."""
    import ray

    if not ray.is_initialized():
        raise RuntimeError("ray is not initialized")
    return cluster_spec_from_nodes(ray.nodes(), name)
