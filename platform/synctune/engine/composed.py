"""The ``engine`` runtime: our engine executing a composed strategy variable by variable
(AutoDist §2.3's composable kernels; :class:`synctune.engine.core.StrategyEngine`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .runtime import ArmContext, PlansRuntime, Stepper

__all__ = ["EngineRuntime", "ENGINE"]


@dataclass(frozen=True)
class EngineRuntime(PlansRuntime):
    """Runs the whole strategy: every plan's partition, synchronizer and compressor; refuses
    what the engine does not execute exactly (:func:`synctune.engine.core.check_supported`)."""

    name = "engine"
    label = "the engine"

    def check(self, strategy: Any, spec: Any, cluster: Any, workload: Any = None) -> None:
        from .core import check_supported

        check_supported(strategy, spec)

    def prepare(self, ctx: ArmContext) -> Stepper:
        from .core import StrategyEngine

        engine = StrategyEngine(ctx.model, ctx.strategy, ctx.spec, ctx.cluster, ctx.make_optimizer, seed=ctx.seed)

        def step() -> None:
            engine.step()
            engine.zero_grad()

        return Stepper(forward_model=ctx.model, step=step, take_comm_bytes=engine.take_comm_bytes,
                       close=engine.close,
                       memory_parts=lambda: {"optimizer": engine.optimizer, "units": list(engine.units)})

    def summary(self) -> str:
        return "engine"

    def training_format(self, strategy: Any) -> str:
        """The engine's own file where the strategy has shard plans (its ZeRO-2 units stay the
        engine's even where FSDP2 could express them), else the plainest that runs it exactly."""
        from .fsdp import has_shard_plans

        return "engine" if has_shard_plans(strategy) else "auto"

    def describe(self, strategy: Any) -> str:
        return strategy.summary()


#: The engine runtime (it has no settings of its own: one value serves every trial).
ENGINE = EngineRuntime()
