"""The registry of runtimes (DESIGN.md "runtime"): every implementation of
:class:`~synctune.engine.runtime.Runtime`, by name. Adding a runtime touches its own module
and this one only."""

from __future__ import annotations

from typing import Any

from ..spec.errors import SpecError
from .composed import ENGINE, EngineRuntime
from .ddp import DDPRuntime
from .fsdp import FSDPRuntime, has_shard_plans
from .fsdp_plans import FSDP_PLANS, FSDPPlansRuntime
from .horovod import HorovodRuntime
from .megatron import MegatronRuntime
from .runtime import Runtime
from .tensor_parallel import TP_RUNTIME, TensorParallelRuntime
from .tensorflow import TensorFlowRuntime

__all__ = ["RUNTIMES", "register_runtime", "runtime_class", "as_runtime", "runtime_from_record",
           "runtime_from_options", "strategy_runtime_class", "executor_for", "executor_names", "tuned_runtimes"]

#: name -> runtime class.
RUNTIMES: dict[str, type[Runtime]] = {}


def register_runtime(cls: type[Runtime]) -> type[Runtime]:
    """Add ``cls`` under its ``name``; a name registered twice is refused."""
    if cls.name in RUNTIMES:
        raise ValueError(f"runtime {cls.name!r} is registered already ({RUNTIMES[cls.name].__name__})")
    RUNTIMES[cls.name] = cls
    return cls


for _cls in (EngineRuntime, DDPRuntime, HorovodRuntime, TensorFlowRuntime, FSDPRuntime, FSDPPlansRuntime,
             TensorParallelRuntime, MegatronRuntime):
    register_runtime(_cls)


def runtime_class(name: Any) -> type[Runtime]:
    """The runtime registered as ``name``; an unknown one is refused, listing the valid names."""
    if not isinstance(name, str) or name not in RUNTIMES:
        raise SpecError(f"trial runtime: kind: expected one of {', '.join(RUNTIMES)}, got {name!r:.60}")
    return RUNTIMES[name]


def as_runtime(value: Runtime | dict | None) -> Runtime:
    """A runtime from what callers and payloads hand around: a :class:`Runtime`, its plain-data
    form (``{"kind": name, name: config}``, :meth:`Runtime.to_dict`), or None (the engine)."""
    if value is None:
        return ENGINE
    if isinstance(value, Runtime):
        return value
    if not isinstance(value, dict):
        raise SpecError(f"trial runtime: expected a runtime or {{'kind': name, name: {{...}}}}, got {value!r:.80}")
    cls = runtime_class(value.get("kind"))
    config = value.get(cls.name, {})
    if not isinstance(config, dict):
        raise SpecError(f"trial runtime: {cls.name}: expected a mapping of settings, got {config!r:.80}")
    return cls.from_config(config)


def runtime_from_record(name: str, config_json: str) -> Runtime:
    """The runtime of a dataset row (its ``runtime`` and ``runtime_json`` columns). A row whose
    runtime is ``fsdp`` with ``from_strategy: true`` in its settings ran a strategy's own shard
    plans: it is read as the ``fsdp-plans`` runtime."""
    import json

    config = json.loads(config_json) if config_json else {}
    if name == FSDPRuntime.name and isinstance(config, dict) and config.get("from_strategy") is True:
        return FSDP_PLANS
    return as_runtime({"kind": name, name: config})


def runtime_from_options(name: str, options: dict[str, str], strategy: Any = None, spec: Any = None) -> Runtime:
    """The runtime ``name`` with command-line ``KEY=VALUE`` settings for a trial of ``strategy``
    (:meth:`Runtime.from_options`); FSDP2 asked for without settings on a strategy with shard
    plans runs those plans (:attr:`FSDPRuntime.plans_runtime`), and a runtime that runs
    strategies (the engine, the default) asked for on one with ``tensor_parallel`` is ``tp``."""
    cls = runtime_class(name)
    if strategy is not None and strategy.tensor_parallel is not None and cls.runs_strategy and not options:
        return TP_RUNTIME  # the one runtime that executes a strategy's tensor_parallel
    plans = cls.plans_runtime
    if plans and strategy is not None and not options and has_shard_plans(strategy):
        cls = runtime_class(plans)
    return cls.from_options(options, strategy, spec)


def tuned_runtimes() -> list[type[Runtime]]:
    """The runtimes a search tunes as baselines (:attr:`Runtime.tuning`), in registry order."""
    return [cls for cls in RUNTIMES.values() if cls.tuning is not None]


def strategy_runtime_class(framework: str) -> type[Runtime]:
    """The runtime that executes searched strategies for a workload of ``framework`` (``torch``:
    the engine; ``tensorflow``: TensorFlow's own collectives, for what they execute exactly)."""
    for cls in RUNTIMES.values():
        if cls.runs_strategy and framework in cls.frameworks:
            return cls
    raise SpecError(f"workload framework {framework!r}: no runtime executes strategies for it; known: "
                    f"{', '.join(sorted({f for c in RUNTIMES.values() for f in c.frameworks}))}")


def executor_names(columns: Any, framework: str = "torch") -> list[str]:
    """The name of :func:`executor_for`'s runtime for each strategy of ``columns``
    (:class:`~synctune.strategy.columns.StrategyColumns`), by the same rule."""
    plain = strategy_runtime_class(framework).name
    return [TP_RUNTIME.name if split else FSDP_PLANS.name if frees else plain
            for split, frees in zip(columns.splits_modules(), columns.frees_parameters())]


def executor_for(strategy: Any, spec: Any = None, framework: str = "torch") -> Runtime:
    """The runtime that executes ``strategy``'s own plans: torch FSDP2 (``fsdp-plans``) where a
    unit frees its parameters after forward (:attr:`~synctune.strategy.schema.Strategy.frees_parameters`:
    the engine keeps them whole), else the runtime that runs searched strategies for a
    ``framework`` workload (:func:`strategy_runtime_class`: the engine for PyTorch, TensorFlow's
    collectives for Keras); torch's DTensor (``tp``) where the strategy splits modules with
    ``tensor_parallel``. The one place that decides it for the search and its summary."""
    if strategy.tensor_parallel is not None:
        return TP_RUNTIME
    if strategy.frees_parameters:
        return FSDP_PLANS
    return strategy_runtime_class(framework).from_options({}, strategy, spec)

