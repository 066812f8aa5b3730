"""Model specs and cluster specs: what a strategy is written against (DESIGN.md vocabulary)."""

from .cluster import (
    CLUSTER_PRESETS,
    INSTANCE_TYPES,
    ClusterSpec,
    InstanceType,
    NodeSpec,
    cluster_preset,
    device_id,
    load_cluster_spec,
    resolve_cluster,
)
from .errors import SpecError
from .model import DTYPE_BYTES, ModelSpec, VariableSpec, extract_model_spec
from .profile import ComputeProfile
from .registry import Registry

__all__ = [
    "CLUSTER_PRESETS",
    "INSTANCE_TYPES",
    "ClusterSpec",
    "ComputeProfile",
    "DTYPE_BYTES",
    "InstanceType",
    "ModelSpec",
    "NodeSpec",
    "Registry",
    "SpecError",
    "VariableSpec",
    "cluster_preset",
    "device_id",
    "extract_model_spec",
    "load_cluster_spec",
    "resolve_cluster",
]
