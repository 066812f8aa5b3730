"""The ``horovod`` runtime: real Horovod (``hvd.DistributedOptimizer``), as its users run it.

The papers' systems are measured against Horovod (AutoDist §3.3, AutoSync §3.1), and our
``horovod`` *builder* only imitates its tensor fusion on our engine. This runtime runs the real
thing on the trial's own worker processes, so a Horovod trial and an engine trial differ only in
how gradients travel: Horovod's background thread negotiates which gradients are ready every
``cycle_time_ms``, fuses them into buffers of up to ``fusion_threshold_mb`` and all-reduces each
buffer with gloo (this CPU build has no MPI or NCCL).

Horovod starts from the process group a trial already has: rank 0 serves Horovod's rendezvous
(its HTTP key-value store, as ``horovodrun`` does), the port travels over the trial's gloo group,
and every rank then calls ``hvd.init()`` with the rank, host and interface of its own worker, so
lab workers talk over their node's shaped link like every other trial. Install Horovod with
``scripts/install-horovod.sh`` (the published 0.28.1 needs a C++17 fix to build against torch).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..spec.checks import is_number
from ..spec.errors import SpecError
from .runtime import ArmContext, ConfiguredRuntime, Stepper, framework_of

__all__ = ["HorovodConfig", "HOROVOD_DEFAULT", "COMPRESSIONS", "HorovodRuntime", "horovod_runtime",
           "horovod_available", "HorovodSession"]

#: Gradient compressions of ``hvd.DistributedOptimizer`` (``hvd.Compression``).
COMPRESSIONS = ("none", "fp16")

INSTALL_HINT = "install it with scripts/install-horovod.sh (builds Horovod 0.28.1 for torch from PyPI's source)"


@dataclass(frozen=True)
class HorovodConfig:
    """What configures a Horovod run. ``fusion_threshold_mb`` and ``cycle_time_ms`` are Horovod's
    ``HOROVOD_FUSION_THRESHOLD`` and ``HOROVOD_CYCLE_TIME`` (its defaults: 128 MiB, 1 ms);
    ``autotune`` is ``HOROVOD_AUTOTUNE`` (Horovod's Bayesian tuning of those two while it runs,
    which the warm-up iterations then include); ``hierarchical_allreduce`` is
    ``HOROVOD_HIERARCHICAL_ALLREDUCE``; ``sparse_as_dense`` all-reduces sparse gradients densely
    instead of all-gathering their rows."""

    fusion_threshold_mb: float = 128.0
    cycle_time_ms: float = 1.0
    compression: str = "none"
    hierarchical_allreduce: bool = False
    autotune: bool = False
    sparse_as_dense: bool = False

    def __post_init__(self) -> None:
        if not (is_number(self.fusion_threshold_mb) and 0 <= self.fusion_threshold_mb <= 65536):
            raise SpecError(f"horovod config: fusion_threshold_mb: expected a number of MiB from 0 (no fusion) to "
                            f"65536, got {self.fusion_threshold_mb!r}")
        if not (is_number(self.cycle_time_ms) and 0 < self.cycle_time_ms <= 10_000):
            raise SpecError(f"horovod config: cycle_time_ms: expected a positive number of milliseconds up to "
                            f"10000, got {self.cycle_time_ms!r}")
        if self.compression not in COMPRESSIONS:
            raise SpecError(f"horovod config: compression: expected one of {', '.join(COMPRESSIONS)}, "
                            f"got {self.compression!r}")
        for key in ("hierarchical_allreduce", "autotune", "sparse_as_dense"):
            if not isinstance(getattr(self, key), bool):
                raise SpecError(f"horovod config: {key}: expected true or false, got {getattr(self, key)!r}")

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain data (what a dataset row and a runtime record hold)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HorovodConfig":
        """The configuration of :meth:`to_dict`'s form, validated; an unknown key is an error that
        lists the valid ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"horovod config: unknown key(s) {unknown}; valid: {', '.join(sorted(known))}")
        return cls(**data)

    @classmethod
    def from_options(cls, options: dict[str, str]) -> "HorovodConfig":
        """The defaults with ``KEY=VALUE`` texts (``--horovod``, an experiment's ``hvd:...``
        entry) typed as the fields are; errors start with the key."""
        values = HOROVOD_DEFAULT.to_dict()
        for key, text in options.items():
            if key not in values:
                raise SpecError(f"unknown key {key!r}; valid: {', '.join(values)}")
            if isinstance(values[key], bool):
                if text.lower() not in ("true", "false"):
                    raise SpecError(f"{key}: expected true or false, got {text!r}")
                values[key] = text.lower() == "true"
            elif isinstance(values[key], float):
                try:
                    values[key] = float(text)
                except ValueError:
                    raise SpecError(f"{key}: expected a number, got {text!r}") from None
            else:
                values[key] = text
        return cls.from_dict(values)

    def env(self) -> dict[str, str]:
        """The environment Horovod reads at ``hvd.init()``."""
        env = {"HOROVOD_FUSION_THRESHOLD": str(int(self.fusion_threshold_mb * 2**20)),
               "HOROVOD_CYCLE_TIME": f"{self.cycle_time_ms:g}",
               "HOROVOD_HIERARCHICAL_ALLREDUCE": "1" if self.hierarchical_allreduce else "0",
               "HOROVOD_AUTOTUNE": "1" if self.autotune else "0"}
        return env

    def summary(self) -> str:
        """A short human-readable form, e.g. ``horovod fusion 64 MiB, cycle 1 ms, fp16``."""
        parts = [f"horovod fusion {self.fusion_threshold_mb:.3g} MiB", f"cycle {self.cycle_time_ms:g} ms"]
        if self.compression != "none":
            parts.append(self.compression)
        if self.hierarchical_allreduce:
            parts.append("hierarchical")
        if self.autotune:
            parts.append("autotune")
        if self.sparse_as_dense:
            parts.append("sparse as dense")
        return ", ".join(parts)


#: Horovod as users get it without tuning.
HOROVOD_DEFAULT = HorovodConfig()


def horovod_runtime(config: HorovodConfig) -> "HorovodRuntime":
    """The runtime that runs real Horovod as ``config`` says."""
    return HorovodRuntime(config)


def _binding(name: str):
    """Horovod's ``torch`` or ``tensorflow`` binding (TensorFlow imported quietly first)."""
    if name == "tensorflow":
        from .. import import_tensorflow

        import_tensorflow()
        import horovod.tensorflow as hvd
    else:
        import horovod.torch as hvd
    return hvd


def horovod_available(binding: str = "torch") -> str | None:
    """None when Horovod's ``torch`` (or ``tensorflow``) binding with gloo is importable here,
    else why not."""
    try:
        import horovod  # noqa: F401
    except ImportError as exc:
        return f"horovod is not installed ({exc}); {INSTALL_HINT}"
    try:
        hvd = _binding(binding)
    except ImportError as exc:
        if binding == "tensorflow":
            return (f"horovod has no TensorFlow binding ({exc}); install TensorFlow, then run "
                    f"scripts/install-horovod.sh again (it builds the binding when TensorFlow is installed)")
        return f"horovod is not installed ({exc}); {INSTALL_HINT}"
    except Exception as exc:  # noqa: BLE001 - a broken build fails with anything
        return f"horovod does not load ({type(exc).__name__}: {exc}); rebuild it with scripts/install-horovod.sh"
    if not hvd.gloo_built():
        return "horovod was built without gloo, which synctune's horovod runtime needs; rebuild it with " \
               "scripts/install-horovod.sh"
    return None


@dataclass(frozen=True)
class HorovodRuntime(ConfiguredRuntime):
    """Real Horovod as :attr:`config` says (``hvd.DistributedOptimizer`` for PyTorch workloads,
    ``hvd.DistributedGradientTape`` for Keras ones); the strategy gives only replicas and batch
    split. Horovod starts once per process (:class:`HorovodSession`)."""

    config: HorovodConfig = HOROVOD_DEFAULT
    name = "horovod"
    config_type = HorovodConfig
    frameworks = ("torch", "tensorflow")
    once_per_process = True
    label = "Horovod"
    trials_noun = "real Horovod baseline(s)"

    def check(self, strategy: Any, spec: Any, cluster: Any, workload: Any = None) -> None:
        """Refuse, before any worker starts, a Horovod trial Horovod would run differently from
        what it claims. A Keras ``workload`` runs on Horovod's TensorFlow binding."""
        config = self.config
        if len(set(strategy.batch_split)) > 1:
            raise SpecError(f"horovod runtime: the batch split is uneven ({list(strategy.batch_split)}); Horovod "
                            f"averages replicas equally: use an even split")
        binding = framework_of(workload)
        why = horovod_available(binding)
        if why is not None:
            raise SpecError(f"horovod runtime: {why}")
        hvd = _binding(binding)
        if config.hierarchical_allreduce and not hvd.nccl_built():
            # Horovod itself silently ignores the flag without NCCL (operations.cc): refuse instead.
            raise SpecError("horovod config: hierarchical_allreduce: Horovod runs hierarchical all-reduce only with "
                            "NCCL, and this build has none (it would silently run flat); set it false")
        gpu = [d for d in strategy.replicas if cluster.node_of(d).device_kind == "gpu"]
        if gpu and not hvd.cuda_built():
            raise SpecError(f"horovod runtime: replica {gpu[0]!r} is a GPU and this Horovod build has no CUDA "
                            f"support; rebuild Horovod with HOROVOD_GPU_OPERATIONS=NCCL on a CUDA machine")
        sparse = [v.name for v in spec.variables if v.sparse]
        if sparse and config.compression != "none" and not config.sparse_as_dense:
            raise SpecError(f"horovod config: compression: {config.compression} applies to dense gradients, and "
                            f"variable {sparse[0]!r} is sparse; set sparse_as_dense true or compression none")

    def session(self, rank: int, strategy: Any, cluster: Any, timeout_s: float, binding: str = "torch"):
        """Horovod started on this rank of the trial's group (a collective)."""
        hosts = [cluster.node_of(d).name for d in strategy.replicas]
        return HorovodSession(self.config, rank, hosts, os.environ.get("SYNCTUNE_MASTER_ADDR", "127.0.0.1"),
                              timeout_s=timeout_s, binding=binding)

    def prepare(self, ctx: ArmContext) -> Stepper:
        session = self.session(ctx.rank, ctx.strategy, ctx.cluster, ctx.collective_timeout_s)
        optimizer = session.optimizer(ctx.make_optimizer(list(ctx.model.parameters())), ctx.model, self.config)

        def step() -> None:
            optimizer.step()
            optimizer.zero_grad()  # Horovod's wrapper takes no arguments (torch's default: set to None)

        return Stepper(forward_model=ctx.model, step=step, close=session.close)

    def run_keras(self, rank: int, world: int, payload: dict) -> dict:
        from .tensorflow import keras_trial_worker

        return keras_trial_worker(rank, world, payload, _HorovodKeras(self))

    def describe(self, strategy: Any) -> str:
        return f"Horovod: {self.summary()} (replicas and batch split of {strategy.summary()})"

    @classmethod
    def from_options(cls, options: dict[str, str], strategy: Any = None, spec: Any = None) -> "HorovodRuntime":
        """``--horovod KEY=VALUE`` settings (:meth:`HorovodConfig.from_options`)."""
        try:
            return cls(HorovodConfig.from_options(options))
        except SpecError as exc:
            raise SpecError(f"--horovod: {exc}") from None


class _HorovodKeras:
    """A Keras workload's step under Horovod's TensorFlow binding (``hvd.DistributedGradientTape``,
    averaging; the split is even: checked before launch), for
    :func:`synctune.engine.tensorflow.keras_trial_worker`."""

    def __init__(self, runtime: HorovodRuntime) -> None:
        self.runtime = runtime
        self.session: HorovodSession | None = None

    def open(self, rank: int, world: int, payload: dict, config: Any):
        """Start Horovod; returns (tensorflow, a context to build the model in, the backend's name)."""
        import contextlib

        from ..spec.cluster import ClusterSpec
        from ..strategy.schema import Strategy
        from .. import import_tensorflow

        self.session = self.runtime.session(rank, Strategy.from_dict(payload["strategy"]),
                                            ClusterSpec.from_dict(payload["cluster"]), config.collective_timeout_s,
                                            binding="tensorflow")
        tf = import_tensorflow()
        return tf, contextlib.nullcontext(), f"horovod tensorflow (gloo), tensorflow {tf.__version__}"

    def make_step(self, tf, workload, model, optimizer, variables, share: float):
        hvd = self.session.hvd
        settings = self.runtime.config
        compression = hvd.Compression.fp16 if settings.compression == "fp16" else hvd.Compression.none

        @tf.function
        def step(x, y):
            with tf.GradientTape() as tape:
                loss = workload.loss(model, (x, y))
            # Horovod averages over ranks. Its tape keys gradients by tf.Variable; Keras 3
            # variables hold theirs in .value.
            tape = hvd.DistributedGradientTape(tape, compression=compression,
                                               sparse_as_dense=settings.sparse_as_dense, op=hvd.Average)
            grads = tape.gradient(loss, [v.value for v in variables])
            optimizer.apply_gradients(zip(grads, variables))
            return loss

        return step

    def close(self) -> None:
        if self.session is not None:
            self.session.close()


def _slot_plan(hosts: list[str]):
    """Horovod's per-rank slots (rank, local and cross ranks and sizes) for ranks on ``hosts``."""
    from horovod.runner.common.util.hosts import SlotInfo

    order = list(dict.fromkeys(hosts))
    local = {h: [r for r, x in enumerate(hosts) if x == h] for h in order}
    slots = []
    for rank, host in enumerate(hosts):
        local_rank = local[host].index(rank)
        peers = [h for h in order if len(local[h]) > local_rank]  # hosts with a rank at this local index
        slots.append(SlotInfo(hostname=host, rank=rank, local_rank=local_rank, cross_rank=peers.index(host),
                              size=len(hosts), local_size=len(local[host]), cross_size=len(peers)))
    return slots


#: Whether this process has started Horovod before (see :class:`HorovodSession`).
_STARTED_HERE = False


class HorovodSession:
    """Horovod initialised on the ranks of the current torch.distributed group, for one trial.

    Every rank constructs it (a collective); ``close()`` shuts Horovod down, so its background
    thread does not disturb later trials on the same warm process. Horovod 0.28.1 cannot start
    twice in one process: once its settings are fixed from the environment, a second
    ``hvd.init()`` writes past a vector in ``ParameterManager::BayesianParameter::SetValue`` and
    the process dies (a SIGSEGV on a warm Ray worker's second Horovod trial). A process
    runs Horovod once; worker groups restart their processes before another Horovod trial."""

    def __init__(self, config: HorovodConfig, rank: int, hosts: list[str], master: str,
                 timeout_s: float = 120.0, binding: str = "torch") -> None:
        import torch.distributed as dist

        from .local import peer_interface

        hvd = _binding(binding)
        global _STARTED_HERE
        if _STARTED_HERE:
            raise RuntimeError("horovod runtime: this process already ran Horovod, which cannot start twice in one "
                               "process (Horovod 0.28.1 crashes); run the trial on fresh worker processes")
        _STARTED_HERE = True
        self.hvd = hvd
        server, box = None, [None]
        if rank == 0:
            from horovod.runner.http.http_server import RendezvousServer

            server = RendezvousServer()
            box[0] = server.start()
            server.init(_slot_plan(hosts))
        try:
            dist.broadcast_object_list(box, src=0)
            slot = _slot_plan(hosts)[rank]
            os.environ.update(config.env())
            os.environ.update({
                "HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo",
                "HOROVOD_GLOO_RENDEZVOUS_ADDR": master, "HOROVOD_GLOO_RENDEZVOUS_PORT": str(box[0]),
                "HOROVOD_GLOO_IFACE": peer_interface()[0], "HOROVOD_GLOO_TIMEOUT_SECONDS": str(int(timeout_s)),
                "HOROVOD_HOSTNAME": slot.hostname, "HOROVOD_RANK": str(slot.rank), "HOROVOD_SIZE": str(slot.size),
                "HOROVOD_LOCAL_RANK": str(slot.local_rank), "HOROVOD_LOCAL_SIZE": str(slot.local_size),
                "HOROVOD_CROSS_RANK": str(slot.cross_rank), "HOROVOD_CROSS_SIZE": str(slot.cross_size)})
            hvd.init()
            if hvd.size() != len(hosts) or hvd.rank() != rank:
                raise RuntimeError(f"horovod runtime: Horovod started as rank {hvd.rank()} of {hvd.size()}, "
                                   f"expected rank {rank} of {len(hosts)}")
            dist.barrier()  # every rank has joined: the rendezvous store has done its work
        finally:
            if server is not None:
                server.stop()

    def optimizer(self, optimizer, model, config: HorovodConfig):
        """``optimizer`` wrapped in ``hvd.DistributedOptimizer`` as ``config`` says."""
        hvd = self.hvd
        compression = hvd.Compression.fp16 if config.compression == "fp16" else hvd.Compression.none
        return hvd.DistributedOptimizer(optimizer, named_parameters=list(model.named_parameters()),
                                        compression=compression, sparse_as_dense=config.sparse_as_dense,
                                        op=hvd.Average)

    def close(self) -> None:
        """Shut Horovod down on this rank, so its background thread leaves later trials alone."""
        self.hvd.shutdown()
