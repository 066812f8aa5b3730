"""Experiment files (``experiments/*.yaml``): what a search optimises and how, in sections, each
validated where it is built with errors that name the file, the key as written, the expected and
the actual value.

A file has a ``name``, a ``seed`` and six sections: ``domain`` (what trains, on which cluster),
``search`` (the algorithm and its budget), ``trial`` (how one trial is measured), ``baselines``
(what the search is compared with), ``confirm`` (the interleaved re-measurement of the winner)
and ``run`` (slices and output). Each section is written as a mapping (``search: {budget: 30}``)
or flat, its keys at the top level of the file (``budget: 30``): :data:`FLAT_KEYS` says which
section each top-level key belongs to. A setting given both ways is
refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal, get_args

from ..spec.checks import LIMITS, check_keys, in_range, is_number
from ..spec.errors import SpecError
from ..spec.files import check_name, read_yaml

__all__ = ["ALGORITHMS", "GENERATORS", "SIMULATOR_CHOICES", "FLAT_KEYS", "SECTIONS", "Experiment", "DomainSection",
           "SearchSection", "TrialSection", "BaselinesSection", "ConfirmSection", "RunSection", "load_experiment"]

#: Search variants (AutoDist §3.3 and its ablations): the full Algorithm 1, constrained random
#: search without a simulator ("Random+G"), plain random search, a genetic algorithm, and the
#: simulator-only searches whose best strategies are trialled directly: AutoDDL §4.4's
#: coordinate descent and TAG §4.2.2's Monte-Carlo tree search.
Algorithm = Literal["autodist", "random-guided", "random", "genetic", "coordinate-descent", "mcts"]
ALGORITHMS: tuple[str, ...] = get_args(Algorithm)
#: Where ``autodist`` gets each round's proposals: the guided sampler (AutoDist §2.4), or the
#: best strategies a simulator-only search found (the same selection then picks among them).
Generator = Literal["sampler", "coordinate-descent", "mcts"]
GENERATORS: tuple[str, ...] = get_args(Generator)
#: The simulators a search can name by kind; the other choice is a saved simulator file.
SimulatorKind = Literal["pretrained", "analytic", "replay", "rnn", "linear", "gat"]
SIMULATOR_CHOICES: tuple[str, ...] = get_args(SimulatorKind)
#: The algorithms that score no proposal, so need no simulator.
UNSIMULATED: tuple[str, ...] = ("random", "random-guided")
#: A Horovod baseline entry: a real Horovod run (``hvd`` or ``hvd:KEY=VALUE,...``), not a builder.
HOROVOD_BASELINE = "hvd"
#: The tuned Megatron baseline's entry in ``baselines.builders``: Megatron-style tensor parallelism
#: with FSDP2 across, its settings tuned (``baselines.megatron_trials``), not a builder trial.
MEGATRON_BASELINE = "megatron"
#: The tuned runtimes' trial counts whose ``auto`` an entry of ``baselines.builders`` decides (8
#: where it is listed, else 0): field -> entry.
LISTED_TUNING = {"megatron_trials": MEGATRON_BASELINE}
#: The optimizers a trial can step (the engine's ``OPTIMIZERS``; a test holds them equal).
TRIAL_OPTIMIZERS = ("sgd", "adam")
#: The builders trialled first when an experiment names none.
DEFAULT_BUILDERS = ("allreduce", "horovod", "ps-lb", "partitioned-ps", "parallax")


def _shown(value: Any) -> str:
    """A value as an error shows it: its repr, cut at 60 characters."""
    shown = repr(value)
    return shown[:60] + "..." if len(shown) > 60 else shown


def _strings(value: Any) -> bool:
    """Whether ``value`` is a tuple of strings."""
    return isinstance(value, tuple) and all(isinstance(v, str) for v in value)


@dataclass(frozen=True, kw_only=True)
class _Section:
    """What every section of an experiment has: its key in the file, and where it was read, so
    that its errors name the file and each key as the user wrote it."""

    #: The section's key in an experiment file.
    KEY: ClassVar[str] = ""
    #: A field's top-level key in the flat form, where it is not the field's own name.
    FLAT: ClassVar[Mapping[str, str]] = {}

    #: The file the section was read from ("" when built in code); its errors start with it.
    source: str = field(default="", compare=False, repr=False)
    #: The fields the file gave as top-level keys (the flat form); errors name them so.
    written_flat: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    @classmethod
    def settings(cls) -> tuple[str, ...]:
        """The section's keys: its fields, less ``source`` and ``written_flat``."""
        return tuple(f.name for f in fields(cls) if f.name not in ("source", "written_flat"))

    @classmethod
    def required(cls) -> tuple[str, ...]:
        """The keys without a default."""
        return tuple(f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING)

    @classmethod
    def flat_key(cls, name: str) -> str:
        """The top-level key that sets field ``name`` in the flat form."""
        return cls.FLAT.get(name, name)

    @classmethod
    def from_flat(cls, flat: str, value: Any) -> dict[str, Any]:
        """The fields a top-level key ``flat`` sets, with their values."""
        return {name: tuple(value) if isinstance(value, list) else value
                for name in cls.settings() if cls.flat_key(name) == flat}

    def key(self, name: str) -> str:
        """How errors name field ``name``: as written, ``budget`` in the flat form, else ``search.budget``."""
        return self.flat_key(name) if name in self.written_flat else f"{self.KEY}.{name}"

    def error(self, text: str) -> SpecError:
        """A :class:`SpecError` saying ``text``, after the file."""
        return SpecError(f"{self.source}: {text}" if self.source else text)

    def bad(self, name: str, expected: str) -> SpecError:
        """The error of field ``name``: its key, what was expected, what it holds."""
        return self.error(f"{self.key(name)}: expected {expected}, got {_shown(getattr(self, name))}")

    def check_int(self, name: str, low: int, high: int) -> None:
        """Field ``name`` is an integer in [low, high]."""
        if not in_range(getattr(self, name), low, high):
            raise self.bad(name, f"an integer from {low} to {high}")

    def check_choice(self, name: str, choices: tuple[str, ...]) -> None:
        """Field ``name`` is one of ``choices`` (the error lists them)."""
        if not (isinstance(getattr(self, name), str) and getattr(self, name) in choices):
            raise self.bad(name, f"one of {', '.join(choices)}")

    def check_bool(self, name: str) -> None:
        """Field ``name`` is true or false."""
        if not isinstance(getattr(self, name), bool):
            raise self.bad(name, "true or false")

    def check_text(self, name: str, expected: str, *, optional: bool) -> None:
        """Field ``name`` is a string of at most 4096 characters, non-empty unless ``optional``."""
        value = getattr(self, name)
        if not isinstance(value, str) or not (value or optional) or len(value) > 4096:
            raise self.bad(name, expected)


@dataclass(frozen=True, kw_only=True)
class DomainSection(_Section):
    """The domain (DESIGN.md): what trains, a zoo model or a user's workload (exactly one), and
    on which cluster."""

    KEY = "domain"

    #: The cluster: a preset (``local-2x2``, ``B7``) or a cluster spec file.
    cluster: str
    #: A zoo model (``bert-tiny``); or give ``workload``.
    model: str = ""
    #: A user's factory, ``package.module:factory`` or ``path/to/file.py:factory`` (a relative
    #: file path is relative to the experiment file's folder); or give ``model``.
    workload: str = ""

    def __post_init__(self) -> None:
        for name in ("cluster", "model", "workload"):
            self.check_text(name, "a non-empty string", optional=name != "cluster")
        if bool(self.model) == bool(self.workload):
            raise self.error(f"give exactly one of {self.key('model')} (a zoo model) and {self.key('workload')} "
                             f"(package.module:factory or path/to/file.py:factory)")
        if self.workload and ":" not in self.workload:
            raise self.bad("workload", "package.module:factory or path/to/file.py:factory")

    @property
    def trains(self) -> str:
        """What trains: the zoo model's name or the workload's import path."""
        return self.workload or self.model


@dataclass(frozen=True, kw_only=True)
class SearchSection(_Section):
    """How the search proposes strategies (AutoDist §2.4, Algorithm 1, or a variant) and how many
    trials it may run."""

    KEY = "search"

    #: Trials of the search, the builder baselines included (tuned DDP and Horovod runs are not).
    budget: int
    #: The search variant (:data:`ALGORITHMS`).
    algorithm: Algorithm = "autodist"
    #: Where ``autodist`` draws a round's proposals: the guided ``sampler``, or the
    #: simulator-only ``coordinate-descent`` or ``mcts``.
    generator: Generator = "sampler"
    #: Strategies a simulator-only search may score per round (a count, not a time, so a resumed
    #: search proposes exactly what the uninterrupted one would).
    sim_evaluations: int = 20_000
    #: ``pretrained`` (shipped with synctune, fine-tuned on the search's own trials, never
    #: re-initialised), a kind learned from scratch (``rnn``, ``linear``, ``gat``), a
    #: training-free one (``analytic``; ``replay``, dPRO §4.3, from the compute profiles
    #: ``synctune sim profile`` measured), or the path of a saved simulator (``.pt``) to transfer
    #: from. Learned ones score proposals only while they rank this search's new trials better
    #: than the training-free model (AutoDist §2.4).
    simulator: SimulatorKind | str = "pretrained"
    #: Strategies sampled per round.
    proposals: int = 2000
    #: Strategies trialled per round (at most ``proposals``).
    candidates: int = 4
    #: The simulator's fidelity level: proposals scored below the highest score under which it
    #: still ranks measured trials with this accuracy are dropped.
    fidelity_accuracy: float = 0.8
    #: Each ``autodist`` round's last proposal is the best measured strategy one move away (off
    #: by default: on ncf-small@lab-b12 it cost the search its wins, 0.75x where 1.80x without).
    incumbent_moves: bool = False
    #: Whether lossy compression (fp16, bf16, PowerSGD) may be proposed, here and in tuned DDP's
    #: comm hooks; false: every candidate trains exactly as plain data-parallel SGD.
    lossy: bool = True
    #: Each device's memory budget in GiB (0: the cluster spec's device memory; a CPU node
    #: without one shares the host's memory among its workers). Proposals the memory model
    #: predicts over it are never trialled; a trial whose measured peak exceeds it is ``oom``.
    memory_gib: float = 0.0
    #: The share of the budget kept free (allocator fragmentation, the runtime's own context):
    #: strategies must fit ``memory_gib * (1 - memory_headroom)``.
    memory_headroom: float = 0.1
    #: Whether the search proposes ``shard`` units (FSDP2/ZeRO, per module): ``auto`` where
    #: replicated training does not fit the budget, ``true`` always, ``false`` never.
    shard: bool | Literal["auto"] = "auto"
    #: Whether the search proposes tensor parallelism (Megatron's plan per block, with sequence
    #: parallelism or without, in TP groups inside a node; scored by the replay simulator):
    #: ``auto`` where replicated training does not fit the budget, ``true`` always, ``false``
    #: never.
    tensor_parallel: bool | Literal["auto"] = False

    def __post_init__(self) -> None:
        for name, low, high in (("budget", 1, LIMITS["budget"]), ("proposals", 1, LIMITS["proposals"]),
                                ("candidates", 1, LIMITS["budget"]), ("sim_evaluations", 100, 10_000_000)):
            self.check_int(name, low, high)
        self.check_choice("algorithm", ALGORITHMS)
        self.check_choice("generator", GENERATORS)
        if self.generator != "sampler" and self.algorithm != "autodist":
            raise self.error(f"{self.key('generator')}: {self.generator} feeds {self.key('algorithm')} autodist, "
                             f"not {self.algorithm}; use {self.key('algorithm')}: autodist, or "
                             f"{self.key('generator')}: sampler")
        self.check_text("simulator", "a non-empty string", optional=False)
        if not (self.simulator in SIMULATOR_CHOICES or self.simulator.endswith((".pt", ".sim"))):
            raise self.bad("simulator", f"one of {', '.join(SIMULATOR_CHOICES)} or a saved simulator file (.pt)")
        if not (is_number(self.fidelity_accuracy) and 0.5 <= self.fidelity_accuracy < 1):
            raise self.bad("fidelity_accuracy", "a number in [0.5, 1)")
        self.check_bool("incumbent_moves")
        self.check_bool("lossy")
        if not (is_number(self.memory_gib) and 0 <= self.memory_gib <= (1 << 50) / (1 << 30)):
            raise self.bad("memory_gib", "a non-negative number of GiB (0: the cluster's device memory)")
        if not (is_number(self.memory_headroom) and 0 <= self.memory_headroom < 1):
            raise self.bad("memory_headroom", "a number in [0, 1) (the share of the budget kept free)")
        if not (isinstance(self.shard, bool) or self.shard == "auto"):
            raise self.bad("shard", "auto, true or false")
        if not (isinstance(self.tensor_parallel, bool) or self.tensor_parallel == "auto"):
            raise self.bad("tensor_parallel", "auto, true or false")
        if self.candidates > self.proposals:
            raise self.error(f"{self.key('candidates')} ({self.candidates}) cannot exceed "
                             f"{self.key('proposals')} ({self.proposals})")

    @property
    def uses_simulator(self) -> bool:
        """Whether the algorithm scores proposals with a simulator (all but the random variants)."""
        return self.algorithm not in UNSIMULATED


@dataclass(frozen=True, kw_only=True)
class TrialSection(_Section):
    """How one trial is measured: warm-up iterations, then timed ones (10 and 40 in the papers)."""

    KEY = "trial"

    #: Iterations run before timing starts (never counted).
    warmup: int = 10
    #: Timed iterations.
    iters: int = 40
    #: Seconds a trial may take, and a slice of the Ray cluster to come up.
    timeout_s: float = 900.0
    #: The optimizer every trial steps (``sgd``, ``adam``): Adam's two moments are what makes
    #: replicated training outgrow a device's memory, and the memory model counts them.
    optimizer: str = "sgd"
    #: Above 0: after ``iters``, go on until the 95% interval of the median iteration time is
    #: within this share of it, at most ``max_iters`` timed iterations or ``max_timed_s`` of
    #: them (the quieter trial; 0: exactly ``iters``). The search's confirmation re-measures its
    #: pick interleaved whatever this is, so the default keeps the papers' fixed count.
    target_ci: float = 0.0
    max_iters: int = 100
    max_timed_s: float = 30.0

    def __post_init__(self) -> None:
        self.check_choice("optimizer", TRIAL_OPTIMIZERS)
        self.check_int("warmup", 0, LIMITS["iterations"])
        self.check_int("iters", 1, LIMITS["iterations"])
        if not (is_number(self.target_ci) and 0 <= self.target_ci < 1):
            raise self.bad("target_ci", "a share from 0 (off) to below 1, e.g. 0.03 for +-3%")
        self.check_int("max_iters", self.iters if self.target_ci else 1, LIMITS["iterations"])
        if not (is_number(self.max_timed_s) and 0 < self.max_timed_s <= LIMITS["timeout_s"]):
            raise self.bad("max_timed_s", "a positive number of seconds")
        if not (is_number(self.timeout_s) and 0 < self.timeout_s <= LIMITS["timeout_s"]):
            raise self.bad("timeout_s", f"a positive number of seconds up to {LIMITS['timeout_s']:g}")


@dataclass(frozen=True, kw_only=True)
class BaselinesSection(_Section):
    """What the search is compared with: hand-optimised builders (AutoDist §3.1), trialled first
    inside the budget; real Horovod runs and the tuned runtimes (torch DDP, FSDP2, Megatron-style
    tensor parallelism), before the search, outside it.

    In the flat form one list, ``baselines:``, holds the builders and the Horovod runs."""

    KEY = "baselines"
    FLAT = {"builders": "baselines", "horovod": "baselines"}

    #: Builder entries as written: a builder name, a builder with options
    #: (``allreduce:chunk=8``), ``tuned`` (the papers' baselines with their settings swept), or
    #: ``megatron`` (the tuned Megatron baseline: see ``megatron_trials``).
    builders: tuple[str, ...] = DEFAULT_BUILDERS
    #: Real Horovod runs: ``hvd`` or ``hvd:KEY=VALUE,...`` (``hvd:fusion_threshold_mb=64,cycle_time_ms=5``),
    #: the ``horovod`` runtime with those settings (checked against Horovod's when the search starts).
    horovod: tuple[str, ...] = ()
    #: torch DDP trials (bucket size, first bucket, comm hook tuned by Optuna through Ray Tune),
    #: one more baseline, run before the search (0: none); skipped where the memory model says
    #: replicated training does not fit the budget.
    ddp_trials: int = 8
    #: torch FSDP2/HSDP trials (mesh, units, reshard after forward, prefetch, reduce dtype tuned by
    #: Optuna through Ray Tune; the first is FSDP2's defaults where they fit), run before the
    #: search: ``auto`` is 8 where the search proposes shard units (``search.shard``), else 0.
    fsdp_trials: int | Literal["auto"] = "auto"
    #: Megatron-style tensor parallelism with FSDP2 across (TP degree, sequence parallelism,
    #: reshard after forward, activation checkpointing tuned by Optuna through Ray Tune, only
    #: among the plans the memory budget admits), run before the search: ``auto`` is 8 where
    #: ``builders`` lists ``megatron`` (the tuned Megatron baseline's entry), else 0.
    megatron_trials: int | Literal["auto"] = "auto"

    def tuned_trials(self, runtime: str) -> int | str:
        """The trials of tuned runtime ``runtime``: the field ``<runtime>_trials`` (0 where the
        experiment has none for it); the Megatron baseline's ``auto`` decided here (it depends on
        the builders listed, not on the search)."""
        name = f"{runtime}_trials"
        wanted = getattr(self, name, 0)
        entry = LISTED_TUNING.get(name)
        if wanted == "auto" and entry is not None:
            return 8 if entry in self.builders else 0
        return wanted

    @classmethod
    def from_flat(cls, flat: str, value: Any) -> dict[str, Any]:
        """The flat ``baselines:`` list split into builders and Horovod runs (each run once)."""
        if flat != "baselines" or not isinstance(value, (list, tuple)):
            return super().from_flat(flat, value)
        runs = [e for e in value if isinstance(e, str) and e.partition(":")[0] == HOROVOD_BASELINE]
        return {"builders": tuple(e for e in value if e not in runs), "horovod": tuple(dict.fromkeys(runs))}

    def __post_init__(self) -> None:
        from ..strategy.builders import BUILDERS, SPLITTING_BUILDERS, parse_baseline
        from ..strategy.schema import StrategyError

        self.check_int("ddp_trials", 0, LIMITS["budget"])
        for name in ("fsdp_trials", "megatron_trials"):
            if getattr(self, name) != "auto" and not in_range(getattr(self, name), 0, LIMITS["budget"]):
                raise self.bad(name, f"auto or an integer from 0 to {LIMITS['budget']}")
        flat = "builders" in self.written_flat  # one list of builders and Horovod runs
        runs = ", and real Horovod runs ('hvd', 'hvd:fusion_threshold_mb=64')" if flat else ""
        if not _strings(self.builders):
            raise self.bad("builders", f"a list of builder names, e.g. [allreduce, ps-lb, 'allreduce:chunk=8'] or "
                                       f"[tuned]{runs}")
        if not _strings(self.horovod):
            raise self.bad("horovod", "a list of real Horovod runs, e.g. [hvd, 'hvd:fusion_threshold_mb=64']")
        for b in self.builders:
            if b.partition(":")[0] == HOROVOD_BASELINE:
                raise self.error(f"{self.key('builders')}: {b[:60]!r} is a real Horovod run, not a builder: list it "
                                 f"under {self.key('horovod')}")
        for b in self.horovod:
            head, _sep, options = b.partition(":")
            if head != HOROVOD_BASELINE or (options and not all(k.strip() and "=" in k for k in options.split(","))):
                raise self.error(f"{self.key('horovod')}: {b[:60]!r}: expected hvd or hvd:KEY=VALUE,KEY=VALUE "
                                 f"(e.g. hvd:fusion_threshold_mb=64,cycle_time_ms=5)")
        for b in self.builders:
            if b.partition(":")[0] in SPLITTING_BUILDERS and b != MEGATRON_BASELINE:
                raise self.error(f"{self.key('builders')}: {b[:60]!r}: the Megatron baseline is tuned (TP degree, "
                                 f"sequence parallelism, reshard after forward, activation checkpointing), not run "
                                 f"with fixed options; list it as {MEGATRON_BASELINE}, or measure this plan with "
                                 f"synctune trial --builder {MEGATRON_BASELINE}"
                                 + "".join(f" --option {o.strip()}" for o in b.partition(":")[2].split(",")
                                           if o.strip())[:120])
        if MEGATRON_BASELINE in self.builders and self.megatron_trials == 0:
            raise self.error(f"{self.key('builders')} lists {MEGATRON_BASELINE} (the tuned Megatron baseline) and "
                             f"{self.key('megatron_trials')} is 0; drop one of them")
        for b in self.expanded_builders:
            if b.partition(":")[0] not in BUILDERS:
                raise self.error(f"{self.key('builders')}: unknown builder {b[:40]!r}; valid: tuned, "
                                 f"{MEGATRON_BASELINE}, {HOROVOD_BASELINE}, {', '.join(BUILDERS)}")
            try:
                parse_baseline(b)
            except StrategyError as exc:
                raise self.error(f"{self.key('builders')}: {exc}") from None

    @property
    def expanded_builders(self) -> tuple[str, ...]:
        """The builder entries trialled, in order, each once: ``tuned`` stands for the tuned set;
        ``megatron`` is the tuned Megatron baseline (:attr:`megatron_trials`), not a builder trial."""
        from ..strategy.builders import TUNED_BASELINES

        return tuple(dict.fromkeys(e for b in self.builders if b != MEGATRON_BASELINE
                                   for e in (TUNED_BASELINES if b == "tuned" else (b,))))

    @property
    def explicit_builders(self) -> tuple[str, ...]:
        """The builder entries written out (not through ``tuned``): these run even where they
        cannot apply (the trial then says why), where the tuned set's are left out."""
        return tuple(b for b in self.builders if b not in ("tuned", MEGATRON_BASELINE))


@dataclass(frozen=True, kw_only=True)
class ConfirmSection(_Section):
    """The confirmation: the best searched strategy re-measured against the best baseline,
    interleaved (A/B/A/B) on the same processes, with a 95% interval (DESIGN.md). Both sides are
    screened first (the fastest single trial of many is partly luck, for a baseline as for a
    candidate), and rounds are added until the interval decides (:class:`~synctune.stats.SequentialRule`)."""

    KEY = "confirm"
    FLAT = {"rounds": "confirm_rounds", "iters": "confirm_iters", "candidates": "confirm_candidates",
            "baselines": "confirm_baselines", "max_rounds": "confirm_max_rounds", "width": "confirm_width"}

    #: Interleaved rounds before the first look (0: no confirmation; the recommendation is then
    #: unconfirmed).
    rounds: int = 10
    #: The cap: rounds are added (a look every ``rounds // 2``) until the interval excludes 1 or
    #: is narrower than :attr:`width`, up to this many (0: four times ``rounds``; equal to
    #: ``rounds``: exactly that many, one look).
    max_rounds: int = 0
    #: The relative interval width ((high - low) / ratio) at which a look stops without a
    #: verdict: the arms are then known to differ by less than about half of it.
    width: float = 0.10
    #: Timed iterations per arm and round.
    iters: int = 5
    #: Searched strategies screened first, those with the fastest single trials (the fastest of
    #: many noisy trials is partly luck): interleaved with the baselines on :attr:`screen_rounds`
    #: rounds, and the pick confirmed on fresh rounds (1: no screening).
    candidates: int = 3
    #: Baselines screened with them: the fastest of each kind (builders, tuned DDP, FSDP2 and
    #: Megatron, Horovod), then the next fastest, up to this many; the screening's pick is the one
    #: confirmed against.
    baselines: int = 3

    def __post_init__(self) -> None:
        if not (self.rounds == 0 or in_range(self.rounds, 2, 1000)):
            raise self.bad("rounds", "0 (no confirmation) or an integer from 2 to 1000")
        if not (self.max_rounds == 0 or in_range(self.max_rounds, max(2, self.rounds), 1000)):
            raise self.bad("max_rounds", f"0 (four times rounds) or an integer from rounds ({self.rounds}) to 1000")
        if not (isinstance(self.width, (int, float)) and not isinstance(self.width, bool)
                and 0 <= self.width <= 10):
            raise self.bad("width", "a number from 0 to 10 (the interval's width relative to the ratio)")
        self.check_int("iters", 1, LIMITS["iterations"])
        self.check_int("candidates", 1, 16)
        self.check_int("baselines", 1, 16)

    @property
    def screen_rounds(self) -> int:
        """Rounds of the screening's first look: half the confirmation's first look, at least 2."""
        return max(2, self.rounds // 2)

    @property
    def screen_max_rounds(self) -> int:
        """The screening's cap: it adds rounds (a look every ``rounds // 2``, the arms shown slower
        than the leader of their kind no longer timed) until its picks are told apart from the
        other contenders, up to half the confirmation's cap; with a fixed confirmation
        (``max_rounds`` equal to ``rounds``) the screening is fixed too."""
        return max(self.screen_rounds, self.rule.max_rounds // 2) if self.rounds else self.screen_rounds

    @property
    def rule(self):
        """The :class:`~synctune.stats.SequentialRule` of these settings (None without rounds)."""
        from ..stats import SequentialRule

        if not self.rounds:
            return None
        cap = self.max_rounds or min(1000, 4 * self.rounds)
        return SequentialRule(min_rounds=self.rounds, max_rounds=cap, step=max(1, self.rounds // 2),
                              width=float(self.width))


@dataclass(frozen=True, kw_only=True)
class RunSection(_Section):
    """Where the search runs and what it writes."""

    KEY = "run"

    #: Trials run concurrently, each on its own slice of the Ray cluster (one in a lab).
    slices: int = 1
    #: Seconds a slice may take to get its nodes and start its workers, apart from the trial's
    #: timeout: sized for a cloud node from zero (boot, a GPU image pulled, torch installed: 10 to
    #: 20 minutes on AWS). A slice that does not start in time is a failed trial with the reason.
    slice_timeout_s: float = 1800.0
    #: Where the recommended strategy goes ("": ``searches/<search id>-best.json`` in the data folder).
    output: str = ""

    def __post_init__(self) -> None:
        self.check_int("slices", 1, 1024)
        if not (is_number(self.slice_timeout_s) and 0 < self.slice_timeout_s <= LIMITS["timeout_s"]):
            raise self.bad("slice_timeout_s", f"a positive number of seconds up to {LIMITS['timeout_s']:g}")
        self.check_text("output", "a file path", optional=True)


#: The sections of an experiment file, by key.
SECTIONS: dict[str, type[_Section]] = {s.KEY: s for s in (DomainSection, SearchSection, TrialSection,
                                                          BaselinesSection, ConfirmSection, RunSection)}
#: The flat form: each top-level key of a section's setting, and the section it belongs to.
FLAT_KEYS: dict[str, type[_Section]] = {s.flat_key(name): s for s in SECTIONS.values() for name in s.settings()}


@dataclass(frozen=True, kw_only=True)
class Experiment:
    """A validated experiment: a name, a seed and the sections. Build one from a file with
    :func:`load_experiment`, from a file's keys (flat or nested) with :meth:`from_dict` or
    :meth:`from_keys`, or from sections."""

    #: Names the search (``<name>-seed<seed>``, its files and its MLflow experiment).
    name: str
    #: What trains, on which cluster.
    domain: DomainSection
    #: The algorithm, its simulator and the budget.
    search: SearchSection
    #: Seeds the search's rounds, the trials' data and the tuned DDP sampler.
    seed: int = 0
    #: How one trial is measured.
    trial: TrialSection = field(default_factory=TrialSection)
    #: What the search is compared with.
    baselines: BaselinesSection = field(default_factory=BaselinesSection)
    #: The interleaved re-measurement of the winner against the best baseline.
    confirm: ConfirmSection = field(default_factory=ConfirmSection)
    #: Slices and output.
    run: RunSection = field(default_factory=RunSection)
    #: The file it was read from ("" when built in code).
    source: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        where = self.source or "experiment"
        check_name(self.name, f"{where}: name")
        if not in_range(self.seed, 0, LIMITS["seed"]):
            raise SpecError(f"{where}: seed: expected an integer from 0 to {LIMITS['seed']}, got {_shown(self.seed)}")
        for key, section in SECTIONS.items():
            if not isinstance(getattr(self, key), section):
                raise SpecError(f"{where}: {key}: expected a {section.__name__}, got {_shown(getattr(self, key))}")

    @classmethod
    def from_dict(cls, data: Any, source: str = "experiment") -> "Experiment":
        """The experiment of an experiment file's mapping: ``name``, ``seed`` and the sections,
        each nested or flat (:data:`FLAT_KEYS`); errors start with ``source``."""
        flat = tuple(k for k in FLAT_KEYS if k not in SECTIONS)
        check_keys(data, source, ("name",), ("seed", *SECTIONS, *flat))
        sections = {key: _read_section(section, data, source) for key, section in SECTIONS.items()}
        return cls(name=data["name"], seed=data.get("seed", 0), **sections, source=source)

    @classmethod
    def from_keys(cls, **keys: Any) -> "Experiment":
        """The experiment of an experiment file's keys given as arguments, flat
        (``budget=30``) or nested (``search={"budget": 30}``)."""
        return cls.from_dict(keys)

    @property
    def trains(self) -> str:
        """What the experiment trains: the zoo model's name or the workload's import path."""
        return self.domain.trains

    @property
    def num_trials(self) -> int:
        """Trials before the confirmation: the search's budget, tuned DDP's, tuned FSDP2's where
        given as a number (``auto`` is decided when the search starts), the tuned Megatron
        baseline's and the Horovod runs."""
        fsdp = 0 if self.baselines.fsdp_trials == "auto" else self.baselines.fsdp_trials
        return (self.search.budget + self.baselines.ddp_trials + fsdp + int(self.baselines.tuned_trials("megatron"))
                + len(self.baselines.horovod))


def _read_section(section: type[_Section], data: Mapping, source: str) -> _Section:
    """One section of an experiment file's mapping: its nested mapping merged with its flat
    (top-level) keys, never the same setting both ways."""
    key = section.KEY
    nested = data.get(key, {})
    flat_form = key in FLAT_KEYS and not isinstance(nested, Mapping)  # baselines: [a, b]
    if flat_form:
        nested = {}
    elif not isinstance(nested, Mapping):
        raise SpecError(f"{source}: {key}: expected a mapping of {', '.join(section.settings())}, "
                        f"got {_shown(nested)}")
    check_keys(nested, f"{source}: {key}", (), section.settings())
    values = {name: tuple(v) if isinstance(v, list) else v for name, v in nested.items()}
    written_flat: set[str] = set()
    for flat, value in data.items():
        if FLAT_KEYS.get(flat) is not section or (flat == key and not flat_form):
            continue
        for name, v in section.from_flat(flat, value).items():
            if name in values:
                raise SpecError(f"{source}: {flat} and {key}.{name} are the same setting; give one of them "
                                f"({key}.{name})")
            values[name] = v
            written_flat.add(name)
    for name in section.required():
        if name not in values:
            raise SpecError(f"{source}: missing key {section.flat_key(name)!r} (or {key}.{name})")
    if section is DomainSection:
        values = _relative_workload(values, source)
    return section(**values, source=source, written_flat=frozenset(written_flat))


def _relative_workload(values: dict[str, Any], source: str) -> dict[str, Any]:
    """``values`` with a relative workload file made relative to the experiment file, as users write it."""
    workload = values.get("workload")
    if isinstance(workload, str) and ":" in workload and source != "experiment":
        target, _sep, attr = workload.rpartition(":")
        if target.endswith(".py") and not Path(target).is_absolute():
            return dict(values, workload=f"{Path(source).parent / target}:{attr}")
    return values


def load_experiment(path: str | Path) -> Experiment:
    """Read and validate an experiment YAML file."""
    return Experiment.from_dict(read_yaml(path, "experiment"), source=str(path))
