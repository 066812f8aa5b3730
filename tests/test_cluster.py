"""Cluster specs: the AutoDist Table 1 presets, the catalog, YAML files and their errors."""

from __future__ import annotations

import pytest

from synctune.spec import CLUSTER_PRESETS, ClusterSpec, SpecError, cluster_preset, load_cluster_spec, resolve_cluster

# AutoDist Table 1, transcribed: (instance types in order, GPU distribution, NIC Gb/s per node).
TABLE_1 = {
    "A1": (["titanx-40gbe"] * 16, [1] * 16, [40] * 16),
    "A2": (["titanx-40gbe"] * 11, [1] * 11, [40] * 11),
    "B1": (["g3.16xlarge"] * 2, [4, 4], [25, 25]),
    "B2": (["g3.16xlarge"] * 3, [4] * 3, [25] * 3),
    "B3": (["g3.16xlarge"] * 4, [4] * 4, [25] * 4),
    "B4": (["g4dn.12xlarge"], [4], [50]),
    "B5": (["g4dn.12xlarge"] * 2, [4] * 2, [50] * 2),
    "B6": (["g4dn.12xlarge"] * 3, [4] * 3, [50] * 3),
    "B7": (["g4dn.12xlarge"] * 4, [4] * 4, [50] * 4),
    "B8": (["g4dn.12xlarge"] * 8, [4] * 8, [50] * 8),
    "B9": (["g3.4xlarge", "g3.16xlarge"], [1, 4], [10, 25]),
    "B10": (["g3.16xlarge", "g4dn.12xlarge"], [4, 4], [25, 50]),
    "B11": (["g3.16xlarge"] * 2 + ["g4dn.12xlarge"] * 2, [4] * 4, [25, 25, 50, 50]),
    "B12": (["g4dn.2xlarge", "g4dn.12xlarge"], [1, 4], [25, 50]),
}


@pytest.mark.parametrize("name", list(TABLE_1))
def test_presets_match_autodist_table_1(name):
    types, dist, nic = TABLE_1[name]
    spec = cluster_preset(name)
    assert [n.instance_type for n in spec.nodes] == types
    assert spec.gpu_distribution() == dist
    assert [n.nic_gbps for n in spec.nodes] == nic
    if name.startswith("B"):  # AWS: every flow capped at 10 Gb/s (AutoDist §3 "Testbeds")
        assert {n.single_flow_gbps for n in spec.nodes} == {10}
    assert all(n.device_kind == "gpu" for n in spec.nodes)


def test_device_models_of_the_catalog():
    assert {n.device_model for n in cluster_preset("B10").nodes} == {"M60", "T4"}
    assert cluster_preset("A1").nodes[0].device_model == "TITAN X"


def test_local_presets_are_cpu_processes():
    spec = cluster_preset("local-2x2")
    assert spec.devices == ("node0:0", "node0:1", "node1:0", "node1:1")
    assert spec.device_kind == "cpu"
    assert "local-1x2" in CLUSTER_PRESETS and "local-4x1" in CLUSTER_PRESETS


def test_yaml_round_trip(tmp_path):
    spec = cluster_preset("B12")
    path = tmp_path / "b12.yaml"
    spec.save(path)
    back = load_cluster_spec(path)
    assert back == spec and back.hash == spec.hash
    assert not list(tmp_path.glob(".*tmp"))  # atomic save leaves no temporary file


def test_yaml_with_catalog_defaults_overrides_and_count(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "name: mine\nnodes:\n"
        "  - instance_type: g4dn.12xlarge\n    count: 2\n"
        "  - name: small\n    instance_type: g4dn.2xlarge\n    nic_gbps: 20\n"
    )
    spec = resolve_cluster(str(path))
    assert [n.name for n in spec.nodes] == ["node0", "node1", "small"]
    assert spec.nodes[2].nic_gbps == 20 and spec.nodes[2].single_flow_gbps == 10
    assert spec.num_devices == 9


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("name: x\nnodes:\n  - instance_type: g4dn.2xlarge\n    num_devices: -1\n",
         r"nodes\[0\]: node 'node0': num_devices: expected an integer from 1 to 1024, got -1"),
        ("name: x\nnodes:\n  - name: w1\n    instance_type: g4dn.2xlarge\n    nic_gbps: fast\n",
         r"nodes\[0\] \('w1'\): node 'w1': nic_gbps"),
        ("name: x\nnodes:\n  - instance_type: p5.48xlarge\n",
         r"nodes\[0\]: instance_type 'p5.48xlarge' is not in the catalog .* required: device_kind"),
        ("name: x\nnodes:\n  - instance_type: g3.4xlarge\n    gpus: 2\n", r"nodes\[0\]: unknown key\(s\) \['gpus'\]"),
        ("name: x\nnodes: []\n", "nodes: expected a non-empty list"),
        ("nodes:\n  - instance_type: g3.4xlarge\n", "missing key 'name'"),
        ("name: x\nnodes:\n  - instance_type: g3.4xlarge\n    name: a\n  - instance_type: g3.4xlarge\n    name: a\n",
         "node name 'a' appears twice"),
        ("name: x\nnodes: [\n", "malformed YAML at line"),
    ],
)
def test_yaml_errors_name_file_node_and_field(tmp_path, text, fragment):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=fragment) as info:
        load_cluster_spec(path)
    assert str(path) in str(info.value)


def test_unknown_cluster_lists_presets():
    with pytest.raises(SpecError, match="not a preset .*B12"):
        resolve_cluster("B99")
    with pytest.raises(SpecError, match="no such cluster spec file"):
        resolve_cluster("missing.yaml")


def test_hash_depends_on_content_not_name():
    a = ClusterSpec.from_dict({"name": "a", "nodes": [{"instance_type": "g3.4xlarge"}]})
    b = ClusterSpec.from_dict({"name": "b", "nodes": [{"instance_type": "g3.4xlarge"}]})
    c = ClusterSpec.from_dict({"name": "a", "nodes": [{"instance_type": "g3.16xlarge"}]})
    assert a.hash == b.hash != c.hash
