"""The ``fsdp-plans`` runtime: torch FSDP2 executing a strategy's own ``shard`` plans (DESIGN.md
"runtime", "shard"; papers/sharding-notes.md "FSDP2").

Each unit id of the strategy becomes the module whose parameters are exactly that unit's
variables, with the unit's shard group as the mesh (1-D, or HSDP's 2-D one), its reshard, prefetch
and reduce dtype (:func:`~synctune.engine.fsdp.plan_from_strategy`); what FSDP2 cannot express is
refused naming the variable and field. It is the runtime of a searched strategy whose units free
their parameters after forward, which the engine keeps whole
(:func:`synctune.engine.runtimes.executor_for`), and its trials are the search's own. FSDP2 with
settings of its own, the baseline users run, is the ``fsdp`` runtime
(:mod:`synctune.engine.fsdp`), which shares this machinery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..spec.errors import SpecError
from .fsdp import (check_plan, check_shard_group, escaping_parameters, fsdp_stepper, has_shard_plans, meta_model,
                   plan_from_strategy, refuse_sparse, shard_units)
from .runtime import ArmContext, PlansRuntime, Stepper

__all__ = ["FSDPPlansRuntime", "FSDP_PLANS", "plans_refusal"]


def plans_refusal(strategy: Any, cluster: Any, module: Any, spec: Any, workload: Any = None) -> str | None:
    """Why FSDP2 cannot run ``strategy``'s own shard plans on ``module`` (the workload's model,
    e.g. on the meta device), or None when it can: every plan ``shard``, one shard group that
    fits the cluster, units FSDP2 can wrap (module boundaries, no parameter escaping them)."""
    try:
        _by_unit, _syncs, (group, _var) = shard_units(strategy)
        check_shard_group("strategy: shard: group", group, strategy, cluster)
        check_plan(plan_from_strategy(module, strategy, spec), escaping_parameters(module, workload), from_plans=True,
                   checkpoint=strategy.checkpoint)
    except SpecError as exc:
        return str(exc)
    return None


@dataclass(frozen=True)
class FSDPPlansRuntime(PlansRuntime):
    """torch FSDP2 as the strategy's ``shard`` plans say (see the module docstring). It has no
    settings of its own: the strategy is its configuration."""

    name = "fsdp-plans"
    label = "FSDP2"
    fsdp_layout = True

    def check(self, strategy: Any, spec: Any, cluster: Any, workload: Any = None) -> None:
        """Refuse, before any worker starts, shard plans FSDP2 would not run as the strategy says."""
        refuse_sparse(spec)
        if not has_shard_plans(strategy):
            raise SpecError(f"{self.name} runtime: the strategy has no shard plans to configure FSDP2 with; run "
                            f"FSDP2 with settings of its own (--runtime fsdp --fsdp KEY=VALUE)")
        _by_unit, _syncs, (group, _var) = shard_units(strategy)
        check_shard_group("strategy: shard: group", group, strategy, cluster)
        module = meta_model(workload) if workload is not None else None
        if module is not None:
            check_plan(plan_from_strategy(module, strategy, spec), escaping_parameters(module, workload),
                       from_plans=True, checkpoint=strategy.checkpoint)

    def plans_refusal(self, strategy: Any, cluster: Any, module: Any, spec: Any, workload: Any = None) -> str | None:
        """:func:`plans_refusal`: every plan shard, one shard group, units FSDP2 can wrap."""
        return plans_refusal(strategy, cluster, module, spec, workload)

    def prepare(self, ctx: ArmContext) -> Stepper:
        plan = plan_from_strategy(ctx.model, ctx.strategy, ctx.spec)
        check_plan(plan, from_plans=True, checkpoint=ctx.strategy.checkpoint)
        return fsdp_stepper(ctx, plan)

    def summary(self) -> str:
        return "fsdp2 from the strategy's shard plans"

    def describe(self, strategy: Any) -> str:
        return f"torch FSDP2 running {strategy.summary()}"

    def training_format(self, strategy: Any) -> str:
        return "fsdp"


#: The ``fsdp-plans`` runtime (no settings of its own: one value serves every trial).
FSDP_PLANS = FSDPPlansRuntime()
