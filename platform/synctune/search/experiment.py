"""Experiment files (``experiments/*.yaml``): what a search optimises and how, validated on load
with errors that name the file, the key, the expected and the actual value."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from ..spec._util import LIMITS, check_keys, in_range, is_number
from ..spec.errors import SpecError
from ..spec.files import check_name, read_yaml

__all__ = ["ALGORITHMS", "GENERATORS", "Experiment", "load_experiment"]

#: Search variants (AutoDist §3.3 and its ablations): the full Algorithm 1, constrained random
#: search without a simulator ("Random+G"), plain random search, a genetic algorithm, and the
#: simulator-only searches whose best strategies are trialled directly: AutoDDL §4.4's
#: coordinate descent and TAG §4.2.2's Monte-Carlo tree search.
ALGORITHMS = ("autodist", "random-guided", "random", "genetic", "coordinate-descent", "mcts")
#: Where ``autodist`` gets each round's proposals: the guided sampler (AutoDist §2.4), or the
#: best strategies a simulator-only search found (the same selection then picks among them).
GENERATORS = ("sampler", "coordinate-descent", "mcts")
SIMULATOR_CHOICES = ("pretrained", "analytic", "replay", "rnn", "linear", "gat")
#: A ``baselines:`` entry that is a real Horovod run (``hvd`` or ``hvd:KEY=VALUE,...``).
HOROVOD_BASELINE = "hvd"


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """A validated experiment. What it trains is ``model`` (a zoo model) or ``workload`` (a
    user's factory, ``package.module:factory`` or ``path/to/file.py:factory``; a relative file
    path is relative to the experiment file's folder), exactly one. ``simulator`` is
    ``pretrained`` (the default: the simulator shipped with synctune, fine-tuned on the search's
    own trials, never re-initialised), a kind learned from scratch during the search (``rnn``,
    ``linear``, ``gat``), a training-free one (``analytic``; ``replay``, dPRO §4.3, from the
    compute profiles ``synctune sim profile`` measured), or the path of a saved simulator to
    transfer from. Learned ones score proposals only while they rank this search's new trials
    better than the training-free model (AutoDist §2.4).

    ``baselines`` names builders (``tuned``: the tuned set) and real Horovod runs (``hvd``,
    ``hvd:fusion_threshold_mb=64,cycle_time_ms=5``: the ``horovod`` runtime with those settings),
    kept apart in ``runtime_baselines``.

    ``ddp_trials`` torch DDP trials (bucket size, first bucket, comm hook tuned by Optuna through
    Ray Tune) run before the search as one more baseline, outside ``budget`` (0: none). At the
    end the best searched strategy is re-measured against the best baseline interleaved on the
    same processes, ``confirm_rounds`` rounds of ``confirm_iters`` iterations per arm (0 rounds:
    no confirmation). With ``confirm_candidates`` above 1, the searched strategies with that many
    fastest single trials are screened first, interleaved with the baseline (half as many rounds,
    at least 2), and the confirmation re-measures the screening's pick on fresh rounds: the
    fastest single trial of many noisy ones is partly luck. ``incumbent_moves: true`` makes each
    ``autodist`` round's last proposal the best measured strategy one move away (off by default:
    on ncf-small@lab-b12 it cost the search its wins, 0.75x where 1.80x without). ``lossy: false`` keeps lossy compression (fp16, bf16, PowerSGD) out of
    the search's proposals and of tuned DDP's comm hooks: every candidate then trains exactly as
    plain data-parallel SGD.

    ``generator`` is where ``autodist`` draws a round's proposals (``sampler``, or the
    simulator-only ``coordinate-descent`` or ``mcts``); ``sim_evaluations`` is how many
    strategies such a search may score per round (a count, not a time, so a resumed search
    proposes exactly what the uninterrupted one would)."""

    name: str
    cluster: str
    model: str = ""
    workload: str = ""
    budget: int
    algorithm: str = "autodist"
    generator: str = "sampler"
    sim_evaluations: int = 20_000
    simulator: str = "pretrained"
    proposals: int = 2000
    candidates: int = 4
    warmup: int = 10
    iters: int = 40
    baselines: tuple[str, ...] = ("allreduce", "horovod", "ps-lb", "partitioned-ps", "parallax")
    fidelity_accuracy: float = 0.8
    seed: int = 0
    timeout_s: float = 900.0
    slices: int = 1
    ddp_trials: int = 8
    confirm_rounds: int = 10
    confirm_iters: int = 5
    confirm_candidates: int = 3
    incumbent_moves: bool = False
    lossy: bool = True
    output: str = ""
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = self.source or "experiment"

        def bad(key: str, expected: str) -> SpecError:
            shown = repr(getattr(self, key))
            return SpecError(f"{where}: {key}: expected {expected}, got {shown[:60] + '...' if len(shown) > 60 else shown}")

        check_name(self.name, f"{where}: name")
        for key in ("model", "workload", "cluster", "simulator", "output"):
            value = getattr(self, key)
            optional = key in ("output", "model", "workload")
            if not isinstance(value, str) or not (value or optional) or len(value) > 4096:
                raise bad(key, "a file path" if key == "output" else "a non-empty string")
        if bool(self.model) == bool(self.workload):
            raise SpecError(f"{where}: give exactly one of model (a zoo model) and workload (package.module:factory "
                            f"or path/to/file.py:factory)")
        if self.workload and ":" not in self.workload:
            raise bad("workload", "package.module:factory or path/to/file.py:factory")
        for key, low, high in (("budget", 1, LIMITS["budget"]), ("proposals", 1, LIMITS["proposals"]),
                               ("candidates", 1, LIMITS["budget"]), ("warmup", 0, LIMITS["iterations"]),
                               ("iters", 1, LIMITS["iterations"]), ("slices", 1, 1024),
                               ("ddp_trials", 0, LIMITS["budget"]), ("confirm_iters", 1, LIMITS["iterations"]),
                               ("confirm_candidates", 1, 16),
                               ("seed", 0, LIMITS["seed"])):
            if not in_range(getattr(self, key), low, high):
                raise bad(key, f"an integer from {low} to {high}")
        if not (self.confirm_rounds == 0 or in_range(self.confirm_rounds, 2, 1000)):
            raise bad("confirm_rounds", "0 (no confirmation) or an integer from 2 to 1000")
        if not isinstance(self.lossy, bool):
            raise bad("lossy", "true or false")
        if not isinstance(self.incumbent_moves, bool):
            raise bad("incumbent_moves", "true or false")
        if self.algorithm not in ALGORITHMS:
            raise bad("algorithm", f"one of {', '.join(ALGORITHMS)}")
        if self.generator not in GENERATORS:
            raise bad("generator", f"one of {', '.join(GENERATORS)}")
        if self.generator != "sampler" and self.algorithm != "autodist":
            raise SpecError(f"{where}: generator: {self.generator} feeds algorithm autodist, not {self.algorithm}; "
                            f"use algorithm: autodist, or generator: sampler")
        if not in_range(self.sim_evaluations, 100, 10_000_000):
            raise bad("sim_evaluations", "an integer from 100 to 10000000")
        if not (self.simulator in SIMULATOR_CHOICES or self.simulator.endswith((".pt", ".sim"))):
            raise bad("simulator", f"one of {', '.join(SIMULATOR_CHOICES)} or a saved simulator file (.pt)")
        if not (is_number(self.fidelity_accuracy) and 0.5 <= self.fidelity_accuracy < 1):
            raise bad("fidelity_accuracy", "a number in [0.5, 1)")
        if not (is_number(self.timeout_s) and 0 < self.timeout_s <= LIMITS["timeout_s"]):
            raise bad("timeout_s", f"a positive number of seconds up to {LIMITS['timeout_s']:g}")
        if isinstance(self.baselines, list):
            object.__setattr__(self, "baselines", tuple(self.baselines))
        if not isinstance(self.baselines, tuple) or not all(isinstance(b, str) for b in self.baselines):
            raise bad("baselines", "a list of builder names, e.g. [allreduce, ps-lb, 'allreduce:chunk=8'] or [tuned], "
                                   "and real Horovod runs ('hvd', 'hvd:fusion_threshold_mb=64')")
        from ..strategy.builders import BUILDERS, TUNED_BASELINES, parse_baseline
        from ..strategy.schema import StrategyError

        # ``hvd`` entries are real Horovod trials (a runtime, not a builder): kept apart, their
        # options checked against Horovod's settings when the search starts (run.search).
        runtime = tuple(b for b in self.baselines if b.partition(":")[0] == HOROVOD_BASELINE)
        for b in runtime:
            options = b.partition(":")[2]
            if options and not all(k.strip() and "=" in k for k in options.split(",")):
                raise SpecError(f"{where}: baselines: {b[:60]!r}: expected hvd or hvd:KEY=VALUE,KEY=VALUE "
                                f"(e.g. hvd:fusion_threshold_mb=64,cycle_time_ms=5)")
        object.__setattr__(self, "runtime_baselines", tuple(dict.fromkeys(runtime)))
        object.__setattr__(self, "baselines", tuple(b for b in self.baselines if b not in runtime))
        # Entries written out are run even where they cannot apply (the trial then says why);
        # entries of the tuned set that do not apply to a cluster are left out of the search.
        object.__setattr__(self, "explicit_baselines", tuple(b for b in self.baselines if b != "tuned"))
        expanded = tuple(e for b in self.baselines for e in (TUNED_BASELINES if b == "tuned" else (b,)))
        object.__setattr__(self, "baselines", tuple(dict.fromkeys(expanded)))
        for b in self.baselines:
            if b.partition(":")[0] not in BUILDERS:
                raise SpecError(f"{where}: baselines: unknown builder {b[:40]!r}; valid: tuned, {HOROVOD_BASELINE}, "
                                f"{', '.join(BUILDERS)}")
            try:
                parse_baseline(b)
            except StrategyError as exc:
                raise SpecError(f"{where}: baselines: {exc}") from None
        if self.candidates > self.proposals:
            raise SpecError(f"{where}: candidates ({self.candidates}) cannot exceed proposals ({self.proposals})")

    @classmethod
    def from_dict(cls, data: Any, source: str = "experiment") -> "Experiment":
        required = ("name", "cluster", "budget")
        known = tuple(f.name for f in fields(cls) if f.name != "source")
        check_keys(data, source, required, tuple(k for k in known if k not in required))
        values = dict(data)
        workload = values.get("workload")
        if isinstance(workload, str) and ":" in workload and source != "experiment":
            # A file path in the workload is relative to the experiment file, as users write it.
            target, _sep, attr = workload.rpartition(":")
            if target.endswith(".py") and not Path(target).is_absolute():
                values["workload"] = f"{Path(source).parent / target}:{attr}"
        return cls(**values, source=source)

    @property
    def trains(self) -> str:
        """What the experiment trains: the zoo model's name or the workload's import path."""
        return self.workload or self.model


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment YAML file."""
    return Experiment.from_dict(read_yaml(path, "experiment"), source=str(path))
