"""The registry of runtimes (DESIGN.md "runtime"): every implementation of
:class:`~synctune.engine.runtime.Runtime`, by name. Adding a runtime touches its own module
and this one only."""

from __future__ import annotations

from typing import Any

from ..spec.errors import SpecError
from .composed import ENGINE, EngineRuntime
from .ddp import DDPRuntime
from .fsdp import FSDPConfig, FSDPRuntime
from .horovod import HorovodRuntime
from .runtime import Runtime
from .tensorflow import TensorFlowRuntime

__all__ = ["RUNTIMES", "register_runtime", "runtime_class", "as_runtime", "runtime_from_record",
           "strategy_runtime_class", "executor_for"]

#: name -> runtime class.
RUNTIMES: dict[str, type[Runtime]] = {}


def register_runtime(cls: type[Runtime]) -> type[Runtime]:
    """Add ``cls`` under its ``name``; a name registered twice is refused."""
    if cls.name in RUNTIMES:
        raise ValueError(f"runtime {cls.name!r} is registered already ({RUNTIMES[cls.name].__name__})")
    RUNTIMES[cls.name] = cls
    return cls


for _cls in (EngineRuntime, DDPRuntime, HorovodRuntime, TensorFlowRuntime, FSDPRuntime):
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
    """The runtime of a dataset row (its ``runtime`` and ``runtime_json`` columns)."""
    import json

    return as_runtime({"kind": name, name: json.loads(config_json) if config_json else {}})


def strategy_runtime_class(framework: str) -> type[Runtime]:
    """The runtime that executes searched strategies for a workload of ``framework`` (``torch``:
    the engine; ``tensorflow``: TensorFlow's own collectives, for what they execute exactly)."""
    for cls in RUNTIMES.values():
        if cls.runs_strategy and framework in cls.frameworks:
            return cls
    raise SpecError(f"workload framework {framework!r}: no runtime executes strategies for it; known: "
                    f"{', '.join(sorted({f for c in RUNTIMES.values() for f in c.frameworks}))}")


def executor_for(strategy: Any, spec: Any = None, framework: str = "torch") -> Runtime:
    """The runtime that executes ``strategy``'s own plans: torch FSDP2 where a unit frees its
    parameters after forward (:attr:`~synctune.strategy.kinds.Synchronizer.frees_parameters`:
    the engine keeps them whole), else the runtime that runs searched strategies for a
    ``framework`` workload (:func:`strategy_runtime_class`: the engine for PyTorch, TensorFlow's
    collectives for Keras). The one place that decides it for the search and its summary."""
    if any(shard.synchronizer.frees_parameters for _plan, _i, shard in strategy.iter_shards()):
        return FSDPRuntime(FSDPConfig(from_strategy=True))
    return strategy_runtime_class(framework).from_options({}, strategy, spec)

