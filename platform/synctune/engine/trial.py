"""A trial: one strategy run for real, W warm-up then M timed iterations (AutoDist §3.3: 10 + 40),
by one runtime (:mod:`synctune.engine.runtimes`), on local processes or a worker group.

What is measured and how (:mod:`synctune.engine.measure`) is the same whatever the runtime.
Data is synthetic, of the model's shapes, made once per rank: the trial times synchronization
and compute, not input pipelines.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable

from ..spec.checks import LIMITS, in_range
from ..spec.cluster import ClusterSpec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from ..strategy.schema import Strategy
from .checkpoint import apply_checkpointing
from .measure import STATUSES, PeakMemory, TrialConfig, TrialResult, device_done, gather_max, timed_iterations
from .runtime import ArmContext, Runtime, framework_of
from .runtimes import as_runtime

if TYPE_CHECKING:
    from ..stats import SequentialRule

__all__ = ["TrialConfig", "TrialResult", "run_trial_local", "run_trials_local", "trial_worker", "trial_payload",
           "check_trial", "PeakMemory", "STATUSES", "confirm_worker", "confirm_payload", "run_confirm_local",
           "interleave", "Interleaved", "relative_scores", "screen_contenders", "screen_picks", "screening_rule",
           "timed_iterations"]

#: The process-group backend of GPU trials: NCCL for CUDA tensors, gloo beside it for the CPU
#: tensors a training loop may still hand a collective (a count, a flag).
GPU_BACKEND = "cpu:gloo,cuda:nccl"

#: Instrumented iterations a trial's memory probe runs after the timed ones; it reports the one
#: with the highest peak, which a memory budget must hold.
MEMORY_PROBE_ITERATIONS = 3


def trial_payload(workload, strategy: Strategy, cluster: ClusterSpec, config: TrialConfig, spec: ModelSpec,
                  *, runtime: Runtime | dict | None = None, **extra: Any) -> dict:
    """What every rank of a trial receives (plain data and the workload: it crosses process
    boundaries); the runtime travels in its plain-data form."""
    return {"workload": workload, "model_spec": spec.to_dict(), "strategy": strategy.to_dict(),
            "cluster": cluster.to_dict(), "config": asdict(config), "runtime": as_runtime(runtime).to_dict(), **extra}


def trial_worker(rank: int, world: int, payload: dict) -> dict:
    """The body of one rank of a trial (runs inside a process of the group)."""
    import os

    from .local import report

    report({"event": "started", "rank": rank, "pid": os.getpid()})
    if "arms" in payload:
        return confirm_worker(rank, world, payload)
    if framework_of(payload["workload"]) != "torch":  # a Keras model: its runtime trains it its own way
        return as_runtime(payload.get("runtime")).run_keras(rank, world, payload)
    return _measure(rank, world, payload, Strategy.from_dict(payload["strategy"]), payload.get("gpu_per_rank", True))


def trials_worker(rank: int, world: int, payload: dict) -> int:
    """Several trials in one process group, one after another; rank 0 reports each result as it
    completes (event ``trial_done``), so finished trials survive a later failure."""
    import os

    from .local import report

    report({"event": "started", "rank": rank, "pid": os.getpid()})
    for index, strategy in enumerate(payload["strategies"]):
        out = _measure(rank, world, payload, Strategy.from_dict(strategy), True, progress=False)
        if rank == 0:
            report({"event": "trial_done", "index": payload["first_index"] + index, "out": out})
    return len(payload["strategies"])


class _Arm:
    """One way of training on this rank: a runtime (our engine running ``strategy``, or torch
    DDP or real Horovod following its replicas and batch split). The model and the batch are
    built the same way for all, so two arms in one process differ only in how gradients travel."""

    def __init__(self, rank: int, payload: dict, strategy: Strategy, runtime: Runtime | dict | None, device) -> None:
        import torch

        workload = payload["workload"]
        config = TrialConfig(**payload["config"])
        self.workload, self.device = workload, device
        torch.manual_seed(config.seed)
        with torch.device(device):
            model = workload.build_model()
        runtime = as_runtime(runtime)
        # Checkpointing first: the runtime then wraps the checkpointed modules (FSDP2's order).
        apply_checkpointing(model, runtime.checkpoint_of(strategy, ModelSpec.from_dict(payload["model_spec"])))
        # The batch before the runtime: ranks that share one (a TP group) make it alike, and a
        # runtime may check its wrapping on it.
        data_rank = runtime.batch_rank(strategy, rank)
        gen = torch.Generator(device=device).manual_seed(config.seed * 100_003 + data_rank)
        self.batch = workload.make_batch(strategy.batch_split[rank], rank=data_rank, generator=gen, device=device)
        self.stepper = runtime.prepare(ArmContext(
            rank=rank, model=model, strategy=strategy, spec=ModelSpec.from_dict(payload["model_spec"]),
            cluster=ClusterSpec.from_dict(payload["cluster"]), device=device, seed=config.seed,
            make_optimizer=lambda params: workload.make_optimizer(params, name=config.optimizer, lr=config.lr),
            collective_timeout_s=config.collective_timeout_s,
            loss_of=lambda m: workload.loss(m, self.batch)))

    def iteration(self):
        """One training iteration; returns the loss (the step is done on return)."""
        import torch

        loss = self.workload.loss(self.stepper.forward_model, self.batch)
        scale = self.stepper.loss_scale
        (loss * scale if scale != 1.0 else loss).backward()
        self.stepper.step()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return loss

    def memory_probe(self) -> dict:
        """:data:`MEMORY_PROBE_ITERATIONS` more training iterations, each instrumented: this rank's
        memory part by part (:func:`synctune.engine.memory.probe_iteration`) in the one whose peak
        was highest. The peak moves from one iteration to the next by a few of the model's
        activations (which buffers a collective's thread has let go of when the next is allocated):
        a budget must hold the highest."""
        from .memory import probe_iteration

        parts = self.stepper.memory_parts() if self.stepper.memory_parts is not None else {}
        # A runtime that exposes its units but steps no optimizer on this rank holds no state.
        optimizer = parts.get("optimizer")
        if "units" in parts and optimizer is None:
            import types

            optimizer = types.SimpleNamespace(state={})
        scale = self.stepper.loss_scale
        loss_fn = self.workload.loss if scale == 1.0 else (lambda model, batch: self.workload.loss(model, batch) * scale)
        # Each probe trains one more step: weighted as every step (FSDP2's uneven splits scale the loss).
        probes = [probe_iteration(model=self.stepper.forward_model, batch=self.batch, loss_fn=loss_fn,
                                  step=self.stepper.step, device=self.device,
                                  optimizer=optimizer if parts else None, units=parts.get("units"),
                                  comm_buffers_bytes=parts.get("comm_buffers_bytes", 0))
                  for _ in range(MEMORY_PROBE_ITERATIONS)]
        return max(probes, key=lambda p: -1 if p.get("peak_bytes") is None else p["peak_bytes"])

    def take_comm_bytes(self) -> int | None:
        """Bytes handed to collectives since the last call, where the runtime counts them."""
        return self.stepper.take_comm_bytes()

    def close(self) -> None:
        self.stepper.close()


def _device(cluster: ClusterSpec, strategy: Strategy, rank: int, gpu_per_rank: bool):
    import torch

    node = cluster.node_of(strategy.replicas[rank])
    if node.device_kind == "gpu":
        # Local launches own every GPU of the machine (rank r takes GPU r); a Ray actor sees only
        # the GPU Ray gave it, as index 0.
        device = torch.device("cuda", rank % torch.cuda.device_count() if gpu_per_rank else 0)
        torch.cuda.set_device(device)
        return device
    return torch.device("cpu")



def _measure(rank: int, world: int, payload: dict, strategy: Strategy, gpu_per_rank: bool,
             progress: bool = True) -> dict:
    import torch.distributed as dist

    t_start = time.perf_counter()
    config = TrialConfig(**payload["config"])
    device = _device(ClusterSpec.from_dict(payload["cluster"]), strategy, rank, gpu_per_rank)
    memory = PeakMemory(device)
    memory.reset()
    arm = _Arm(rank, payload, strategy, payload.get("runtime"), device)
    timed = timed_iterations(rank, world, config, device, memory, arm.iteration, t_start=t_start,
                             take_comm=arm.take_comm_bytes, close=arm.close, progress=progress,
                             memory_probe=arm.memory_probe)
    return {**timed, "backend": dist.get_backend(), "device_kind": device.type}




def confirm_worker(rank: int, world: int, payload: dict) -> dict:
    """Interleaved re-measurement on the same processes (DESIGN.md "confirmed speed-up"): every
    arm is built once and warmed up, then each round times ``per_round`` iterations of one arm
    and then of the other, the order alternating between rounds (A B, B A, A B, ...) so a slow
    drift of the machine weighs on both alike, until the payload's :class:`~synctune.stats.SequentialRule`
    stops it. Returns, per round, each arm's median iteration time (slowest rank per iteration).

    With more than two arms (candidates first, then ``len(arms) - candidates`` baselines), a
    screening comes first (:func:`interleave`), so that neither side of the reported speed-up
    is the luckiest of several noisy measurements (the winner's curse, one level up)."""
    import statistics

    import torch.distributed as dist

    from .local import report

    config = TrialConfig(**payload["config"])
    arms_spec = payload["arms"]
    strategies = [Strategy.from_dict(a["strategy"]) for a in arms_spec]
    cluster = ClusterSpec.from_dict(payload["cluster"])
    device = _device(cluster, strategies[0], rank, payload.get("gpu_per_rank", True))
    arms = [_Arm(rank, payload, s, a.get("runtime"), device)
            for s, a in zip(strategies, arms_spec)]
    for arm in arms:
        for _ in range(config.warmup):
            arm.iteration()
            arm.take_comm_bytes()
    per_round = int(payload["per_round"])

    def timed(which: int) -> float:
        arm, times = arms[which], []
        for _ in range(per_round):
            dist.barrier()
            t0 = time.perf_counter()
            arm.iteration()
            device_done(device)
            times.append(time.perf_counter() - t0)
            arm.take_comm_bytes()
        # Every rank gets the same gathered times, so every rank makes the same picks and stops
        # after the same round.
        return statistics.median(gather_max(times, device))

    def on_screen_round(r: int, rounds: int) -> None:
        report({"event": "screen_round", "round": r, "rounds": rounds})

    def on_round(r: int, rounds: int, medians: list[list[float]]) -> None:
        report({"event": "confirm_round", "round": r, "rounds": rounds, "a_s": medians[0][-1], "b_s": medians[1][-1]})

    done = interleave(timed, len(arms), rule=_payload_rule(payload), screen_rounds=int(payload.get("screen_rounds", 0)),
                      screen_max_rounds=int(payload.get("screen_max_rounds", 0)), candidates=payload.get("candidates"),
                      on_screen_round=on_screen_round if rank == 0 else None, on_round=on_round if rank == 0 else None)
    for arm in arms:
        arm.close()
    return {**done.to_dict(), "backend": dist.get_backend(), "device_kind": device.type}


def _payload_rule(payload: dict):
    from ..stats import SequentialRule

    rule = payload.get("rule")
    return SequentialRule(**rule) if rule else SequentialRule.fixed(int(payload["rounds"]))


@dataclass(frozen=True)
class Interleaved:
    """What :func:`interleave` measured: per-round times of the two arms compared (``medians``:
    the candidate's, then the baseline's), the indices of those arms, why the rounds stopped,
    and the screening's per-arm times (None without one)."""

    medians: list[list[float]]
    picked: int
    picked_baseline: int
    stopped: str
    screen: list[list[float]] | None = None

    def to_dict(self) -> dict:
        """What rank 0 reports: the two arms' per-round times in seconds (``a_s`` the candidate's,
        ``b_s`` the baseline's) and why they stopped; with a screening, its picks and per-arm times."""
        out = {"a_s": self.medians[0], "b_s": self.medians[1], "stopped": self.stopped}
        if self.screen is not None:
            out.update({"picked": self.picked, "picked_baseline": self.picked_baseline, "screen_s": self.screen})
        return out


def relative_scores(screen: list[list[float]]) -> list[float]:
    """Per arm of a screening (per arm, per round times), the median of its per-round time
    relative to the round's geometric mean over every arm (so a round the machine ran slow
    weighs on no arm); smaller is faster."""
    import statistics

    rounds = len(screen[0])
    means = [math.exp(sum(math.log(arm[r]) for arm in screen) / len(screen)) for r in range(rounds)]
    return [statistics.median(arm[r] / means[r] for r in range(rounds)) for arm in screen]


def screen_picks(screen: list[list[float]], candidates: int, live: list[int] | None = None) -> tuple[int, int]:
    """The screening's picks: the candidate (among the first ``candidates`` arms) and the
    baseline (among the rest) with the smallest :func:`relative_scores`, scored among the arms
    ``live`` (default every arm; those still timed when a sequential screening stopped)."""
    live = list(range(len(screen))) if live is None else sorted(live)
    score = dict(zip(live, relative_scores([screen[i] for i in live])))
    return (min((i for i in live if i < candidates), key=score.__getitem__),
            min((i for i in live if i >= candidates), key=score.__getitem__))


def screening_rule(screen_rounds: int, screen_max_rounds: int, rule) -> "SequentialRule | None":
    """The looks of a sequential screening (:func:`screen_contenders`): from ``screen_rounds``
    every ``rule.step`` rounds up to ``screen_max_rounds``, at the confirmation rule's width and
    error rate; None for a fixed screening (``screen_max_rounds`` 0 or not above ``screen_rounds``)."""
    from ..stats import SequentialRule

    if screen_max_rounds <= screen_rounds:
        return None
    return SequentialRule(min_rounds=screen_rounds, max_rounds=screen_max_rounds, step=rule.step, width=rule.width,
                          alpha=rule.alpha)


def screen_contenders(screen: list[list[float]], live: list[int], candidates: int, rule) -> tuple[list[int], bool]:
    """One look of a sequential screening over the arms ``live`` (each timed in every round so
    far): per kind (the first ``candidates`` arms, then the baselines), the leader by
    :func:`relative_scores`, and every other arm of its kind compared with it, paired by round,
    at ``rule``'s per-look level. An arm the interval shows slower than its leader is dropped; an
    arm whose interval is narrower than ``rule.width`` ties with it. Returns the arms still in
    contention and whether each kind is settled (one arm left, or only ties with the leader)."""
    score = dict(zip(live, relative_scores([screen[i] for i in live])))
    kept, settled = [], True
    for kind in ([i for i in live if i < candidates], [i for i in live if i >= candidates]):
        leader = min(kind, key=score.__getitem__)
        kept.append(leader)
        for arm in kind:
            if arm == leader:
                continue
            found = rule.interval(screen[arm], screen[leader])  # the leader's speed-up over the arm
            if found.verdict == "faster":
                continue
            kept.append(arm)
            settled = settled and found.width <= rule.width
    return sorted(kept), settled


def interleave(timed: Callable[[int], float], arms: int, *, rule=None, rounds: int | None = None,
               screen_rounds: int = 0, screen_max_rounds: int = 0, candidates: int | None = None,
               on_screen_round: Callable[[int, int], None] | None = None,
               on_round: Callable[[int, int, list[list[float]]], None] | None = None) -> Interleaved:
    """The schedule of a confirmation (:func:`confirm_worker`), over ``timed(arm)``, which times
    one round of an arm. The first ``candidates`` arms (default: all but the last) are
    candidates, the others baselines. With more than two arms and ``screen_rounds``, rounds of
    every arm come first, the order rotating, and pick one candidate and one baseline
    (:func:`screen_picks`); then rounds of the two picks on fresh iterations, alternating A B,
    B A, until ``rule`` (a :class:`~synctune.stats.SequentialRule`; default exactly ``rounds``)
    stops them.

    The screening runs exactly ``screen_rounds`` rounds, or, with ``screen_max_rounds`` above
    it, is sequential: from ``screen_rounds`` on, every ``rule.step`` rounds, arms shown slower
    than the leader of their kind stop being timed, and the screening ends once each kind is
    settled (:func:`screen_contenders`) or at ``screen_max_rounds``. A fixed screening of a few
    noisy rounds can pass over a find a few percent faster than the one it picks; this one adds
    rounds until the contenders are told apart, and spends them only on the contenders."""
    from ..stats import SequentialRule

    rule = rule or SequentialRule.fixed(int(rounds))
    candidates = arms - 1 if candidates is None else int(candidates)
    if not 1 <= candidates < arms:
        raise ValueError(f"interleave: {candidates} candidate(s) among {arms} arms leaves no baseline")
    screen_rounds = screen_rounds if arms > 2 else 0
    looks = screening_rule(screen_rounds, screen_max_rounds, rule) if screen_rounds else None
    cap = looks.max_rounds if looks else screen_rounds
    screen: list[list[float]] = [[] for _ in range(arms)]
    live = list(range(arms))
    for r in range(cap):
        for which in [live[(r + j) % len(live)] for j in range(len(live))]:
            screen[which].append(timed(which))
        if on_screen_round:
            on_screen_round(r + 1, cap)
        if looks and r + 1 in looks.looks and r + 1 < cap:
            live, settled = screen_contenders(screen, live, candidates, looks)
            if settled:
                break
    pair = screen_picks(screen, candidates, live) if screen_rounds else (0, arms - 1)
    medians: list[list[float]] = [[], []]
    while True:
        r = len(medians[0])
        for slot in ((0, 1) if r % 2 == 0 else (1, 0)):
            medians[slot].append(timed(pair[slot]))
        if on_round:
            on_round(r + 1, rule.max_rounds, medians)
        stopped = rule.stop_reason(medians[1], medians[0])
        if stopped:
            return Interleaved(medians, pair[0], pair[1], stopped, screen if screen_rounds else None)


def _describe(strategy: Strategy, cluster: ClusterSpec, config: TrialConfig, launcher: str) -> dict[str, Any]:
    return {"model": strategy.model["name"], "cluster": cluster.name, "cluster_scale": cluster.scale,
            "strategy_hash": strategy.hash,
            "launcher": launcher, "num_workers": len(strategy.replicas), "warmup": config.warmup,
            "iters": config.iters, "global_batch_size": strategy.global_batch_size}


def result_from_rank0(out: dict, strategy: Strategy, cluster: ClusterSpec, config: TrialConfig, launcher: str,
                      wall_s: float) -> TrialResult:
    """Assemble the :class:`TrialResult` of a finished trial from rank 0's report."""
    return TrialResult.from_times(
        out["times"], backend=out["backend"], device_kind=out["device_kind"],
        comm_bytes_per_iter=out["comm_bytes_per_iter"], peak_memory_bytes=out["peak_memory_bytes"], wall_s=wall_s,
        extra={"final_loss": out["final_loss"], "phases_s": out.get("phases_s", {}), "optimizer": config.optimizer,
               **({"memory": out["memory"]} if out.get("memory") else {}),
               **({"measure": out["measure"]} if out.get("measure") else {})},
        # the timed iterations it took (a trial with a target interval decides how many)
        **(_describe(strategy, cluster, config, launcher) | {"iters": len(out["times"])}))


def failed_result(status: str, error: str, strategy: Strategy, cluster: ClusterSpec, config: TrialConfig,
                  launcher: str, wall_s: float) -> TrialResult:
    """A :class:`TrialResult` for a trial that did not finish."""
    return TrialResult(status=status, error=error, wall_s=wall_s, **_describe(strategy, cluster, config, launcher))


def check_network(cluster: ClusterSpec, node_net) -> None:
    """Refuse, before any worker starts, a node network that cannot place ``cluster``'s workers:
    a lab cluster without one (its links exist only in the lab's namespaces), or one missing a
    node (``node_net``: node name -> its network, as :func:`synctune.engine.local.rank_networks`
    reads it)."""
    from ..spec.cluster import is_lab_cluster

    if is_lab_cluster(cluster) and not node_net:
        raise SpecError(f"cluster {cluster.name!r} is a lab cluster: its workers run in the lab's network namespaces "
                        f"(synctune lab up {cluster.name}; the CLI then finds them)")
    if node_net:
        missing = [n.name for n in cluster.nodes if n.name not in node_net]
        if missing:
            raise SpecError(f"cluster {cluster.name!r}: the node network has no entry for node(s) {missing}")


def check_trial(workload, strategy: Strategy, cluster: ClusterSpec, runtime: Runtime | dict | None = None
                ) -> ModelSpec:
    """Validate ``strategy`` for ``workload`` on ``cluster`` and refuse, before any worker starts,
    what ``runtime`` (default: the engine) does not execute as claimed; returns the workload's
    model spec."""
    from ..strategy.validate import validate

    spec = workload.spec()
    validate(strategy, spec, cluster)
    check_runtime(runtime, strategy, spec, cluster, workload)
    return spec


def check_runtime(runtime: Runtime | dict | None, strategy: Strategy, spec: ModelSpec, cluster: ClusterSpec,
                  workload: Any = None) -> Runtime:
    """Refuse a trial ``runtime`` that would not run what it claims (or does not train the
    workload's framework); returns the runtime."""
    runtime = as_runtime(runtime)
    framework = framework_of(workload)
    if framework == "tensorflow" and framework not in runtime.frameworks:  # a PyTorch one: the runtime's check
        raise SpecError(f"workload {workload.name!r} is a Keras model: it runs with the tensorflow runtime "
                        f"(--runtime tensorflow) or Horovod's TensorFlow binding (--runtime horovod), not "
                        f"{runtime.label or runtime.name}")
    if strategy.tensor_parallel is not None and not runtime.runs_tensor_parallel:
        raise SpecError(f"strategy: tensor_parallel: the strategy splits modules across TP groups, which the "
                        f"{runtime.name} runtime would not do; run it with --runtime tp")
    runtime.check(strategy, spec, cluster, workload)
    return runtime


def run_trial_local(strategy: Strategy, cluster: ClusterSpec, config: TrialConfig = TrialConfig(), *, workload,
                    on_progress: Callable[[dict], None] | None = None, node_net=None,
                    runtime: Runtime | dict | None = None) -> TrialResult:
    """Run a trial of ``workload`` on local worker processes, one per replica (CPU clusters, or
    GPUs of this machine).

    ``node_net`` (node name -> ``{"netns", "address", "ifname"}``, a lab's network) runs each
    node's workers inside that node's namespace, over its shaped link. ``runtime`` (a
    :class:`~synctune.engine.runtime.Runtime` or its plain-data form; default the engine) runs
    the trial: torch DDP, Horovod and TensorFlow take only replicas and batch split from
    ``strategy``. Never raises for a trial that fails at run time:
    the result's status says what happened.
    """
    from .local import WorkerFailure, rank_networks, run_local

    check_network(cluster, node_net)
    spec = check_trial(workload, strategy, cluster, runtime)
    backend = _backend_for(cluster, strategy)
    payload = trial_payload(workload, strategy, cluster, config, spec, runtime=runtime)
    start = time.monotonic()
    try:
        outs = run_local(trial_worker, len(strategy.replicas), (payload,), backend=backend, timeout_s=config.timeout_s,
                         collective_timeout_s=config.collective_timeout_s,
                         on_progress=(lambda _rank, msg: on_progress(msg)) if on_progress else None,
                         nets=rank_networks(cluster, strategy.replicas, node_net), pin_cpus=config.pin_cpus)
    except WorkerFailure as failure:
        return failed_result(failure.status, failure.message, strategy, cluster, config, "local",
                             time.monotonic() - start)
    return result_from_rank0(outs[0], strategy, cluster, config, "local", time.monotonic() - start)


def _backend_for(cluster: ClusterSpec, strategy: Strategy) -> str:
    kinds = {cluster.node_of(d).device_kind for d in strategy.replicas}
    if "gpu" not in kinds:
        return "gloo"
    import torch

    needed = len(strategy.replicas)
    have = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if kinds != {"gpu"} or have < needed:
        raise SpecError(f"cluster {cluster.name!r} needs {needed} GPU worker(s) and this machine has {have} GPU(s); "
                        f"run it on a Ray cluster with matching nodes, or use a local-* preset")
    return GPU_BACKEND


def confirm_payload(workload, arms: list[tuple[Strategy, Runtime | dict | None]], cluster: ClusterSpec,
                    config: TrialConfig, *, rounds: int, per_round: int, screen_rounds: int = 0,
                    screen_max_rounds: int = 0, rule=None, candidates: int | None = None) -> dict:
    """The payload of an interleaved re-measurement of arms (strategy, runtime or None): two, or
    with ``screen_rounds`` several candidates then several baselines (``candidates``: how many
    come first; default all but the last; ``screen_max_rounds`` above ``screen_rounds``: a
    sequential screening, see :func:`interleave`), :func:`confirm_worker`; every arm is checked
    as a trial first. All arms must use the same replicas. ``rule`` (a :class:`~synctune.stats.SequentialRule`)
    says when the rounds stop; default exactly ``rounds``."""
    rule = confirm_rule(rounds, rule)
    check_confirm_shape(len(arms), per_round, screen_rounds, candidates, screen_max_rounds)
    if any(list(s.replicas) != list(arms[0][0].replicas) for s, _r in arms):
        raise SpecError("a confirmation runs its arms on the same processes: their strategies must have the same "
                        f"replicas, got {sorted({tuple(s.replicas) for s, _r in arms})}")
    check_arms([r for _s, r in arms])
    spec = None
    for strategy, runtime in arms:
        spec = check_trial(workload, strategy, cluster, runtime)
    return trial_payload(workload, arms[0][0], cluster, config, spec, rounds=rule.min_rounds, per_round=per_round,
                         screen_rounds=screen_rounds, screen_max_rounds=screen_max_rounds, rule=rule.to_dict(),
                         candidates=candidates,
                         arms=[{"strategy": s.to_dict(), "runtime": as_runtime(r).to_dict()} for s, r in arms])


def confirm_rule(rounds: int, rule=None):
    """The confirmation's stopping rule: ``rule``, or exactly ``rounds`` rounds; refused with
    the setting's range when out of it."""
    from ..stats import SequentialRule

    if rule is None:
        if not in_range(rounds, 2, 1000):
            raise SpecError(f"confirmation: rounds must be an integer from 2 to 1000, got {rounds!r}")
        return SequentialRule.fixed(rounds)
    if not (in_range(rule.min_rounds, 2, 1000) and in_range(rule.max_rounds, rule.min_rounds, 1000)):
        raise SpecError(f"confirmation: rounds must be an integer from 2 to 1000 and max_rounds from rounds to "
                        f"1000, got {rule.min_rounds!r} and {rule.max_rounds!r}")
    return rule


def check_confirm_shape(arms: int, per_round: int, screen_rounds: int, candidates: int | None,
                        screen_max_rounds: int = 0) -> None:
    """Refuse a confirmation's arm count, iterations per round, screening or candidate count
    out of range."""
    if arms < 2 or (arms > 2 and not screen_rounds):
        raise SpecError(f"a confirmation compares two arms (more only with screening rounds), got {arms}")
    if not (in_range(per_round, 1, LIMITS["iterations"]) and in_range(screen_rounds, 0, 1000)):
        raise SpecError(f"confirmation: per_round must be an integer from 1 to {LIMITS['iterations']} and "
                        f"screen_rounds from 0 to 1000, got {per_round!r} and {screen_rounds!r}")
    if not (screen_max_rounds == 0 or (screen_rounds >= 2 and in_range(screen_max_rounds, screen_rounds, 1000))):
        raise SpecError(f"confirmation: screen_max_rounds must be 0 (a fixed screening) or an integer from "
                        f"screen_rounds (at least 2) to 1000, got {screen_max_rounds!r} with screen_rounds "
                        f"{screen_rounds!r}")
    if candidates is not None and not in_range(candidates, 1, arms - 1):
        raise SpecError(f"confirmation: candidates must leave at least one baseline among {arms} arms, got "
                        f"{candidates!r}")


def check_arms(runtimes: list[Runtime | dict | None]) -> list[Runtime]:
    """Refuse runtimes that cannot share processes as arms of one confirmation: one that runs
    whole trials only, or two that start once per process."""
    out = [as_runtime(r) for r in runtimes]
    whole = [r.name for r in out if not r.interleavable]
    if whole:
        raise SpecError(f"confirmation: the {whole[0]} runtime runs whole trials only (it starts once per process); "
                        f"confirm engine, ddp or horovod arms")
    once = [r.name for r in out if r.once_per_process]
    if len(once) > 1:
        raise SpecError(f"confirmation: two arms are {once[0]} runtimes, which start once per process; compare a "
                        f"{once[0]} arm with engine or ddp arms")
    return out


def run_confirm_local(arms: list[tuple[Strategy, Runtime | dict | None]], cluster: ClusterSpec,
                      config: TrialConfig = TrialConfig(), *, workload, rounds: int = 10, per_round: int = 5,
                      screen_rounds: int = 0, screen_max_rounds: int = 0, rule=None, candidates: int | None = None,
                      node_net=None, on_progress: Callable[[dict], None] | None = None) -> dict:
    """Re-measure arms interleaved on one set of local worker processes (see
    :func:`confirm_worker`); returns the per-round medians (``a_s``, ``b_s``) and, from them,
    the speed-up of A over B with its interval (:func:`confirm_figures`). With
    ``screen_rounds`` and more than two arms, A and B are the screening's picks (``picked``,
    ``picked_baseline``; sequential up to ``screen_max_rounds``, see :func:`interleave`). ``rule`` stops the rounds (default exactly ``rounds``). Raises
    :class:`~synctune.engine.local.WorkerFailure` if a worker fails."""
    from .local import rank_networks, run_local

    check_network(cluster, node_net)
    rule = confirm_rule(rounds, rule)
    payload = confirm_payload(workload, arms, cluster, config, rounds=rounds, per_round=per_round,
                              screen_rounds=screen_rounds, screen_max_rounds=screen_max_rounds, rule=rule,
                              candidates=candidates)
    strategy = arms[0][0]
    start = time.monotonic()
    total_s = confirm_timeout_s(config, rule.max_rounds, per_round, arms=len(arms), screen_rounds=screen_rounds,
                                screen_max_rounds=screen_max_rounds)
    outs = run_local(trial_worker, len(strategy.replicas), (payload,), backend=_backend_for(cluster, strategy),
                     timeout_s=total_s, collective_timeout_s=config.collective_timeout_s,
                     on_progress=(lambda _rank, msg: on_progress(msg)) if on_progress else None,
                     nets=rank_networks(cluster, strategy.replicas, node_net), pin_cpus=config.pin_cpus)
    return confirm_figures(outs[0], rule, per_round, "local", time.monotonic() - start)


def confirm_timeout_s(config: TrialConfig, rounds: int, per_round: int, *, arms: int = 2,
                      screen_rounds: int = 0, screen_max_rounds: int = 0) -> float:
    """A confirmation's time limit: the trial timeout scaled by how many more iterations it runs
    (every arm's warm-up, the screening up to its cap and every round up to the cap), never
    below two trials' worth."""
    screen = max(screen_rounds, screen_max_rounds)
    iterations = arms * config.warmup + (arms * screen + 2 * rounds) * per_round
    return config.timeout_s * max(2.0, iterations / (config.warmup + config.iters))


def confirm_figures(out: dict, rule, per_round: int, launcher: str, wall_s: float) -> dict:
    """Rank 0's confirmation output with the speed-up of arm A over arm B and its interval at
    the rule's level (95% for a fixed number of rounds; see :class:`~synctune.stats.SequentialRule`),
    the rounds used and why they stopped."""
    ratio = rule.interval(out["b_s"], out["a_s"])
    return {**out, **ratio.to_dict(), "rounds": ratio.rounds, "per_round": per_round, "rule": rule.to_dict(),
            "launcher": launcher, "wall_s": wall_s}


def run_trials_local(strategies: list[Strategy], cluster: ClusterSpec, config: TrialConfig = TrialConfig(), *,
                     workload, on_result: Callable[[int, TrialResult], None] | None = None, node_net=None
                     ) -> list[TrialResult]:
    """Run many trials of ``workload`` on one cluster and one local process group, in order.

    Start-up (spawn, imports, rendezvous) is paid once per group, not per trial; consecutive
    trials on the same replicas share a group. If a trial fails, it gets its failure as result and the remaining trials continue in a fresh group.
    ``on_result(index, result)`` is called as each trial finishes; ``node_net`` as for
    :func:`run_trial_local`.
    """
    from .local import WorkerFailure, rank_networks, run_local

    check_network(cluster, node_net)
    if any(cluster.node_of(d).device_kind != "cpu" for s in strategies for d in s.replicas):
        raise SpecError("run_trials_local runs CPU clusters; use run_trial_local or a Ray worker group for GPUs")
    spec = workload.spec()
    for s in strategies:
        check_trial(workload, s, cluster)
    results: dict[int, TrialResult] = {}
    pending = list(range(len(strategies)))
    while pending:
        first = pending[0]
        # One process group runs consecutive trials on the same replicas only: a strategy on a
        # replica subset (TAG §4.2) needs a group of its own size and placement.
        run = list(itertools.takewhile(lambda i: strategies[i].replicas == strategies[first].replicas, pending))
        group = [strategies[i] for i in run]
        start = time.monotonic()
        last = [start]

        def on_progress(_rank, msg):
            if msg.get("event") == "trial_done":
                i = msg["index"]
                now = time.monotonic()
                results[i] = result_from_rank0(msg["out"], strategies[i], cluster, config, "local", now - last[0])
                last[0] = now
                if on_result:
                    on_result(i, results[i])

        payload = trial_payload(workload, group[0], cluster, config, spec, first_index=first,
                                strategies=[s.to_dict() for s in group])
        world = len(group[0].replicas)
        try:
            run_local(trials_worker, world, (payload,), timeout_s=config.timeout_s * len(group),
                      collective_timeout_s=config.collective_timeout_s, on_progress=on_progress,
                      nets=rank_networks(cluster, group[0].replicas, node_net), pin_cpus=config.pin_cpus)
        except WorkerFailure as failure:
            culprit = next(i for i in run if i not in results)
            results[culprit] = failed_result(failure.status, failure.message, strategies[culprit], cluster, config,
                                             "local", time.monotonic() - last[0])
            if on_result:
                on_result(culprit, results[culprit])
        pending = [i for i in pending if i not in results]
    return [results[i] for i in range(len(strategies))]
