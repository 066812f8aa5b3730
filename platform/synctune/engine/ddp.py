"""The ``ddp`` runtime: plain torch ``DistributedDataParallel``, as users run it today.

A DDP trial is a baseline, not one of our strategies: DDP forms its own buckets (greedily in
reverse parameter order, and again after its first iteration), all-reduces each bucket when
its last gradient is ready, and compresses through a comm hook. What a user tunes is captured
by :class:`DDPConfig`: the bucket size cap, the first bucket's cap (DDP keeps the first bucket,
which holds the last gradients of backward, small so communication starts sooner), whether
gradients are views into the buckets, and the comm hook (none, fp16, bf16, PowerSGD).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from ..spec.checks import is_int, is_number
from ..spec.errors import SpecError
from .runtime import ArmContext, ConfiguredRuntime, Stepper
from .tuning import Categorical, LogUniform, NothingToTune, Tuning, TuningSpace

__all__ = ["DDPConfig", "COMM_HOOKS", "DDP_DEFAULT", "DDPRuntime", "wrap_ddp", "ddp_runtime", "DDP_POWERSGD_RANK",
           "ddp_config_of", "ddp_hooks"]

#: Comm hooks a DDP trial can register (torch.distributed.algorithms.ddp_comm_hooks).
COMM_HOOKS = ("none", "fp16", "bf16", "powersgd")


@dataclass(frozen=True)
class DDPConfig:
    """What configures a torch DDP run. Sizes in MiB (DDP's own unit). ``first_bucket_mb``
    None means "the same cap as every bucket" (DDP's behaviour when a cap is given); 0 < it
    < ``bucket_cap_mb`` gives the first bucket its own smaller cap (``bucket_cap_mb_list``)."""

    bucket_cap_mb: float = 25.0
    gradient_as_bucket_view: bool = True
    comm_hook: str = "none"
    powersgd_rank: int | None = None
    num_groups: int = 0  # informational: merge groups of the strategy it came from, if any
    first_bucket_mb: float | None = None

    def __post_init__(self) -> None:
        if not (is_number(self.bucket_cap_mb) and 0 < self.bucket_cap_mb <= 65536):
            raise SpecError(f"ddp config: bucket_cap_mb: expected a positive number of MiB up to 65536, "
                            f"got {self.bucket_cap_mb!r}")
        if self.first_bucket_mb is not None and not (is_number(self.first_bucket_mb) and self.first_bucket_mb > 0):
            raise SpecError(f"ddp config: first_bucket_mb: expected a positive number of MiB or null, "
                            f"got {self.first_bucket_mb!r}")
        if self.comm_hook not in COMM_HOOKS:
            raise SpecError(f"ddp config: comm_hook: expected one of {', '.join(COMM_HOOKS)}, got {self.comm_hook!r}")
        if self.comm_hook == "powersgd" and not (is_int(self.powersgd_rank) and self.powersgd_rank >= 1):
            raise SpecError(f"ddp config: powersgd_rank: the powersgd hook needs a positive integer rank, "
                            f"got {self.powersgd_rank!r}")
        if self.comm_hook == "powersgd" and self.first_bucket_mb is not None:
            # torch's PowerSGD hook under per-bucket caps sends tensors of different sizes on
            # different ranks and the job aborts (torch 2.13, gloo).
            raise SpecError("ddp config: first_bucket_mb: torch's PowerSGD hook fails with a separate first-bucket "
                            "cap (ranks disagree on tensor sizes); leave first_bucket_mb null with comm_hook powersgd")
        if not isinstance(self.gradient_as_bucket_view, bool):
            raise SpecError(f"ddp config: gradient_as_bucket_view: expected true or false, "
                            f"got {self.gradient_as_bucket_view!r}")

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain data (what a dataset row and a runtime record hold)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "DDPConfig":
        """The configuration of :meth:`to_dict`'s form, validated; an unknown key is an error that
        lists the valid ones."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise SpecError(f"ddp config: unknown key(s) {unknown}; valid: {', '.join(sorted(known))}")
        return cls(**data)

    def summary(self) -> str:
        """A short human-readable form, e.g. ``ddp bucket 25 MiB, first 1 MiB, hook fp16``."""
        first = f", first {self.first_bucket_mb:.3g} MiB" if self.first_bucket_mb else ""
        hook = self.comm_hook + (f" rank {self.powersgd_rank}" if self.comm_hook == "powersgd" else "")
        return f"ddp bucket {self.bucket_cap_mb:.3g} MiB{first}, hook {hook}"


#: DDP as users get it without tuning: 25 MiB buckets, a 1 MiB first bucket, no hook.
DDP_DEFAULT = DDPConfig(bucket_cap_mb=25.0, first_bucket_mb=1.0, gradient_as_bucket_view=False)


#: PowerSGD's rank in tuned-DDP trials (the allreduce builder's default).
DDP_POWERSGD_RANK = 4


def ddp_config_of(params: dict) -> DDPConfig:
    """The :class:`DDPConfig` of one tuned-DDP point (``comm_hook``, ``bucket_cap_mb``,
    ``first_bucket_mb``)."""
    hook = params["comm_hook"]
    cap = float(params["bucket_cap_mb"])
    first = min(float(params["first_bucket_mb"]), cap)
    # torch's PowerSGD hook fails with a separate first-bucket cap (see DDPConfig): it gets none.
    return DDPConfig(bucket_cap_mb=cap, first_bucket_mb=None if hook == "powersgd" or first >= cap else first,
                     comm_hook=hook, powersgd_rank=DDP_POWERSGD_RANK if hook == "powersgd" else None,
                     gradient_as_bucket_view=True)


def ddp_hooks(model: Any, cluster: Any, lossy: bool = True) -> list[str]:
    """The comm hooks a tuned-DDP search tries in a domain: bf16 only on GPUs (torch's hook
    needs NCCL); none but ``none`` for a model with sparse gradients (hooks compress dense
    buckets) or when the experiment says ``lossy: false``."""
    if not lossy or any(v.sparse for v in model.variables):
        return ["none"]
    return ["none", "fp16", "powersgd"] + (["bf16"] if cluster.device_kind == "gpu" else [])


def wrap_ddp(model: Any, config: DDPConfig | dict, device_ids: list[int] | None = None) -> Any:
    """``model`` in torch DDP as ``config`` says, its comm hook registered."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    c = config if isinstance(config, DDPConfig) else DDPConfig.from_dict(config)
    caps: dict[str, Any] = {"bucket_cap_mb": c.bucket_cap_mb}
    if c.first_bucket_mb is not None and c.first_bucket_mb < c.bucket_cap_mb:
        # A per-bucket list: the first bucket gets its own cap, the last entry caps all others.
        caps = {"bucket_cap_mb_list": [c.first_bucket_mb, c.bucket_cap_mb]}
    ddp = DDP(model, device_ids=device_ids, gradient_as_bucket_view=c.gradient_as_bucket_view, **caps)
    if c.comm_hook == "fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif c.comm_hook == "bf16":
        ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif c.comm_hook == "powersgd":
        state = powersgd.PowerSGDState(process_group=None, matrix_approximation_rank=c.powersgd_rank,
                                       start_powerSGD_iter=2, use_error_feedback=True, warm_start=True)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
    return ddp


@dataclass(frozen=True)
class DDPRuntime(ConfiguredRuntime):
    """torch DDP as :attr:`config` says; the strategy gives only replicas and batch split."""

    config: DDPConfig = DDP_DEFAULT
    name = "ddp"
    config_type = DDPConfig
    label = "DDP"
    trials_noun = "tuned torch DDP trials"
    tuning = Tuning(params=("comm_hook", "bucket_cap_mb", "first_bucket_mb"), origin="ddp-tuned",
                    label="tuned DDP", title="torch DDP", knobs="bucket size, first bucket and comm hook")

    @classmethod
    def tuning_space(cls, model: Any, cluster: Any, *, lossy: bool, fits=None) -> TuningSpace:
        """The comm hook (:func:`ddp_hooks`), the bucket size cap (1-256 MiB) and the first
        bucket's cap, from DDP's default (25 MiB, a 1 MiB first bucket, no hook). DDP's settings
        do not change what a rank holds beyond its buckets: replicated training either fits the
        memory budget (``fits`` of DDP's default) or nothing here does."""
        if fits is not None and not fits(cls()):
            raise NothingToTune(cls.name, "replicated training does not fit the memory budget")
        params = {"comm_hook": Categorical(tuple(ddp_hooks(model, cluster, lossy))),
                  "bucket_cap_mb": LogUniform(1.0, 256.0), "first_bucket_mb": LogUniform(0.0625, 64.0)}
        # Judged again at every draw: the memory model learns from each trial, an oom one first,
        # and a draw it then refuses ends the tuning (nothing else here holds less).
        return TuningSpace(params=params, first={"comm_hook": "none", "bucket_cap_mb": 25.0, "first_bucket_mb": 1.0},
                           admits=None if fits is None else (lambda _point: fits(cls())))

    @classmethod
    def from_tuned(cls, point: dict[str, Any]) -> "DDPRuntime":
        """DDP as a tuned point says (:func:`ddp_config_of`)."""
        return cls(ddp_config_of(point))

    def check(self, strategy: Any, spec: Any, cluster: Any, workload: Any = None) -> None:
        """Refuse, before any worker starts, a DDP trial DDP would run differently from what it
        claims."""
        config = self.config
        if len(set(strategy.batch_split)) > 1:
            raise SpecError(f"ddp runtime: the batch split is uneven ({list(strategy.batch_split)}); DDP averages "
                            f"replicas equally: use an even split")
        sparse = [v.name for v in spec.variables if v.sparse]
        if sparse and config.comm_hook != "none":
            raise SpecError(f"ddp config: comm_hook: {config.comm_hook} compresses dense buckets, and variable "
                            f"{sparse[0]!r} has sparse gradients; use comm_hook none for this model")
        cpu = [d for d in strategy.replicas if cluster.node_of(d).device_kind != "gpu"]
        if cpu and config.comm_hook == "bf16":
            raise SpecError(f"ddp config: comm_hook: bf16 needs CUDA and NCCL, and replica {cpu[0]!r} is a CPU "
                            f"device; use fp16 or none")

    def prepare(self, ctx: ArmContext) -> Stepper:
        device = ctx.device
        model = wrap_ddp(ctx.model, self.config, device_ids=[device.index] if device.type == "cuda" else None)
        optimizer = ctx.make_optimizer(list(model.parameters()))

        def step() -> None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        def memory_parts() -> dict[str, Any]:
            # DDP's reducer holds its gradient buckets from construction on; torch reports their
            # sizes (bytes) in its logging data, the only place it exposes them.
            sizes = str(model._get_ddp_logging_data().get("bucket_sizes", ""))
            return {"optimizer": optimizer, "units": [],
                    "comm_buffers_bytes": sum(int(x) for x in sizes.replace(" ", "").split(",") if x.isdigit())}

        return Stepper(forward_model=model, step=step, memory_parts=memory_parts)

    def describe(self, strategy: Any) -> str:
        return f"torch DDP: {self.summary()} (replicas and batch split of {strategy.summary()})"

    def training_format(self, strategy: Any) -> str:
        return "ddp"

    @classmethod
    def from_options(cls, options: dict[str, str], strategy: Any = None, spec: Any = None) -> "DDPRuntime":
        """``--ddp KEY=VALUE`` settings, typed as :class:`DDPConfig`'s fields; unset ones are
        :data:`DDP_DEFAULT`'s (a cap given alone caps every bucket, as in DDP)."""
        values = DDP_DEFAULT.to_dict()
        if "bucket_cap_mb" in options and "first_bucket_mb" not in options:
            values["first_bucket_mb"] = None
        for key, text in options.items():
            if key not in values:
                raise SpecError(f"--ddp: unknown key {key!r}; valid: "
                                f"{', '.join(k for k in values if k != 'num_groups')}")
            values[key] = _typed_option(key, text)
        if values["comm_hook"] == "powersgd":
            values["first_bucket_mb"] = None
            values["powersgd_rank"] = values["powersgd_rank"] or 4
        return cls(DDPConfig.from_dict(values))


def _typed_option(key: str, text: str) -> Any:
    """One ``--ddp`` value as its field's type."""
    if key in ("bucket_cap_mb", "first_bucket_mb"):
        if key == "first_bucket_mb" and text.lower() in ("null", "none"):
            return None
        try:
            return float(text)
        except ValueError:
            raise SpecError(f"--ddp: {key}: expected a number of MiB, got {text!r}") from None
    if key == "powersgd_rank":
        # isdigit() alone passes '²' (int() refuses it) and 5,000 digits (past int()'s limit)
        if not (text.isascii() and text.isdigit()) or len(text) > 18:
            raise SpecError(f"--ddp: powersgd_rank: expected a positive integer, got {text[:40]!r}"
                            f"{'...' if len(text) > 40 else ''}")
        return int(text)
    if key == "gradient_as_bucket_view":
        if text.lower() not in ("true", "false"):
            raise SpecError(f"--ddp: gradient_as_bucket_view: expected true or false, got {text!r}")
        return text.lower() == "true"
    return text


def ddp_runtime(config: DDPConfig) -> DDPRuntime:
    """The runtime that runs torch DDP as ``config`` says."""
    return DDPRuntime(config)
