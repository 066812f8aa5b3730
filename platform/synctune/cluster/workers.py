"""A Ray worker group: one actor per device of a cluster spec, placed by a placement group with
one bundle per node, joined in a torch.distributed process group that stays up across trials.

Plain actors rather than Ray Train: a trial needs a heterogeneous slice (nodes of different
types and device counts), and keeping one process group alive for many consecutive trials
pays the start-up cost (Ray scheduling, imports, rendezvous) once per slice, not per trial.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Callable

from ..engine.local import rank_networks
from ..engine.runtime import Runtime
from ..engine.runtimes import as_runtime
from ..engine.trial import (
    GPU_BACKEND,
    TrialConfig,
    TrialResult,
    check_trial,
    failed_result,
    result_from_rank0,
    trial_payload,
)
from ..spec.cluster import ClusterSpec
from ..spec.errors import InfraError, SpecError

if TYPE_CHECKING:  # strategies reach a worker group as plain objects: only the type is named here
    from ..strategy.schema import Strategy

__all__ = ["RayWorkerGroup", "ConfirmFailed", "SlicePending", "node_type_resource", "NODE_TYPE_PREFIX",
           "HEAD_RESOURCE", "LIMITS_NAMESPACE", "LIMITS_KEY", "node_type_limits", "check_slice_feasible"]

#: Prefix of the custom resource that names a node's instance type.
NODE_TYPE_PREFIX = "synctune-node:"
#: A resource only the head node has (Ray adds it); the search's own actors ask for a sliver of
#: it, so the driver side never takes resources a worker slice needs (they stay on the head).
HEAD_RESOURCE = "node:__internal_head__"


#: Where an autoscaling cluster publishes, in Ray's internal key-value store, how many nodes of
#: each instance type its autoscaler may launch (JSON: instance type -> max_workers summed over
#: the node types advertising it). Ray 2.60's autoscaler v2 keeps its node types to itself;
#: ``synctune cluster up --local`` publishes them, and a slice is then checked against them.
LIMITS_NAMESPACE = "synctune"
LIMITS_KEY = "node-type-limits"


def node_type_resource(instance_type: str) -> str:
    """The custom Ray resource a node of ``instance_type`` advertises, one unit per node
    (``cluster.yaml`` sets it per node type; ``ray start --resources`` elsewhere). AWS reports
    the same GPU type (T4) for g4dn.2xlarge and g4dn.12xlarge, so the GPU alone cannot tell
    node types apart."""
    return f"{NODE_TYPE_PREFIX}{instance_type}"


def node_type_limits() -> dict[str, int] | None:
    """How many nodes of each instance type the connected Ray cluster's autoscaler may launch,
    as the cluster published them (:data:`LIMITS_KEY`); None when it published none (a cluster
    without an autoscaler, or one not started by synctune). Ray must be initialized."""
    import json

    from ray.experimental import internal_kv

    raw = internal_kv._internal_kv_get(LIMITS_KEY, namespace=LIMITS_NAMESPACE)
    if not raw:
        return None
    try:
        return {str(k): int(v) for k, v in json.loads(raw).items()}
    except (ValueError, TypeError, AttributeError):
        return None


def _alive_node_types() -> dict[str, int]:
    import ray

    counts: dict[str, int] = {}
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        for key in node.get("Resources", {}):
            if key.startswith(NODE_TYPE_PREFIX):
                counts[key[len(NODE_TYPE_PREFIX):]] = counts.get(key[len(NODE_TYPE_PREFIX):], 0) + 1
    return counts


def check_slice_feasible(cluster: ClusterSpec) -> None:
    """Refuse (:class:`SpecError`, one line naming the type and the limit) a slice of ``cluster``
    that the connected Ray cluster can never form: more nodes of an instance type than its
    autoscaler may launch (or than are alive, when more are), or a type it has no node type
    for. Checked only where the cluster published its limits (:func:`node_type_limits`): on
    other clusters a missing node may still come, and the slice waits for it. Ray must be
    initialized."""
    from collections import Counter

    limits = node_type_limits()
    if limits is None:
        return
    alive = _alive_node_types()
    for instance_type, count in Counter(node.instance_type for node in cluster.nodes).items():
        limit = max(limits.get(instance_type, 0), alive.get(instance_type, 0))
        if limit == 0:
            offered = ", ".join(f"{t} (at most {n})" for t, n in sorted(limits.items())) or "none"
            raise SpecError(f"cluster {cluster.name!r} needs {count} node(s) of type {instance_type!r}; the Ray "
                            f"cluster has no node type advertising {node_type_resource(instance_type)!r} (it offers: "
                            f"{offered})")
        if count > limit:
            raise SpecError(f"cluster {cluster.name!r} needs {count} node(s) of type {instance_type!r}; the Ray "
                            f"cluster's autoscaler launches at most {limit} (max_workers)")


class _Worker:
    """The actor body (wrapped with ``ray.remote`` lazily, so importing this module needs no Ray).

    With a node network (``net``: a lab node), all torch.distributed work runs on one thread
    that entered the node's namespace: namespaces are per thread, so Ray's own threads and
    connections stay where they are while gloo's sockets go through the node's shaped link.
    """

    def __init__(self, threads: int, net: dict | None = None) -> None:
        import os

        import torch

        torch.set_num_threads(threads)
        self.rank = -1
        self.net = net
        self._pool = None
        self._store = None  # the rendezvous store this actor serves as rank 0 (address())
        if net:
            from concurrent.futures import ThreadPoolExecutor

            from ..engine.local import enter_netns

            os.environ["GLOO_SOCKET_IFNAME"] = net["ifname"]
            self._pool = ThreadPoolExecutor(1, initializer=enter_netns, initargs=(net["netns"],))
            if net.get("cgroup"):
                from ..engine.local import join_cgroup

                join_cgroup(net["cgroup"])  # the whole actor computes at its lab node's speed

    def _call(self, fn, *args):
        return self._pool.submit(fn, *args).result() if self._pool else fn(*args)

    def address(self, timeout_s: float, host: str | None = None) -> tuple[str, int]:
        """Open the rendezvous store this actor serves as the next group's rank 0 at ``host``
        (default: its lab node's address, else its Ray node's); return host and port.

        The store binds an ephemeral port itself and keeps it: probing a free port and binding it
        later leaves a window in which another socket takes it (EADDRINUSE on a busy node)."""
        import ray

        host = host or (self.net["master"] if self.net else ray.util.get_node_ip_address())
        return host, self._call(self._open_store, host, timeout_s)

    def _open_store(self, host: str, timeout_s: float) -> int:
        import datetime

        import torch.distributed as dist

        # On the pool's thread, so a lab node's store listens inside the node's namespace.
        self._store = dist.TCPStore(host, 0, None, True, datetime.timedelta(seconds=timeout_s),
                                    wait_for_workers=False)
        return self._store.port

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def init_group(self, rank: int, world: int, master: str, port: int, backend: str, timeout_s: float) -> int:
        return self._call(self._init_group, rank, world, master, port, backend, timeout_s)

    def _init_group(self, rank: int, world: int, master: str, port: int, backend: str, timeout_s: float) -> int:
        import datetime
        import os

        import torch.distributed as dist

        self.rank = rank
        os.environ["SYNCTUNE_MASTER_ADDR"] = master  # where rank 0 serves runtimes' rendezvous (Horovod)
        if rank == 0:
            store, self._store = self._store, None
            if store is None:
                raise RuntimeError("rank 0 of a group must first serve its rendezvous store (address())")
        else:
            store = dist.TCPStore(master, port, world, False, datetime.timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        return os.getpid()

    def leave_group(self) -> None:
        """Leave the process group (the group re-forms over another set of replicas)."""
        self._call(self._shutdown)
        self.rank = -1

    def run(self, payload: dict, progress) -> dict:
        return self._call(self._run, payload, progress)

    def _run(self, payload: dict, progress) -> dict:
        import torch.distributed as dist

        from ..engine import local
        from ..engine.trial import trial_worker

        local._REPORTER = (lambda msg: progress.put_nowait(msg)) if progress is not None else None
        try:
            return trial_worker(self.rank, dist.get_world_size(), payload)
        finally:
            local._REPORTER = None

    def probe(self, name: str, args: tuple) -> Any:
        """Run calibration probe ``name`` (:data:`synctune.engine.probes.PROBES`) on this rank."""
        return self._call(self._probe, name, args)

    def _probe(self, name: str, args: tuple) -> Any:
        import torch.distributed as dist

        from ..engine.probes import PROBES

        return PROBES[name](self.rank, dist.get_world_size(), *args)

    def shutdown(self) -> None:
        self._call(self._shutdown)

    def _shutdown(self) -> None:
        import torch.distributed as dist

        self._store = None
        if dist.is_initialized():
            dist.destroy_process_group()


class RayWorkerGroup:
    """Workers for one slice of a Ray cluster that matches ``cluster``, reused across trials.

    The slice is a placement group with one bundle per node of the spec (AutoDist §2.1's
    resource spec made concrete): the node's devices as CPU/GPU plus one unit of its node-type
    resource (:func:`node_type_resource`), so on an autoscaling cluster the pending bundles are
    the demand that makes the autoscaler add exactly those node types. The one exception is a
    CPU node on a Ray instance where nothing advertises its type and no autoscaler published
    limits (:func:`node_type_limits`): one machine standing in for the cluster, where that
    resource could never appear. ``startup_timeout_s`` bounds getting the slice's nodes and
    starting its workers, apart from any trial's timeout. ``placement`` is ``"auto"`` (STRICT_SPREAD when the Ray cluster has as many
    alive nodes as the slice, or lacks the node-type resources it asks for, so the autoscaler
    adds those nodes; else PACK, as on one machine advertising several units) or a Ray strategy
    name. Call :meth:`shutdown` (or use ``with``) to release the slice.
    """

    def __init__(self, cluster: ClusterSpec, *, placement: str = "auto", collective_timeout_s: float = 120.0,
                 startup_timeout_s: float = 300.0, node_net: dict | None = None) -> None:
        from ..engine.trial import check_network

        check_network(cluster, node_net)
        self.cluster = cluster
        self.node_net = node_net
        self.placement_strategy = placement
        self.collective_timeout_s = collective_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.actors: list[Any] = []
        self.pids: list[int] = []
        #: Per rank: the Ray node id and the node type it runs on (None when untyped).
        self.placement: list[dict[str, Any]] = []
        self.pg = None
        self.backend = GPU_BACKEND if cluster.device_kind == "gpu" else "gloo"
        if cluster.device_kind == "mixed":
            raise SpecError(f"cluster {cluster.name!r} mixes GPU and CPU nodes; one process group needs one backend")
        self.starts = 0
        self.single_start_used = False  # whether the processes ran Horovod or TensorFlow (once per process)
        #: The actors (indices into the cluster's devices) in the process group now, in rank
        #: order: every device after start; a strategy's replica subset while it runs (TAG §4.2).
        self.members: list[int] = []
        self.regroups = 0

    def __enter__(self) -> "RayWorkerGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def alive(self) -> bool:
        """Whether the group holds started actors: true after :meth:`start`, false after :meth:`shutdown`."""
        return bool(self.actors)

    def _bundles(self, available: dict[str, float], autoscaled: bool = False) -> list[dict[str, float]]:
        bundles = []
        for node in self.cluster.nodes:
            bundle: dict[str, float] = {"CPU": float(node.num_devices)}
            if node.device_kind == "gpu":
                bundle["GPU"] = float(node.num_devices)
            key = node_type_resource(node.instance_type)
            if key in available or node.device_kind == "gpu" or autoscaled:
                bundle[key] = 1.0
            bundles.append(bundle)
        return bundles

    def _strategy(self, bundles: list[dict[str, float]]) -> str:
        import ray

        if self.placement_strategy != "auto":
            return self.placement_strategy
        if len(bundles) == 1:
            return "PACK"
        alive = [n for n in ray.nodes() if n.get("Alive")]
        if len(alive) >= len(bundles):
            return "STRICT_SPREAD"
        # Fewer nodes than the slice needs. If the node-type resources it asks for are missing,
        # the autoscaler will add nodes (one unit each): ask for them spread. Otherwise one
        # machine advertises several units (a laptop standing in for a cluster): pack.
        total = ray.cluster_resources()
        need: dict[str, float] = {}
        for b in bundles:
            for k, v in b.items():
                if k.startswith(NODE_TYPE_PREFIX):
                    need[k] = need.get(k, 0.0) + v
        return "STRICT_SPREAD" if any(total.get(k, 0.0) < v for k, v in need.items()) else "PACK"

    def start(self) -> None:
        """Reserve the slice, start one actor per device and form the process group."""
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self.actors:
            return
        if not ray.is_initialized():
            raise RuntimeError("ray is not initialized: call ray.init() (address='local' for this machine) first")
        available = ray.cluster_resources()
        bundles = self._bundles(available, autoscaled=node_type_limits() is not None)
        strategy = self._strategy(bundles)
        # Placement-group names are unique per Ray cluster, and several slices share a spec.
        self.pg = placement_group(bundles, strategy=strategy, name=f"synctune-{self.cluster.name}-{uuid.uuid4().hex[:8]}")
        ready, _ = ray.wait([self.pg.ready()], timeout=self.startup_timeout_s)
        if not ready:
            ray.util.remove_placement_group(self.pg)
            self.pg = None
            raise SlicePending(f"cluster {self.cluster.name!r}: Ray could not reserve a matching slice "
                               f"({strategy}, bundles {bundles}) within {self.startup_timeout_s:g} s; "
                               f"cluster resources: {_resource_summary(available)}")
        remote = ray.remote(_Worker)
        ranks = []
        nets = rank_networks(self.cluster, self.cluster.devices, self.node_net) or [None] * self.cluster.num_devices
        for bundle_index, node in enumerate(self.cluster.nodes):
            for _ in range(node.num_devices):
                opts: dict[str, Any] = {"num_cpus": 1, "scheduling_strategy": PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=bundle_index)}
                if node.device_kind == "gpu":
                    opts["num_gpus"] = 1
                ranks.append(remote.options(**opts).remote(1, nets[len(ranks)]))
        self.actors = ranks
        try:
            master, port = ray.get(self.actors[0].address.remote(self.collective_timeout_s),
                                   timeout=self.startup_timeout_s)
            world = len(self.actors)
            self.pids = ray.get([a.init_group.remote(r, world, master, port, self.backend, self.collective_timeout_s)
                                 for r, a in enumerate(self.actors)], timeout=self.startup_timeout_s)
            node_ids = ray.get([a.node_id.remote() for a in self.actors], timeout=self.startup_timeout_s)
        except Exception:
            self.shutdown()
            raise
        types = {n["NodeID"]: next((k[len(NODE_TYPE_PREFIX):] for k in n.get("Resources", {})
                                    if k.startswith(NODE_TYPE_PREFIX)), None) for n in ray.nodes()}
        self.placement = [{"node_id": nid, "node_type": types.get(nid)} for nid in node_ids]
        self.members = list(range(len(self.actors)))
        self.starts += 1

    def _form_group(self, members: list[int]) -> None:
        """Re-form the process group over the actors ``members`` (rank i: ``members[i]``); the
        other actors stay idle, outside it, their devices still reserved by the slice. Costs one
        rendezvous, paid only when the replica set changes between trials."""
        import ray

        if members == self.members:
            return
        try:
            ray.get([a.leave_group.remote() for a in self.actors], timeout=self.startup_timeout_s)
            first = self.actors[members[0]]
            host = None
            if self.node_net:  # a lab: the first replica's node address, inside the lab's network
                devices = self.cluster.devices
                host = rank_networks(self.cluster, [devices[i] for i in members], self.node_net)[0]["master"]
            host, port = ray.get(first.address.remote(self.collective_timeout_s, host),
                                 timeout=self.startup_timeout_s)
            ray.get([self.actors[i].init_group.remote(r, len(members), host, port, self.backend,
                                                      self.collective_timeout_s)
                     for r, i in enumerate(members)], timeout=self.startup_timeout_s)
        except Exception:
            self.shutdown()
            raise
        self.members = list(members)
        self.regroups += 1

    def run_trial(self, strategy: Strategy, config: TrialConfig = TrialConfig(), *, workload,
                  on_progress: Callable[[dict], None] | None = None, runtime: Runtime | dict | None = None
                  ) -> TrialResult:
        """Run one trial of ``workload`` on the group by ``runtime`` (default: the engine); a worker that dies or hangs ends
        it as failed/timeout (and the group is torn down, to be restarted by the next trial)."""
        spec = check_trial(workload, strategy, self.cluster, runtime)
        members = self._check_replicas(strategy)
        start = time.monotonic()
        started_at = time.time()
        self._fresh_for_single_start([runtime])
        self.start()
        self._form_group(members)
        payload = trial_payload(workload, strategy, self.cluster, config, spec, gpu_per_rank=False, runtime=runtime)
        out, status, message = self._execute(payload, config.timeout_s, on_progress)
        if out is None:
            return failed_result(status, message, strategy, self.cluster, config, "ray", time.monotonic() - start)
        result = result_from_rank0(out, strategy, self.cluster, config, "ray", time.monotonic() - start)
        # Where each rank ran (node types, not node ids: the ids mean nothing outside this cluster).
        result.extra.update({"ray_node_types": [self.placement[i]["node_type"] for i in members],
                             "started_at": started_at, "finished_at": time.time()})
        return result

    def run_confirm(self, arms: list, config: TrialConfig = TrialConfig(), *, workload, rounds: int = 10,
                    per_round: int = 5, screen_rounds: int = 0, screen_max_rounds: int = 0, rule=None,
                    candidates: int | None = None, on_progress: Callable[[dict], None] | None = None, retries: int = 1) -> dict:
        """Re-measure arms (strategy, runtime or None) interleaved on the group's processes
        (:func:`synctune.engine.trial.confirm_worker`); returns the per-round medians and the
        speed-up of arm A over arm B with its interval. With ``screen_rounds`` and more than two
        arms (the first ``candidates`` candidates, the rest baselines), a screening picks A and
        B first (``picked``, ``picked_baseline``; sequential up to ``screen_max_rounds``, see
        :func:`synctune.engine.trial.interleave`). ``rule`` (a :class:`~synctune.stats.SequentialRule`)
        says when the rounds stop; default exactly ``rounds``.

        A confirmation whose worker died is run again from the start on fresh workers, up to
        ``retries`` times (the result names each failure under ``retried``): a crash in one
        process (seen in gloo's sparse all-gather under torch DDP) says nothing about the arms,
        and half a confirmation cannot be paired. Other failures are not retried: an arm that
        raises would raise again, and a timeout would take as long again. A failure that remains
        raises :class:`ConfirmFailed` (the group is torn down)."""
        from ..engine.trial import check_confirm_shape, confirm_rule

        rule = confirm_rule(rounds, rule)
        check_confirm_shape(len(arms), per_round, screen_rounds, candidates, screen_max_rounds)
        failures: list[str] = []
        while True:
            try:
                out = self._confirm_once(arms, config, workload=workload, rule=rule, per_round=per_round,
                                         screen_rounds=screen_rounds, screen_max_rounds=screen_max_rounds,
                                         candidates=candidates, on_progress=on_progress)
            except ConfirmFailed as exc:
                if len(failures) >= retries or "a worker died" not in str(exc):
                    raise
                failures.append(str(exc)[:300])
                self.shutdown()  # fresh processes: whatever broke in the old ones goes with them
                continue
            if failures:
                out["retried"] = failures
            return out

    def _confirm_once(self, arms: list, config: TrialConfig, *, workload, rule, per_round: int,
                      screen_rounds: int, screen_max_rounds: int, candidates: int | None, on_progress) -> dict:
        from ..engine.trial import confirm_figures, confirm_payload, confirm_timeout_s

        members = [self._check_replicas(strategy) for strategy, _runtime in arms]
        if any(m != members[0] for m in members):
            return self._confirm_across_replica_sets(arms, config, workload=workload, rule=rule,
                                                     per_round=per_round, screen_rounds=screen_rounds,
                                                     screen_max_rounds=screen_max_rounds, candidates=candidates,
                                                     on_progress=on_progress)
        members = members[0]
        payload = confirm_payload(workload, arms, self.cluster, config, rounds=rule.min_rounds, per_round=per_round,
                                  screen_rounds=screen_rounds, screen_max_rounds=screen_max_rounds, rule=rule,
                                  candidates=candidates)
        payload["gpu_per_rank"] = False
        start = time.monotonic()
        self._fresh_for_single_start([r for _s, r in arms])
        self.start()
        self._form_group(members)
        out, status, message = self._execute(
            payload, confirm_timeout_s(config, rule.max_rounds, per_round, arms=len(arms),
                                       screen_rounds=screen_rounds, screen_max_rounds=screen_max_rounds),
            on_progress)
        if out is None:
            raise ConfirmFailed(f"confirmation {status}: {message}")
        return confirm_figures(out, rule, per_round, "ray", time.monotonic() - start)

    def _confirm_across_replica_sets(self, arms: list, config: TrialConfig, *, workload, rule, per_round: int,
                                     screen_rounds: int, screen_max_rounds: int, candidates: int | None,
                                     on_progress) -> dict:
        """Arms on different replica sets (a subset against every device) cannot share one
        process group, so each round runs each arm as a short trial (``config.warmup`` warm-up
        iterations, ``per_round`` timed ones) on the group re-formed over its replicas, in the
        orders of the interleaved confirmation (a screening first when there are more than two
        arms); the rounds pair up and stop as they do there."""
        import dataclasses
        import statistics

        from ..engine.trial import confirm_figures, interleave

        once = [r.name for r in map(as_runtime, (r for _s, r in arms)) if r.once_per_process]
        if once:
            raise SpecError(f"confirmation: arms on different replica sets run as separate trials, and the {once[0]} "
                            f"runtime starts once per process; confirm engine or ddp arms")
        start = time.monotonic()
        short = dataclasses.replace(config, iters=per_round)
        done = [0]

        def timed(which: int) -> float:
            strategy, runtime = arms[which]
            result = self.run_trial(strategy, short, workload=workload, runtime=runtime)
            done[0] += 1
            if result.status != "ok":
                raise ConfirmFailed(f"confirmation {result.status}: arm {which + 1}, short trial {done[0]}: "
                                    f"{(result.error or '')[:300]}")
            return statistics.median(result.iteration_times_s)

        def on_round(r: int, total: int, medians: list[list[float]]) -> None:
            if on_progress:
                on_progress({"event": "confirm_round", "round": r, "rounds": total, "a_s": medians[0][-1],
                             "b_s": medians[1][-1]})

        measured = interleave(timed, len(arms), rule=rule, screen_rounds=screen_rounds,
                              screen_max_rounds=screen_max_rounds, candidates=candidates, on_round=on_round)
        out = {**measured.to_dict(), "backend": self.backend, "device_kind": self.cluster.device_kind,
               "regrouped": True}
        return confirm_figures(out, rule, per_round, "ray", time.monotonic() - start)

    def _fresh_for_single_start(self, runtimes: list) -> None:
        """Horovod and TensorFlow start once per process (:class:`synctune.engine.horovod.HorovodSession`,
        :mod:`synctune.engine.tensorflow`): before such a run on processes that already ran one,
        restart the workers."""
        if not any(as_runtime(r).once_per_process for r in runtimes):
            return
        if self.actors and self.single_start_used:
            self.shutdown()
        self.single_start_used = True

    def probe(self, name: str, *args, timeout_s: float = 600.0) -> list:
        """Every rank's result of calibration probe ``name`` run on the whole slice (the group
        re-forms over every device first if a replica subset holds it)."""
        import ray

        self.start()
        self._form_group(list(range(len(self.actors))))
        try:
            return ray.get([a.probe.remote(name, args) for a in self.actors], timeout=timeout_s)
        except Exception as exc:
            self.shutdown()
            raise InfraError(f"cluster {self.cluster.name!r}: calibration probe {name!r} failed: "
                             f"{type(exc).__name__}: {str(exc)[:300]}") from None

    def _check_replicas(self, strategy: Strategy) -> list[int]:
        """The actors that run ``strategy``: its replicas' devices, in rank order (every device,
        or a subset: the slice keeps the others reserved and idle)."""
        devices = list(self.cluster.devices)
        unknown = [d for d in strategy.replicas if d not in devices]
        if unknown or len(set(strategy.replicas)) != len(strategy.replicas) or not strategy.replicas:
            raise SpecError(f"strategy replicas {list(strategy.replicas)}: expected distinct devices of cluster "
                            f"{self.cluster.name!r} ({', '.join(devices)})")
        return [devices.index(d) for d in strategy.replicas]

    def _execute(self, payload: dict, timeout_s: float, on_progress) -> tuple[dict | None, str, str]:
        """Run ``payload`` on every rank; rank 0's output, or None with a status and a message."""
        import ray
        from ray.util.queue import Queue

        start = time.monotonic()
        progress = Queue(actor_options={"num_cpus": 0}) if on_progress else None
        refs = [self.actors[i].run.remote(payload, progress) for i in self.members]
        deadline = start + timeout_s
        pending = list(refs)
        try:
            while pending:
                done, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
                if progress is not None:
                    for msg in progress.get_nowait_batch(progress.qsize()):
                        on_progress(msg)
                for ref in done:
                    ray.get(ref)  # raises if that worker failed or died
                if pending and time.monotonic() > deadline:
                    self.shutdown()
                    return None, "timeout", f"no result from {len(pending)} worker(s) after {timeout_s:g} s"
        except Exception as exc:  # noqa: BLE001 - a trial failure is a result, not an error
            status, message = _describe_failure(exc)
            # A peer's death reaches the survivors as transport errors, often first: look for it.
            ray.wait(refs, num_returns=len(refs), timeout=2.0)
            for rank, ref in enumerate(refs):
                try:
                    ray.get(ref, timeout=0.1)
                except ray.exceptions.RayActorError as died:
                    status, message = "failed", f"rank {rank}: {_describe_failure(died)[1]}; {message[:300]}"
                    break
                except Exception:  # noqa: BLE001 - other ranks' own errors or still running
                    continue
            self.shutdown()
            return None, status, message
        finally:
            if progress is not None:
                progress.shutdown()
        return ray.get(refs[0]), "ok", ""

    def shutdown(self) -> None:
        """Kill the actors and release the placement group."""
        import ray

        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:  # noqa: BLE001 - already dead
                pass
        self.actors = []
        self.pids = []
        self.placement = []
        self.members = []
        self.single_start_used = False
        if self.pg is not None:
            try:
                ray.util.remove_placement_group(self.pg)
            except Exception:  # noqa: BLE001
                pass
            self.pg = None


class ConfirmFailed(InfraError):
    """An interleaved re-measurement did not finish (a worker died, hung or raised)."""


class SlicePending(InfraError):
    """No slice matching the cluster spec could be reserved in time (nodes missing, or the
    autoscaler could not add them)."""


def _resource_summary(resources: dict[str, float]) -> str:
    keep = {k: v for k, v in resources.items() if not k.startswith("node:") and k not in (
        "memory", "object_store_memory")}
    return ", ".join(f"{k}={v:g}" for k, v in sorted(keep.items())) or "none"


def _describe_failure(exc: BaseException) -> tuple[str, str]:
    from ray.exceptions import RayActorError, RayTaskError

    from ..engine.local import classify_error

    if isinstance(exc, RayActorError):
        return "failed", f"a worker died: {str(exc).splitlines()[0][:500]}"
    if isinstance(exc, RayTaskError):
        cause = exc.cause if getattr(exc, "cause", None) is not None else exc
        return classify_error(cause), f"{type(cause).__name__}: {str(cause).splitlines()[0][:500]}"
    return classify_error(exc), f"{type(exc).__name__}: {exc}"
