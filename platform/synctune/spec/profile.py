"""The measured compute profile of a workload on a device (DESIGN.md vocabulary; dPRO §4.1).

What the replay simulator needs of the computation, measured rather than counted: the forward
time, when each variable's gradient becomes ready during backward, the end of backward and the
optimizer's step, all at a stated per-replica batch and with a stated number of workers sharing
the machine (on CPUs, four workers on two cores compute at half speed; a profile measured alone
would not say so).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from .errors import SpecError
from .checks import is_number, require
from .files import MAX_NAME_LENGTH
from .model import ModelSpec

__all__ = ["ComputeProfile"]


def _file_name_part(value: Any) -> bool:
    """Whether ``value`` is a model or device name as :class:`ModelSpec` accepts one (printable,
    no '/', not a path of its own) and so can be part of a file name."""
    return (isinstance(value, str) and 0 < len(value) <= MAX_NAME_LENGTH and value.isprintable() and "/" not in value
            and value not in (".", ".."))

#: Version of :meth:`ComputeProfile.to_dict`'s form.
PROFILE_SCHEMA = 1


@dataclass(frozen=True, kw_only=True)
class ComputeProfile:
    """Medians over timed iterations of the slowest worker, in seconds.

    ``ready_s[i]`` is when the gradient of the model spec's ``i``-th variable (backward order)
    was ready, counted from the start of backward; ``backward_s`` is when backward returned;
    ``step_s`` is one optimizer step over every variable (no synchronization anywhere).
    ``batch_size`` is the per-replica batch it was measured at, ``workers`` how many workers
    computed at once on ``device`` (the trial's contention).

    On a GPU the host launches kernels ahead of the device, and a model of many small kernels
    keeps the GPU waiting for the host; two optional figures say so (None where not measured: CPU
    profiles, whose calls return with the work done). ``launch_s``: when the iteration's last
    call (the step) returned on the host clock, from the iteration's start; ``hook_s``: the host
    seconds the engine's gradient path adds per variable on that host (a probe of its own, on a
    synthetic model, not this one: :func:`synctune.engine.profile.hook_cost`). The replay's host
    path is ``launch_s + variables x hook_s`` (:meth:`host_s`).

    ``recompute_s``: per activation-checkpointing mode (``full``, ``selective``), the seconds
    backward took longer with every block of the model checkpointed in that mode (the
    recomputed forwards; :mod:`synctune.strategy.checkpoint`), where the profile measured it
    (None: not measured, and the replay adds nothing for checkpointed blocks).

    ``io_elements``: per module holding parameters of its own (its dotted name in the model), the
    elements per sample of its first tensor input and of its output, from one forward (the
    activations a tensor-parallel split module's collectives carry; None: not measured).
    """

    model: str
    device: str
    workers: int
    batch_size: int
    forward_s: float
    backward_s: float
    step_s: float
    ready_s: tuple[float, ...]
    launch_s: float | None = None
    hook_s: float | None = None
    recompute_s: Mapping[str, float] | None = None
    io_elements: Mapping[str, tuple[float, float]] | None = None

    def __post_init__(self) -> None:
        where = f"compute profile of {self.model!r}"
        # Both name the file the profile is filed as (model@device-wN.json): a profile from a
        # pulled release must not be able to name a path outside the profiles folder.
        require(_file_name_part(self.model), "compute profile: model",
                f"a model name without '/' of at most {MAX_NAME_LENGTH} characters", self.model)
        require(_file_name_part(self.device), f"{where}: device",
                f"a device name without '/' of at most {MAX_NAME_LENGTH} characters", self.device)
        for key in ("workers", "batch_size"):
            value = getattr(self, key)
            require(isinstance(value, int) and not isinstance(value, bool) and value >= 1, f"{where}: {key}",
                    "a positive integer", value)
        for key in ("forward_s", "backward_s", "step_s"):
            value = getattr(self, key)
            require(is_number(value) and 0 <= value < 1e6, f"{where}: {key}", "seconds (a non-negative number)",
                    value)
        for key in ("launch_s", "hook_s"):
            value = getattr(self, key)
            require(value is None or (is_number(value) and 0 <= value < 1e6), f"{where}: {key}",
                    "seconds (a non-negative number) or null", value)
        require(isinstance(self.ready_s, tuple) and all(is_number(x) and 0 <= x < 1e6 for x in self.ready_s),
                f"{where}: ready_s", "a list of non-negative seconds", self.ready_s)
        require(self.recompute_s is None or (isinstance(self.recompute_s, Mapping) and all(
            k in ("full", "selective") and is_number(v) and 0 <= v < 1e6 for k, v in self.recompute_s.items())),
            f"{where}: recompute_s", "seconds per checkpointing mode (full, selective) or null", self.recompute_s)
        require(self.io_elements is None or (isinstance(self.io_elements, Mapping) and all(
            isinstance(k, str) and 0 < len(k) <= 1000 and isinstance(v, (tuple, list)) and len(v) == 2
            and all(is_number(x) and 0 <= x < 1e15 for x in v) for k, v in self.io_elements.items())),
            f"{where}: io_elements", "per module name, [input elements, output elements] per sample, or null",
            self.io_elements)
        if self.io_elements is not None:
            object.__setattr__(self, "io_elements", {k: (float(v[0]), float(v[1])) for k, v in self.io_elements.items()})

    def check(self, model: ModelSpec) -> None:
        """Refuse a profile of another model (one ready time per variable of ``model``)."""
        require(self.model == model.name, f"compute profile of {self.model!r}: model", repr(model.name), self.model)
        require(len(self.ready_s) == len(model.variables), f"compute profile of {self.model!r}: ready_s",
                f"{len(model.variables)} ready times (one per variable of {model.name!r})", len(self.ready_s))

    def host_s(self) -> float | None:
        """The host's own time per iteration (``launch_s`` plus the engine's hooks on every
        variable), or None where the profile did not measure it."""
        if self.launch_s is None or self.hook_s is None:
            return None
        return self.launch_s + len(self.ready_s) * self.hook_s

    def to_dict(self) -> dict[str, Any]:
        """The profile as plain data under its schema version (:data:`PROFILE_SCHEMA`), what a
        profile file holds; the host figures only where measured."""
        host = {k: getattr(self, k) for k in ("launch_s", "hook_s") if getattr(self, k) is not None}
        if self.recompute_s is not None:
            host["recompute_s"] = dict(self.recompute_s)
        if self.io_elements is not None:
            host["io_elements"] = {k: list(v) for k, v in self.io_elements.items()}
        return {"schema": PROFILE_SCHEMA, "model": self.model, "device": self.device, "workers": self.workers,
                "batch_size": self.batch_size, "forward_s": self.forward_s, "backward_s": self.backward_s,
                "step_s": self.step_s, "ready_s": list(self.ready_s), **host}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str = "compute profile") -> "ComputeProfile":
        """The profile of :meth:`to_dict`'s form, validated; errors start with ``where`` (e.g. the
        file it came from), since profiles arrive from files and pulled releases."""
        require(isinstance(data, Mapping), where, "a mapping", type(data).__name__)
        require(data.get("schema") == PROFILE_SCHEMA, f"{where}: schema", PROFILE_SCHEMA, data.get("schema"))
        keys = ("model", "device", "workers", "batch_size", "forward_s", "backward_s", "step_s", "ready_s")
        missing = [k for k in keys if k not in data]
        require(not missing, where, f"keys {', '.join(keys)}", f"missing {', '.join(missing)}")
        ready = data["ready_s"]
        require(isinstance(ready, list), f"{where}: ready_s", "a list of numbers", type(ready).__name__)
        try:
            host = {k: data[k] for k in ("launch_s", "hook_s", "recompute_s", "io_elements") if data.get(k) is not None}  # optional
            return cls(**{k: data[k] for k in keys if k != "ready_s"}, ready_s=tuple(ready), **host)
        except SpecError as exc:
            raise SpecError(f"{where}: {exc}") from None
