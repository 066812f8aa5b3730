"""The slices a search runs its trials on: one named actor per slice, holding a
:class:`~synctune.cluster.workers.RayWorkerGroup` for the experiment's cluster (the process
group starts once per slice for the whole search, not once per trial), and the Tune trainable
that hands each Tune trial's strategy to its slice. Results cross Ray as plain data
(:meth:`~synctune.engine.measure.TrialResult.to_dict`)."""

from __future__ import annotations

import json

from ..engine.measure import TrialConfig, TrialResult
from ..engine.runtimes import as_runtime, runtime_class
from ..spec.cluster import ClusterSpec
from ..strategy.schema import Strategy

__all__ = ["SliceActor", "trainable", "release_slices", "outcome_of", "judge_memory"]


class SliceActor:
    """Actor body holding one worker group (wrapped with ray.remote by the search)."""

    def __init__(self, cluster: dict, startup_timeout_s: float, node_net: dict | None, workload) -> None:
        """``startup_timeout_s`` bounds each start of the slice (its nodes, its workers): the
        experiment's ``run.slice_timeout_s``."""
        from ..cluster.workers import RayWorkerGroup

        self.workload = workload
        self.group = RayWorkerGroup(ClusterSpec.from_dict(cluster), startup_timeout_s=startup_timeout_s,
                                    node_net=node_net)

    #: How many times a trial whose worker died (its node lost, most often) runs again on a
    #: fresh slice before its failure is recorded.
    RETRIES = 1

    def run(self, strategy: dict, config: dict, runtime: dict | None = None) -> dict:
        """One trial (``runtime`` in its plain-data form); its result as plain data.

        A trial whose worker died runs again from the start on a fresh slice (the old one is
        released, so a lost node's place is taken by another the autoscaler adds), up to
        :attr:`RETRIES` times: still one trial, one row, its result's ``extra["retried"]``
        naming each lost attempt. The retry is here rather than in Ray Tune's ``FailureConfig``:
        the Tune trial does not fail (the slice actor, on the head, reports the lost worker as a
        result), and a Tune retry would restore nothing a trial keeps."""
        plan, trial_config = Strategy.from_dict(strategy), TrialConfig(**config)
        retried: list[str] = []
        while True:
            out = self._attempt(plan, trial_config, runtime)
            error = out.get("error") or ""
            if out.get("status") == "failed" and "a worker died" in error and len(retried) < self.RETRIES:
                retried.append(error[:300])
                self.group.shutdown()
                continue
            if retried:
                out["extra"] = {**(out.get("extra") or {}), "retried": retried}
            return out

    def _attempt(self, plan: Strategy, trial_config: TrialConfig, runtime: dict | None) -> dict:
        """One attempt of a trial: the slice started (a failure to start is the trial's
        failure, with the reason), then the trial run on it."""
        import time

        from ..cluster.workers import SlicePending
        from ..engine.trial import failed_result

        start = time.monotonic()
        try:
            self.group.start()
        except SlicePending as exc:  # the nodes never came: this trial fails, the search goes on
            return failed_result("failed", f"{exc} (run.slice_timeout_s)", plan, self.group.cluster, trial_config,
                                 "ray", time.monotonic() - start).to_dict()
        except Exception as exc:  # noqa: BLE001 - a slice that cannot start is this trial's failure, recorded
            first = str(exc).strip().splitlines()[0][:500] if str(exc).strip() else ""
            return failed_result("failed", f"the slice did not start: {type(exc).__name__}: {first}", plan,
                                 self.group.cluster, trial_config, "ray", time.monotonic() - start).to_dict()
        try:
            return self.group.run_trial(plan, trial_config, workload=self.workload,
                                        runtime=as_runtime(runtime)).to_dict()
        except SlicePending as exc:  # restarted after a lost worker, and the nodes never came back
            return failed_result("failed", f"{exc} (run.slice_timeout_s)", plan, self.group.cluster, trial_config,
                                 "ray", time.monotonic() - start).to_dict()

    def confirm(self, arms: list, config: dict, rule: dict, per_round: int, screen_rounds: int = 0,
                candidates: int | None = None, screen_max_rounds: int = 0) -> dict:
        """Interleaved re-measurement of arms ((strategy dict, runtime dict) pairs: the
        ``candidates`` first, then the baselines; screened first when more than two, sequentially
        up to ``screen_max_rounds``), until
        ``rule`` (a :class:`~synctune.stats.SequentialRule`'s plain form) stops it."""
        from ..cluster.workers import ConfirmFailed, SlicePending
        from ..stats import SequentialRule

        try:
            return self.group.run_confirm([(Strategy.from_dict(st), as_runtime(rt)) for st, rt in arms],
                                          TrialConfig(**config), workload=self.workload, rule=SequentialRule(**rule),
                                          per_round=per_round, screen_rounds=screen_rounds,
                                          screen_max_rounds=screen_max_rounds, candidates=candidates)
        except (ConfirmFailed, SlicePending) as exc:
            return {"error": str(exc)}

    def where(self) -> str:
        """The Ray node this slice actor runs on (the head: it takes no worker resources)."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def shutdown(self) -> None:
        """Release the slice: kill its worker actors and free their placement group."""
        self.group.shutdown()


def trainable(config: dict) -> None:
    """A Tune trial: its strategy (and runtime, or a tuner's point) run on its slice."""
    import ray
    from ray import tune

    holder = ray.get_actor(config["slice"])
    runtime = config.get("runtime")  # the runtime that runs a proposal (the engine, FSDP2, TensorFlow)
    tuned = runtime_class(config["tuned"]) if "tuned" in config else None
    if tuned is not None:  # a tuned runtime's trial: Optuna's parameters arrive in the config
        params = {k: config[k] for k in tuned.tuning.params}
        runtime = tuned.from_tuned(params).to_dict()
    result = judge_memory(ray.get(holder.run.remote(config["strategy"], config["trial_config"], runtime)),
                          config.get("memory_limits"))
    if tuned is not None:
        result["extra"][f"{tuned.name}_params"] = params
    tune.report({"mean_s": result["mean_s"] if result["status"] == "ok" else float("nan"),
                 "result_json": json.dumps(result)})


def judge_memory(result: dict, limits: list | None) -> dict:
    """A finished trial's result (plain data) as status ``oom`` when a rank's measured peak
    (its memory breakdown's ``peak_bytes``: tensor memory, the allocator's on a GPU) exceeds
    that rank's budget in ``limits`` (bytes per rank, None: none): DESIGN.md "memory budget".
    Its times stay in the row; the search never ranks nor recommends it. A real CUDA
    out-of-memory is ``oom`` already (:func:`synctune.engine.local.classify_error`)."""
    from ..simulator.memory import over_limits

    if result.get("status") != "ok" or not limits:
        return result
    why = over_limits(((result.get("extra") or {}).get("memory") or {}).get("peak_bytes") or [], limits)
    return dict(result, status="oom", error=f"{why} (search.memory_gib)") if why else result


def outcome_of(reported: dict | None) -> TrialResult:
    """The trial result a Tune trial reported (a failed one if it raised before reporting)."""
    if reported and "result_json" in reported:
        return TrialResult.from_dict(json.loads(reported["result_json"]))
    return TrialResult(status="failed", error="the Tune trial raised before reporting", launcher="ray")


def release_slices(holders: list) -> None:
    """Tear down every slice (actors and placement groups), even if one of them hangs."""
    import ray

    refs = [h.shutdown.remote() for h in holders]
    try:
        ray.wait(refs, num_returns=len(refs), timeout=60)
    finally:
        for h in holders:
            ray.kill(h)
