"""Everything a search needs before its first trial, in one step: :func:`prepare_search` checks
and reads what the experiment names and returns a frozen :class:`SearchContext`.

The preparation refuses, before Ray starts or any trial runs, what would fail later: a search id
that already has rows without ``--resume``, a lab search on several slices, the simulator file,
the Horovod baselines, a memory budget nothing fits, a tuned Megatron baseline that cannot run in
the domain. It then does the search's I/O in order: the dataset rows of this search (what a
resumed search continues from), the activation figures the memory budget starts with (measured
in this process, and for the tuned Megatron baseline's plans on one TP group of local processes
each), the compute profile the replay simulator needs (measured once per model and worker
count), and the search's MLflow parent run. The phases
of the search (:mod:`synctune.run.search`) only read the context.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..data.paths import dataset_dir
from ..data.store import TrialDataset
from ..data.tracking import MlflowLogger
from ..engine.measure import TrialConfig
from ..engine.runtime import Runtime
from ..engine.runtimes import executor_for, executor_names
from ..search.algorithm import StrategySearch
from ..search.experiment import Experiment
from ..search.interface import MemoryCheck
from ..simulator.bound import RuntimeResidual
from ..simulator.memory import GIB, MIB, ActivationFigures, MemoryBudget
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.files import check_name
from ..spec.model import ModelSpec
from ..strategy.builders import build_strategy
from ..strategy.schema import Strategy
from ..strategy.tensor_parallel import tp_key
from .baselines import horovod_baselines
from .profiles import ensure_profile
from .simulators import make_search_simulator

__all__ = ["SearchContext", "prepare_search", "search_algorithm", "search_id_of", "memory_budget", "check_budget",
           "prepare_memory", "split_batches", "split_activations", "cached_split_activations",
           "check_megatron_baseline",
           "megatron_baseline", "shard_rate", "tp_rate", "check_tensor_parallel", "SearchFilter",
           "tensorflow_projection"]


def search_id_of(exp: Experiment) -> str:
    """The stable id of an experiment's search (what ``--resume`` finds again); it names files."""
    return check_name(f"{exp.name}-seed{exp.seed}", f"{exp.source or 'experiment'}: search id")


def tensorflow_projection(model: ModelSpec) -> Callable[[Strategy], Strategy]:
    """What a search over a Keras model proposes: each sampled strategy projected into what
    TensorFlow's MultiWorkerMirroredStrategy executes (:func:`synctune.engine.tensorflow.project_to_tensorflow`)."""
    from ..engine.tensorflow import project_to_tensorflow

    return lambda strategy: project_to_tensorflow(strategy, model)


def memory_budget(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, workload: Any,
                  split: Sequence[Any] = ()) -> MemoryBudget:
    """The search's memory budget (DESIGN.md "memory budget"), its figures measured in this
    process (:func:`~synctune.engine.memory.single_process_memory`) at the batch sizes a rank
    trains with (the model's, and half of it, for a line through the uneven splits): the
    activations without checkpointing and with every block checkpointed in each mode, the blocks'
    shares, and the optimizer's state as the workload's own optimizer keeps it (a workload that
    brings its own AdamW holds two moments whatever ``trial.optimizer`` says). A model that
    cannot be built here (a Keras one) starts with none, and the optimizer by its name. ``split``:
    tensor-parallel plans whose devices' figures are measured too, each on one TP group of local
    processes running it (:func:`cached_split_activations`, :attr:`MemoryBudget.split`)."""
    budget = MemoryBudget(model, cluster, gib=exp.search.memory_gib, headroom=exp.search.memory_headroom,
                          optimizer=exp.trial.optimizer)
    if workload.framework == "torch":
        from ..engine.memory import single_process_memory
        from ..strategy.checkpoint import checkpoint_blocks

        probed = single_process_memory(workload, {model.batch_size, max(1, model.batch_size // 2)},
                                       optimizer=exp.trial.optimizer, seed=exp.seed,
                                       blocks=checkpoint_blocks(v.name for v in model.variables))
        for batch, figure in probed["activations"]["none"].items():
            budget.probe.add(batch, figure)
        for mode, figures in probed["activations"].items():
            if mode != "none" and figures:
                budget.checkpointed[mode] = ActivationFigures({b: [f] for b, f in figures.items()})
        budget.shares = dict(probed["shares"])
        if probed["optimizer_state"] is not None:
            budget.optimizer = probed["optimizer_state"]
        for tp in split:
            budget.split[tp_key(tp)] = cached_split_activations(
                workload, tp, split_batches(model, tp.degree), optimizer=exp.trial.optimizer, seed=exp.seed)
    return budget


def split_batches(model: Any, degree: int) -> set[int]:
    """The batches a split plan's activations are measured at: a TP group's at the model's batch
    per replica (each of its ranks holds the group's, ``degree`` replicas' samples), and half of
    it, for a line through uneven splits."""
    group = degree * model.batch_size
    return {group, max(1, group // 2)}


def split_activations(workload: Any, tp: Any, batch_sizes: Sequence[int] | set[int], *, optimizer: str = "sgd",
                      seed: int = 0, timeout_s: float = 600.0) -> ActivationFigures:
    """Per batch size, a device's strategy-independent memory under tensor-parallel plan ``tp``
    (its peak less parameters, optimizer state and gradients; the largest of the group's
    devices), measured on one TP group: ``tp.degree`` local processes over gloo running the
    plan itself with the ``tp`` runtime (torch's DTensor, its collectives' buffers, the loss over
    vocabulary-split logits, the sequence split), one iteration after a warm-up. One process
    cannot hold what a plan's devices do: split logits and sequence slices exist only where the
    plan runs. A plan the runtime refuses (its check on every rank together: a split that
    changes the model) is refused here, before any trial, with the runtime's message; a probe
    that fails otherwise is an infrastructure failure (RuntimeError)."""
    import dataclasses

    from ..engine.tensor_parallel import TP_RUNTIME
    from ..engine.trial import run_trial_local
    from ..spec.cluster import cluster_preset

    one = cluster_preset("local-1x1")
    group = dataclasses.replace(one, name=f"local-1x{tp.degree}", nodes=(dataclasses.replace(
        one.nodes[0], num_devices=tp.degree),))
    base = build_strategy("allreduce", workload.spec(), group)
    figures = ActivationFigures()
    for batch in sorted(set(int(b) for b in batch_sizes)):
        strategy = dataclasses.replace(base, tensor_parallel=tp, batch_split=(batch,) * tp.degree)
        result = run_trial_local(strategy, group, TrialConfig(warmup=1, iters=1, optimizer=optimizer, seed=seed,
                                                              timeout_s=timeout_s),
                                 workload=workload, runtime=TP_RUNTIME)
        if result.status != "ok":
            refusal = _refusal_in(result.error or "")
            if refusal:
                raise SpecError(refusal)
            raise RuntimeError(f"the memory probe of tensor-parallel plan {tp.degree} x {len(tp.styles)} modules "
                               f"({tp.degree} local processes) ended {result.status}: {result.error}")
        memory = result.extra.get("memory") or {}
        ranks = []
        for r in range(tp.degree):
            part = {k: (memory.get(k) or [None] * tp.degree)[r] for k in ("peak_bytes", "params_bytes",
                                                                           "optimizer_state_bytes", "grads_bytes")}
            if part["peak_bytes"] is not None:
                ranks.append(part["peak_bytes"] - sum(part[k] or 0 for k in ("params_bytes", "optimizer_state_bytes",
                                                                              "grads_bytes")))
        if ranks:
            figures.add(batch, max(ranks))
    return figures


#: Per (workload, plan, batch sizes, optimizer, seed), what :func:`split_activations` measured (its
#: figures) or the runtime's refusal of the plan: a process prepares a plan once.
_SPLIT_FIGURES: dict[tuple, ActivationFigures | SpecError] = {}


def cached_split_activations(workload: Any, tp: Any, batch_sizes: Sequence[int] | set[int], *,
                             optimizer: str = "sgd", seed: int = 0) -> ActivationFigures:
    """:func:`split_activations`, measured once per process for a (workload, plan, batch sizes,
    optimizer, seed); a plan the runtime refused is refused again with the same message."""
    key = (str(getattr(workload, "source", None) or workload.name), tp_key(tp),
           tuple(sorted(set(int(b) for b in batch_sizes))), optimizer, seed)
    if key not in _SPLIT_FIGURES:
        try:
            _SPLIT_FIGURES[key] = split_activations(workload, tp, batch_sizes, optimizer=optimizer, seed=seed)
        except SpecError as exc:
            _SPLIT_FIGURES[key] = exc
    found = _SPLIT_FIGURES[key]
    if isinstance(found, SpecError):
        raise SpecError(str(found))
    return found


def _megatron_setting(exp: Experiment) -> tuple[str, str, str]:
    """Where a refusal of the tuned Megatron baseline points: the file, the setting, the fix."""
    setting = exp.baselines.key("megatron_trials")
    return (exp.source or exp.name, setting,
            f"drop megatron from {exp.baselines.key('builders')} (or set {setting}: 0)")


def check_megatron_baseline(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, workload: Any) -> bool:
    """Whether the experiment tunes a Megatron baseline (``baselines.megatron_trials``); one that
    cannot run in the domain is refused in one line naming the setting and the fix: a Keras model,
    a cluster whose nodes hold no TP group of two devices or more, a model without Megatron pairs
    (:func:`~synctune.engine.megatron.megatron_refusal`). Cheap: checked before the memory probe."""
    from ..engine.megatron import megatron_refusal

    if not int(exp.baselines.tuned_trials("megatron")):
        return False
    where, setting, fix = _megatron_setting(exp)
    why = megatron_refusal(model, cluster) if workload.framework == "torch" else (
        f"{workload.name} is a Keras model, which tensor parallelism by torch's DTensor does not train")
    if why is not None:
        raise SpecError(f"{where}: {setting}: the tuned Megatron baseline cannot run here: {why}; {fix}")
    return True


def megatron_baseline(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, workload: Any,
                      budget: MemoryBudget) -> dict[str, str]:
    """Prepare the tuned Megatron baseline (``baselines.megatron_trials``) before any trial: refuse,
    in one line naming the setting and the fix, one that cannot run in the domain
    (:func:`check_megatron_baseline`, or a plan of every degree the runtime refuses), and measure
    each of its tensor-parallel plans' activation figures on one TP group
    (:func:`cached_split_activations`) into ``budget.split``, so that its tuning draws only what
    the budget admits. Returns the plans the runtime refused (by
    :func:`~synctune.strategy.tensor_parallel.tp_key`, with the refusal): the tuning never draws
    them. Nothing to do (an empty dict) where the experiment tunes no Megatron baseline."""
    from ..engine.megatron import MegatronConfig, megatron_degrees, megatron_plan

    if not check_megatron_baseline(exp, model, cluster, workload):
        return {}
    where, setting, fix = _megatron_setting(exp)
    skeleton = build_strategy("allreduce", model, cluster)
    plans = {}
    for degree in megatron_degrees(model, cluster):
        for sequence in (False, True):
            try:
                tp = megatron_plan(MegatronConfig(degree=degree, sequence_parallel=sequence), skeleton,
                                   model).tensor_parallel
            except SpecError:
                continue  # a plan the builder cannot write is never drawn
            plans[tp_key(tp)] = tp
    refused: dict[str, str] = {}
    for key, tp in plans.items():
        try:
            budget.split[key] = cached_split_activations(workload, tp, split_batches(model, tp.degree),
                                                         optimizer=exp.trial.optimizer, seed=exp.seed)
        except SpecError as exc:
            refused[key] = str(exc)
    if len(refused) == len(plans):
        raise SpecError(f"{where}: {setting}: the tuned Megatron baseline cannot run here: the tp runtime refuses "
                        f"every plan: {next(iter(refused.values()))}; {fix}")
    return refused


def _refusal_in(error: str) -> str | None:
    """The runtime's refusal (a ``strategy: ...`` line) inside a failed worker's message, or None."""
    at = error.find("strategy: tensor_parallel")
    return error[at:].strip().splitlines()[0] if at >= 0 else None


def check_budget(budget: MemoryBudget, where: str) -> None:
    """Refuse, before any trial, a budget that nothing fits: one line with the smallest predicted
    peak (of the most frugal strategies the builders make, :meth:`MemoryBudget.frugal`), the
    levers tried (:meth:`MemoryBudget.levers_tried`) and the fix."""
    peak, name, fits = budget.smallest()
    limits = [x for x in budget.limits(build_strategy("allreduce", budget.model, budget.cluster)) if x is not None]
    if limits and not fits:
        raise SpecError(f"{where}: search.memory_gib: nothing fits {budget.describe()} ({min(limits) / MIB:.1f} MiB "
                        f"per rank): the smallest predicted peak is {peak / MIB:.1f} MiB per rank ({name}); tried "
                        f"{budget.levers_tried()}; raise search.memory_gib, lower search.memory_headroom, or train a "
                        f"smaller batch")


#: The share of sampled strategies split by tensor parallelism where a search proposes it.
TP_PROB = 0.5


def tp_rate(exp: Experiment, budget: MemoryBudget, skeleton: Strategy) -> float:
    """The share of sampled strategies that split modules (tensor parallelism): :data:`TP_PROB`
    with ``search.tensor_parallel: true``, and with ``auto`` where replicated training does not
    fit; none with ``false``, under ``auto`` where replicated training fits, or where the cluster
    or model allows no TP degree (:meth:`MemoryBudget.tp_degrees`)."""
    setting = exp.search.tensor_parallel
    if setting is False or (setting == "auto" and budget.fits(skeleton)):
        return 0.0
    return TP_PROB if budget.tp_degrees()[0] else 0.0


def check_tensor_parallel(exp: Experiment, budget: MemoryBudget, rate: float, where: str,
                          framework: str = "torch") -> None:
    """Refuse, before any trial, a search that asks for tensor parallelism it cannot propose,
    run or score: ``true`` where the cluster or model allows no TP degree, a workload that is not
    PyTorch's (DTensor's ``tp`` runtime runs those only), or a simulator other than the replay
    (the one that prices split compute and TP collectives) where TP is proposed."""
    degrees, why = budget.tp_degrees()
    if exp.search.tensor_parallel is True and not degrees:
        raise SpecError(f"{where}: search.tensor_parallel: true, but {why}; set search.tensor_parallel: false")
    if rate and framework != "torch":
        raise SpecError(f"{where}: search.tensor_parallel: {str(exp.search.tensor_parallel).lower()}, but the "
                        f"workload is {framework}'s and tensor parallelism runs on PyTorch workloads only (torch's "
                        f"DTensor); set search.tensor_parallel: false")
    if rate and exp.search.uses_simulator and exp.search.simulator != "replay":
        raise SpecError(f"{where}: search.simulator: {exp.search.simulator} does not price tensor parallelism (split "
                        f"compute, TP collectives), which this search proposes (search.tensor_parallel: "
                        f"{str(exp.search.tensor_parallel).lower()}); use simulator: replay, or set "
                        f"search.tensor_parallel: false")


def prepare_memory(exp: Experiment, model: ModelSpec, cluster: ClusterSpec, workload: Any) -> tuple[MemoryBudget, float]:
    """The search's memory budget (:func:`memory_budget`) and its share of sharded proposals
    (:func:`shard_rate`), refusing before any trial a budget nothing fits and a search that
    would score shard units with a simulator that never saw any. Where the search proposes
    tensor parallelism (:func:`tp_rate`), the budget tries it (:attr:`MemoryBudget.tensor_parallel`)
    with the activations of Megatron's sequence-parallel plan measured at each degree
    (:func:`split_activations`, a torch workload's)."""
    where = exp.source or exp.name
    budget = memory_budget(exp, model, cluster, workload)
    skeleton = build_strategy("allreduce", model, cluster)
    split = tp_rate(exp, budget, skeleton)
    check_tensor_parallel(exp, budget, split, where, workload.framework)
    if split:
        budget.tensor_parallel = True
        if workload.framework == "torch":
            for degree in budget.tp_degrees()[0]:
                tp = _sequence_plan(model, cluster, degree)
                if tp is not None and tp_key(tp) not in budget.split:
                    budget.split[tp_key(tp)] = split_activations(workload, tp, split_batches(model, degree),
                                                                 optimizer=exp.trial.optimizer, seed=exp.seed)
    check_budget(budget, where)
    rate = shard_rate(exp, budget, skeleton)
    if exp.search.shard is False and not budget.fits(skeleton):
        raise SpecError(f"{where}: search.shard: false, but replicated training does not fit the memory budget "
                        f"(predicted {max(budget.peaks(skeleton)) / GIB:.3f} GiB per rank; {budget.describe()}); "
                        f"set search.shard: auto, or raise search.memory_gib")
    if rate and exp.search.uses_simulator and exp.search.simulator == "pretrained" and not _pretrained_scores_shard():
        why = "; replicated training does not fit the budget" if not budget.fits(skeleton) else ""
        raise SpecError(f"{where}: search.simulator: the shipped pretrained simulator was trained before the shard "
                        f"synchronizer, and this search proposes shard units (search.shard: "
                        f"{str(exp.search.shard).lower()}{why}); use simulator: replay (or analytic, or rnn)")
    return budget, rate


def _sequence_plan(model: ModelSpec, cluster: ClusterSpec, degree: int) -> Any:
    """Megatron's sequence-parallel plan at ``degree`` (its vocabulary split where the model allows
    it, as :meth:`MemoryBudget.frugal` builds it), or None where the model has none."""
    from ..strategy.errors import StrategyError

    for extra in ({"embedding": "rowwise", "loss_parallel": True}, {"loss_parallel": True}, {"embedding": "rowwise"},
                  {}):
        try:
            return build_strategy("megatron", model, cluster, degree=degree, dp="allreduce", sequence_parallel=True,
                                  **extra).tensor_parallel
        except StrategyError:
            continue
    return None


def _pretrained_scores_shard() -> bool:
    """Whether the shipped simulator was trained with the shard synchronizer among its inputs: a
    simulator file without it refuses shard units only when it scores them, mid-search, so the
    search asks before its first trial."""
    from ..simulator import load_simulator

    return "shard" in (load_simulator("pretrained").config.get("synchronizers") or [])


def shard_rate(exp: Experiment, budget: MemoryBudget, skeleton: Strategy) -> float:
    """The share of sampled strategies that shard units: every one where replicated training does
    not fit (``search.shard: auto``; the others would not fit either), half with ``shard: true``,
    none with ``false`` or where replicated training fits under ``auto``."""
    if exp.search.shard is False:
        return 0.0
    if not budget.fits(skeleton):
        return 1.0
    return 0.5 if exp.search.shard is True else 0.0


@dataclass(frozen=True, kw_only=True)
class SearchContext:
    """What a search is and what it started from, fixed before its first trial
    (:func:`prepare_search`): the experiment, its domain and workload, the search id, the memory
    budget and the share of sharded proposals, the trials' settings, the lab network (if any),
    the runtimes' baselines it measures (Horovod entries), the dataset rows this search recorded
    already (``done``, in the order recorded), and where it records (the dataset, the MLflow
    logger and the parent run)."""

    exp: Experiment
    model: ModelSpec
    cluster: ClusterSpec
    workload: Any
    search_id: str
    memory: MemoryBudget
    shard_prob: float
    trial_config: TrialConfig
    node_net: dict | None
    horovod_entries: tuple
    done: tuple
    dataset: TrialDataset
    logger: MlflowLogger
    parent_run: str
    #: The tensor-parallel plans the ``tp`` runtime refused when the preparation ran them (by
    #: :func:`~synctune.strategy.tensor_parallel.tp_key`, with the refusal): no runtime is run on them.
    refused_plans: Mapping[str, str] = field(default_factory=dict)

    @property
    def framework(self) -> str:
        """The workload's framework (``torch`` or ``tensorflow``)."""
        return self.workload.framework

    @property
    def tp_prob(self) -> float:
        """The share of sampled strategies split by tensor parallelism: :data:`TP_PROB` where the
        memory budget holds it in the search's space (:func:`prepare_memory`), else none."""
        return TP_PROB if self.memory.tensor_parallel else 0.0

    @functools.cached_property
    def skeleton(self) -> Strategy:
        """Replicated all-reduce: the replicas and (even) batch split the runtimes' baselines run on."""
        return build_strategy("allreduce", self.model, self.cluster)

    @functools.cached_property
    def project(self) -> Callable[[Strategy], Strategy] | None:
        """What every proposal is projected into (TensorFlow's packs for a Keras model), or None."""
        return tensorflow_projection(self.model) if self.framework == "tensorflow" else None

    @functools.cached_property
    def module(self) -> Any:
        """The workload's model on the meta device (built for real where an op has no meta
        kernel), built once: what FSDP2's units are worked out on, for the memory model and the
        proposal filter."""
        from ..engine.fsdp import meta_model

        module = meta_model(self.workload)
        return module if module is not None else self.workload.build_model()

    def executor(self, strategy: Strategy) -> Runtime:
        """The runtime that runs a searched strategy (:func:`executor_for`): the engine
        (TensorFlow for a Keras model); FSDP2 for one whose shard units reshard."""
        return executor_for(strategy, self.model, self.framework)

    def runtime_fits(self, runtime: Runtime, strategy: Strategy | None = None) -> bool:
        """Whether the memory model says ``runtime`` fits running ``strategy`` (the skeleton by
        default): predicted on the strategy whose memory its ranks hold
        (:meth:`~synctune.engine.runtime.Runtime.plans_of`), in its layout; never for a
        tensor-parallel plan the preparation saw the runtime refuse (:attr:`refused_plans`)."""
        held = runtime.plans_of(strategy or self.skeleton, lambda: self.module, self.model)
        if held.tensor_parallel is not None and tp_key(held.tensor_parallel) in self.refused_plans:
            return False
        return self.memory.fits(held, fsdp=runtime.fsdp_layout)


class SearchFilter(MemoryCheck):
    """What the search algorithm may propose in a search (its
    :class:`~synctune.search.interface.MemoryCheck`): strategies the memory budget fits that their
    runtime can run. A strategy whose units reshard runs on FSDP2, which needs every plan
    ``shard``, one shard group and units at module boundaries; the samplers' moves can make one
    that validates and that no runtime runs (a resharded unit beside an all-reduce), and it is
    never proposed. Checked on the context's module (:attr:`SearchContext.module`)."""

    def __init__(self, context: SearchContext) -> None:
        self.context = context

    def fits(self, strategy: Strategy) -> bool:
        ctx = self.context
        runtime = ctx.executor(strategy)
        if runtime.plans_refusal(strategy, ctx.cluster, ctx.module, ctx.model, ctx.workload) is not None:
            return False
        return ctx.memory.fits(strategy, fsdp=runtime.fsdp_layout)

    def fit(self, strategies: list, breakdowns: list) -> None:
        self.context.memory.fit(strategies, breakdowns)

    def state(self) -> dict:
        return self.context.memory.state()

    def restore(self, state: dict) -> None:
        self.context.memory.restore(state)

    def nothing_fits(self) -> str | None:
        return self.context.memory.nothing_fits()


def search_algorithm(context: SearchContext, state: dict) -> StrategySearch:
    """The search algorithm of ``context`` rebuilt from ``state`` (plain JSON), with a fresh
    simulator; proposals are filtered by what the memory budget fits and their runtime runs
    (:class:`~synctune.run.prepare.SearchFilter`)."""
    ctx = context
    simulator = make_search_simulator(ctx.exp, ctx.model, ctx.cluster)
    if (ctx.shard_prob or ctx.tp_prob) and simulator is not None and simulator.predicts_seconds and \
            simulator.training_free is simulator:
        # Proposals run on several runtimes (the engine, FSDP2 where units reshard, DTensor's tp
        # where modules split): the replay's
        # seconds are scaled per runtime by what the trials measured.
        simulator = RuntimeResidual(simulator, lambda s: ctx.executor(s).name,
                                    lambda columns: executor_names(columns, ctx.framework))
    return StrategySearch.from_state(state, ctx.model, ctx.cluster, ctx.exp, simulator, ctx.project,
                                     memory=SearchFilter(ctx), shard_prob=ctx.shard_prob, tp_prob=ctx.tp_prob)


def prepare_search(exp: Experiment, workload: Any, cluster: ClusterSpec, *, model: ModelSpec | None = None,
                   resume: bool = False, tracking_uri: str | None = None, node_net: dict | None = None,
                   say: Callable[[str], None] = lambda _message: None) -> SearchContext:
    """Check the experiment's search and do its I/O before any trial (see the module docstring);
    ``model``: the workload's spec where the caller has it already; ``say`` hears of long steps
    (a profile measured). The search's MLflow parent run is started last, once nothing is left to
    refuse."""
    model = model or workload.spec()
    where = exp.source or exp.name
    search_id = search_id_of(exp)
    if node_net and exp.run.slices > 1:
        slices = exp.run.key("slices")
        raise SpecError(f"{where}: {slices}: a lab has one set of links, so its trials run one at a time "
                        f"({slices}: 1), got {exp.run.slices}")
    dataset = TrialDataset(dataset_dir())
    done = dataset.records(model=model.name, cluster=cluster.name, search_id=search_id)
    if done and not resume:
        raise SpecError(f"search {search_id!r} already has {len(done)} recorded trial(s) in {dataset.root}; pass "
                        f"--resume to continue it, or change the experiment's name or seed")
    make_search_simulator(exp, model, cluster)  # the simulator file, read and checked now
    horovod = tuple(horovod_baselines(exp, model, cluster, workload))
    check_megatron_baseline(exp, model, cluster, workload)
    memory, rate = prepare_memory(exp, model, cluster, workload)
    refused_plans = megatron_baseline(exp, model, cluster, workload, memory)
    if exp.search.uses_simulator and exp.search.simulator != "analytic" and workload.framework == "torch":
        # Where the search may checkpoint blocks (a budget set, a model torch can recompute),
        # the profile also measures what recomputation costs.
        ensure_profile(workload, model, cluster, say,
                       recompute=bool(exp.search.memory_gib and memory.checkpoint_modes()))
    logger = MlflowLogger(exp.name, tracking_uri)
    parent = logger.start_search(search_id, {
        "experiment": where, "model": model.name, "cluster": cluster.name, "algorithm": exp.search.algorithm,
        "simulator": exp.search.simulator, "budget": exp.search.budget, "seed": exp.seed,
        "workload": workload.source, "ddp_trials": exp.baselines.ddp_trials,
        "megatron_trials": exp.baselines.tuned_trials("megatron"), "confirm_rounds": exp.confirm.rounds})
    if resume and parent:
        # A driver killed after logging a trial's run but before its row: that trial runs again.
        logger.drop_unrecorded_trials(search_id, {r.record_id for r in dataset.records(search_id=search_id)})
    trial_config = TrialConfig(warmup=exp.trial.warmup, iters=exp.trial.iters, seed=exp.seed,
                               timeout_s=exp.trial.timeout_s, optimizer=exp.trial.optimizer,
                               target_ci=exp.trial.target_ci, max_iters=exp.trial.max_iters,
                               max_timed_s=exp.trial.max_timed_s)
    return SearchContext(exp=exp, model=model, cluster=cluster, workload=workload, search_id=search_id,
                         memory=memory, shard_prob=rate, trial_config=trial_config,
                         node_net=dict(node_net) if node_net else None, horovod_entries=horovod,
                         done=tuple(sorted(done, key=lambda r: (r.created_at, r.record_id))), dataset=dataset,
                         logger=logger, parent_run=parent, refused_plans=refused_plans)
