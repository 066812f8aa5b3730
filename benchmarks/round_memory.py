"""Memory of a search round: the peak of drawing and scoring one round of proposals as columns.

A search round (``autodist``) draws ``proposals`` strategies from the guided sampler as columns
(:meth:`GuidedSampler.sample_columns`: one row per shard of every proposal), finds the distinct
ones (``digests``), scores them (the analytic model and the replay, as a search does) and
computes their diversity signatures. Scoring goes through the search's ``BoundSimulator``
(chunked where the engine has ``StrategyColumns.take``; in one piece before). On BERT-large a proposal has hundreds of shards, so a round
of 30,000 holds millions of rows: this prints the bytes of the columns by dtype and the peak
Python-tracked allocation (``tracemalloc``, which numpy reports its arrays to) of the round, and
the process's peak resident set.

    python benchmarks/round_memory.py [--model bert-large] [--cluster B7] [--proposals 30000]
"""

from __future__ import annotations

import argparse
import resource
import time
import tracemalloc
from collections import Counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="bert-large")
    parser.add_argument("--cluster", default="B7")
    parser.add_argument("--proposals", type=int, default=30_000)
    args = parser.parse_args()

    import numpy as np

    from synctune.models import model_spec
    from synctune.search import GuidedSampler
    from synctune.simulator import AnalyticSimulator, BoundSimulator, DomainContext, ReplaySimulator, analytic_time
    from synctune.spec import cluster_preset

    spec, cluster = model_spec(args.model), cluster_preset(args.cluster)
    ctx = DomainContext(spec, cluster)
    guided = GuidedSampler(spec, cluster, seed=0)
    guided.sample_columns(64)  # tables built and the sampler's loop compiled, outside the figures
    replay = ReplaySimulator()
    replay._predict_batch(guided.sample_columns(64), ctx)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    tracemalloc.start()
    t0 = time.perf_counter()
    cols = guided.sample_columns(args.proposals)
    drawn = tracemalloc.get_traced_memory()[1]
    _, first = np.unique(cols.digests(), return_index=True)
    if hasattr(cols, "take"):  # as a search scores a round: a chunk at a time
        BoundSimulator(AnalyticSimulator(), spec, cluster).score_columns(cols)
        BoundSimulator(replay, spec, cluster).score_columns(cols)
    else:  # an engine before chunked scoring (what it did then)
        analytic_time(cols, ctx)
        replay._predict_batch(cols, ctx)
    cols.signatures()
    wall = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    by_dtype: Counter = Counter()
    for name, value in vars(cols).items():
        if isinstance(value, np.ndarray) and name not in ("offsets", "batch_split", "ngroups"):
            by_dtype[str(value.dtype)] += value.nbytes
    rows = len(cols.sid)
    print(f"{args.model} on {cluster.name}: {args.proposals} proposals, {rows:,} shard rows "
          f"({rows / args.proposals:.0f} per proposal), {len(first)} distinct; {wall:.1f} s")
    print("columns: " + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in sorted(by_dtype.items()))
          + f"; {sum(by_dtype.values()) / 2**20:.0f} MiB in all ({sum(by_dtype.values()) / rows:.0f} bytes per row)")
    print(f"peak traced allocation: drawing {drawn / 2**20:.0f} MiB, the whole round {peak / 2**20:.0f} MiB; "
          f"peak resident set {max(rss, rss0) / 2**10:.0f} MiB (before the round {rss0 / 2**10:.0f} MiB)")


if __name__ == "__main__":
    main()
