"""Experiment files (``experiments/*.yaml``): what a search optimises and how, validated on load
with errors that name the file, the key, the expected and the actual value."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping

from ..spec._util import is_int, is_number, read_yaml
from ..spec.errors import SpecError

__all__ = ["ALGORITHMS", "Experiment", "load_experiment"]

#: Search variants (AutoDist §3.3 and its ablations): the full Algorithm 1, constrained random
#: search without a simulator ("Random+G"), plain random search, and a genetic algorithm.
ALGORITHMS = ("autodist", "random-guided", "random", "genetic")
SIMULATOR_CHOICES = ("analytic", "rnn", "linear", "gat")


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """A validated experiment. ``simulator`` is a kind learned from scratch during the search
    (``rnn``, ``linear``, ``gat``), ``analytic``, or the path of a saved simulator to transfer from."""

    name: str
    model: str
    cluster: str
    budget: int
    algorithm: str = "autodist"
    simulator: str = "rnn"
    proposals: int = 2000
    candidates: int = 4
    warmup: int = 10
    iters: int = 40
    baselines: tuple[str, ...] = ("allreduce", "horovod", "ps-lb", "partitioned-ps", "parallax")
    fidelity_accuracy: float = 0.8
    seed: int = 0
    timeout_s: float = 900.0
    slices: int = 1
    output: str = ""
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = self.source or "experiment"

        def bad(key: str, expected: str) -> SpecError:
            return SpecError(f"{where}: {key}: expected {expected}, got {getattr(self, key)!r}")

        for key in ("name", "model", "cluster"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise bad(key, "a non-empty string")
        for key, low in (("budget", 1), ("proposals", 1), ("candidates", 1), ("warmup", 0), ("iters", 1),
                         ("slices", 1)):
            value = getattr(self, key)
            if not (is_int(value) and value >= low):
                raise bad(key, f"an integer >= {low}")
        if self.algorithm not in ALGORITHMS:
            raise bad("algorithm", f"one of {', '.join(ALGORITHMS)}")
        if not isinstance(self.simulator, str) or not (
                self.simulator in SIMULATOR_CHOICES or self.simulator.endswith((".pt", ".sim"))):
            raise bad("simulator", f"one of {', '.join(SIMULATOR_CHOICES)} or a saved simulator file (.pt)")
        if not (is_number(self.fidelity_accuracy) and 0.5 <= self.fidelity_accuracy < 1):
            raise bad("fidelity_accuracy", "a number in [0.5, 1)")
        if not (is_number(self.timeout_s) and self.timeout_s > 0):
            raise bad("timeout_s", "a positive number of seconds")
        if not is_int(self.seed):
            raise bad("seed", "an integer")
        if isinstance(self.baselines, list):
            object.__setattr__(self, "baselines", tuple(self.baselines))
        from ..strategy.builders import BUILDERS

        for b in self.baselines:
            if b not in BUILDERS:
                raise SpecError(f"{where}: baselines: unknown builder {b!r}; valid: {', '.join(BUILDERS)}")
        if self.candidates > self.proposals:
            raise SpecError(f"{where}: candidates ({self.candidates}) cannot exceed proposals ({self.proposals})")

    @classmethod
    def from_dict(cls, data: Any, source: str = "experiment") -> "Experiment":
        if not isinstance(data, Mapping):
            raise SpecError(f"{source}: expected a mapping of keys, got {type(data).__name__}")
        known = [f.name for f in fields(cls) if f.name != "source"]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise SpecError(f"{source}: unknown key(s) {unknown}; valid: {', '.join(known)}")
        for key in ("name", "model", "cluster", "budget"):
            if key not in data:
                raise SpecError(f"{source}: missing key {key!r}")
        return cls(**dict(data), source=source)


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment YAML file."""
    return Experiment.from_dict(read_yaml(path, "experiment"), source=str(path))
