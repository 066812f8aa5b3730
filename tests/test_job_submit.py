"""The README's cluster flow on this machine: a Ray head started with `ray start --head`
(token auth on), a search submitted with `ray job submit --working-dir`, its trials recorded."""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest

from synctune.data import TrialDataset
from synctune.engine.local import free_port

ROOT = Path(__file__).resolve().parents[1]
RAY = [sys.executable, "-c", "import sys; from ray.scripts.scripts import main; sys.exit(main())"]


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("job")
    # Unix socket paths must stay short: the session folder lives under a short /tmp name.
    temp = Path(tempfile.mkdtemp(prefix="st-ray-", dir="/tmp"))
    names = ("gcs", "dashboard", "client", "agent", "agent_grpc", "env_agent", "metrics", "node_manager",
             "object_manager")
    picked: list[int] = []
    while len(picked) < len(names):  # the OS may hand a just-freed port out twice: Ray refuses duplicates
        port = free_port()
        if port not in picked:
            picked.append(port)
    ports = dict(zip(names, picked))
    env = dict(os.environ, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32),
               SYNCTUNE_HOME=str(tmp_path / "home"), PYTHONPATH=str(ROOT / "platform"))
    for key in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI"):
        env.pop(key, None)
    head = subprocess.Popen(
        RAY + ["start", "--head", "--block", "--num-cpus", "3", "--disable-usage-stats", "--temp-dir", str(temp),
               "--port", str(ports["gcs"]), "--dashboard-host", "127.0.0.1", "--dashboard-port", str(ports["dashboard"]),
               "--ray-client-server-port", str(ports["client"]), "--dashboard-agent-listen-port", str(ports["agent"]),
               "--dashboard-agent-grpc-port", str(ports["agent_grpc"]), "--runtime-env-agent-port",
               str(ports["env_agent"]), "--metrics-export-port", str(ports["metrics"]), "--node-manager-port",
               str(ports["node_manager"]), "--object-manager-port", str(ports["object_manager"])],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    url = f"http://127.0.0.1:{ports['dashboard']}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert head.poll() is None, head.stdout.read()[-3000:]
            try:
                urllib.request.urlopen(url + "/api/version", timeout=2)
                break
            except OSError as exc:
                if getattr(exc, "code", None) == 401:  # up, and refusing us without the token
                    break
                time.sleep(1)
        else:
            pytest.fail("the Ray head's dashboard never answered")
        yield url, env, tmp_path / "home"
    finally:
        try:
            os.kill(head.pid, signal.SIGTERM)  # `ray start --block` stops what it started, in order
            head.wait(timeout=60)
        except ProcessLookupError:  # it never came up: the assertion above says why
            pass
        except subprocess.TimeoutExpired:
            pass
        try:  # whatever of its process group outlived it
            os.killpg(head.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        head.wait(timeout=30)
        shutil.rmtree(temp, ignore_errors=True)


def test_search_submitted_as_a_ray_job(ray_head, tmp_path):
    url, env, home = ray_head
    work = tmp_path / "work"
    work.mkdir()
    (work / "tiny-job.yaml").write_text(
        "name: tiny-job\nmodel: cnn-small\ncluster: local-1x2\nbudget: 3\nsimulator: analytic\nproposals: 20\n"
        "candidates: 1\nwarmup: 1\niters: 3\nbaselines: [allreduce, ps-lb]\nddp_trials: 0\nconfirm_rounds: 0\n")
    job = subprocess.run(RAY + ["job", "submit", "--address", url, "--working-dir", str(work), "--",
                                sys.executable, "-m", "synctune", "search", "tiny-job.yaml"],
                         env=env, capture_output=True, text=True, timeout=600)
    out = job.stdout + job.stderr
    assert job.returncode == 0, out[-4000:]
    assert "search tiny-job-seed0: 3 trials (0 failed)" in out, out[-4000:]
    rows = TrialDataset(home / "dataset").read(search_id="tiny-job-seed0")
    assert len(rows) == 3 and (rows["status"] == "ok").all() and (rows["launcher"] == "ray").all()


def test_job_submit_without_the_token_is_refused(ray_head, tmp_path):
    """The head refuses a submission that lacks its token (HTTP 401) or carries another (403), and
    the job's command never runs; the lines are Ray's own (`format_authentication_http_error`).
    Both refusals first, then one listing of the head's jobs for both."""
    url, head_env, _home = ray_head
    markers = []
    for token, refusal in [
        (None, "Authentication required: Unauthorized: Missing authentication token"),
        ("wrong", "Authentication failed: Forbidden: Invalid authentication token"),
    ]:
        if token is None:
            # a client in token mode with no token gives up before asking the head (a line of its own,
            # whatever the head does); with token auth off on its side it asks without one
            env = dict({k: v for k, v in head_env.items() if k != "RAY_AUTH_TOKEN"}, RAY_AUTH_MODE="disabled")
        else:
            env = dict(head_env, RAY_AUTH_TOKEN=secrets.token_hex(32))
        marker = tmp_path / f"ran-{token or 'no-token'}"
        markers.append(marker)
        job = subprocess.run(RAY + ["job", "submit", "--address", url, "--", sys.executable, "-c",
                                    f"open({str(marker)!r}, 'w')"],
                             env=env, capture_output=True, text=True, timeout=120)
        out = job.stdout + job.stderr
        assert job.returncode != 0, (token, out[-4000:])
        # the server's answer, not a client that gave up before asking: each status has its own line
        assert refusal in out, (token, out[-4000:])
    # nor was either job queued to run later: the head, asked with its token, lists no such job
    listing = subprocess.run(RAY + ["job", "list", "--address", url], env=head_env,
                             capture_output=True, text=True, timeout=120)
    assert listing.returncode == 0, (listing.stdout + listing.stderr)[-4000:]
    for marker in markers:
        assert str(marker) not in listing.stdout + listing.stderr
        assert not marker.exists()
