"""The interface every runtime implements: what executes a trial (DESIGN.md "runtime").

A runtime is our engine running a composed strategy (``engine``), or a system users run
today as a baseline (``ddp``, ``horovod``, ``tensorflow``). In the spirit of torch's DDP comm
hooks (``torch.distributed.algorithms.ddp_comm_hooks``: one hook signature, state objects,
every hook interchangeable), each runtime is one small frozen value with the same methods:

- :meth:`Runtime.check`, before any worker starts: refuse, with a message naming the field,
  what the runtime would run differently from what the trial claims;
- :meth:`Runtime.prepare`, on each worker of a PyTorch workload: wrap the rank's model and
  optimizer and return a :class:`Stepper` that steps after each backward;
- :meth:`Runtime.run_keras`, on each worker of a Keras workload, for the runtimes that train
  one (:attr:`Runtime.frameworks`);
- :attr:`Runtime.once_per_process`: the runtime configures its collectives once per process
  (Horovod, TensorFlow), so worker groups restart their processes before another such trial;
- :meth:`Runtime.to_dict` / :func:`synctune.engine.runtimes.as_runtime`: the plain-data form
  that crosses Ray and pickling and is recorded (``runtime`` and ``runtime_json`` columns).

Implementations live one per module and are registered in :mod:`synctune.engine.runtimes`;
this module imports none of them.
"""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

from ..spec.errors import SpecError
from .tuning import NothingToTune, Tuning, TuningSpace

__all__ = ["Runtime", "ConfiguredRuntime", "PlansRuntime", "ArmContext", "Stepper", "per_world", "framework_of"]

#: Per world (the default process group, held weakly), what runtimes build once and share across
#: the trials of a worker: process groups, device meshes. A worker runs many trials; groups made
#: per trial and never destroyed would pile up (threads, connections) and change how fast later
#: trials run the same strategy. Shared, every trial of a worker sees the same groups, as one
#: training job does.
_PER_WORLD: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def framework_of(workload: Any) -> str:
    """The framework a trial trains in: its workload's declared ``framework``
    (:attr:`synctune.workload.base.Workload.framework`); a runtime checked without a workload
    (None: a strategy and specs alone) is checked as for a PyTorch one, the framework every
    runtime but TensorFlow's trains."""
    return "torch" if workload is None else workload.framework


def per_world(key: Any, make: Callable[[], Any]) -> Any:
    """``make()``, called once per world (the default process group) for ``key``. Making a
    process group is collective: every rank runs the same trials, so every rank asks for the
    same keys in the same order."""
    import torch.distributed as dist

    cache = _PER_WORLD.setdefault(dist.distributed_c10d._get_default_group(), {})
    if key not in cache:
        cache[key] = make()
    return cache[key]


@dataclass(frozen=True, kw_only=True)
class ArmContext:
    """What a runtime is handed on one rank to train a PyTorch workload: the rank's freshly
    built model (on its device), the strategy (whose replicas and batch split every runtime
    follows), the specs, and the workload's optimizer factory (``make_optimizer(params)``)."""

    rank: int
    model: Any
    strategy: Any
    spec: Any
    cluster: Any
    device: Any
    make_optimizer: Callable[[Any], Any]
    seed: int
    collective_timeout_s: float
    #: The workload's loss of a model on this rank's batch (``loss_of(model)``), for a runtime that
    #: checks its wrapping changes nothing the model computes (tensor parallelism); None where
    #: the caller has no batch.
    loss_of: Callable[[Any], Any] | None = None


@dataclass(frozen=True, kw_only=True)
class Stepper:
    """A prepared runtime on one rank: the module the loss is computed through, and what to do
    after each backward (``step``: synchronize, update, clear the gradients). ``take_comm_bytes``
    returns the bytes handed to collectives since its last call where the runtime counts them
    (our engine does; DDP's and Horovod's are their own business: None). ``memory_parts``, where
    the runtime exposes them, returns ``{"optimizer": ..., "units": [...]}``: the optimizer this
    rank steps and the objects holding its communication buffers, for the per-rank memory
    breakdown (:mod:`synctune.engine.memory`), and ``comm_buffers_bytes`` where the runtime
    holds buffers it reports only by size (torch DDP's buckets). ``loss_scale``: what this rank's loss is
    multiplied by before backward (FSDP2 averages gradients over ranks equally; an uneven batch
    split is weighted by scaling each rank's loss)."""

    forward_model: Any
    step: Callable[[], None]
    loss_scale: float = 1.0
    take_comm_bytes: Callable[[], int | None] = lambda: None
    close: Callable[[], None] = lambda: None
    memory_parts: Callable[[], dict[str, Any]] | None = None


class Runtime(ABC):
    """What executes a trial; see the module docstring. Subclasses are frozen dataclasses
    holding their configuration, named by :attr:`name` in the registry."""

    #: The registry key, the ``runtime`` column of a dataset row and ``--runtime`` on the CLI.
    name: ClassVar[str]
    #: The workload frameworks it trains (``torch``, ``tensorflow``).
    frameworks: ClassVar[tuple[str, ...]] = ("torch",)
    #: It configures its collectives once per process: a process runs one such trial.
    once_per_process: ClassVar[bool] = False
    #: It can be one arm of an interleaved confirmation on shared processes.
    interleavable: ClassVar[bool] = True
    #: It executes the strategy's synchronization (refusing what it cannot execute exactly); the
    #: others take only the strategy's replicas and batch split.
    runs_strategy: ClassVar[bool] = False
    #: It executes a strategy's ``tensor_parallel`` (every other runtime refuses such a strategy).
    runs_tensor_parallel: ClassVar[bool] = False
    #: Its ranks hold parameters, gradients and buffers as torch FSDP2 does (the memory model's
    #: ``fsdp`` layout: :func:`synctune.simulator.memory.predict_memory`), not as the engine does.
    fsdp_layout: ClassVar[bool] = False
    #: How summaries name it as a baseline, and what its baseline trials are, in words.
    label: ClassVar[str] = ""
    trials_noun: ClassVar[str] = "baseline trial(s)"
    #: How its tuned trials are named, where a search tunes it (:meth:`tuning_space`); None: never tuned.
    tuning: ClassVar[Tuning | None] = None
    #: The runtime that runs a strategy's own plans where this one, asked for without settings,
    #: would ignore them (FSDP2's settings beside shard plans); None: no such runtime.
    plans_runtime: ClassVar[str | None] = None

    @abstractmethod
    def check(self, strategy: Any, spec: Any, cluster: Any, workload: Any = None) -> None:
        """Refuse (:class:`SpecError` naming the field) a trial this runtime would not run as
        claimed; called before any worker starts."""

    def prepare(self, ctx: ArmContext) -> Stepper:
        """Wrap one rank's model and optimizer for a PyTorch workload."""
        raise SpecError(f"{self.name} runtime: it does not train PyTorch workloads")

    def run_keras(self, rank: int, world: int, payload: dict) -> dict:
        """One rank of a trial of a Keras workload (rank 0's output is the trial's)."""
        raise SpecError(f"{self.name} runtime: it does not train Keras workloads")

    @abstractmethod
    def config_dict(self) -> dict[str, Any]:
        """The configuration as plain data (the ``runtime_json`` of a dataset row)."""

    @classmethod
    @abstractmethod
    def from_config(cls, config: dict[str, Any]) -> "Runtime":
        """The runtime back from :meth:`config_dict`'s form; refuses unknown keys."""

    @abstractmethod
    def summary(self) -> str:
        """A short human-readable form, as summaries name a baseline."""

    @classmethod
    def from_options(cls, options: dict[str, str], strategy: Any, spec: Any) -> "Runtime":
        """The runtime from command-line ``KEY=VALUE`` settings (text values, typed here) for a
        trial of ``strategy``; a runtime without settings refuses any."""
        if options:
            raise SpecError(f"{cls.name} runtime: it takes no settings, got {', '.join(sorted(options))}")
        return cls.from_config({})

    @classmethod
    def tuning_space(cls, model: Any, cluster: Any, *, lossy: bool,
                     fits: Callable[["Runtime"], bool] | None = None) -> TuningSpace:
        """The settings a search tunes for this runtime in the domain (``model``, ``cluster``):
        lossy options only where ``lossy``, and only settings whose runtime ``fits`` accepts (the
        memory budget's judgement of it, :meth:`plans_of`). Refuses, with a
        :class:`~synctune.engine.tuning.NothingToTune` that says why, a runtime with nothing to
        tune here."""
        raise NothingToTune(cls.name, f"the {cls.name} runtime has no tuning space")

    @classmethod
    def from_tuned(cls, point: dict[str, Any]) -> "Runtime":
        """The runtime one tuned point configures (the names of :attr:`tuning`'s ``params``)."""
        raise SpecError(f"{cls.name} runtime: it is not tuned")

    def plans_refusal(self, strategy: Any, cluster: Any, module: Any, spec: Any, workload: Any = None) -> str | None:
        """Why this runtime cannot run ``strategy``'s own plans on the workload's ``module`` (e.g.
        on the meta device), or None: a search never proposes what its runtime would refuse. The
        engine runs every plan validation admits."""
        return None

    def batch_rank(self, strategy: Any, rank: int) -> int:
        """Whose batch rank ``rank`` trains (the rank whose seed makes it): its own, except where
        ranks share one batch (a tensor-parallel group's)."""
        return rank

    def plans_of(self, strategy: Any, module: Callable[[], Any], spec: Any) -> Any:
        """What this runtime runs for a trial of ``strategy``, in the strategy language (what the
        memory model predicts and a training file sets up; ``module()``: the workload's model, e.g.
        on the meta device, built only where needed): ``strategy`` itself for a runtime that runs its plans or takes only
        its replicas and batch split; FSDP2 under its own settings runs the all-``shard`` strategy
        of its units."""
        return strategy

    def executed(self, strategy: Any, spec: Any) -> Any:
        """The strategy a trial of ``strategy`` under this runtime executes, as its dataset row and
        MLflow run record it (strategy JSON, hash, summary, ``tp_degree``): ``strategy`` itself
        for a runtime that runs its plans or takes only its replicas and batch split (its own
        settings are the row's ``runtime_json``); a runtime that writes the plan it runs from its
        settings (the ``megatron`` runtime's tensor parallelism) gives that plan."""
        return strategy

    def checkpoint_of(self, strategy: Any, spec: Any) -> tuple[tuple[str, str], ...]:
        """The modules a trial of ``strategy`` checkpoints, as ``(module, mode)`` pairs: the
        strategy's own (:attr:`~synctune.strategy.schema.Strategy.checkpoint`), which every
        PyTorch runtime executes; a runtime with a checkpointing setting of its own (FSDP2's)
        gives that."""
        return strategy.checkpoint

    def training_format(self, strategy: Any) -> str | None:
        """How a training file runs what this runtime ran for ``strategy``
        (:data:`synctune.run.apply.FORMATS`), or None where no training file does (the runtime's
        own launcher is the way: Horovod's, TensorFlow's)."""
        return None

    def training_note(self, strategy: Any, spec: Any) -> str | None:
        """How to train with this runtime where no training file is written, in one line (None:
        its settings in the result file say it)."""
        return None

    def describe(self, strategy: Any) -> str:
        """What a trial of ``strategy`` under this runtime runs, in one line."""
        return f"{self.summary()} (replicas and batch split of {strategy.summary()})"

    def to_dict(self) -> dict[str, Any]:
        """The plain-data form a trial payload carries (``{"kind": name, name: config}``)."""
        return {"kind": self.name, self.name: self.config_dict()}

    def config_json(self) -> str:
        """:meth:`config_dict` as canonical JSON; empty for a runtime with nothing to configure."""
        import json

        config = self.config_dict()
        return json.dumps(config, sort_keys=True) if config else ""


class PlansRuntime(Runtime):
    """A runtime whose configuration is the strategy it runs (the engine; FSDP2 from shard
    plans): it runs the strategy's plans and has no settings of its own, so one value serves
    every trial."""

    runs_strategy = True

    def config_dict(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Runtime":
        if config:
            raise SpecError(f"{cls.name} runtime: it takes no settings (the strategy is its configuration), got "
                            f"{sorted(config)}")
        return cls()


class ConfiguredRuntime(Runtime):
    """A runtime whose settings are one frozen config value (``config``, of :attr:`config_type`,
    with ``to_dict``, ``from_dict`` and ``summary``): torch DDP's, Horovod's."""

    config_type: ClassVar[type]

    def config_dict(self) -> dict[str, Any]:
        return self.config.to_dict()

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "Runtime":
        return cls(cls.config_type.from_dict(config))

    def summary(self) -> str:
        return self.config.summary()
