"""cluster.yaml: valid under Ray's own schema, able to form the papers' AWS clusters, and the
checks that catch broken copies (unknown key, missing node type, untyped or mistyped nodes)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import synctune
from synctune.cluster import check_cluster_config, cluster_spec_from_nodes
from synctune.spec import SpecError, cluster_preset

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "cluster.yaml"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "synctune", *args], capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def _broken(tmp_path: Path, edit) -> Path:
    data = yaml.safe_load(CONFIG.read_text())
    edit(data)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("preset", ["B1", "B3", "B4", "B7", "B8", "B9", "B10", "B11", "B12"])
def test_cluster_yaml_can_form_the_aws_presets(preset):
    report = check_cluster_config(CONFIG, cluster_preset(preset))
    assert sum(report.needs.values()) == len(cluster_preset(preset).nodes)
    assert not report.warnings  # dashboard on localhost, token auth on


def test_cli_check_passes_for_the_bert_large_b7_experiment():
    done = _cli("cluster", "check", "cluster.yaml", "--experiment", "experiments/bert-large-B7.yaml")
    assert done.returncode == 0, done.stderr
    assert "cluster B7 (4x g4dn.12xlarge): can be formed" in done.stdout


@pytest.mark.parametrize("edit, message", [
    (lambda d: d.update(max_worker=3), "'max_worker' was unexpected"),
    (lambda d: d["available_node_types"].pop("g4dn.12xlarge"), "no node type advertises 'synctune-node:g4dn.12xlarge'"),
    (lambda d: d["available_node_types"]["g4dn.12xlarge"].update(max_workers=2), "at most 2"),
    (lambda d: d.update(max_workers=3), "max_workers: cluster 'B7' needs 4 worker nodes"),
    (lambda d: d["available_node_types"]["g4dn.12xlarge"].update(resources={}), "expected exactly one"),
    (lambda d: d["available_node_types"]["g4dn.12xlarge"]["node_config"].update(InstanceType="g4dn.2xlarge"),
     "InstanceType: expected 'g4dn.12xlarge'"),
    (lambda d: d["available_node_types"]["head"].update(resources={"synctune-node:g4dn.12xlarge": 1}),
     "must not advertise"),
])
def test_cli_check_rejects_broken_copies_with_one_line(tmp_path, edit, message):
    path = _broken(tmp_path, edit)
    done = _cli("cluster", "check", str(path), "--experiment", "experiments/bert-large-B7.yaml")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"synctune: error: {path}"), done.stderr
    assert message in lines[0]


def test_check_warns_when_the_dashboard_is_open_or_auth_is_off(tmp_path):
    def edit(d):
        d["head_start_ray_commands"] = ["ray stop", "ray start --head --dashboard-host=0.0.0.0"]
    report = check_cluster_config(_broken(tmp_path, edit))
    assert any("0.0.0.0" in w for w in report.warnings)
    assert any("token auth" in w for w in report.warnings)


def test_local_cpu_cluster_cannot_be_formed_by_the_aws_config():
    with pytest.raises(SpecError, match="'local-cpu'"):
        check_cluster_config(CONFIG, cluster_preset("local-2x2"))


def test_setup_installs_this_repositorys_version():
    text = CONFIG.read_text()
    pinned = set(re.findall(r"synctune.__version__ != '([^']+)'", text))
    assert pinned == {synctune.__version__}
    assert "-c ~/synctune/constraints.txt" in text


def test_cluster_spec_from_ray_nodes_uses_the_catalog_for_known_types():
    nodes = [
        {"Alive": True, "NodeID": "h", "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 8.0}},
        {"Alive": True, "NodeID": "a", "NodeManagerAddress": "10.0.0.3",
         "Resources": {"CPU": 48.0, "GPU": 4.0, "synctune-node:g4dn.12xlarge": 1.0}},
        {"Alive": True, "NodeID": "b", "NodeManagerAddress": "10.0.0.2",
         "Resources": {"CPU": 8.0, "GPU": 1.0, "synctune-node:g4dn.2xlarge": 1.0}},
        {"Alive": False, "NodeID": "c", "NodeManagerAddress": "10.0.0.4",
         "Resources": {"CPU": 8.0, "GPU": 1.0, "synctune-node:g4dn.2xlarge": 1.0}},
    ]
    spec = cluster_spec_from_nodes(nodes, "b12-live")
    assert [(n.instance_type, n.num_devices, n.nic_gbps) for n in spec.nodes] == [
        ("g4dn.12xlarge", 4, 50.0), ("g4dn.2xlarge", 1, 25.0)]
    with pytest.raises(SpecError, match="no alive Ray node advertises"):
        cluster_spec_from_nodes(nodes[:1])
