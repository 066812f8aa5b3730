"""The Parquet dataset: concurrent appends, crash safety, dedup, schema evolution, filters,
stats and export; releases pushed and pulled over a folder, http and S3, with checksums."""

from __future__ import annotations

import dataclasses
import datetime
import functools
import http.server
import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner

from synctune.cli import cli
from synctune.data import RECORD_SCHEMA_VERSION, TrialDataset, TrialRecord, pull_release, push_release
from synctune.engine.local import free_port
from synctune.models import model_spec
from synctune.spec import SpecError, cluster_preset
from synctune.strategy import build_strategy

BUILDERS = ("ps-lb", "allreduce", "parallax", "ps")


@functools.lru_cache(maxsize=None)
def _template(model: str, cluster: str, builder: str) -> TrialRecord:
    spec, cl = model_spec(model), cluster_preset(cluster)
    strategy = build_strategy(builder, spec, cl)
    result = {"status": "ok", "iteration_times_s": [0.1, 0.12, 0.11], "mean_s": 0.11, "median_s": 0.11,
              "std_s": 0.008, "samples_per_s": 290.0, "comm_bytes_per_iter": 4096, "peak_memory_bytes": 2**28,
              "backend": "gloo", "device_kind": "cpu", "launcher": "local", "warmup": 1, "iters": 3}
    return TrialRecord.from_trial(result, strategy, spec, cl, origin=builder, search_id="s", trial_id="t")


def make_records(n: int, *, writer: int = 0, model: str = "cnn-small", cluster: str = "local-1x2",
                 status: str = "ok") -> list[TrialRecord]:
    """Distinct records (trial ids differ) around the template of a real strategy."""
    out = []
    for i in range(n):
        base = _template(model, cluster, BUILDERS[i % len(BUILDERS)])
        out.append(dataclasses.replace(base, record_id=f"w{writer}-r{i}", search_id=f"search-{writer}",
                                       trial_id=f"trial-{i}", mean_s=0.1 + i * 1e-3, status=status,
                                       created_at=datetime.datetime(2026, 1, 1, tzinfo=datetime.timezone.utc)
                                       + datetime.timedelta(seconds=i)))
    return out


SHARED = 40  # records every writer appends too (same dedup keys): they must appear once


def _contender(root: str, writer: int, batches: int, ack: str, start) -> None:
    """Appends small batches to the one partition every contender uses: its own records plus
    records shared with all others; after each append returns, the batch's record ids are
    acknowledged (fsynced), so a writer killed at any moment has a known committed prefix."""
    ds = TrialDataset(root)
    own = make_records(batches * 5, writer=writer)
    shared = make_records(SHARED, writer=999)
    start.wait()
    with open(ack, "a") as fh:
        for b in range(batches):
            batch = own[b * 5:(b + 1) * 5] + shared[(b * 4) % SHARED:(b * 4) % SHARED + 4]
            ds.append(batch)
            fh.write(" ".join(r.record_id for r in batch) + "\n")
            fh.flush()
            os.fsync(fh.fileno())


def _compactor(root: str, start, stop) -> None:
    ds = TrialDataset(root)
    start.wait()
    while not stop.is_set():
        ds.compact()


def _reader(root: str, start, stop, failures) -> None:
    ds = TrialDataset(root)
    start.wait()
    while not stop.is_set():
        try:
            table = ds.table()
            keys = [tuple(r.values()) for r in table.select(["record_id"]).to_pylist()]
            if len(keys) != len(set(keys)):
                failures.put("a reader saw a duplicate")
        except Exception as exc:  # noqa: BLE001 - any error a concurrent reader hits is a failure
            failures.put(f"{type(exc).__name__}: {exc}")


def test_contending_writers_compactors_and_readers_lose_nothing_and_duplicate_nothing(tmp_path):
    """Six writers append interleaved batches to one partition (each batch also carries records
    every writer appends), two compactors rewrite it at the same time, a reader reads it in a
    loop, and two writers are SIGKILLed mid-run. Afterwards every acknowledged row is there,
    exactly once; nothing is there that nobody wrote; no reader ever failed or saw a duplicate."""
    ctx = mp.get_context("spawn")
    start, stop, failures = ctx.Barrier(6 + 2 + 1 + 1), ctx.Event(), ctx.Queue()
    root = str(tmp_path / "ds")
    acks = [tmp_path / f"ack-{w}" for w in range(6)]
    writers = [ctx.Process(target=_contender, args=(root, w, 40, str(acks[w]), start)) for w in range(6)]
    others = [ctx.Process(target=_compactor, args=(root, start, stop)) for _ in range(2)]
    others.append(ctx.Process(target=_reader, args=(root, start, stop, failures)))
    for p in writers + others:
        p.start()
    start.wait(timeout=120)
    time.sleep(1.0)
    for victim in writers[:2]:  # killed mid-run, wherever they are (maybe inside a write)
        os.kill(victim.pid, signal.SIGKILL)
        time.sleep(0.3)
    for p in writers:
        p.join(timeout=600)
    stop.set()
    for p in others:
        p.join(timeout=120)
    assert [p.exitcode for p in writers[2:]] == [0] * 4 and [p.exitcode for p in others] == [0] * 3
    errors = []
    while not failures.empty():
        errors.append(failures.get())
    assert errors == []
    df = TrialDataset(root).read()
    present = list(df["record_id"])
    assert len(present) == len(set(present))
    acked = {rid for ack in acks if ack.exists() for line in ack.read_text().splitlines() for rid in line.split()}
    attempted = {r.record_id for w in range(6) for r in make_records(200, writer=w)} | {
        r.record_id for r in make_records(SHARED, writer=999)}
    assert acked <= set(present) <= attempted
    survivors = {r.record_id for w in range(2, 6) for r in make_records(200, writer=w)}
    assert survivors <= set(present)
    assert not [p for p in Path(root).rglob("*") if p.is_file() and not p.name.startswith(".")
                and not p.name.endswith(".parquet")]


def test_compacting_one_partition_leaves_the_others_as_they_are(tmp_path):
    """What a search does when it ends: its (model, cluster) partition becomes one file holding
    every row once; another partition's files are not touched."""
    ds = TrialDataset(tmp_path)
    for i in range(3):
        ds.append(make_records(4, writer=i))
        ds.append(make_records(2, writer=i, cluster="local-2x2"))
    ds.append(make_records(4, writer=0))  # the same rows again: read once, compacted once
    mine = lambda: [f for f in ds.files() if f.parent.name.endswith("local-1x2")]  # noqa: E731
    other = [f for f in ds.files() if f.parent.name.endswith("local-2x2")]
    before = ds.read().sort_values("record_id").reset_index(drop=True)
    assert len(mine()) == 4 and len(other) == 3
    out = ds.compact(model="cnn-small", cluster="local-1x2")
    assert out == {"files_before": 4, "files_after": 1, "rows": 12}
    assert len(mine()) == 1 and [f for f in ds.files() if f.parent.name.endswith("local-2x2")] == other
    after = ds.read().sort_values("record_id").reset_index(drop=True)
    assert list(after["record_id"]) == list(before["record_id"]) and len(after) == 18
    assert list(after["mean_s"]) == list(before["mean_s"])
    assert ds.compact(model="ncf-small")["files_before"] == 0


def _slow_writer(root: str) -> None:
    ds = TrialDataset(root)
    batch = 0
    while True:
        ds.append(make_records(500, writer=1000 + batch))
        batch += 1


def test_writer_killed_mid_append_leaves_a_readable_dataset(tmp_path):
    ds = TrialDataset(tmp_path)
    ds.append(make_records(50, writer=1))
    ctx = mp.get_context("spawn")
    proc = ctx.Process(target=_slow_writer, args=(str(tmp_path),))
    proc.start()
    until = time.monotonic() + 120
    while not ds.files()[1:] and time.monotonic() < until:  # let it commit at least one batch
        time.sleep(0.05)
    time.sleep(0.3)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=30)
    df = TrialDataset(tmp_path).read()
    assert len(df) >= 550 and (len(df) - 50) % 500 == 0  # whole batches only, never a partial file
    assert {r.record_id for r in make_records(50, writer=1)} <= set(df["record_id"])  # every one of the first 50


def test_duplicates_are_skipped_and_filters_work(tmp_path):
    ds = TrialDataset(tmp_path)
    recs = make_records(8) + make_records(4, model="ncf-small", cluster="local-2x2", status="failed")
    assert ds.append(recs) == 12
    assert ds.append(recs[:5] + recs[:5]) == 5  # deduplicated within the batch
    assert len(ds.read()) == 12  # and on read
    assert ds.append(recs[:5], skip_existing=True) == 0
    assert ds.compact() == {"files_before": 3, "files_after": 2, "rows": 12}
    assert len(ds.read()) == 12 and len(ds.table().to_pylist()) == 12
    assert len(ds.read(model="ncf-small")) == 4
    assert len(ds.read(cluster="local-1x2", status="ok")) == 8
    assert ds.read(status="oom").empty
    back = ds.records(model="cnn-small")
    assert sorted(r.record_id for r in back) == sorted(r.record_id for r in recs[:8])
    assert back[0].iteration_times_s == (0.1, 0.12, 0.11)
    stats = ds.stats().set_index("model")
    assert stats.loc["ncf-small", "failed"] == 4 and stats.loc["cnn-small", "best_mean_s"] == pytest.approx(0.1)
    paths = {p.relative_to(tmp_path).parts[:2] for p in ds.files()}
    assert paths == {("model=cnn-small", "cluster=local-1x2"), ("model=ncf-small", "cluster=local-2x2")}


def test_older_schema_rows_read_with_nulls(tmp_path):
    """Schema evolution: a file written before a column existed still reads, the column null."""
    ds = TrialDataset(tmp_path)
    table = pa.Table.from_pylist([r.to_row() for r in make_records(3)])
    old = table.drop_columns(["predicted_time_s", "experiment"]).set_column(
        table.schema.get_field_index("schema_version") - 2, "schema_version", pa.array([0, 0, 0], pa.int32()))
    assert ds.append_table(old) == 3
    ds.append(make_records(2, writer=9))
    df = ds.read()
    assert len(df) == 5
    assert df["predicted_time_s"].isna().all()
    assert sorted(df["schema_version"].tolist()) == [0, 0, 0, RECORD_SCHEMA_VERSION, RECORD_SCHEMA_VERSION]
    newer = old.set_column(old.schema.get_field_index("schema_version"), "schema_version",
                           pa.array([RECORD_SCHEMA_VERSION + 1] * 3, pa.int32()))
    with pytest.raises(SpecError, match="newer than this synctune"):
        ds.append_table(newer)


def test_export_csv_and_parquet(tmp_path):
    home = tmp_path / "ds"
    TrialDataset(home).append(make_records(5))
    runner = CliRunner()
    out = tmp_path / "all.csv"
    res = runner.invoke(cli, ["dataset", "export", "--data", str(home), "--format", "csv", "-o", str(out)])
    assert res.exit_code == 0, res.output
    lines = out.read_text().splitlines()
    assert len(lines) == 6 and "iteration_times_s" in lines[0] and "[0.1, 0.12, 0.11]" in lines[1]
    pq_out = tmp_path / "ok.parquet"
    res = runner.invoke(cli, ["dataset", "export", "--data", str(home), "--format", "parquet", "-o", str(pq_out),
                              "--status", "ok"])
    assert res.exit_code == 0 and pq.read_table(pq_out).num_rows == 5


# ----------------------------------------------------------------------------------- releases


def _populated(tmp_path) -> TrialDataset:
    ds = TrialDataset(tmp_path / "source")
    ds.append(make_records(6) + make_records(3, model="bert-tiny", cluster="local-2x2"))
    return ds


def _stats_rows(ds: TrialDataset) -> list:
    return ds.stats().to_dict("records")


def test_push_and_pull_through_a_folder(tmp_path):
    src = _populated(tmp_path)
    manifest = push_release(src, str(tmp_path / "rel"), name="v-test")
    assert manifest["total_rows"] == 9 and len(manifest["files"]) == 2
    on_disk = json.loads((tmp_path / "rel" / "manifest.json").read_text())
    assert on_disk == manifest
    dst = TrialDataset(tmp_path / "empty")
    assert pull_release(str(tmp_path / "rel"), dst) == {"files": 2, "rows": 9, "new_rows": 9, "profiles": {}}
    assert _stats_rows(dst) == _stats_rows(src)
    assert pull_release(str(tmp_path / "rel"), dst)["new_rows"] == 0  # merging twice adds nothing


def test_a_release_carries_its_compute_profiles(tmp_path, monkeypatch):
    """`dataset push` publishes the data folder's compute profiles of the release's models (the
    replay simulator's measured inputs); `dataset pull` into a fresh data folder files them
    without replacing one measured there, and refuses a tampered one before merging anything."""
    from synctune.run import profile_path, save_profile
    from synctune.spec import ComputeProfile

    src = _populated(tmp_path)
    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path / "home-a"))
    mine = ComputeProfile(model="bert-tiny", device="cpu", workers=4, batch_size=8, forward_s=0.01, backward_s=0.02,
                          step_s=0.001, ready_s=tuple(0.001 * i for i in range(len(model_spec("bert-tiny").variables))))
    other = dataclasses.replace(mine, model="vgg16", ready_s=(0.0,))
    save_profile(mine)
    save_profile(other)  # a model the release does not hold: not published
    runner = CliRunner()
    res = runner.invoke(cli, ["dataset", "push", str(tmp_path / "rel"), "--data", str(src.root)])
    assert res.exit_code == 0 and "1 compute profile(s)" in res.output, res.output
    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path / "home-b"))
    res = runner.invoke(cli, ["dataset", "pull", str(tmp_path / "rel"), "--data", str(tmp_path / "b")])
    assert res.exit_code == 0 and "filed 1 compute profile(s)" in res.output, res.output
    assert ComputeProfile.from_dict(json.loads(profile_path("bert-tiny", "cpu", 4).read_text()), where="x") == mine
    assert not profile_path("vgg16", "cpu", 4).exists()
    shipped = tmp_path / "rel" / "profiles" / "bert-tiny@cpu-w4.json"
    shipped.write_text(shipped.read_text().replace("0.01", "0.02", 1))
    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path / "home-c"))
    res = runner.invoke(cli, ["dataset", "pull", str(tmp_path / "rel"), "--data", str(tmp_path / "c")])
    assert res.exit_code == 2 and "checksum mismatch" in res.stderr
    assert not (tmp_path / "c").exists() or not TrialDataset(tmp_path / "c").files()


def test_a_release_carries_profiles_of_a_device_measured_apart(tmp_path, monkeypatch):
    """`dataset push --profiles DIR` publishes every profile in DIR, models without rows included
    (a GPU's profiles, measured apart from the trials), under the name the data folder files it
    by; `dataset pull` files them. A file that is not a profile, or a second, different profile of
    the same (model, device, workers), is refused with one line naming it, and nothing is pushed."""
    from synctune.run import profile_path, save_profile
    from synctune.spec import ComputeProfile

    src = _populated(tmp_path)
    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path / "home-a"))
    gpu = ComputeProfile(model="vgg16", device="NVIDIA H200", workers=1, batch_size=32, forward_s=0.0082,
                         backward_s=0.0168, step_s=0.0004, ready_s=tuple(0.0005 * i for i in range(32)),
                         launch_s=0.0077, hook_s=2e-5)
    folder = tmp_path / "gpu"
    folder.mkdir()
    (folder / "vgg16-NVIDIA_H200-w1.json").write_text(json.dumps(gpu.to_dict()))  # not the filing name
    runner = CliRunner()
    res = runner.invoke(cli, ["dataset", "push", str(tmp_path / "rel"), "--data", str(src.root),
                              "--profiles", str(folder)])
    assert res.exit_code == 0 and "1 compute profile(s)" in res.output, res.output
    assert (tmp_path / "rel" / "profiles" / "vgg16@NVIDIA_H200-w1.json").is_file()
    monkeypatch.setenv("SYNCTUNE_HOME", str(tmp_path / "home-b"))
    res = runner.invoke(cli, ["dataset", "pull", str(tmp_path / "rel"), "--data", str(tmp_path / "b")])
    assert res.exit_code == 0 and "filed 1 compute profile(s)" in res.output, res.output
    assert ComputeProfile.from_dict(json.loads(profile_path("vgg16", "NVIDIA H200", 1).read_text()), where="x") == gpu

    save_profile(dataclasses.replace(gpu, forward_s=0.0099))  # home-b now holds a different one
    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "a.json").write_text(json.dumps(gpu.to_dict()))
    res = runner.invoke(cli, ["dataset", "push", str(tmp_path / "rel2"), "--data", str(src.root), "--profiles",
                              str(clash), "--profiles", str(profile_path("vgg16", "NVIDIA H200", 1).parent)])
    assert res.exit_code == 2 and "a different profile of vgg16 on 1 NVIDIA H200 worker(s)" in res.stderr, res.output
    assert "a.json" in res.stderr and not (tmp_path / "rel2").exists()
    (clash / "a.json").write_text('{"schema": 1, "model": "vgg16"}')
    res = runner.invoke(cli, ["dataset", "push", str(tmp_path / "rel3"), "--data", str(src.root),
                              "--profiles", str(clash)])
    assert res.exit_code == 2 and "a.json: not a compute profile" in res.stderr and len(res.stderr.splitlines()) == 1
    assert not (tmp_path / "rel3").exists()


def test_tampered_release_is_refused_and_local_data_unchanged(tmp_path):
    src = _populated(tmp_path)
    manifest = push_release(src, str(tmp_path / "rel"))
    dst = TrialDataset(tmp_path / "local")
    dst.append(make_records(2, writer=7))
    before = sorted(p.name for p in dst.files())
    victim = tmp_path / "rel" / manifest["files"][1]["path"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01  # flip one bit
    victim.write_bytes(bytes(data))
    with pytest.raises(SpecError, match=r"part-0.parquet: checksum mismatch .* the local dataset is unchanged"):
        pull_release(str(tmp_path / "rel"), dst)
    assert sorted(p.name for p in dst.files()) == before and len(dst.read()) == 2
    res = CliRunner().invoke(cli, ["dataset", "pull", "--data", str(dst.root), str(tmp_path / "rel")])
    assert res.exit_code == 2 and res.stderr.startswith("synctune: error: ") and "checksum mismatch" in res.stderr


def test_bad_manifests_are_refused(tmp_path):
    rel = tmp_path / "rel"
    rel.mkdir()
    ds = TrialDataset(tmp_path / "d")
    with pytest.raises(SpecError, match="no file 'manifest.json'"):
        pull_release(str(rel), ds)
    (rel / "manifest.json").write_text("{oops")
    with pytest.raises(SpecError, match="malformed JSON"):
        pull_release(str(rel), ds)
    (rel / "manifest.json").write_text(json.dumps({"format": "synctune-dataset-release", "schema_version": 1,
                                                   "files": [{"path": "../../etc/passwd", "rows": 1, "sha256": "x"}]}))
    with pytest.raises(SpecError, match="leaves the release"):
        pull_release(str(rel), ds)


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def test_pull_over_http(tmp_path):
    src = _populated(tmp_path)
    push_release(src, str(tmp_path / "rel"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=str(tmp_path)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/rel"
        dst = TrialDataset(tmp_path / "dst")
        res = CliRunner().invoke(cli, ["dataset", "pull", "--data", str(dst.root), url])
        assert res.exit_code == 0, res.output
        assert "9 rows in 2 file(s)" in res.output and _stats_rows(dst) == _stats_rows(src)
        res = CliRunner().invoke(cli, ["dataset", "pull", "--data", str(dst.root), url + "/missing"])
        assert res.exit_code == 2 and "HTTP 404" in res.stderr
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture()
def s3_server(monkeypatch):
    import boto3
    import moto.server as moto_server

    port = free_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    endpoint = f"127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1")
    client.create_bucket(Bucket="synctune-releases")
    try:
        yield endpoint, client
    finally:
        server.stop()


def test_push_to_s3_pull_into_empty_dir_and_tamper(tmp_path, s3_server):
    endpoint, client = s3_server
    src = _populated(tmp_path)
    uri = f"s3://synctune-releases/v0.1?endpoint_override={endpoint}&scheme=http&region=us-east-1"
    runner = CliRunner()
    res = runner.invoke(cli, ["dataset", "push", "--data", str(src.root), uri, "--name", "v0.1"])
    assert res.exit_code == 0, res.output
    keys = sorted(o["Key"] for o in client.list_objects_v2(Bucket="synctune-releases")["Contents"])
    assert "v0.1/manifest.json" in keys and len(keys) == 3

    dst = TrialDataset(tmp_path / "fresh")
    res = runner.invoke(cli, ["dataset", "pull", "--data", str(dst.root), uri])
    assert res.exit_code == 0, res.output
    assert _stats_rows(dst) == _stats_rows(src)
    stats_before = runner.invoke(cli, ["dataset", "stats", "--data", str(dst.root)]).output
    assert stats_before == runner.invoke(cli, ["dataset", "stats", "--data", str(src.root)]).output.replace(
        str(src.root), str(dst.root))

    key = next(k for k in keys if k.endswith(".parquet"))
    body = bytearray(client.get_object(Bucket="synctune-releases", Key=key)["Body"].read())
    body[100] ^= 0xFF
    client.put_object(Bucket="synctune-releases", Key=key, Body=bytes(body))
    other = TrialDataset(tmp_path / "other")
    other.append(make_records(1, writer=5))
    res = runner.invoke(cli, ["dataset", "pull", "--data", str(other.root), uri])
    assert res.exit_code == 2 and "checksum mismatch" in res.stderr
    assert len(other.read()) == 1
    assert runner.invoke(cli, ["dataset", "stats", "--data", str(dst.root)]).output == stats_before


@pytest.mark.parametrize("release", [r["name"] for r in json.loads(
    (Path(__file__).resolve().parents[1] / "dataset" / "releases.json").read_text())])
def test_every_published_release_pulls_into_an_empty_data_dir_and_verifies(release, tmp_path):
    """What `synctune dataset pull dataset/<release>` does on a fresh machine."""
    entry = next(r for r in json.loads((Path(__file__).resolve().parents[1] / "dataset" / "releases.json")
                                       .read_text()) if r["name"] == release)
    source = Path(__file__).resolve().parents[1] / entry["source"]
    env = dict(os.environ, SYNCTUNE_HOME=str(tmp_path / "home"))
    done = subprocess.run([sys.executable, "-m", "synctune", "dataset", "pull", str(source)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert f"pulled {entry['rows']} rows" in done.stdout and f"{entry['rows']} new" in done.stdout
    rows = TrialDataset(tmp_path / "home" / "dataset").read()
    assert len(rows) == entry["rows"] and (rows["schema_version"] == entry["schema_version"]).all()


def test_a_lab_preset_begun_earlier_gives_new_domains_its_recorded_calibration():
    """``lab collect`` calibrates a preset only while it has no rows: a domain begun after a
    restart is measured on the links its preset's recorded rows were, so the preset stays one
    cluster in the dataset (a re-probe once read a link's latency 4x its earlier value)."""
    from synctune.cli._lab import preset_calibration
    from synctune.spec import cluster_preset

    earlier, other = cluster_preset("lab-2x2"), cluster_preset("lab-4x1")
    assert preset_calibration({}, ["bert-tiny", "cnn-small"]) is None  # nothing recorded: calibrate
    assert preset_calibration({"bert-tiny": earlier}, ["bert-tiny", "cnn-small"]) is earlier
    # the first model in collection order that has rows decides, whatever the dict's order
    assert preset_calibration({"ncf-small": other, "bert-tiny": earlier}, ["bert-tiny", "ncf-small"]) is earlier
