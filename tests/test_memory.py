"""Memory, measured and predicted (issue 33 item 4): per-device memory in the cluster spec, the
per-rank breakdown a trial records, and the simulator's memory model, each checked against an
independent count (torch's own sizes, hand-computed figures)."""

from __future__ import annotations

import pytest

from synctune.spec.cluster import CLUSTER_PRESETS, GIB, ClusterSpec, cluster_preset
from synctune.spec.errors import SpecError

# The public per-GPU memory of each catalog GPU (NVIDIA's data sheets: T4 16 GB GDDR6, Tesla
# M60 2 x 8 GB (one GPU per g3 "GPU"), GeForce GTX TITAN X 12 GB).
PUBLIC_GPU_MEMORY_GIB = {"T4": 16, "M60": 8, "TITAN X": 12}


def test_catalog_gpus_have_their_public_memory():
    for name in CLUSTER_PRESETS:
        for node in cluster_preset(name).nodes:
            if node.device_kind == "gpu":
                assert node.device_memory_bytes == PUBLIC_GPU_MEMORY_GIB[node.device_model] * 2**30, (name, node)
            else:
                assert node.device_memory_bytes == 0, (name, node)  # unset: the host's memory is shared


def test_memory_gib_on_a_cpu_node_sets_its_budget_and_presets_keep_their_hashes():
    spec = ClusterSpec.from_dict({"name": "c", "nodes": [{"instance_type": "local-cpu", "num_devices": 2,
                                                          "memory_gib": 1.5}]})
    assert spec.nodes[0].device_memory_bytes == 3 * 2**29
    assert spec.device_memory_budget_bytes("node0:1") == 3 * 2**29
    # memory_gib is another spelling of device_memory_bytes: the same spec, the same hash.
    same = ClusterSpec.from_dict({"name": "c", "nodes": [{"instance_type": "local-cpu", "num_devices": 2,
                                                          "device_memory_bytes": 3 * 2**29}]})
    assert same.hash == spec.hash
    # Presets keep the hashes they had before the field existed (key of every dataset row).
    assert cluster_preset("local-2x2").hash == "d4dad25a77a50ffdc954ff009e3e2dcb9e1589f7a876392e28847f05c312d869"
    assert cluster_preset("lab-2x2").hash == "567630a7b5991a019379902b97863a035e226ad9096e4f5304e6d96810e44c0a"
    assert cluster_preset("B7").hash == "f557a4c6c753260f5eb0c08498b8740fb4f64221a12f1c0f28b3dfc1af860533"
    local = cluster_preset("local-2x2")
    # Its budget defaults to the host's memory split among the cluster's four workers.
    import os

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert local.device_memory_budget_bytes("node1:0") == host // 4
    assert cluster_preset("B7").device_memory_budget_bytes("node3:3") == 16 * GIB


@pytest.mark.parametrize("node, needle", [
    ({"instance_type": "local-cpu", "memory_gib": 0}, "memory_gib"),
    ({"instance_type": "local-cpu", "memory_gib": "4"}, "memory_gib"),
    ({"instance_type": "local-cpu", "memory_gib": 4, "device_memory_bytes": 4}, "both given"),
])
def test_bad_memory_gib_is_refused_naming_the_field(node, needle):
    with pytest.raises(SpecError, match=needle):
        ClusterSpec.from_dict({"name": "c", "nodes": [node]})
