"""The column sampler draws what the object sampler drew (one way to draw strategies).

The guided sampler draws only columns now, from numpy's stream; the object sampler it replaced
drew from Python's, so no draw can be bit-identical. Its code is kept unchanged as an
independent reference (tests/_reference_sampler.py), and here both draw a few hundred
strategies (fixed seeds) on domains that exercise every decision: a sparse zoo model
(ncf-small: all-gather, sparse merge groups, ZeRO-2 only), a dense one (bert-tiny: compressors,
hierarchical all-reduce, fsdp units, HSDP), one with linear weights cheaper by SFB (vgg16 on
B7), and nodes of different measured speeds (transformer-small on lab-b10c, cnn-small on
lab-b12: replica subsets, uneven splits), with and without ``shard_prob``, and with a memory
budget's ``fits`` (growth). Every strategy of both is described by the same numbers (made from
the strategy objects, not from columns), and each number's mean must agree within four standard
errors of the difference of two independent means (a two-sample z interval: a real shift of a
rate of 0.1 on 300 draws is about five of them); categorical outcomes (the strategy's class,
its merge-group count) must pass a chi-square test of homogeneity at p > 0.001.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
from _reference_sampler import GuidedSampler as ReferenceSampler
from scipy.stats import chi2_contingency

from synctune.models import model_spec
from synctune.search import GuidedSampler
from synctune.simulator.memory import predict_memory
from synctune.spec import cluster_preset
from synctune.strategy import build_strategy, validate

DRAWS = 300
Z = 4.0  # standard errors of the difference allowed for every mean
P_MIN = 1e-3  # the chi-square tests' level


def _speeds(name: str, speeds: list[float]):
    """A lab preset with measured node speeds, as calibration writes them."""
    cluster = cluster_preset(name)
    return dataclasses.replace(cluster, nodes=tuple(dataclasses.replace(n, compute_gflops=s)
                                                    for n, s in zip(cluster.nodes, speeds)))


def _budget(spec, cluster):
    """A memory budget's predicate independent of the samplers: the memory model's peak with
    Adam at most halfway between ZeRO-2 over every module (depth 2) and replicated training."""
    def peak(s) -> int:
        return max(r.peak_bytes for r in predict_memory(s, spec, cluster, optimizer_state_multiplier="adam",
                                                        fsdp=s.frees_parameters))

    zero2 = peak(build_strategy("shard", spec, cluster, depth=2, reshard=False))
    replicated = peak(build_strategy("allreduce", spec, cluster))
    limit = (zero2 + replicated) // 2
    return lambda s: peak(s) <= limit


CASES = {
    "ncf-small@local-2x2": ("ncf-small", lambda: cluster_preset("local-2x2"), {}),
    "ncf-small@local-2x2 shard": ("ncf-small", lambda: cluster_preset("local-2x2"), {"shard_prob": 0.5}),
    "bert-tiny@local-2x2": ("bert-tiny", lambda: cluster_preset("local-2x2"), {}),
    "bert-tiny@local-2x2 shard": ("bert-tiny", lambda: cluster_preset("local-2x2"), {"shard_prob": 0.6}),
    "bert-tiny@local-2x2 shard fits": ("bert-tiny", lambda: cluster_preset("local-2x2"),
                                       {"shard_prob": 0.6, "fits": _budget}),
    "vgg16@B7": ("vgg16", lambda: cluster_preset("B7"), {}),
    "transformer-small@lab-b10c speeds shard": ("transformer-small", lambda: _speeds("lab-b10c", [17.0, 34.0]),
                                                {"shard_prob": 0.5, "subset_prob": 0.4}),
    "cnn-small@lab-b12 speeds": ("cnn-small", lambda: _speeds("lab-b12", [10.0, 20.0]), {"subset_prob": 0.5}),
}


def _syncs(s):
    return [(p, sh) for p in s.plans for sh in p.shards]


def describe(s, spec, cluster, fits) -> dict[str, float]:
    """The numbers a strategy's decisions come to; NaN where one does not apply (a PS rate of a
    strategy with no PS shard): those are left out of that number's mean."""
    shards = _syncs(s)
    kinds = [sh.synchronizer.kind for _p, sh in shards]
    ps = [sh.synchronizer for _p, sh in shards if sh.synchronizer.kind == "ps"]
    units = [sh.synchronizer for _p, sh in shards if sh.synchronizer.kind == "shard"]
    dense_groups = {sh.synchronizer.group for p, sh in shards if sh.synchronizer.kind == "allreduce"
                    and not spec[p.variable].sparse}
    comps = {sh.compressor.kind for _p, sh in shards}
    nan = math.nan
    out = {f"share {k}": kinds.count(k) / len(kinds) for k in ("ps", "allreduce", "allgather", "sfb", "shard")}
    out.update({
        "partitioned variables": sum(p.is_partitioned for p in s.plans) / len(s.plans),
        "shards per variable": len(shards) / len(s.plans),
        "compressed": float(bool(comps - {"none"})),
        "powersgd": float("powersgd" in comps),
        "fp16": float("fp16" in comps),
        "hierarchical": float(any(getattr(sh.synchronizer, "algorithm", "") == "hierarchical" for _p, sh in shards)),
        "dense merge groups": float(len(dense_groups)),
        "servers used": float(len({x.placement for x in ps})),
        "local aggregation (of ps)": sum(x.local_aggregation for x in ps) / len(ps) if ps else nan,
        "subset": float(len(s.replicas) < cluster.num_devices),
        "node 0 left out (of subsets)": (float(not set(cluster.nodes[0].devices) & set(s.replicas))
                                         if len(s.replicas) < cluster.num_devices else nan),
        "uneven split": float(len(set(s.batch_split)) > 1),
        "node 0's batch share": sum(b for d, b in zip(s.replicas, s.batch_split) if d in cluster.nodes[0].devices)
        / s.global_batch_size,
        "sharded": float(bool(units)),
        "all shard (of sharded)": float(len(units) == len(shards)) if units else nan,
        "reshard (of sharded)": float(any(u.reshard for u in units)) if units else nan,
        "prefetch 2 (of resharded units)": (sum(u.prefetch == 2 for u in units if u.reshard)
                                            / max(1, sum(u.reshard for u in units))
                                            if any(u.reshard for u in units) else nan),
        "hsdp (of sharded)": float(units[0].group > 0) if units else nan,
        "bf16 (of sharded)": float(units[0].reduce_dtype == "bf16") if units else nan,
        "units (of sharded)": float(len({u.unit for u in units})) if units else nan,
        "sharded variables (of sharded)": len(units) / len(s.plans) if units else nan,
    })
    if fits is not None:
        out["fits"] = float(fits(s))
        out["fits (of sharded)"] = float(fits(s)) if units else nan
    return out


def _category(s) -> str:
    kinds = {sh.synchronizer.kind for _p, sh in _syncs(s)}
    if "shard" not in kinds:
        return "replicated"
    return "all shard" if kinds == {"shard"} else "zero2 beside other plans"


def _groups_bin(s, spec) -> str:
    n = len({sh.synchronizer.group for p, sh in _syncs(s) if sh.synchronizer.kind == "allreduce"
             and not spec[p.variable].sparse})
    return "0" if n == 0 else "1" if n == 1 else "2-3" if n <= 3 else "4-7" if n <= 7 else "8+"


def _chi2(a: list[str], b: list[str]) -> float:
    """The p-value of a chi-square test that ``a`` and ``b`` come from one categorical
    distribution (1.0 where both hold one and the same category)."""
    cats = sorted(set(a) | set(b))
    if len(cats) < 2:
        return 1.0
    table = np.array([[a.count(c) for c in cats], [b.count(c) for c in cats]])
    return float(chi2_contingency(table)[1])


def compare(case: str, draws: int = DRAWS) -> tuple[dict, dict, dict]:
    """Per number: (reference mean, column mean, difference in standard errors); per categorical
    outcome, its chi-square p-value; both samplers' draws validated."""
    name, make_cluster, options = CASES[case]
    spec, cluster = model_spec(name), make_cluster()
    options = dict(options)
    fits = options.pop("fits")(spec, cluster) if "fits" in options else None
    samples = {}
    for label, cls, seed in (("reference", ReferenceSampler, 11), ("columns", GuidedSampler, 12)):
        drawn = cls(spec, cluster, seed=seed, fits=fits, **options).sample_many(draws)
        for s in drawn:
            validate(s, spec, cluster)
        samples[label] = drawn
    figures = {}
    described = {k: [describe(s, spec, cluster, fits) for s in v] for k, v in samples.items()}
    for key in described["reference"][0]:
        a = np.array([d[key] for d in described["reference"]])
        b = np.array([d[key] for d in described["columns"]])
        a, b = a[~np.isnan(a)], b[~np.isnan(b)]
        if not len(a) and not len(b):
            continue
        assert len(a) >= 10 and len(b) >= 10, (case, key, len(a), len(b))
        se = math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b))
        diff = b.mean() - a.mean()
        figures[key] = (float(a.mean()), float(b.mean()), 0.0 if diff == 0 else (math.inf if se == 0 else diff / se))
    categorical = {
        "strategy class": _chi2([_category(s) for s in samples["reference"]],
                                [_category(s) for s in samples["columns"]]),
        "dense merge groups": _chi2([_groups_bin(s, spec) for s in samples["reference"]],
                                    [_groups_bin(s, spec) for s in samples["columns"]]),
    }
    return figures, categorical, {k: len(v) for k, v in samples.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_the_column_sampler_draws_the_object_samplers_distribution(case):
    figures, categorical, _ = compare(case)
    far = {key: f for key, f in figures.items() if abs(f[2]) > Z}
    assert far == {}, (case, far)
    low = {key: p for key, p in categorical.items() if p <= P_MIN}
    assert low == {}, (case, low)


def test_the_comparison_sees_a_changed_distribution():
    """The comparison can fail: the column sampler with another replica-subset rate (0.1 for
    the reference's 0.4) is told apart from the reference on the numbers and the interval above."""
    name, make_cluster, options = CASES["transformer-small@lab-b10c speeds shard"]
    spec, cluster = model_spec(name), make_cluster()
    ref = ReferenceSampler(spec, cluster, seed=11, **options).sample_many(DRAWS)
    changed = GuidedSampler(spec, cluster, seed=12, **{**options, "subset_prob": 0.1}).sample_many(DRAWS)
    a = np.array([describe(s, spec, cluster, None)["subset"] for s in ref])
    b = np.array([describe(s, spec, cluster, None)["subset"] for s in changed])
    assert abs(b.mean() - a.mean()) / math.sqrt(a.var(ddof=1) / len(a) + b.var(ddof=1) / len(b)) > Z
