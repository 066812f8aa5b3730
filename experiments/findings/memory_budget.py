"""Does the search choose sharding under a memory budget, and beat tuned FSDP2?

Per domain (model @ lab preset, a per-device budget in MiB, the trials stepping Adam; the lab is
brought up and calibrated here, root needed) and per seed, one real search (``run_search``:
tuned DDP where replicated training fits the budget, FSDP2 with its defaults then tuned by
Optuna through Ray Tune over the configurations the memory model says fit, the builders that
fit, then Algorithm 1 with the replay simulator proposing shard units per module; the
confirmation screens the 3 fastest searched strategies against the 3 fastest baselines of every
kind, FSDP2's included, and re-measures the picks interleaved until the sequential rule decides).

Then the oracle, by a procedure of its own: a sweep of the sharding space (FSDP2's per-module
units at every module depth, shard group every replica or one node (HSDP), resharded after
forward or not, fp32 or bf16 reductions; the engine runs the unresharded, FSDP2 the resharded),
the fitting builders, every baseline configuration the searches measured and the strategies they
found, each as a single trial; the 5 fastest re-measured interleaved, the best kept.

Table per domain: whether replicated Adam fits the budget, the confirmed speed-up of the
recommendation over the screened best baseline [95%], its speed-up over the best tuned FSDP2/HSDP
configuration (the two re-measured interleaved until the rule decides) [95%], its gap to the
oracle [95%], trials until a single trial within 5% of the oracle, memory per rank of the
recommendation predicted and measured against the budget, and the oom trials spent.

    python experiments/findings/memory_budget.py                       # 4 domains x 3 seeds (long)
    python experiments/findings/memory_budget.py --domains bert-tiny@lab-2x2:150 --seeds 0
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import lab, markdown_table, use_data_folder  # noqa: E402

#: model@preset:budget MiB. bert-tiny and transformer-small at budgets replicated Adam training
#: does not fit (parameters, gradients and two moments on every replica); cnn-small and
#: transformer-small at budgets it fits.
DOMAINS = ("bert-tiny@lab-2x2:150", "transformer-small@lab-2x2:6", "cnn-small@lab-2x2:64",
           "transformer-small@lab-b12:64")


def budget_of(spec, cluster, mib: float):
    from synctune.simulator.memory import MemoryBudget

    return MemoryBudget(spec, cluster, gib=mib / 1024, headroom=0.0, optimizer="adam")


def sharding_sweep(spec, cluster, budget) -> list:
    """(strategy, runtime, origin) of the sharding space's grid points that fit ``budget``."""
    from synctune.engine.runtimes import executor_for
    from synctune.strategy import build_strategy
    from synctune.strategy.schema import StrategyError
    from synctune.strategy.validate import validate

    depth = max(len(v.name.split(".")) - 1 for v in spec.variables)
    node = cluster.nodes[0].num_devices
    groups = [0] + ([node] if len(cluster.nodes) > 1 and node > 1 and
                    len({n.num_devices for n in cluster.nodes}) == 1 else [])
    out = []
    for d in range(1, depth + 1):
        for group in groups:
            for reshard in (True, False):
                for dtype in ("fp32", "bf16"):
                    try:
                        s = build_strategy("shard", spec, cluster, depth=d, group=group, reshard=reshard,
                                           reduce_dtype=dtype)
                        validate(s, spec, cluster)
                    except StrategyError:
                        continue
                    if budget.fits(s):
                        runtime = executor_for(s)  # FSDP2 where units reshard, else the engine
                        out.append((s, runtime, f"shard depth {d}, group {group}, reshard {reshard}, {dtype}"))
    return out


def oracle(workload, cluster, node_net, budget, warmup: int, iters: int, extra: list) -> dict:
    """The fastest of the sweep and ``extra`` (strategy, runtime, origin) by single trials, its 5
    fastest re-measured interleaved (10 rounds, every arm each round)."""
    from synctune.cluster.workers import RayWorkerGroup
    from synctune.engine.trial import TrialConfig

    spec = workload.spec()
    pool = sharding_sweep(spec, cluster, budget) + extra
    seen, arms = set(), []
    for s, rt, origin in pool:
        key = (s.hash, rt.config_json(), rt.name)
        if key not in seen:
            seen.add(key)
            arms.append((s, rt, origin))
    from synctune.spec import SpecError

    config = TrialConfig(warmup=warmup, iters=iters, optimizer="adam")
    timed = []
    with RayWorkerGroup(cluster, node_net=node_net) as group:
        for n, (s, rt, origin) in enumerate(arms, 1):
            try:
                r = group.run_trial(s, config, workload=workload, runtime=rt)
            except SpecError as exc:  # a grid point the runtime refuses (e.g. not a module boundary)
                print(f"    oracle {n}/{len(arms)}: {origin}: refused: {str(exc)[:120]}", flush=True)
                continue
            peaks = ((r.extra or {}).get("memory") or {}).get("peak_bytes") or []
            over = budget.over(peaks, s)
            if r.ok and over is None:  # over the budget: an oom arm, never the oracle
                timed.append((r.median_s, s, rt, origin))
            print(f"    oracle {n}/{len(arms)}: {origin}: "
                  + (f"{r.median_s * 1e3:.1f} ms" if r.ok else r.status) + (" (over the budget)" if over else ""),
                  flush=True)
        timed.sort(key=lambda t: t[0])
        top = timed[:5]
        if len(top) < 2:
            raise RuntimeError(f"oracle: {len(top)} arm(s) finished within the budget; need 2")
        from synctune.stats import SequentialRule

        c = group.run_confirm([(s, rt) for _t, s, rt, _o in top], TrialConfig(warmup=warmup, seed=0,
                                                                               optimizer="adam"),
                              workload=workload, rule=SequentialRule(min_rounds=2, max_rounds=2), per_round=5,
                              screen_rounds=10, candidates=len(top) - 1)
    screen = c["screen_s"]
    best = min(range(len(top)), key=lambda i: statistics.median(screen[i]))
    return {"arm": (top[best][1], top[best][2]), "origin": top[best][3], "median_s": statistics.median(screen[best]),
            "swept": len(arms), "arms": [(o, statistics.median(t)) for (_m, _s, _r, o), t in zip(top, screen)]}


def paired(workload, cluster, node_net, arm, other, warmup: int):
    """``arm`` against ``other`` re-measured interleaved until the sequential rule decides (10 to
    40 rounds of 5 iterations): the confirmation's figures (ratio: ``arm``'s speed-up)."""
    from synctune.cluster.workers import RayWorkerGroup
    from synctune.engine.trial import TrialConfig
    from synctune.stats import SequentialRule

    with RayWorkerGroup(cluster, node_net=node_net) as group:
        return group.run_confirm([arm, other], TrialConfig(warmup=warmup, seed=0, optimizer="adam"), workload=workload,
                                 rule=SequentialRule(min_rounds=10, max_rounds=40), per_round=5)


def one_search(workload, cluster, node_net, mib: float, seed: int, budget: int, warmup: int, iters: int) -> dict:
    from synctune.data import TrialDataset, dataset_dir
    from synctune.run.search import run_search
    from synctune.search import Experiment

    spec = workload.spec()
    exp = Experiment.from_keys(name=f"mem-{spec.name}-{cluster.name}-{int(mib)}", model=spec.name,
                               cluster=cluster.name, budget=budget, algorithm="autodist", simulator="replay",
                               proposals=400, candidates=3, warmup=warmup, iters=iters, optimizer="adam",
                               memory_gib=mib / 1024, memory_headroom=0.0, shard=True,
                               baselines=("tuned", "shard"), ddp_trials=6, fsdp_trials=8, confirm_rounds=10,
                               confirm_iters=5, timeout_s=180, seed=seed)
    start = time.monotonic()
    summary = run_search(exp, spec, cluster, workload=workload, node_net=node_net,
                         on_phase=lambda m: print(f"    {m}", flush=True))
    rows = sorted(TrialDataset(dataset_dir()).records(search_id=f"{exp.name}-seed{seed}"),
                  key=lambda r: (r.created_at, r.record_id))
    return {"seed": seed, "summary": summary, "wall": time.monotonic() - start, "rows": rows}


def _found(run: dict) -> list:
    """The baselines' best configurations and the search's 3 fastest finds, as oracle arms."""
    from synctune.engine.runtimes import runtime_from_record
    from synctune.strategy import Strategy

    ok = sorted((r for r in run["rows"] if r.status == "ok" and not r.trial_id.startswith("confirm-")),
                key=lambda r: r.mean_s)
    out, kinds = [], {}
    for r in ok:
        kind = r.runtime if r.runtime in ("ddp", "fsdp") and r.origin.endswith("tuned") else "search"
        if kinds.get(kind, 0) < (3 if kind == "search" else 1):
            kinds[kind] = kinds.get(kind, 0) + 1
            out.append((Strategy.from_json(r.strategy_json), runtime_from_record(r.runtime, r.runtime_json),
                        f"seed {run['seed']}: {r.trial_id} ({r.origin})"))
    return out


def table_row(run: dict, found: dict, workload, cluster, node_net, warmup: int, fits: bool) -> list[object]:
    from synctune.strategy import build_strategy

    s = run["summary"]
    c = s.confirmed
    confirmed = (f"{c.interval.ratio:.3f} [{c.interval.low:.3f}, {c.interval.high:.3f}] ({c.verdict})"
                 if c is not None and c.measured else "n/a")
    rec = s.recommended
    handed = (rec.strategy, rec.runtime) if rec else None
    fsdp = s.runtime_best("fsdp")
    over_fsdp = gap = "n/a"
    if handed and fsdp is not None:
        # Tuned FSDP2 runs on the replicas and batch split of data-parallel all-reduce.
        arm_fsdp = (build_strategy("allreduce", workload.spec(), cluster), fsdp.runtime)
        if rec.runtime == fsdp.runtime:
            over_fsdp = "1 (is tuned FSDP2)"
        else:
            p = paired(workload, cluster, node_net, handed, arm_fsdp, warmup)
            over_fsdp = f"{p['ratio']:.3f} [{p['low']:.3f}, {p['high']:.3f}]" if "ratio" in p else "n/a"
    if handed:
        if handed[0].hash == found["arm"][0].hash and handed[1] == found["arm"][1]:
            gap = "0 (is the oracle)"
        else:
            p = paired(workload, cluster, node_net, handed, found["arm"], warmup)
            gap = f"{1 / p['ratio'] - 1:+.1%} [{1 / p['high'] - 1:+.1%}, {1 / p['low'] - 1:+.1%}]" if "ratio" in p \
                else "n/a"
    oracle_s = found["median_s"]
    trials = [r for r in run["rows"] if not r.trial_id.startswith("confirm-")]
    within = next((n for n, r in enumerate(trials, 1) if r.status == "ok" and r.median_s <= 1.05 * oracle_s), None)
    m = s.memory
    mib = lambda xs: "/".join(f"{x / 2**20:.1f}" for x in xs or [] if x is not None) or "n/a"  # noqa: E731
    return [run["seed"], "yes" if fits else "no", len(trials), rec.name if rec else "n/a", confirmed, over_fsdp, gap,
            within or "-", f"{mib(m.predicted_peak_bytes if m else None)} / {mib(m.measured_peak_bytes if m else None)}",
            m.oom_trials if m else "n/a", f"{run['wall']:.0f}"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--domains", default=",".join(DOMAINS), help="model@lab-preset:budget-MiB, comma-separated")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget", type=int, default=30, help="trials of each search (builders included)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--home", help="synctune data folder of this run (default: a new one)")
    args = parser.parse_args()
    use_data_folder(args.home, "synctune-mem-")

    import ray

    from synctune.strategy import build_strategy
    from synctune.workload import resolve_workload

    seeds = [int(x) for x in args.seeds.split(",")]
    tables = []
    for domain in args.domains.split(","):
        model, _at, rest = domain.partition("@")
        preset, _c, mib_text = rest.partition(":")
        mib = float(mib_text)
        workload = resolve_workload(model)
        with lab(preset) as (cluster, node_net):
            spec = workload.spec()
            budget = budget_of(spec, cluster, mib)
            from synctune.run.prepare import memory_budget  # the probe the searches use
            from synctune.search import Experiment

            probe = memory_budget(Experiment.from_keys(name="probe", model=model, cluster=preset, budget=1,
                                                       optimizer="adam", memory_gib=mib / 1024, memory_headroom=0.0),
                                  spec, cluster, workload)
            budget.probe = budget.activations = probe.probe
            fits = budget.fits(build_strategy("allreduce", spec, cluster))
            print(f"{domain}: replicated Adam {'fits' if fits else 'does not fit'} the budget (predicted "
                  f"{max(budget.peaks(build_strategy('allreduce', spec, cluster))) / 2**20:.1f} MiB per rank)",
                  flush=True)
            ray.init(address="local", num_cpus=cluster.num_devices + 1, include_dashboard=False, log_to_driver=False)
            try:
                runs = []
                for seed in seeds:
                    runs.append(one_search(workload, cluster, node_net, mib, seed, args.budget, args.warmup,
                                           args.iters))
                    print(f"  seed {seed}: done in {runs[-1]['wall']:.0f} s", flush=True)
                found = oracle(workload, cluster, node_net, budget, args.warmup, args.iters,
                               [f for r in runs for f in _found(r)])
                print(f"{domain}: oracle {found['median_s'] * 1e3:.1f} ms ({found['origin']})", flush=True)
                rows = [table_row(r, found, workload, cluster, node_net, args.warmup, fits) for r in runs]
                for row in rows:
                    print("  " + " | ".join(str(x) for x in row), flush=True)
            finally:
                ray.shutdown()
        tables.append((domain, found, rows))
    for domain, found, rows in tables:
        print(f"\n{domain} MiB per device, Adam: oracle {found['median_s'] * 1e3:.1f} ms ({found['origin']}; best of "
              f"{found['swept']} single trials, top 5 re-measured interleaved)")
        print("  re-measured: " + "; ".join(f"{o} {t * 1e3:.1f} ms" for o, t in found["arms"]))
        print(markdown_table(["seed", "replicated Adam fits", "trials", "recommended",
                              "confirmed speed-up over the best baseline [95%]",
                              "speed-up over tuned FSDP2/HSDP [95%]", "gap to the oracle [95%]",
                              "trials to within 5%", "memory per rank MiB predicted / measured", "oom trials",
                              "wall s"], rows))


if __name__ == "__main__":
    main()
