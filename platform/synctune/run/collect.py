"""Collecting the dataset: builders and sampled strategies of one domain measured for real,
each row recorded as its trial ends (so an interrupted collection keeps what it measured)."""

from __future__ import annotations

from ..data.store import TrialDataset
from ..data.tracking import MlflowLogger
from ..engine.trial import TrialConfig, TrialResult, run_trials_local
from ..search.sampler import RandomSampler
from ..spec.cluster import ClusterSpec
from ..strategy.builders import BUILDERS, build_strategy
from .recording import record_result

__all__ = ["collect_domain"]


def collect_domain(ds: TrialDataset, workload, cluster: ClusterSpec, *, num_random: int, builders: bool, seed: int,
                   warmup: int, iters: int, use_mlflow: bool = False, node_net=None) -> list[TrialResult]:
    """Trial every builder (optionally) and ``num_random`` random strategies of ``workload`` on
    ``cluster``, one process group for all, each row recorded as its trial ends; returns the
    results in order."""
    from tqdm import tqdm

    spec = workload.spec()
    config = TrialConfig(warmup=warmup, iters=iters, seed=seed)
    strategies, origins = [], []
    if builders:
        for b in BUILDERS:
            strategies.append(build_strategy(b, spec, cluster))
            origins.append(b)
    strategies += RandomSampler(spec, cluster, seed=seed).sample_many(num_random)
    origins += ["random"] * num_random
    search_id = f"collect-{spec.name}@{cluster.name}-seed{seed}"
    logger = MlflowLogger(f"collect-{spec.name}@{cluster.name}") if use_mlflow else None
    parent = logger.start_search(search_id, {"model": spec.name, "cluster": cluster.name}) if logger else ""
    bar = tqdm(total=len(strategies), desc=f"{spec.name}@{cluster.name}", unit="trial", disable=None)

    def on_result(i: int, result: TrialResult) -> None:
        record_result(result.to_dict(), strategies[i], spec, cluster, dataset=ds, logger=logger, origin=origins[i],
                      search_id=search_id, trial_id=f"{i:04d}", experiment=logger.experiment if logger else "",
                      parent_run_id=parent, workload_source=workload.source)
        bar.update(1)

    try:
        return run_trials_local(strategies, cluster, config, workload=workload, on_result=on_result,
                                node_net=node_net)
    finally:
        bar.close()
