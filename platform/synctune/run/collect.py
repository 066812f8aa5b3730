"""Collecting the dataset: builders and sampled strategies of one domain measured for real,
each row recorded as its trial ends, and resumable: a collection started again with the same
seed trials only what is not recorded yet (so a long collection may be spread over sittings)."""

from __future__ import annotations

from ..data.store import TrialDataset
from ..data.tracking import MlflowLogger
from ..engine.trial import TrialConfig, TrialResult, run_trials_local
from ..search.sampler import GuidedSampler, RandomSampler
from ..spec.cluster import ClusterSpec
from ..strategy.builders import BUILDERS, build_strategy
from .recording import record_result

__all__ = ["collect_domain", "collection_plan", "collect_search_id"]


def collect_search_id(model: str, cluster: str, seed: int) -> str:
    """The search id a collection's rows carry: what a resumed collection looks up."""
    return f"collect-{model}@{cluster}-seed{seed}"


def sharded_variants(spec, cluster: ClusterSpec) -> list[tuple[str, object]]:
    """``(label, strategy)`` of the ``shard`` builder's settings the engine runs (ZeRO-2: reshard is
    the FSDP2 runtime's), in a fixed order: unit depth 2, 1, 3 x shard group every replica or one
    node's devices (HSDP, where nodes hold several) x fp32 or bf16 reduce; duplicates (the same
    strategy under two settings, or the builder's default, which a collection trials already) once."""
    from ..strategy import build_strategy

    per_node = min(n.num_devices for n in cluster.nodes)
    groups = [0] + ([per_node] if 1 < per_node < cluster.num_devices
                    and all(n.num_devices == per_node for n in cluster.nodes) else [])
    out, seen = [], {build_strategy("shard", spec, cluster).hash}
    for depth in (2, 1, 3):
        for group in groups:
            for dtype in ("fp32", "bf16"):
                s = build_strategy("shard", spec, cluster, depth=depth, group=group, reduce_dtype=dtype)
                if s.hash not in seen:
                    seen.add(s.hash)
                    out.append((f"shard:depth={depth},group={group},reduce_dtype={dtype}", s))
    return out


def collection_plan(spec, cluster: ClusterSpec, *, num_random: int, num_guided: int = 0, builders: bool = True,
                    seed: int = 0, num_sharded: int = 0) -> list[tuple[str, str, object]]:
    """``(trial_id, origin, strategy)`` of a collection, in order: every builder, ``num_random``
    strategies of the unconstrained sampler (the papers' "random") and ``num_guided`` of the
    guided one (compressors, hierarchical all-reduce, uneven batch splits, replica subsets and
    SFB where they apply), then the first ``num_sharded`` of :func:`sharded_variants`. Each
    stream depends on the seed only, and a trial's id on its place in its own stream, so a
    larger ``num_random``, ``num_guided`` or ``num_sharded`` extends a collection without
    renaming what it measured."""
    plan = []
    if builders:
        plan += [(b, b, build_strategy(b, spec, cluster)) for b in BUILDERS]
    plan += [(f"random-{i:04d}", "random", s)
             for i, s in enumerate(RandomSampler(spec, cluster, seed=seed).sample_many(num_random))]
    plan += [(f"guided-{i:04d}", "random-guided", s)
             for i, s in enumerate(GuidedSampler(spec, cluster, seed=seed).sample_many(num_guided))]
    if num_sharded:
        plan += [(f"shard-{i:04d}", label, s) for i, (label, s) in enumerate(sharded_variants(spec, cluster)[:num_sharded])]
    return plan


def collect_domain(ds: TrialDataset, workload, cluster: ClusterSpec, *, num_random: int, builders: bool, seed: int,
                   warmup: int, iters: int, num_guided: int = 0, use_mlflow: bool = False, node_net=None,
                   say=None, num_sharded: int = 0, measure: dict | None = None) -> list[TrialResult]:
    """Trial the :func:`collection_plan` of ``workload`` on ``cluster`` in one process group,
    each row recorded as its trial ends. Trials this collection (same model, cluster name and
    seed) already recorded in ``ds`` are skipped, failed ones included; returns the results of
    the trials run now, in order. ``measure``: more :class:`TrialConfig` settings (the quieter
    trial's ``target_ci``, ``max_iters``, ``max_timed_s``, ``pin_cpus``)."""
    from tqdm import tqdm

    spec = workload.spec()
    config = TrialConfig(warmup=warmup, iters=iters, seed=seed, **(measure or {}))
    search_id = collect_search_id(spec.name, cluster.name, seed)
    plan = collection_plan(spec, cluster, num_random=num_random, num_guided=num_guided, builders=builders, seed=seed,
                           num_sharded=num_sharded)
    done = set(ds.table(model=spec.name, cluster=cluster.name, search_id=search_id).column("trial_id").to_pylist())
    todo = [p for p in plan if p[0] not in done]
    if say is not None and len(todo) < len(plan):
        say(f"{spec.name}@{cluster.name}: {len(plan) - len(todo)} of {len(plan)} trials already recorded "
            f"({search_id}); running the other {len(todo)}")
    if not todo:
        return []
    logger = MlflowLogger(f"collect-{spec.name}@{cluster.name}") if use_mlflow else None
    parent = logger.start_search(search_id, {"model": spec.name, "cluster": cluster.name}) if logger else ""
    bar = tqdm(total=len(todo), desc=f"{spec.name}@{cluster.name}", unit="trial", disable=None)
    finished = [0]  # a disabled bar counts nothing

    def on_result(i: int, result: TrialResult) -> None:
        trial_id, origin, strategy = todo[i]
        record_result(result, strategy, spec, cluster, dataset=ds, logger=logger, origin=origin,
                      search_id=search_id, trial_id=trial_id, experiment=logger.experiment if logger else "",
                      parent_run_id=parent, workload_source=workload.source)
        bar.update(1)
        if bar.disable and say is not None:
            # No terminal for the bar (nohup, a log file): a line per trial, so progress shows.
            figure = f"{result.median_s * 1e3:.1f} ms" if result.status == "ok" else result.status
            finished[0] += 1
            say(f"{spec.name}@{cluster.name}: {finished[0]}/{len(todo)} {trial_id}: {figure}")

    try:
        return run_trials_local([s for _t, _o, s in todo], cluster, config, workload=workload, on_result=on_result,
                                node_net=node_net)
    finally:
        bar.close()
