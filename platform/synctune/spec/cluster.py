"""Cluster spec: nodes, their devices and links (AutoDist §2.1 "R"; presets from AutoDist Table 1).

A node is an instance of a catalog type (g4dn.12xlarge, g3.4xlarge, a cluster-A TITAN X
node, a local CPU "node" of worker processes); any field of the type can be overridden per
node. Bandwidths are in Gbit/s: ``nic_gbps`` (the node's NIC), ``single_flow_gbps`` (what one
TCP flow gets; 10 on AWS whatever the NIC), ``intra_node_gbps`` (device to device inside it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .checks import LIMITS, check_keys, in_range, is_number, require, sha256_hex, shown
from .errors import SpecError
from .files import MAX_NAME_LENGTH, check_path, read_yaml, write_text_atomic
from .registry import Registry

__all__ = [
    "InstanceType",
    "INSTANCE_TYPES",
    "NodeSpec",
    "ClusterSpec",
    "CLUSTER_PRESETS",
    "cluster_preset",
    "load_cluster_spec",
    "resolve_cluster",
    "device_id",
    "LAB_SCALE",
    "is_lab_cluster",
    "host_memory_bytes",
]

GIB = 1024**3


@dataclass(frozen=True, kw_only=True)
class InstanceType:
    """A catalog entry: what one node of this type has."""

    name: str
    device_kind: str  # "gpu" or "cpu"
    device_model: str
    num_devices: int
    nic_gbps: float
    single_flow_gbps: float
    intra_node_gbps: float
    device_memory_bytes: int
    description: str = ""
    #: Lab nodes only: the fraction of one CPU core each worker may use (a cgroup CPU quota),
    #: which makes lab nodes compute at different speeds; None: unlimited.
    cpu_share: float | None = None


#: The instance types of the papers' testbeds (AutoDist §3 "Testbeds") plus local CPU nodes.
INSTANCE_TYPES: Registry[InstanceType] = Registry("instance type")
for _it in (
    # AWS caps one TCP flow at 10 Gbit/s whatever the NIC (AutoDist §3); T4/M60 talk over PCIe 3.0.
    InstanceType(name="g4dn.2xlarge", device_kind="gpu", device_model="T4", num_devices=1, nic_gbps=25.0,
                 single_flow_gbps=10.0, intra_node_gbps=80.0, device_memory_bytes=16 * GIB,
                 description="AWS g4dn.2xlarge: 1x NVIDIA T4, up to 25 GbE"),
    InstanceType(name="g4dn.12xlarge", device_kind="gpu", device_model="T4", num_devices=4, nic_gbps=50.0,
                 single_flow_gbps=10.0, intra_node_gbps=80.0, device_memory_bytes=16 * GIB,
                 description="AWS g4dn.12xlarge: 4x NVIDIA T4, 50 GbE"),
    InstanceType(name="g3.4xlarge", device_kind="gpu", device_model="M60", num_devices=1, nic_gbps=10.0,
                 single_flow_gbps=10.0, intra_node_gbps=80.0, device_memory_bytes=8 * GIB,
                 description="AWS g3.4xlarge: 1x NVIDIA Tesla M60, up to 10 GbE"),
    InstanceType(name="g3.16xlarge", device_kind="gpu", device_model="M60", num_devices=4, nic_gbps=25.0,
                 single_flow_gbps=10.0, intra_node_gbps=80.0, device_memory_bytes=8 * GIB,
                 description="AWS g3.16xlarge: 4x NVIDIA Tesla M60, 25 GbE"),
    InstanceType(name="titanx-40gbe", device_kind="gpu", device_model="TITAN X", num_devices=1, nic_gbps=40.0,
                 single_flow_gbps=40.0, intra_node_gbps=80.0, device_memory_bytes=12 * GIB,
                 description="AutoDist cluster A node: 1x GeForce TITAN X, 40 GbE switch"),
    # Loopback gloo all-reduce runs at about 1 GB/s on the reference 2-core machine.
    InstanceType(name="local-cpu", device_kind="cpu", device_model="cpu", num_devices=1, nic_gbps=8.0,
                 single_flow_gbps=8.0, intra_node_gbps=8.0, device_memory_bytes=0,
                 description="worker processes on this machine, one per device, gloo over loopback"),
):
    INSTANCE_TYPES.register(_it.name, _it)

#: How much the lab scales the papers' link speeds down to fit this machine (2 cores): a
#: "25 GbE" lab node gets 25 / 32 Gbit/s = 781 Mbit/s through its shaped veth. Recorded in
#: every lab cluster spec (``scale``) and so in every dataset row.
LAB_SCALE = 1 / 32
for _gbe in (10, 25, 50):
    INSTANCE_TYPES.register(f"lab-{_gbe}gbe", InstanceType(
        name=f"lab-{_gbe}gbe", device_kind="cpu", device_model="cpu", num_devices=1, nic_gbps=_gbe * LAB_SCALE,
        single_flow_gbps=_gbe * LAB_SCALE, intra_node_gbps=8.0, device_memory_bytes=0,
        description=f"lab node: CPU worker processes in a network namespace, its link shaped to {_gbe} GbE x "
                    f"{LAB_SCALE:g} = {_gbe * LAB_SCALE * 1000:.0f} Mbit/s (synctune lab up)"))

#: Relative compute speed of a g3 (M60) lab node to a g4dn (T4) one: 1:2. Peak fp32 throughput
#: is 4.8 vs 8.1 TFLOPS per GPU (1.7x; M60 is half of a two-GPU board), and T4's tensor cores,
#: which M60 lacks, widen the gap for mixed precision: about 2x, the figure TAG takes. A lab g4dn
#: worker may use half a core, a g3 worker a quarter.
LAB_G4DN_SHARE, LAB_G3_SHARE = 0.5, 0.25
for _kind, _model, _share, _gbe in (("g3", "M60", LAB_G3_SHARE, 25), ("g4dn", "T4", LAB_G4DN_SHARE, 50)):
    INSTANCE_TYPES.register(f"lab-{_kind}-{_gbe}gbe", InstanceType(
        name=f"lab-{_kind}-{_gbe}gbe", device_kind="cpu", device_model=f"cpu-{_kind}", num_devices=1,
        nic_gbps=_gbe * LAB_SCALE, single_flow_gbps=_gbe * LAB_SCALE, intra_node_gbps=8.0, device_memory_bytes=0,
        cpu_share=_share,
        description=f"lab node computing like a {_kind} ({_model}) node: each worker limited to {_share:g} of a CPU "
                    f"core (cgroup quota), its link shaped to {_gbe} GbE x {LAB_SCALE:g}"))

_NODE_FIELDS = ("name", "instance_type", "device_kind", "device_model", "num_devices", "nic_gbps",
                "single_flow_gbps", "intra_node_gbps", "device_memory_bytes")
#: Optional node fields: written only when set, so specs without them keep their hashes.
_OPTIONAL_NODE_FIELDS = ("latency_ms", "cpu_share", "compute_gflops")


def _is_name(value: Any) -> bool:
    return (isinstance(value, str) and 0 < len(value) <= MAX_NAME_LENGTH and value.isprintable()
            and "/" not in value)


def device_id(node_name: str, index: int) -> str:
    """The id of device ``index`` of node ``node_name`` as strategies write it: ``"node0:1"``."""
    return f"{node_name}:{index}"


@dataclass(frozen=True, kw_only=True)
class NodeSpec:
    """One node of a cluster; every field is explicit once built (catalog defaults filled in)."""

    name: str
    instance_type: str
    device_kind: str
    device_model: str
    num_devices: int
    nic_gbps: float
    single_flow_gbps: float
    intra_node_gbps: float
    device_memory_bytes: int = 0
    #: One-way message latency of the node's link (alpha of AutoDDL's alpha-beta model), as
    #: calibration measured it; None when never measured (left out of the spec then, so specs
    #: and their hashes stay what they were).
    latency_ms: float | None = None
    #: Lab nodes: the fraction of one CPU core each worker may use (cgroup quota); None: unlimited.
    cpu_share: float | None = None
    #: Each worker's compute speed as calibration measured it (GFLOP/s of a float32 matrix
    #: product, all workers running at once); None when never measured.
    compute_gflops: float | None = None

    def __post_init__(self) -> None:
        where = f"node {self.name!r}"
        require(_is_name(self.name) and ":" not in self.name, "node name",
                f"a non-empty string without ':' of at most {MAX_NAME_LENGTH} characters", self.name)
        require(isinstance(self.instance_type, str) and bool(self.instance_type), f"{where}: instance_type",
                "a non-empty string", self.instance_type)
        require(self.device_kind in ("gpu", "cpu"), f"{where}: device_kind", "'gpu' or 'cpu'", self.device_kind)
        require(isinstance(self.device_model, str) and bool(self.device_model), f"{where}: device_model",
                "a non-empty string", self.device_model)
        require(in_range(self.num_devices, 1, LIMITS["devices_per_node"]), f"{where}: num_devices",
                f"an integer from 1 to {LIMITS['devices_per_node']}", self.num_devices)
        for key in ("nic_gbps", "single_flow_gbps", "intra_node_gbps"):
            value = getattr(self, key)
            require(is_number(value) and 0 < value <= 1e6, f"{where}: {key}", "a positive number (Gbit/s)", value)
        require(self.single_flow_gbps <= self.nic_gbps, f"{where}: single_flow_gbps",
                f"at most nic_gbps ({self.nic_gbps})", self.single_flow_gbps)
        require(in_range(self.device_memory_bytes, 0, 1 << 50), f"{where}: device_memory_bytes",
                "a non-negative integer (0 = shared host memory)", self.device_memory_bytes)
        require(self.latency_ms is None or (is_number(self.latency_ms) and 0 <= self.latency_ms <= 10_000),
                f"{where}: latency_ms", "milliseconds from 0 to 10000 (or absent)", self.latency_ms)
        require(self.cpu_share is None or (is_number(self.cpu_share) and 0.01 <= self.cpu_share <= 64),
                f"{where}: cpu_share", "a fraction of a CPU core from 0.01 to 64 (or absent)", self.cpu_share)
        require(self.compute_gflops is None or (is_number(self.compute_gflops) and 0 < self.compute_gflops <= 1e9),
                f"{where}: compute_gflops", "a positive number of GFLOP/s (or absent)", self.compute_gflops)

    @property
    def memory_gib(self) -> float:
        """Each device's memory in GiB (0: unset, a CPU node sharing the host's memory)."""
        return self.device_memory_bytes / GIB

    @property
    def devices(self) -> tuple[str, ...]:
        """Device ids of this node, ``name:0`` .. ``name:num_devices-1``."""
        return tuple(device_id(self.name, i) for i in range(self.num_devices))

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form with every field spelled out (the optional ones only once set)."""
        out = {k: getattr(self, k) for k in _NODE_FIELDS}
        for key in _OPTIONAL_NODE_FIELDS:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


#: Spec-file keys that only spell another field differently (never written back).
_INPUT_ONLY_NODE_KEYS = ("memory_gib",)


def _memory_gib_to_bytes(value: Any, where: str) -> int:
    require(is_number(value) and 0 < value <= (1 << 50) / GIB, f"{where}: memory_gib",
            "a positive number of GiB per device", value)
    return int(round(value * GIB))


def _node_from_dict(data: Mapping[str, Any], where: str, default_name: str) -> NodeSpec:
    check_keys(data, where, (), _NODE_FIELDS + ("count",) + _OPTIONAL_NODE_FIELDS + _INPUT_ONLY_NODE_KEYS)
    if "memory_gib" in data and "device_memory_bytes" in data:
        raise SpecError(f"{where}: memory_gib and device_memory_bytes both given: they are one field (each "
                        f"device's memory); keep one")
    if "instance_type" not in data:
        raise SpecError(f"{where}: missing key 'instance_type' (one of {', '.join(INSTANCE_TYPES)} or your own)")
    type_name = data["instance_type"]
    require(isinstance(type_name, str), f"{where}: instance_type", "a name from the catalog or your own", type_name)
    values: dict[str, Any] = {"name": data.get("name", default_name), "instance_type": type_name}
    if type_name in INSTANCE_TYPES:
        it = INSTANCE_TYPES.get(type_name)
        for key in _NODE_FIELDS[2:]:
            values[key] = getattr(it, key)
        if it.cpu_share is not None:
            values["cpu_share"] = it.cpu_share
    else:
        missing = [k for k in _NODE_FIELDS[2:] if k not in data and k != "device_memory_bytes"]
        if missing:
            raise SpecError(
                f"{where}: instance_type {shown(type_name)} is not in the catalog ({', '.join(INSTANCE_TYPES)}), "
                f"so these keys are required: {', '.join(missing)}"
            )
    for key in _NODE_FIELDS[2:] + _OPTIONAL_NODE_FIELDS:
        if key in data:
            values[key] = data[key]
    if "memory_gib" in data:
        values["device_memory_bytes"] = _memory_gib_to_bytes(data["memory_gib"], where)
    try:
        return NodeSpec(**values)
    except SpecError as exc:
        raise SpecError(f"{where}: {exc}") from None


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """A set of nodes. ``scale`` records how much the link speeds were scaled down (lab presets)."""

    name: str
    nodes: tuple[NodeSpec, ...]
    description: str = ""
    scale: float = 1.0
    _devices: dict[str, NodeSpec] = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        require(_is_name(self.name), "cluster name", f"a non-empty string of at most {MAX_NAME_LENGTH} characters",
                self.name)
        require(isinstance(self.description, str), f"cluster {self.name!r}: description", "a string",
                self.description)
        if isinstance(self.nodes, list):
            object.__setattr__(self, "nodes", tuple(self.nodes))
        require(0 < len(self.nodes) <= LIMITS["nodes"], f"cluster {self.name!r}: nodes",
                f"1 to {LIMITS['nodes']} nodes", len(self.nodes))
        require(is_number(self.scale) and 0 < self.scale <= 1e6, f"cluster {self.name!r}: scale",
                "a positive number", self.scale)
        seen: set[str] = set()
        for node in self.nodes:
            if node.name in seen:
                raise SpecError(f"cluster {self.name!r}: node name {node.name!r} appears twice")
            seen.add(node.name)
            for dev in node.devices:
                self._devices[dev] = node
        require(len(self._devices) <= LIMITS["devices"], f"cluster {self.name!r}: devices",
                f"at most {LIMITS['devices']} devices in all", len(self._devices))

    @property
    def devices(self) -> tuple[str, ...]:
        """All device ids, node by node."""
        return tuple(self._devices)

    @property
    def num_devices(self) -> int:
        """Total number of devices."""
        return len(self._devices)

    def node_of(self, device: str) -> NodeSpec:
        """The node that holds ``device``."""
        try:
            return self._devices[device]
        except KeyError:
            raise SpecError(f"cluster {self.name!r} has no device {device!r}") from None

    def has_device(self, device: str) -> bool:
        """Whether ``device`` exists in this cluster."""
        return device in self._devices

    def node(self, name: str) -> NodeSpec:
        """The node called ``name``."""
        for n in self.nodes:
            if n.name == name:
                return n
        raise SpecError(f"cluster {self.name!r} has no node {name!r}; nodes: {', '.join(n.name for n in self.nodes)}")

    @property
    def device_kind(self) -> str:
        """``gpu``, ``cpu`` or ``mixed``."""
        kinds = {n.device_kind for n in self.nodes}
        return kinds.pop() if len(kinds) == 1 else "mixed"

    def device_memory_budget_bytes(self, device: str) -> int | None:
        """The memory one worker on ``device`` may use at its peak (DESIGN.md "memory budget"):
        the node's ``device_memory_bytes`` when set; for a CPU node without it, the host's
        physical memory divided by the cluster's device count (every worker of a local or lab
        cluster runs on this machine); None for a GPU node whose memory nobody wrote down."""
        node = self.node_of(device)
        if node.device_memory_bytes > 0:
            return node.device_memory_bytes
        if node.device_kind == "cpu":
            total = host_memory_bytes()
            return total // self.num_devices if total else None
        return None

    def gpu_distribution(self) -> list[int]:
        """Devices per node, as AutoDist Table 1 writes it (``[4, 4]``)."""
        return [n.num_devices for n in self.nodes]

    def to_dict(self) -> dict[str, Any]:
        """Plain-data form with every node field spelled out."""
        return {
            "name": self.name,
            "description": self.description,
            "scale": self.scale,
            "nodes": [n.to_dict() for n in self.nodes],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "cluster spec") -> "ClusterSpec":
        """Build from plain data; nodes may name a catalog type and override fields, or use ``count``."""
        check_keys(data, where, ("name", "nodes"), ("description", "scale"))
        raw_nodes = data["nodes"]
        if not isinstance(raw_nodes, list) or not raw_nodes:
            raise SpecError(f"{where}: nodes: expected a non-empty list, got {type(raw_nodes).__name__}")
        nodes: list[NodeSpec] = []
        for i, raw in enumerate(raw_nodes):
            node_where = f"{where}: nodes[{i}]"
            if isinstance(raw, Mapping) and "name" in raw:
                node_where += f" ({str(raw['name'])[:60]!r})"
            count = raw.get("count", 1) if isinstance(raw, Mapping) else 1
            require(in_range(count, 1, LIMITS["nodes"] - len(nodes)), f"{node_where}: count",
                    f"a positive integer (at most {LIMITS['nodes']} nodes in a cluster)", count)
            if count > 1 and isinstance(raw, Mapping) and "name" in raw:
                raise SpecError(f"{node_where}: 'name' and 'count' > 1 cannot be combined (names must be unique)")
            for _ in range(count):
                nodes.append(_node_from_dict(raw, node_where, default_name=f"node{len(nodes)}"))
        try:
            return cls(
                name=data["name"],
                description=data.get("description", ""),
                scale=data.get("scale", 1.0),
                nodes=tuple(nodes),
            )
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from None

    @property
    def hash(self) -> str:
        """sha256 of nodes and scale (not the name or description)."""
        return sha256_hex({"nodes": [n.to_dict() for n in self.nodes], "scale": self.scale})

    def save(self, path: str | Path) -> None:
        """Write as YAML, atomically."""
        import yaml

        write_text_atomic(path, yaml.safe_dump(self.to_dict(), sort_keys=False))

def _build(name: str, description: str, groups: list[tuple[str, int]], scale: float = 1.0,
           **overrides: Any) -> ClusterSpec:
    nodes = []
    for group in groups:
        type_name, count = group[0], group[1]
        it = INSTANCE_TYPES.get(type_name)
        for _ in range(count):
            values = {k: getattr(it, k) for k in _NODE_FIELDS[2:]}
            if it.cpu_share is not None:
                values["cpu_share"] = it.cpu_share
            values.update(overrides)
            if len(group) > 2:  # per-group device count
                values["num_devices"] = group[2]
            nodes.append(NodeSpec(name=f"node{len(nodes)}", instance_type=type_name, **values))
    return ClusterSpec(name=name, description=description, nodes=tuple(nodes), scale=scale)


#: AutoDist Table 1 (A1, A2, B1–B12) and local presets for one machine (CPU processes).
CLUSTER_PRESETS: Registry[ClusterSpec] = Registry("cluster preset")
for _name, _desc, _groups in (
    ("A1", "16x Cluster A nodes, [1] x 16, 40GbE", [("titanx-40gbe", 16)]),
    ("A2", "11x Cluster A nodes, [1] x 11, 40GbE", [("titanx-40gbe", 11)]),
    ("B1", "2x g3.16, [4] x 2, 25 GbE", [("g3.16xlarge", 2)]),
    ("B2", "3x g3.16, [4] x 3, 25 GbE", [("g3.16xlarge", 3)]),
    ("B3", "4x g3.16, [4] x 4, 25 GbE", [("g3.16xlarge", 4)]),
    ("B4", "1x g4dn.12, [4] x 1, 50 GbE", [("g4dn.12xlarge", 1)]),
    ("B5", "2x g4dn.12, [4] x 2, 50 GbE", [("g4dn.12xlarge", 2)]),
    ("B6", "3x g4dn.12, [4] x 3, 50 GbE", [("g4dn.12xlarge", 3)]),
    ("B7", "4x g4dn.12, [4] x 4, 50 GbE", [("g4dn.12xlarge", 4)]),
    ("B8", "8x g4dn.12, [4] x 8, 50 GbE", [("g4dn.12xlarge", 8)]),
    ("B9", "1x g3.4, 1x g3.16, [1, 4], 10/25 GbE", [("g3.4xlarge", 1), ("g3.16xlarge", 1)]),
    ("B10", "1x g3.16, 1x g4dn.12, [4] x 2, 25/50 GbE", [("g3.16xlarge", 1), ("g4dn.12xlarge", 1)]),
    ("B11", "2x g3.16, 2x g4dn.12, [4] x 4, 25/50 GbE", [("g3.16xlarge", 2), ("g4dn.12xlarge", 2)]),
    ("B12", "1x g4dn.2, 1x g4dn.12, [1, 4], 25/50 GbE", [("g4dn.2xlarge", 1), ("g4dn.12xlarge", 1)]),
):
    CLUSTER_PRESETS.register(_name, _build(_name, "AutoDist Table 1: " + _desc, _groups))
for _nodes, _per in ((1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1)):
    _name = f"local-{_nodes}x{_per}"
    CLUSTER_PRESETS.register(
        _name,
        _build(_name, f"{_nodes} local node(s) x {_per} CPU worker process(es), gloo over loopback",
               [("local-cpu", _nodes)], num_devices=_per),
    )


# The lab (synctune lab up PRESET): AutoDist's clusters scaled down to one 2-core machine. Node
# counts and device counts shrink to fit; link speeds keep their ratios (x LAB_SCALE).
for _name, _desc, _groups in (
    ("lab-2x2", "2 nodes x 2 workers, 25 GbE (B5/B7's shape)", [("lab-25gbe", 2, 2)]),
    ("lab-4x1", "4 nodes x 1 worker, 25 GbE (A2's shape: one device per node)", [("lab-25gbe", 4, 1)]),
    ("lab-2x1", "2 nodes x 1 worker, 10 GbE (the smallest bandwidth-bound lab)", [("lab-10gbe", 2, 1)]),
    ("lab-b9", "1 node x 1 worker at 10 GbE + 1 node x 2 workers at 25 GbE (B9's shape)",
     [("lab-10gbe", 1, 1), ("lab-25gbe", 1, 2)]),
    ("lab-b12", "1 node x 1 worker at 25 GbE + 1 node x 2 workers at 50 GbE (B12's shape)",
     [("lab-25gbe", 1, 1), ("lab-50gbe", 1, 2)]),
    # Heterogeneous compute as well as links (cgroup CPU quotas; see LAB_G3_SHARE).
    ("lab-b10c", "1 g3-like node x 2 workers at 25 GbE + 1 g4dn-like node x 2 workers at 50 GbE (B10's shape; "
                 "g3 workers compute at half the g4dn speed)", [("lab-g3-25gbe", 1, 2), ("lab-g4dn-50gbe", 1, 2)]),
    ("lab-b11c", "2 g3-like nodes at 25 GbE + 2 g4dn-like nodes at 50 GbE, 1 worker each (B11's shape; g3 "
                 "workers compute at half the g4dn speed)", [("lab-g3-25gbe", 2, 1), ("lab-g4dn-50gbe", 2, 1)]),
):
    CLUSTER_PRESETS.register(_name, _build(_name, f"lab: {_desc}, links x {LAB_SCALE:g}", _groups, scale=LAB_SCALE))


def cluster_preset(name: str) -> ClusterSpec:
    """The preset called ``name`` (``A1``, ``B7``, ``local-2x2``, ...)."""
    return CLUSTER_PRESETS.get(name)


def load_cluster_spec(path: str | Path) -> ClusterSpec:
    """Read a cluster spec from a YAML (or JSON) file; errors name the file, node and field."""
    return ClusterSpec.from_dict(read_yaml(path, "cluster spec"), where=str(path))


def resolve_cluster(name_or_path: str) -> ClusterSpec:
    """A preset by name, else a cluster spec file by path; one clear error if neither."""
    if name_or_path in CLUSTER_PRESETS:
        return CLUSTER_PRESETS.get(name_or_path)
    check_path(name_or_path, "cluster")
    if Path(name_or_path).suffix.lower() in (".yaml", ".yml", ".json") or Path(name_or_path).exists():
        return load_cluster_spec(name_or_path)
    raise SpecError(
        f"unknown cluster {name_or_path!r}: not a preset ({', '.join(CLUSTER_PRESETS)}) nor a .yaml file"
    )


def host_memory_bytes() -> int | None:
    """This machine's physical memory (None where the platform does not say)."""
    import os

    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        return None


def is_lab_cluster(cluster: ClusterSpec) -> bool:
    """Whether ``cluster``'s nodes are lab nodes (their workers must run in the lab's namespaces)."""
    return any(n.instance_type.startswith("lab-") for n in cluster.nodes)
