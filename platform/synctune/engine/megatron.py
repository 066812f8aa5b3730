"""The ``megatron`` runtime: Megatron-LM's tensor parallelism inside nodes with FSDP2 across them,
as users run it (torchtitan's ``parallelize``), a baseline a search tunes (DESIGN.md "runtime";
AutoDDL's comparison with Megatron-LM, §5).

Its settings (:class:`MegatronConfig`) are the plan's knobs users turn: the TP degree, sequence
parallelism, FSDP2's reshard after forward on the data-parallel axis, and activation
checkpointing of every block. Like torch DDP's and FSDP2's baselines it takes only the replicas
and batch split of the strategy it is handed (a search's all-reduce skeleton): on them it writes
the ``megatron`` builder's plan (:func:`~synctune.strategy.builders.megatron_over`, ``dp=auto``:
FSDP2 over the TP groups, all-reduce where there is one group) and runs it with the ``tp``
runtime (:mod:`synctune.engine.tensor_parallel`), checks included. The memory model predicts that
plan (:meth:`MegatronRuntime.plans_of`), so a search draws only the points its budget admits.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass, fields
from typing import Any

from ..spec.checks import is_int
from ..spec.errors import SpecError
from ..strategy.checkpoint import checkpoint_blocks
from ..strategy.schema import Strategy
from .fsdp import FSDP_CHECKPOINT
from .runtime import ArmContext, ConfiguredRuntime, Stepper
from .tensor_parallel import TP_RUNTIME
from .tuning import Categorical, NothingToTune, Tuning, TuningSpace

__all__ = ["MegatronConfig", "MegatronRuntime", "MEGATRON_DEFAULT", "megatron_degrees", "megatron_refusal",
           "megatron_plan", "megatron_settings"]


@dataclass(frozen=True, kw_only=True)
class MegatronConfig:
    """What configures a Megatron-style run: ``degree`` (the TP group's devices, inside a node),
    ``sequence_parallel`` (the norms and dropout between the split pairs on sequence slices),
    ``reshard`` (FSDP2 frees each block's parameters after forward on the data-parallel axis; moot
    with one TP group, where that axis all-reduces over nothing) and ``checkpoint``
    (:data:`~synctune.engine.fsdp.FSDP_CHECKPOINT`: every block checkpointed in that mode, or none)."""

    degree: int = 2
    sequence_parallel: bool = False
    reshard: bool = True
    checkpoint: str = "none"

    def __post_init__(self) -> None:
        if not (is_int(self.degree) and 2 <= self.degree <= 1024):
            raise SpecError(f"megatron config: degree: expected a TP degree from 2 to 1024, got {self.degree!r}")
        for name in ("sequence_parallel", "reshard"):
            if not isinstance(getattr(self, name), bool):
                raise SpecError(f"megatron config: {name}: expected true or false, got {getattr(self, name)!r}")
        if self.checkpoint not in FSDP_CHECKPOINT:
            raise SpecError(f"megatron config: checkpoint: expected one of {', '.join(FSDP_CHECKPOINT)}, got "
                            f"{self.checkpoint!r:.60}")

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain data (a dataset row's ``runtime_json``)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "MegatronConfig":
        """The configuration of :meth:`to_dict`'s form, validated; an unknown key is refused."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise SpecError(f"megatron config: unknown key(s) {unknown}; valid: {', '.join(known)}")
        return cls(**data)

    def summary(self) -> str:
        """A short human-readable form, e.g. ``tp 2, sp, reshard, checkpoint selective``."""
        parts = [f"tp {self.degree}"] + (["sp"] if self.sequence_parallel else [])
        parts.append("reshard" if self.reshard else "keep")
        if self.checkpoint != "none":
            parts.append(f"checkpoint {self.checkpoint}")
        return ", ".join(parts)


#: The Megatron-style run users start with: TP over two devices, no sequence parallelism,
#: blocks resharded after forward, no checkpointing.
MEGATRON_DEFAULT = MegatronConfig()

#: Strategies :func:`megatron_plan` wrote, by (config, skeleton hash, model hash).
_PLANS: dict[tuple, Strategy | SpecError] = {}


def megatron_plan(config: MegatronConfig, strategy: Strategy, spec: Any) -> Strategy:
    """The strategy a Megatron-style run of ``config`` executes on ``strategy``'s replicas and batch
    split: the ``megatron`` builder's plan (:func:`~synctune.strategy.builders.megatron_over`,
    ``dp=auto``) with every block checkpointed in ``config.checkpoint``'s mode. Refuses (naming
    the setting) a plan the builder cannot write for the model, and a checkpointing setting beside
    a strategy that checkpoints modules of its own (other than the setting's: the plan of its own
    output is itself). Written once per (config, strategy, model)."""
    from ..strategy.builders import MegatronOptions, megatron_over

    key = (config, strategy.hash, spec.hash)
    if key not in _PLANS:
        try:
            blocks = checkpoint_blocks(v.name for v in spec.variables)
            own = tuple(sorted((b, config.checkpoint) for b in blocks)) if config.checkpoint != "none" else ()
            # A strategy checkpointing exactly what this config does is this config's own plan
            # (read back from a trial's row): planned again, it gives itself.
            if config.checkpoint != "none" and strategy.checkpoint and tuple(strategy.checkpoint) != own:
                raise SpecError(f"checkpoint: {config.checkpoint!r} beside the strategy's own checkpoint "
                                f"({len(strategy.checkpoint)} module(s)); set checkpoint=none or drop the strategy's")
            built = megatron_over(spec, strategy, MegatronOptions(degree=config.degree, reshard=config.reshard,
                                                                  sequence_parallel=config.sequence_parallel))
            if config.checkpoint != "none":
                built = dataclasses.replace(built, checkpoint=own)
            _PLANS[key] = built
        except SpecError as exc:
            _PLANS[key] = SpecError(f"megatron config: {exc}")
    found = _PLANS[key]
    if isinstance(found, SpecError):
        raise SpecError(str(found))
    return found


def megatron_settings(model: Any, cluster: Any) -> list[MegatronConfig]:
    """Every setting of the tuned Megatron baseline's grid in a domain: each TP degree of
    :func:`megatron_degrees`, sequence parallelism or not, resharded or not, every block
    checkpointed in each mode of :data:`~synctune.engine.fsdp.FSDP_CHECKPOINT` or none (whether
    the builder writes each setting's plan for the model is :func:`megatron_plan`'s to say)."""
    return [MegatronConfig(degree=degree, sequence_parallel=sequence, reshard=reshard, checkpoint=checkpoint)
            for degree in megatron_degrees(model, cluster) for sequence in (False, True)
            for reshard in (True, False) for checkpoint in FSDP_CHECKPOINT]


def megatron_degrees(model: Any, cluster: Any) -> list[int]:
    """The TP degrees a Megatron-style run can take in a domain: 2 or more, dividing every node's
    devices (a TP group lies inside a node), where the model has an attention or MLP pair whose
    features the degree divides."""
    from ..strategy.builders import megatron_styles

    smallest = min(n.num_devices for n in cluster.nodes)
    return [d for d in range(2, smallest + 1)
            if all(n.num_devices % d == 0 for n in cluster.nodes) and megatron_styles(model, d)]


def megatron_refusal(model: Any, cluster: Any) -> str | None:
    """Why no Megatron-style run exists in a domain, in one line (None: at least one degree has a
    plan): a cluster whose nodes hold no TP group of two devices or more, a model without numbered
    blocks or Megatron pairs, a model FSDP2 cannot shard."""
    if megatron_degrees(model, cluster):
        sparse = next((v.name for v in model.variables if v.sparse), None)
        if sparse is not None:
            return (f"variable {sparse!r} of model {model.name!r} has a sparse gradient, which DTensor and FSDP2 "
                    f"cannot split")
        return None
    sizes = sorted({n.num_devices for n in cluster.nodes})
    if sizes[0] < 2 or not any(all(s % d == 0 for s in sizes) for d in range(2, sizes[0] + 1)):
        return (f"cluster {cluster.name!r} has nodes of {', '.join(map(str, sizes))} device(s): no TP degree of 2 or "
                f"more divides every node's devices")
    return (f"model {model.name!r} has no numbered blocks with an attention or MLP pair of linear layers (query, key, "
            f"value ... then an output; fc1, up_proj ... then fc2, down_proj) whose features a TP degree of "
            f"{', '.join(map(str, range(2, sizes[0] + 1)))} divides")


@dataclass(frozen=True)
class MegatronRuntime(ConfiguredRuntime):
    """Megatron-style TP with FSDP2 across as :attr:`config` says (see the module docstring); the
    strategy gives replicas and batch split only (one with ``tensor_parallel`` of its own runs on
    the ``tp`` runtime)."""

    config: MegatronConfig = MEGATRON_DEFAULT
    name = "megatron"
    config_type = MegatronConfig
    fsdp_layout = True
    label = "Megatron"
    trials_noun = "tuned Megatron-style TP + FSDP2 trials"
    tuning = Tuning(params=("degree", "sequence_parallel", "reshard", "checkpoint"), origin="megatron-tuned",
                    label="tuned Megatron", title="Megatron-style TP with FSDP2",
                    knobs="TP degree, sequence parallelism, reshard after forward and activation checkpointing")

    def plan(self, strategy: Any, spec: Any) -> Strategy:
        """The strategy this run executes on ``strategy``'s replicas (:func:`megatron_plan`)."""
        return megatron_plan(self.config, strategy, spec)

    def check(self, strategy: Any, spec: Any, cluster: Any, workload: Any = None) -> None:
        """Refuse, before any worker starts, a run that would not execute as claimed: the plan
        validated against the specs, then the ``tp`` runtime's own checks of it."""
        from ..strategy.validate import validate

        built = self.plan(strategy, spec)
        try:
            validate(built, spec, cluster)
        except SpecError as exc:
            raise SpecError(f"megatron config: {exc}") from None
        TP_RUNTIME.check(built, spec, cluster, workload)

    def prepare(self, ctx: ArmContext) -> Stepper:
        return TP_RUNTIME.prepare(dataclasses.replace(ctx, strategy=self.plan(ctx.strategy, ctx.spec)))

    def plans_of(self, strategy: Any, module, spec: Any) -> Any:
        """The Megatron plan the run executes (what the memory model predicts)."""
        return self.plan(strategy, spec)

    def executed(self, strategy: Any, spec: Any) -> Strategy:
        """The Megatron plan the run executes (:meth:`plan`): what a trial's row records, its TP
        degree, split blocks, sequence parallelism and checkpointing, not the skeleton it was
        handed."""
        return self.plan(strategy, spec)

    def checkpoint_of(self, strategy: Any, spec: Any) -> tuple[tuple[str, str], ...]:
        return self.plan(strategy, spec).checkpoint

    def batch_rank(self, strategy: Any, rank: int) -> int:
        """A TP group's replicas train one batch (the ``tp`` runtime's rule)."""
        return rank // self.config.degree

    def training_format(self, strategy: Any) -> str:
        return "tp"

    def describe(self, strategy: Any) -> str:
        return (f"Megatron-style TP (torch DTensor) with FSDP2 across: {self.summary()} (replicas and batch split of "
                f"{strategy.summary()})")

    @classmethod
    def from_options(cls, options: dict[str, str], strategy: Any = None, spec: Any = None) -> "MegatronRuntime":
        """Command-line ``KEY=VALUE`` settings, typed as :class:`MegatronConfig`'s fields."""
        values: dict[str, Any] = MEGATRON_DEFAULT.to_dict()
        for key, text in options.items():
            if key not in values:
                raise SpecError(f"megatron config: unknown key {key!r}; valid: {', '.join(values)}")
            lower = text.strip().lower()
            if key == "degree":
                if not (text.isascii() and text.isdigit()) or len(text) > 4:
                    raise SpecError(f"megatron config: degree: expected an integer, got {text[:40]!r}")
                values[key] = int(text)
            elif key in ("sequence_parallel", "reshard"):
                if lower not in ("true", "false"):
                    raise SpecError(f"megatron config: {key}: expected true or false, got {text[:40]!r}")
                values[key] = lower == "true"
            else:
                values[key] = text
        return cls(MegatronConfig.from_dict(values))

    @classmethod
    def tuning_space(cls, model: Any, cluster: Any, *, lossy: bool, fits=None) -> TuningSpace:
        """``degree`` (:func:`megatron_degrees`), ``sequence_parallel``, ``reshard`` (tuned where
        a degree leaves more than one TP group) and ``checkpoint``
        (:data:`~synctune.engine.fsdp.FSDP_CHECKPOINT`), each setting only where some admitted
        point has it. A point is admitted where the builder writes its plan and ``fits`` (the
        memory budget's judgement of the runtime) accepts it; a drawn point that is not gives way
        to the nearest that is: its own settings
        with more checkpointing, then resharded, then the other sequence setting, then the larger
        degrees (each holds less), then the smaller. The first point is the builder's default (a
        TP group of a node's devices, no sequence parallelism, resharded, no checkpointing) where
        it is admitted, else the first of its fallbacks that is. Nothing here is lossy."""
        from ..strategy.builders import build_strategy

        why = megatron_refusal(model, cluster)
        if why is not None:
            raise NothingToTune(cls.name, why)
        degrees = megatron_degrees(model, cluster)
        skeleton = build_strategy("allreduce", model, cluster)

        def builds(point) -> bool:
            try:
                megatron_plan(_config(point), skeleton, model)
            except SpecError:
                return False
            return True

        def admits(point) -> bool:
            return builds(point) and (fits is None or fits(cls.from_tuned(dict(point))))

        every = [{"degree": d, "sequence_parallel": sp, "reshard": r, "checkpoint": c}
                 for d in degrees for sp in (False, True) for r in (True, False) for c in FSDP_CHECKPOINT]
        admitted = [p for p in every if admits(p)]
        if not admitted:
            raise NothingToTune(cls.name, "no Megatron plan fits the memory budget")
        # Only settings some admitted point has: a resumed search is not told a point outside them.
        degrees = sorted({p["degree"] for p in admitted})
        sequence = tuple(sp for sp in (False, True) if any(p["sequence_parallel"] is sp for p in admitted))
        reshard = (True, False) if len(skeleton.replicas) > min(degrees) else (True,)
        base = {"sequence_parallel": False, "reshard": True, "checkpoint": "none"}

        def fallbacks(point) -> list[dict]:
            degree = point["degree"]
            order = ([degree] + sorted(d for d in degrees if d > degree)
                     + sorted((d for d in degrees if d < degree), reverse=True))
            more = FSDP_CHECKPOINT[FSDP_CHECKPOINT.index(point["checkpoint"]):]
            out: list[dict] = []
            for d in order:
                for sp in dict.fromkeys((point["sequence_parallel"], *sequence)):
                    for r in dict.fromkeys((point["reshard"], *reshard)):
                        for c in more if d == degree else FSDP_CHECKPOINT:
                            candidate = {"degree": d, "sequence_parallel": sp, "reshard": r, "checkpoint": c}
                            if candidate not in out:
                                out.append(candidate)
            return out

        first = {"degree": max(degrees), **base}
        if not admits(first):
            first = next((p for p in fallbacks(first) if admits(p)), admitted[0])
        return TuningSpace(
            params={"degree": Categorical(tuple(degrees)), "sequence_parallel": Categorical(sequence),
                    "reshard": Categorical(reshard), "checkpoint": Categorical(FSDP_CHECKPOINT)},
            first=first, admits=admits, fallbacks=fallbacks)

    @classmethod
    def from_tuned(cls, point: dict[str, Any]) -> "MegatronRuntime":
        """The run a tuned point says."""
        return cls(_config(point))


def _config(point: Any) -> MegatronConfig:
    """The :class:`MegatronConfig` of one tuned point (Optuna gives plain values back)."""
    return MegatronConfig(degree=point["degree"], sequence_parallel=point["sequence_parallel"],
                          reshard=point["reshard"], checkpoint=point["checkpoint"])
