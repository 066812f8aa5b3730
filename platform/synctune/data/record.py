"""The trial record: one measured (model, cluster, strategy, runtime) row (DESIGN.md "Dataset row").

The schema is versioned (:data:`RECORD_SCHEMA_VERSION`, stored in every row). A new version
may add nullable columns; readers see older rows with those columns null. Column meanings are
documented in ``dataset/README.md``.
"""

from __future__ import annotations

import datetime
import json
import platform
import uuid
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping

from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.schema import Strategy

__all__ = ["RECORD_SCHEMA_VERSION", "TrialRecord", "arrow_schema", "environment", "dedup_key"]

#: Version of the record schema written now. 2 added ``workload_source``; 3 added ``runtime``
#: and ``runtime_json`` (null in older rows, which are all ``engine`` trials); 4 added
#: ``tp_degree`` (null in older rows, none of which split modules: read as 1).
RECORD_SCHEMA_VERSION = 4


def environment(backend: str = "", device_kind: str = "") -> dict[str, str]:
    """Versions and platform of this process, for the record's environment columns."""
    from importlib import metadata

    def version(pkg: str) -> str:
        try:
            return metadata.version(pkg)
        except metadata.PackageNotFoundError:
            return ""

    return {
        "synctune_version": version("synctune"),
        "torch_version": version("torch"),
        "ray_version": version("ray"),
        "python_version": platform.python_version(),
        "platform": f"{platform.system()}-{platform.machine()}",
        "backend": backend,
        "device_kind": device_kind,
    }


@dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One row of the dataset. Times in seconds, sizes in bytes."""

    record_id: str
    search_id: str
    trial_id: str
    mlflow_run_id: str
    experiment: str
    created_at: datetime.datetime
    model_name: str
    model_hash: str
    model_spec_json: str
    cluster_name: str
    cluster_hash: str
    cluster_spec_json: str
    cluster_scale: float
    strategy_hash: str
    strategy_json: str
    strategy_summary: str
    num_replicas: int
    global_batch_size: int
    num_variables: int
    num_partitioned: int
    num_shards: int
    num_ps_shards: int
    num_allreduce_shards: int
    num_allgather_shards: int
    num_merge_groups: int
    num_ps_servers: int
    num_local_aggregation: int
    max_staleness: int
    compressors: tuple[str, ...]
    origin: str
    predicted_time_s: float | None
    status: str
    error: str
    launcher: str
    warmup: int
    iters: int
    iteration_times_s: tuple[float, ...]
    mean_s: float | None
    median_s: float | None
    std_s: float | None
    samples_per_s: float | None
    comm_bytes_per_iter: int | None
    peak_memory_bytes: int | None
    synctune_version: str
    torch_version: str
    ray_version: str
    python_version: str
    platform: str
    backend: str
    device_kind: str
    schema_version: int = RECORD_SCHEMA_VERSION
    extra_json: str = field(default="{}")
    #: Where the workload comes from: ``zoo:NAME`` or the user's import path (provenance; the
    #: model itself is ``model_name``/``model_hash``/``model_spec_json``).
    workload_source: str = ""
    #: What executed the trial: a name of the runtime registry (:mod:`synctune.engine.runtimes`;
    #: ``engine``, ``ddp``, ``horovod``, ``tensorflow``); simulators learn from ``engine`` rows only.
    runtime: str = "engine"
    #: The runtime's configuration as JSON (a DDP trial's :class:`~synctune.engine.ddp.DDPConfig`, a
    #: Horovod trial's :class:`~synctune.engine.horovod.HorovodConfig`).
    runtime_json: str = ""
    #: The devices of a tensor-parallel group (the strategy's ``tensor_parallel`` degree; 1: none):
    #: the mesh is ``(num_replicas // tp_degree, tp_degree)``, the plan is in ``strategy_json``.
    tp_degree: int = 1

    @classmethod
    def from_trial(cls, result: Mapping[str, Any], strategy: Strategy, model: ModelSpec, cluster: ClusterSpec, *,
                   origin: str, search_id: str = "", trial_id: str = "", predicted_time_s: float | None = None,
                   mlflow_run_id: str = "", experiment: str = "", created_at: datetime.datetime | None = None,
                   workload_source: str = "", runtime: str = "engine", runtime_json: str = "") -> "TrialRecord":
        """A record of a trial ``result`` (``TrialResult.to_dict()``) of ``strategy``."""
        stats = strategy.stats()
        env = environment(result.get("backend", ""), result.get("device_kind", ""))
        return cls(
            record_id=uuid.uuid4().hex,
            search_id=search_id,
            trial_id=trial_id or uuid.uuid4().hex[:12],
            mlflow_run_id=mlflow_run_id,
            experiment=experiment,
            created_at=created_at or datetime.datetime.now(datetime.timezone.utc),
            model_name=model.name,
            model_hash=model.hash,
            model_spec_json=json.dumps(model.to_dict(), sort_keys=True, separators=(",", ":")),
            cluster_name=cluster.name,
            cluster_hash=cluster.hash,
            cluster_spec_json=json.dumps(cluster.to_dict(), sort_keys=True, separators=(",", ":")),
            cluster_scale=float(cluster.scale),
            strategy_hash=strategy.hash,
            strategy_json=strategy.to_json(indent=None),
            strategy_summary=strategy.summary(),
            num_replicas=stats["num_replicas"],
            global_batch_size=stats["global_batch_size"],
            num_variables=stats["num_variables"],
            num_partitioned=stats["num_partitioned"],
            num_shards=stats["num_shards"],
            num_ps_shards=stats["num_ps_shards"],
            num_allreduce_shards=stats["num_allreduce_shards"],
            num_allgather_shards=stats["num_allgather_shards"],
            num_merge_groups=stats["num_merge_groups"],
            num_ps_servers=stats["num_ps_servers"],
            num_local_aggregation=stats["num_local_aggregation"],
            max_staleness=stats["max_staleness"],
            compressors=tuple(stats["compressors"]),
            origin=origin,
            predicted_time_s=predicted_time_s,
            status=result["status"],
            error=result.get("error", ""),
            launcher=result.get("launcher", ""),
            warmup=int(result.get("warmup", 0)),
            iters=int(result.get("iters", 0)),
            iteration_times_s=tuple(float(t) for t in result.get("iteration_times_s", ())),
            mean_s=result.get("mean_s"),
            median_s=result.get("median_s"),
            std_s=result.get("std_s"),
            samples_per_s=result.get("samples_per_s"),
            comm_bytes_per_iter=result.get("comm_bytes_per_iter"),
            peak_memory_bytes=result.get("peak_memory_bytes"),
            extra_json=json.dumps(result.get("extra", {}), sort_keys=True),
            workload_source=workload_source,
            runtime=runtime,
            runtime_json=runtime_json,
            tp_degree=stats["tp_degree"],
            **env,
        )

    def to_row(self) -> dict[str, Any]:
        """Plain-data form with the Arrow column names."""
        row = asdict(self)
        row["compressors"] = list(self.compressors)
        row["iteration_times_s"] = list(self.iteration_times_s)
        return row

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> "TrialRecord":
        """Inverse of :meth:`to_row`; columns unknown to this version are ignored."""
        names = {f.name for f in fields(cls)}
        values = {k: v for k, v in row.items() if k in names}
        missing = names - set(values) - {"schema_version", "extra_json", "workload_source", "runtime", "runtime_json",
                                         "tp_degree"}
        if missing:
            raise SpecError(f"dataset row lacks column(s) {sorted(missing)}")
        values["compressors"] = tuple(values["compressors"] or ())
        values["workload_source"] = values.get("workload_source") or ""
        values["runtime"] = values.get("runtime") or "engine"
        values["runtime_json"] = values.get("runtime_json") or ""
        tp = values.get("tp_degree")
        values["tp_degree"] = 1 if tp is None or tp != tp else int(tp)
        values["iteration_times_s"] = tuple(values["iteration_times_s"] or ())
        for key in ("mean_s", "median_s", "std_s", "samples_per_s", "predicted_time_s", "comm_bytes_per_iter",
                    "peak_memory_bytes"):
            value = values.get(key)
            if value is not None and value != value:  # NaN from pandas means missing
                values[key] = None
        return cls(**values)

    @property
    def memory_breakdown(self) -> list[dict[str, int | None]] | None:
        """Per rank, the memory the trial measured part by part (``extra_json``'s ``memory``:
        part -> per-rank bytes, see :mod:`synctune.engine.memory`); None for a row recorded
        without one (older rows, runtimes that do not train through the probe)."""
        memory = json.loads(self.extra_json or "{}").get("memory")
        if not memory:
            return None
        ranks = max(len(v) for v in memory.values())
        return [{part: values[r] for part, values in memory.items()} for r in range(ranks)]

    @property
    def environment_key(self) -> str:
        """What must match for two measurements to be "the same environment"."""
        return "|".join((self.synctune_version, self.torch_version, self.python_version, self.platform,
                         self.backend, self.device_kind))


def dedup_key(row: Mapping[str, Any]) -> tuple:
    """Rows with equal keys are the same measurement (kept once)."""
    env = "|".join(str(row.get(k, "")) for k in ("synctune_version", "torch_version", "python_version", "platform",
                                                  "backend", "device_kind"))
    # A DDP trial shares its strategy hash with an engine trial but never its trial id
    # (``ddp-N``, or a fresh id from ``synctune trial``): the key needs no runtime.
    return (row["model_hash"], row["cluster_hash"], row["strategy_hash"], env, row["search_id"], row["trial_id"])


def arrow_schema():
    """The Arrow schema of version :data:`RECORD_SCHEMA_VERSION`."""
    import pyarrow as pa

    types = {
        "created_at": pa.timestamp("us", tz="UTC"),
        "cluster_scale": pa.float64(),
        "compressors": pa.list_(pa.string()),
        "predicted_time_s": pa.float64(),
        "iteration_times_s": pa.list_(pa.float64()),
        "mean_s": pa.float64(),
        "median_s": pa.float64(),
        "std_s": pa.float64(),
        "samples_per_s": pa.float64(),
        "comm_bytes_per_iter": pa.int64(),
        "peak_memory_bytes": pa.int64(),
        "schema_version": pa.int32(),
    }
    ints = {"num_replicas", "global_batch_size", "num_variables", "num_partitioned", "num_shards", "num_ps_shards",
            "num_allreduce_shards", "num_allgather_shards", "num_merge_groups", "num_ps_servers",
            "num_local_aggregation", "max_staleness", "warmup", "iters", "tp_degree"}
    cols = []
    for f in fields(TrialRecord):
        if f.name in types:
            t = types[f.name]
        elif f.name in ints:
            t = pa.int64()
        else:
            t = pa.string()
        cols.append(pa.field(f.name, t))
    return pa.schema(cols, metadata={b"synctune_record_schema": str(RECORD_SCHEMA_VERSION).encode()})
