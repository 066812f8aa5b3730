"""The ``tensorflow`` runtime: a Keras workload trained by TensorFlow's own collectives.

AutoDist and AutoSync are TensorFlow systems; their all-reduce strategies are what TensorFlow's
``MultiWorkerMirroredStrategy`` (MWMS) executes natively. This runtime runs a strategy there
when TensorFlow can execute it exactly, and refuses it otherwise, naming the variable and field:

- every variable whole (no partition), no compressor, no parameter server;
- dense variables on ``allreduce`` (flat: TensorFlow's ring) and their merge groups runs of
  consecutive variables in gradient order. MWMS packs dense gradients in that order (it reverses
  ``model.trainable_variables``, the order of the spec) and starts a new pack once the current
  one holds more than ``bytes_per_pack`` (``cross_device_utils.group_by_size``), so a strategy's
  groups become one ``CommunicationOptions(bytes_per_pack=...)`` when such a threshold exists;
- sparse variables (``IndexedSlices``) on ``allgather``, which is what MWMS does with them.

What MWMS makes of each synchronizer kind is its entry in :data:`TENSORFLOW_KINDS` (this module
fills it for the two kinds MWMS runs), so the checks below never ask which kind a plan is.

Replicas weigh their loss by their share of the global batch before Keras's optimizer sums the
gradients across workers, so uneven batch splits train like one process on the whole batch, as
in the engine. The runtime works on the trial's own processes: each rank opens a gRPC port on its
own address (a lab worker's is its node's shaped link), the addresses travel over the trial's
gloo group into ``TF_CONFIG``, and timing uses the same barrier and slowest-rank rule as every
trial. TensorFlow configures its collectives once per process, so, as with Horovod, a process
runs one TensorFlow trial (worker groups restart their processes before another).

The same worker (:func:`keras_trial_worker`) runs a Keras workload under real Horovod (runtime ``horovod``, its TensorFlow
binding: ``hvd.DistributedGradientTape``), the Horovod baseline of a Keras model.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Callable

from .. import import_tensorflow
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..spec.registry import Registry
from ..strategy.schema import AllGatherSynchronizer, AllReduceSynchronizer, ShardPlan, Strategy, VariablePlan
from .runtime import Runtime, framework_of

__all__ = ["TensorFlowRuntime", "tensorflow_runtime", "bytes_per_pack_of", "TensorFlowKind", "TENSORFLOW_KINDS",
           "register_tensorflow_kind", "keras_trial_worker", "project_to_tensorflow", "tensorflow_packs"]

FIX = ("use the allreduce builder (one pack) or a strategy whose merge groups TensorFlow's packing forms "
       "(synctune.engine.tensorflow.project_to_tensorflow)")


@dataclass(frozen=True)
class TensorFlowKind:
    """What TensorFlow's MultiWorkerMirroredStrategy makes of one synchronizer kind.

    ``sparse``: the kind synchronizes sparse (``IndexedSlices``) gradients, which MWMS all-gathers;
    otherwise dense ones, which MWMS packs into all-reduces, a pack being one of the kind's units
    (:attr:`~synctune.strategy.kinds.Synchronizer.merge_id`: an all-reduce's merge group).
    ``refuse(sync)``: what of ``sync``'s options MWMS does not run, as ``field: message`` (the
    error names the variable before it), else None."""

    sparse: bool
    refuse: Callable[[Any], str | None] = lambda sync: None


#: Synchronizer kind name -> what MWMS makes of it; a kind not registered here is refused by the
#: ``tensorflow`` runtime (TensorFlow's ParameterServerStrategy is not run).
TENSORFLOW_KINDS: Registry[TensorFlowKind] = Registry("tensorflow synchronizer kind")


def register_tensorflow_kind(name: str, kind: TensorFlowKind) -> TensorFlowKind:
    """Let the ``tensorflow`` runtime run synchronizer kind ``name`` (a second registration is an error)."""
    return TENSORFLOW_KINDS.register(name, kind)


def _flat_ring_only(sync: AllReduceSynchronizer) -> str | None:
    """MWMS's collectives run one flat ring: a hierarchical all-reduce is not what it runs."""
    if sync.algorithm != "flat":
        return f"allreduce: algorithm: TensorFlow's collectives run a flat ring, got {sync.algorithm}; use flat"
    return None


register_tensorflow_kind("allreduce", TensorFlowKind(sparse=False, refuse=_flat_ring_only))
register_tensorflow_kind("allgather", TensorFlowKind(sparse=True))


def _tensorflow_kind(sync: Any) -> TensorFlowKind | None:
    """What MWMS makes of ``sync``'s kind (None: MWMS does not run it)."""
    return TENSORFLOW_KINDS.get(sync.kind) if sync.kind in TENSORFLOW_KINDS else None


def bytes_per_pack_of(strategy: Strategy, spec: ModelSpec) -> int:
    """The ``bytes_per_pack`` with which TensorFlow's MWMS executes ``strategy`` exactly, or a
    :class:`SpecError` naming the variable and field TensorFlow cannot execute."""
    groups: list[tuple[int, list[int]]] = []  # (group id, sizes of its members in spec order)
    seen: set[int] = set()
    for plan in strategy.plans:
        var = spec[plan.variable]
        where = f"tensorflow runtime: variable {plan.variable!r}"
        if len(plan.shards) != 1:
            raise SpecError(f"{where}: partition: TensorFlow's MultiWorkerMirroredStrategy mirrors whole variables, "
                            f"and this plan has {len(plan.shards)} shards; {FIX}")
        shard = plan.shards[0]
        if shard.compressor.kind != "none":
            raise SpecError(f"{where}: compressor: TensorFlow's collectives send gradients uncompressed, got "
                            f"{shard.compressor.kind}; use compressor none")
        sync = shard.synchronizer
        tf = _tensorflow_kind(sync)
        if var.sparse:
            if tf is None or not tf.sparse:
                gathers = " or ".join(k for k in TENSORFLOW_KINDS if TENSORFLOW_KINDS.get(k).sparse)
                raise SpecError(f"{where}: synchronizer: TensorFlow all-gathers a sparse (IndexedSlices) gradient, got "
                                f"{sync.kind}; use {gathers} for it")
            continue
        if tf is None or tf.sparse:
            raise SpecError(f"{where}: synchronizer: this runtime runs all-reduce only (TensorFlow's "
                            f"ParameterServerStrategy is not run here), got {sync.kind}; {FIX}")
        refused = tf.refuse(sync)
        if refused:
            raise SpecError(f"{where}: {refused}")
        pack = sync.merge_id
        if groups and groups[-1][0] == pack:
            groups[-1][1].append(var.num_bytes)
        elif pack in seen:
            raise SpecError(f"{where}: {sync.kind}: {sync.merge_field}: TensorFlow packs consecutive gradients, and "
                            f"group {pack} is split by another group; {FIX}")
        else:
            groups.append((pack, [var.num_bytes]))
            seen.add(pack)
    if len(groups) <= 1:
        return 0  # one pack of every dense gradient
    # group_by_size closes a pack after the gradient that takes it past the threshold t: every
    # group but the last must exceed t, and no group may exceed t before its last member.
    low = max(sum(sizes[:-1]) for _g, sizes in groups)
    high = min(sum(sizes) for _g, sizes in groups[:-1])
    if low >= high:
        raise SpecError(f"tensorflow runtime: allreduce: group: TensorFlow packs gradients by size (a new pack once "
                        f"one exceeds bytes_per_pack), and no size gives this strategy's {len(groups)} merge groups "
                        f"(they would need a threshold of at least {low} and below {high} bytes); {FIX}")
    return max(low, 1)


def tensorflow_packs(sizes: list[int], bytes_per_pack: int) -> list[int]:
    """The pack of each dense gradient (sizes in bytes, gradient order) as MWMS forms them:
    a new pack starts once the current one holds more than ``bytes_per_pack`` (0: one pack)."""
    packs, current, pack = [], 0, -1
    for size in sizes:
        if pack < 0 or (bytes_per_pack and current > bytes_per_pack):
            pack, current = pack + 1, 0
        packs.append(pack)
        current += size
    return packs


def project_to_tensorflow(strategy: Strategy, spec: ModelSpec, bytes_per_pack: int | None = None) -> Strategy:
    """The strategy TensorFlow executes that is nearest to ``strategy``: the same replicas and
    batch split; dense variables whole on a flat all-reduce, packed as MWMS packs them with
    ``bytes_per_pack`` (default: the mean size of ``strategy``'s dense merge groups, so a
    search's proposals keep their fusion granularity); sparse variables whole on all-gather; no
    compression. A search over a Keras model proposes in this space."""
    dense = [v for v in spec.variables if not v.sparse]
    if bytes_per_pack is None:
        sizes: dict[tuple, int] = {}
        for plan in strategy.plans:
            var = spec[plan.variable]
            if var.sparse:
                continue
            for i, shard in enumerate(plan.shards):
                sync, tf = shard.synchronizer, _tensorflow_kind(shard.synchronizer)
                # A dense gradient MWMS runs joins its unit's pack; any other is a pack of its own.
                key = ("pack", sync.merge_id) if tf is not None and not tf.sparse else ("own", plan.variable, i)
                sizes[key] = sizes.get(key, 0) + var.num_bytes // len(plan.shards)
        bytes_per_pack = 0 if len(sizes) <= 1 else int(sum(sizes.values()) / len(sizes))
    groups = dict(zip((v.name for v in dense), tensorflow_packs([v.num_bytes for v in dense], bytes_per_pack)))
    plans = []
    for var in spec.variables:
        sync = AllGatherSynchronizer() if var.sparse else AllReduceSynchronizer(group=groups[var.name])
        plans.append(VariablePlan(variable=var.name, partition=(1,) * len(var.shape),
                                  shards=(ShardPlan(synchronizer=sync),)))
    return Strategy(model=strategy.model, cluster=strategy.cluster, replicas=strategy.replicas,
                    batch_split=strategy.batch_split, plans=tuple(plans))


@dataclass(frozen=True)
class TensorFlowRuntime(Runtime):
    """TensorFlow's MultiWorkerMirroredStrategy with ``bytes_per_pack`` (the packing that forms the
    strategy's merge groups: :func:`bytes_per_pack_of`) and the ring implementation, for Keras
    workloads. TensorFlow configures its collectives once per process, so it runs whole trials,
    never one arm of an interleaved confirmation."""

    bytes_per_pack: int = 0
    implementation: str = "ring"
    name = "tensorflow"
    label = "TensorFlow"
    frameworks = ("tensorflow",)
    once_per_process = True
    interleavable = False
    runs_strategy = True

    def check(self, strategy: Strategy, spec: ModelSpec, cluster: Any, workload: Any = None) -> None:
        """Refuse, before any worker starts, a TensorFlow trial that would not run what it claims."""
        if framework_of(workload) not in self.frameworks:
            raise SpecError(f"tensorflow runtime: workload {getattr(workload, 'name', workload)!r} is a PyTorch "
                            f"model; the tensorflow runtime trains Keras workloads (keras-cnn-small, "
                            f"keras-ncf-small, or a KerasWorkload)")
        expected = bytes_per_pack_of(strategy, spec)
        if self.bytes_per_pack != expected:
            raise SpecError(f"tensorflow runtime: bytes_per_pack {self.bytes_per_pack} does not give this "
                            f"strategy's merge groups ({expected} does)")
        gpu = [d for d in strategy.replicas if cluster.node_of(d).device_kind == "gpu"]
        if gpu:
            raise SpecError(f"tensorflow runtime: replica {gpu[0]!r} is a GPU, and the TensorFlow extra installed "
                            f"here is the CPU build (tensorflow-cpu); run GPU trials with the engine, ddp or horovod "
                            f"runtime")
        try:
            import_tensorflow()
        except ImportError as exc:
            raise SpecError(f"tensorflow runtime: TensorFlow is not installed ({exc}); install it with: python3 -m "
                            f"pip install -c constraints.txt -e \".[tensorflow]\"") from None

    def run_keras(self, rank: int, world: int, payload: dict) -> dict:
        return keras_trial_worker(rank, world, payload, _Mirrored(self))

    def config_dict(self) -> dict[str, Any]:
        return {"bytes_per_pack": self.bytes_per_pack, "implementation": self.implementation}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "TensorFlowRuntime":
        if not isinstance(config, dict) or set(config) != {"bytes_per_pack", "implementation"}:
            raise SpecError(f"trial runtime: expected {{'kind': 'tensorflow', 'tensorflow': {{'bytes_per_pack', "
                            f"'implementation'}}}}, got {config!r:.80}")
        if config["implementation"] != "ring" or not isinstance(config["bytes_per_pack"], int) \
                or isinstance(config["bytes_per_pack"], bool) or config["bytes_per_pack"] < 0:
            raise SpecError(f"tensorflow config: expected a non-negative integer bytes_per_pack and implementation "
                            f"ring, got {config!r:.80}")
        return cls(bytes_per_pack=config["bytes_per_pack"], implementation=config["implementation"])

    def summary(self) -> str:
        pack = self.bytes_per_pack
        return f"tensorflow MWMS ring, {'one pack' if not pack else f'packs of {pack / 2**20:.3g} MiB'}"

    def training_note(self, strategy: Strategy, spec: ModelSpec) -> str:
        """The Keras model's own way: MultiWorkerMirroredStrategy with the strategy's packing."""
        return (f"train it with tf.distribute.MultiWorkerMirroredStrategy(communication_options=tf.distribute."
                f"experimental.CommunicationOptions(bytes_per_pack={bytes_per_pack_of(strategy, spec)}, "
                f"implementation=RING)); no training file is written")

    def describe(self, strategy: Strategy) -> str:
        pack = self.bytes_per_pack
        return (f"TensorFlow MultiWorkerMirroredStrategy, ring, bytes_per_pack {pack} "
                f"({'one pack' if pack == 0 else 'packs as the merge groups'}): {strategy.summary()}")

    @classmethod
    def from_options(cls, options: dict[str, str], strategy: Strategy, spec: ModelSpec) -> "TensorFlowRuntime":
        """The runtime that executes ``strategy`` (its packing is the strategy's merge groups)."""
        if options:
            raise SpecError(f"tensorflow runtime: its settings come from the strategy, got {', '.join(options)}")
        return tensorflow_runtime(strategy, spec)


def tensorflow_runtime(strategy: Strategy, spec: ModelSpec) -> TensorFlowRuntime:
    """The runtime that runs ``strategy`` with TensorFlow (refuses what TensorFlow cannot execute
    exactly, naming the variable and field)."""
    return TensorFlowRuntime(bytes_per_pack=bytes_per_pack_of(strategy, spec))


_STARTED_HERE = False


class _Mirrored:
    """A Keras workload's step under TensorFlow's MultiWorkerMirroredStrategy, for
    :func:`keras_trial_worker`. Each rank opens a gRPC port on its own address (a lab worker's is
    its node's shaped link); the addresses travel over the trial's gloo group into ``TF_CONFIG``."""

    def __init__(self, runtime: TensorFlowRuntime) -> None:
        self.runtime = runtime
        self.mwms = None

    def open(self, rank: int, world: int, payload: dict, config: Any):
        """Start TensorFlow's collectives; returns (tensorflow, the strategy's scope, the backend's name)."""
        import socket

        import torch
        import torch.distributed as dist

        from .local import peer_interface

        global _STARTED_HERE
        if _STARTED_HERE:
            raise RuntimeError("tensorflow runtime: this process already ran a TensorFlow trial, and TensorFlow "
                               "configures its collectives once per process; run the trial on fresh worker "
                               "processes")
        _STARTED_HERE = True
        host = peer_interface()[1]
        with socket.socket() as s:  # a free port on this worker's own address, for TensorFlow's gRPC server
            s.bind((host, 0))
            port = s.getsockname()[1]
        addresses: list[Any] = [None] * world
        dist.all_gather_object(addresses, f"{host}:{port}")
        os.environ["TF_CONFIG"] = json.dumps({"cluster": {"worker": addresses},
                                              "task": {"type": "worker", "index": rank}})
        tf = import_tensorflow()
        threads = torch.get_num_threads()
        tf.config.threading.set_intra_op_parallelism_threads(threads)
        tf.config.threading.set_inter_op_parallelism_threads(threads)
        comm = tf.distribute.experimental.CommunicationOptions(
            bytes_per_pack=int(self.runtime.bytes_per_pack), timeout_seconds=float(config.collective_timeout_s),
            implementation=tf.distribute.experimental.CommunicationImplementation.RING)
        self.mwms = tf.distribute.MultiWorkerMirroredStrategy(communication_options=comm)
        return tf, self.mwms.scope(), f"tensorflow {tf.__version__} ring (grpc)"

    def make_step(self, tf, workload, model, optimizer, variables, share: float):
        mwms = self.mwms

        @tf.function
        def step(x, y):
            def replica_step(x, y):
                with tf.GradientTape() as tape:
                    loss = workload.loss(model, (x, y))
                    # Keras's optimizer sums gradients over workers: weighted by batch share,
                    # that sum is the gradient of the global batch's mean loss.
                    weighted = loss * share
                grads = tape.gradient(weighted, variables)
                optimizer.apply_gradients(zip(grads, variables))
                return loss

            return mwms.run(replica_step, args=(x, y))

        return step

    def close(self) -> None:
        pass


def keras_trial_worker(rank: int, world: int, payload: dict, session: Any) -> dict:
    """One rank of a trial of a Keras workload (inside a process of the trial's torch.distributed
    group), its step made by ``session`` (TensorFlow's MultiWorkerMirroredStrategy, or Horovod's
    TensorFlow binding: :class:`synctune.engine.horovod.HorovodRuntime`); timed like every trial
    (:func:`synctune.engine.measure.timed_iterations`)."""
    import numpy as np
    import torch

    from .measure import PeakMemory, TrialConfig, timed_iterations

    t_start = time.perf_counter()
    config = TrialConfig(**payload["config"])
    strategy = Strategy.from_dict(payload["strategy"])
    workload = payload["workload"]
    memory = PeakMemory(torch.device("cpu"))
    memory.reset()
    tf, scope, backend = session.open(rank, world, payload, config)
    import keras

    keras.utils.set_random_seed(config.seed)
    with scope:
        model = workload.build_model()
        optimizer = workload.make_optimizer(name=config.optimizer, lr=config.lr)
    share = strategy.batch_split[rank] / strategy.global_batch_size
    x, y = workload.make_batch(strategy.batch_split[rank], rank=rank, seed=config.seed)
    step = session.make_step(tf, workload, model, optimizer, model.trainable_variables, share)
    # Reading the loss waits for the step and its collectives: the iteration is done on return.
    timed = timed_iterations(rank, world, config, torch.device("cpu"), memory,
                             lambda: float(np.asarray(step(x, y))), t_start=t_start, close=session.close)
    return {**timed, "backend": backend, "device_kind": "cpu"}
