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


def _setup_commands(node_type: str) -> list[str]:
    """The commands `ray up` runs on a node of this type: setup_commands, then the head's or the
    worker's own (a node type's worker_setup_commands replace the top-level ones)."""
    data = yaml.safe_load(CONFIG.read_text())
    if node_type == data["head_node_type"]:
        return data["setup_commands"] + data["head_setup_commands"]
    own = data["available_node_types"][node_type].get("worker_setup_commands")
    return data["setup_commands"] + (own if own is not None else data["worker_setup_commands"])


def _run_setup(tmp_path: Path, node_type: str, image_torch: str | None, arch: list[str]) -> tuple[list[str], str]:
    """Runs a node type's setup commands here, in a home of their own holding this checkout as
    ~/synctune, with `pip` recording its arguments instead of installing and, when image_torch is
    given, a stand-in torch of that version (CUDA architectures `arch`) shadowing the real one, as
    an image's would ("" for an image without torch: its import fails). Returns pip's calls and
    the constraints file synctune was installed with."""
    home, bin_dir, fake = tmp_path / "home", tmp_path / "bin", tmp_path / "image-site"
    for folder in (home, bin_dir, fake):
        folder.mkdir()
    (home / "synctune").symlink_to(ROOT)
    log = tmp_path / "pip.log"
    (bin_dir / "pip").write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    for script in ("pip", "python"):
        (bin_dir / script).chmod(0o755)
    path = [str(ROOT / "platform")]
    if image_torch is not None:
        (fake / "torch").mkdir()
        (fake / "torch" / "__init__.py").write_text("raise ImportError('no torch')\n" if not image_torch else
            f"__version__ = {image_torch!r}\n"
            f"class cuda:\n    @staticmethod\n    def get_arch_list():\n        return {arch!r}\n")
        path.insert(0, str(fake))
    env = {"HOME": str(home), "PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": ":".join(path)}
    for command in _setup_commands(node_type):
        done = subprocess.run(["bash", "-c", command], env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (command, done.stderr)
    calls = log.read_text().splitlines() if log.exists() else []
    constraints = home / "synctune-constraints.txt"
    return calls, constraints.read_text() if constraints.exists() else ""


@pytest.mark.parametrize("node_type, arch", [
    ("head", []), ("g4dn.12xlarge", ["sm_75", "sm_80"]), ("g4dn.2xlarge", ["sm_75"]),
    ("g3.16xlarge", ["sm_52", "sm_75"]), ("g3.4xlarge", ["sm_52"])])
def test_setup_keeps_the_images_torch_and_pins_the_rest(tmp_path, node_type, arch):
    """A GPU image's own torch (2.11, CUDA build) stays: nothing installs torch and the install
    of synctune goes through constraints.txt less its torch line, so CI's pins still hold for
    Ray, MLflow and pyarrow."""
    calls, constraints = _run_setup(tmp_path, node_type, "2.11.0+cu130", arch)
    assert calls == ["install --quiet -c ~/synctune-constraints.txt ~/synctune".replace("~", str(tmp_path / "home"))]
    pins = [line for line in (ROOT / "constraints.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    kept = [line for line in constraints.splitlines() if line and not line.startswith("#")]
    assert kept == [line for line in pins if not line.startswith("torch==")]
    assert "ray==2.60.0" in kept


@pytest.mark.parametrize("node_type, image_torch, arch, index", [
    ("head", "", [], "/whl/cpu"),                        # no torch in the image
    ("g4dn.2xlarge", "", [], None),
    ("head", "2.10.0", [], "/whl/cpu"),
    ("g4dn.12xlarge", "2.10.0+cu128", ["sm_75"], None),
    ("g3.4xlarge", "2.13.0+cu130", ["sm_75", "sm_80"], "/whl/cu126"),  # a build without the M60's sm_52
])
def test_setup_installs_torch_when_the_image_has_none_fit(tmp_path, node_type, image_torch, arch, index):
    calls, _ = _run_setup(tmp_path, node_type, image_torch, arch)
    torch_calls = [call for call in calls if "torch==" in call]
    assert len(torch_calls) == 1 and "torch==2.13.0" in torch_calls[0]
    assert (index in torch_calls[0]) if index else ("--index-url" not in torch_calls[0])
    assert calls.index(torch_calls[0]) < next(i for i, c in enumerate(calls) if c.endswith("/synctune"))


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
