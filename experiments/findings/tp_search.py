"""Does the search choose tensor parallelism, sharding and checkpointing jointly, under a memory
budget, better than what users run and what a model-only tool would deploy? Per lab domain and
seed: the search's recommendation against tuned Megatron-style TP + FSDP2 and tuned FSDP2/HSDP,
the modelled pick, and an oracle; memory, OOM share and the room left under a lower bound.

Per domain (model @ lab preset, optionally a memory budget in GiB per device; the lab is brought
up and calibrated here, root needed; ``--stand-in`` runs every domain over loopback instead) and
per seed:
  - the search is prepared (``prepare_search``), the modelled pick made from that context before
    any trial (``synctune.run.modelled.context_pick``: the builders, Megatron's plans at every
    tuned setting and draws of the search's own sampler, judged by the memory model as prepared,
    ranked by the training-free replay), then the search runs (``run_prepared``): tuned DDP (6
    trials) where replicated training fits, tuned FSDP2/HSDP (8, with checkpointing among its
    settings), tuned Megatron TP + FSDP2 (8: TP degree, sequence parallelism, reshard,
    checkpointing) where the model has Megatron's pairs, the builders, ``--budget`` trials of
    Algorithm 1 with the replay (shard units, TP and checkpointing per module where the budget
    asks for them), the confirmation against the best baseline;
  - the recommendation (the searched strategy only when confirmed faster, else that baseline) is
    re-measured interleaved (10 to 40 rounds of 5 iterations, until the sequential rule decides)
    against the faster of tuned Megatron and tuned FSDP2/HSDP, against the modelled pick, and
    against the oracle.

The oracle, per domain after its seeds, by a procedure of its own: every point of the grid users
tune (torch DDP's defaults; FSDP2's layouts: per-block units resharded or kept, or the root, over
every replica or HSDP over the nodes, each with every block checkpointed in each mode or none;
Megatron's plan at every TP degree, sequence parallelism, reshard and checkpointing setting; the
engine's shard builder at every module depth, shard group, reshard and reduce dtype), those the
memory model fits, the searches' recommendations, modelled picks, 3 fastest finds and best tuned
trials of each runtime: single trials (a measured peak over the budget excludes an arm), the 5
fastest re-measured interleaved (10 rounds), the best kept (``memory_budget.oracle``).

Lower bound: the recommendation as its runtime runs it, priced by the search's training-free
replay with perfect overlap, the larger of its compute and its communication at the links'
calibrated bandwidths (``ReplaySimulator.lower_bound``); the table gives the recommendation's
re-measured time as a multiple of it.

    python experiments/findings/tp_search.py                                      # 5 domains x 3 seeds (long)
    python experiments/findings/tp_search.py --domains transformer-small@lab-2x2:0.006 --seeds 0
    python experiments/findings/tp_search.py --domains transformer-small@lab-2x2:0.006 --seeds 0 \\
        --stand-in local-2x2 --budget 6                                           # the code path, no root

Searches record their rows in the run's data folder (``--home``; printed first): publish it as a
dataset release with ``synctune dataset push``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import markdown_table, use_data_folder  # noqa: E402
from memory_budget import oracle, paired  # noqa: E402
from search_vs_modelled import Domain, add_domain_options, measured_domain, read_domain_options, \
    workload_path  # noqa: E402

#: Three domains where memory forces sharding, TP or checkpointing (the zoo transformer at 6 MiB;
#: Hugging Face Llama built from a config at 30 MiB and Hugging Face BERT at 17 MiB, where FSDP2
#: fits only with every block checkpointed and no Megatron plan fits), two where replicated
#: training fits (a CNN, Hugging Face BERT on the device's memory).
DOMAINS = ("transformer-small@lab-2x2:0.006", "hf_llama@lab-2x2:0.0293", "hf_bert@lab-2x2:0.0166", "cnn-small@lab-2x2",
           "hf_bert@lab-2x2")
MIB = 1 << 20


def experiment(domain: Domain, spec, cluster, seed: int, args):
    """The experiment of one search (module docstring): autodist with the replay, shard units and
    tensor parallelism where the budget asks for them, the tuned baselines, Megatron's where the
    model has its pairs."""
    from synctune.engine.megatron import megatron_refusal
    from synctune.search import Experiment
    from synctune.workload.zoo import MODELS

    trains = {"model": domain.model} if domain.model in MODELS else {"workload": workload_path(domain.model)}
    memory = {"memory_gib": domain.gib, "memory_headroom": 0.0} if domain.gib is not None else {}
    megatron = megatron_refusal(spec, cluster) is None
    tag = f"{domain.gib:g}gib" if domain.gib is not None else "device"
    return Experiment.from_keys(name=f"tps-{spec.name}-{cluster.name}-{tag}", **trains, cluster=cluster.name,
                                budget=args.budget, algorithm="autodist", simulator="replay", proposals=400,
                                candidates=3, warmup=args.warmup, iters=args.iters, optimizer="adam",
                                baselines=("tuned", "shard") + (("megatron",) if megatron else ()),
                                ddp_trials=6, fsdp_trials=8, shard="auto", tensor_parallel="auto",
                                confirm_rounds=10, confirm_iters=5, timeout_s=240, seed=seed, **memory)


def grid(context) -> list:
    """(strategy, runtime, origin) of every point of the grid users tune that the memory model
    (as the search prepared it) fits: DDP's defaults, FSDP2's layouts x checkpointing, Megatron's
    settings, on the replicated skeleton; the engine's shard builder comes from
    ``memory_budget.sharding_sweep`` inside :func:`memory_budget.oracle`."""
    from synctune.engine.ddp import DDPRuntime
    from synctune.engine.fsdp import FSDP_CHECKPOINT, FSDPRuntime, fsdp_config_of, fsdp_layouts
    from synctune.engine.megatron import MegatronRuntime, megatron_refusal, megatron_settings
    from synctune.spec import SpecError

    model, cluster, skeleton = context.model, context.cluster, context.skeleton
    runtimes = [(DDPRuntime(), "DDP defaults")]
    for layout in fsdp_layouts(model, cluster):
        for checkpoint in FSDP_CHECKPOINT:
            config = fsdp_config_of({"layout": layout, "prefetch": 1, "reduce_dtype": "fp32", "checkpoint": checkpoint})
            runtimes.append((FSDPRuntime(config), f"FSDP2 {layout}, checkpoint {checkpoint}"))
    if megatron_refusal(model, cluster) is None:
        runtimes += [(MegatronRuntime(c), f"Megatron {c.summary()}") for c in megatron_settings(model, cluster)]
    out = []
    for runtime, origin in runtimes:
        try:
            if context.runtime_fits(runtime):
                out.append((skeleton, runtime, origin))
        except SpecError:
            continue  # a setting the model has no plan for
    return out


def found_arms(run: dict) -> list:
    """The seed's recommendation and modelled pick, the best trial of each tuned runtime and the
    search's 3 fastest finds, as oracle arms."""
    from synctune.engine.runtimes import runtime_from_record
    from synctune.strategy import Strategy

    ok = sorted((r for r in run["rows"] if r.status == "ok" and not r.trial_id.startswith("confirm-")),
                key=lambda r: r.mean_s)
    out, kinds = [], {}
    for r in ok:
        kind = r.runtime if r.origin.endswith("-tuned") else "search"
        if kinds.get(kind, 0) < (3 if kind == "search" else 1):
            kinds[kind] = kinds.get(kind, 0) + 1
            # A tuned runtime takes the replicas and batch split of the skeleton; its row holds the
            # plan it wrote (Megatron's, FSDP2's units), which it would refuse as its input.
            strategy = Strategy.from_json(r.strategy_json) if kind == "search" else run["context"].skeleton
            out.append((strategy, runtime_from_record(r.runtime, r.runtime_json),
                        f"seed {run['seed']}: {r.trial_id} ({r.origin})"))
    rec = run["summary"].recommended
    if rec is not None:
        out.append((rec.strategy, rec.runtime, f"seed {run['seed']}: recommendation"))
    out.append((*run["modelled"], f"seed {run['seed']}: modelled pick"))
    return out


def one_search(domain: Domain, workload, spec, cluster, node_net, seed: int, args) -> dict:
    """One search with its modelled pick made first; its rows, lower bound and wall time."""
    from synctune.data import TrialDataset, dataset_dir
    from synctune.run.modelled import context_pick, modelled_arm
    from synctune.run.prepare import prepare_search
    from synctune.run.search import run_prepared
    from synctune.run.simulators import make_search_simulator

    say = lambda m: print(f"    {m}", flush=True)  # noqa: E731
    start = time.monotonic()
    exp = experiment(domain, spec, cluster, seed, args)
    context = prepare_search(exp, workload, cluster, model=spec, node_net=node_net, say=say)
    pick = context_pick(context)
    modelled = modelled_arm(context, pick)
    say(f"{pick.summary()}: {what(pick.strategy, spec)}")
    summary = run_prepared(context, on_phase=say)
    rows = sorted(TrialDataset(dataset_dir()).records(search_id=summary.search_id),
                  key=lambda r: (r.created_at, r.record_id))
    bound = None
    rec = summary.recommended
    if rec is not None:
        replay = make_search_simulator(exp, spec, cluster).simulator
        held = rec.runtime.plans_of(rec.strategy, lambda: context.module, context.model)
        bound = replay.lower_bound(held, context.model, cluster)
        say(f"recommended: {rec.kind}, {rec.name} ({rec.runtime.name}: {what(held, spec)}); lower bound "
            f"{bound['bound_s'] * 1e3:.1f} ms "
            f"(compute {bound['compute_s'] * 1e3:.1f}, communication {bound['comm_s'] * 1e3:.1f})")
    return {"seed": seed, "summary": summary, "rows": rows, "pick": pick, "bound": bound, "context": context,
            "modelled": (modelled.strategy, modelled.runtime), "wall": time.monotonic() - start}


def what(strategy, spec) -> str:
    """A strategy in a few words: its tensor parallelism, and what else it does otherwise than
    torch DDP (sharding, checkpointing, synchronizers)."""
    from synctune.strategy.explain import differences_from_ddp

    split = strategy.tensor_parallel
    parts = [f"TP {split.degree}" + (" with SP" if split.sequence_parallel else "")] if split else []
    return "; ".join(parts + [differences_from_ddp(strategy, spec)])


def _paired(workload, cluster, node_net, arm, other, warmup: int) -> dict:
    """``memory_budget.paired``, a failure reported in the row (``error``) rather than ending the run."""
    try:
        return paired(workload, cluster, node_net, arm, other, warmup)
    except Exception as exc:  # noqa: BLE001 - a worker that died or an arm refused: the cell says so
        print(f"    re-measurement failed: {str(exc)[:200]}", flush=True)
        return {"error": str(exc)[:80]}


def _same(a, b) -> bool:
    return a[0].hash == b[0].hash and a[1].name == b[1].name and a[1].config_json() == b[1].config_json()


def _speedup(p: dict) -> str:
    if "ratio" not in p:
        return f"n/a ({p['error']})" if "error" in p else "n/a"
    return f"{p['ratio']:.3f} [{p['low']:.3f}, {p['high']:.3f}]"


def table_row(run: dict, found: dict, workload, cluster, node_net, warmup: int) -> list[object]:
    """One seed's row: every comparison re-measured interleaved (``memory_budget.paired``)."""
    s, context = run["summary"], run["context"]
    c = s.confirmed
    confirmed = f"{_speedup({'ratio': c.interval.ratio, 'low': c.interval.low, 'high': c.interval.high})} " \
                f"({c.verdict})" if c is not None and c.measured else "n/a"
    trials = [r for r in run["rows"] if not r.trial_id.startswith("confirm-")]
    oom = sum(r.status == "oom" for r in trials)
    rec = s.recommended
    if rec is None:
        return [run["seed"], len(trials), f"{oom}/{len(trials)}", "none"] + ["n/a"] * 7 + [f"{run['wall']:.0f}"]
    handed = (rec.strategy, rec.runtime)
    tuned = [b for b in (s.runtime_best("megatron"), s.runtime_best("fsdp")) if b is not None]
    over_tuned, rec_s = "n/a (no tuned Megatron or FSDP2 trial finished)", []
    if tuned:
        best = min(tuned, key=lambda b: b.mean_s)
        arm = (context.skeleton, best.runtime)
        if _same(handed, arm):
            over_tuned = f"1 (is {best.label})"
        else:
            p = _paired(workload, cluster, node_net, handed, arm, warmup)
            over_tuned = f"{_speedup(p)} over {best.label}"
            rec_s += list(p.get("a_s") or [])
    if _same(handed, run["modelled"]):
        over_pick = "1 (is the modelled pick)"
    else:
        p = _paired(workload, cluster, node_net, handed, run["modelled"], warmup)
        over_pick = _speedup(p)
        rec_s += list(p.get("a_s") or [])
    if _same(handed, found["arm"]):
        gap = "0 (is the oracle)"
        rec_s.append(found["median_s"])
    else:
        p = _paired(workload, cluster, node_net, handed, found["arm"], warmup)
        gap = f"{1 / p['ratio'] - 1:+.1%} [{1 / p['high'] - 1:+.1%}, {1 / p['low'] - 1:+.1%}]" if "ratio" in p \
            else "n/a"
        rec_s += list(p.get("a_s") or [])
    within = next((n for n, r in enumerate(trials, 1) if r.status == "ok" and r.median_s <= 1.05 * found["median_s"]),
                  None)
    m = s.memory
    mib = lambda xs: "/".join(f"{x / MIB:.1f}" for x in xs or [] if x is not None) or "n/a"  # noqa: E731
    bound = run["bound"]
    room = (f"{statistics.median(rec_s) / bound['bound_s']:.2f}x of {bound['bound_s'] * 1e3:.1f} ms "
            f"({'compute' if bound['compute_s'] >= bound['comm_s'] else 'communication'})"
            if rec_s and bound else "n/a")
    return [run["seed"], len(trials), f"{oom}/{len(trials)}", f"{rec.name} ({rec.runtime.name})", confirmed,
            over_tuned, over_pick, gap, within or "-",
            f"{mib(m.predicted_peak_bytes if m else None)} / {mib(m.measured_peak_bytes if m else None)}", room,
            f"{run['wall']:.0f}"]


HEADERS = ["seed", "trials", "oom", "recommendation", "confirmed speed-up over the best baseline [95%]",
           "speed-up over the faster of tuned Megatron TP + FSDP2 and tuned FSDP2/HSDP [95%]",
           "speed-up over the modelled pick [95%]", "gap to the oracle [95%]", "trials to within 5%",
           "MiB per rank predicted / measured", "time / lower bound", "wall s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_domain_options(parser, DOMAINS)
    args = parser.parse_args(argv)

    domains, seeds = read_domain_options(parser, args)
    use_data_folder(args.home, "synctune-tps-")

    tables = []
    for domain in domains:
        with measured_domain(domain, args.stand_in) as (workload, spec, cluster, node_net):
            runs = []
            for seed in seeds:
                runs.append(one_search(domain, workload, spec, cluster, node_net, seed, args))
                print(f"  seed {seed}: done in {runs[-1]['wall']:.0f} s", flush=True)
            context = runs[0]["context"]
            swept = grid(context) + [a for r in runs for a in found_arms(r)]
            found = oracle(workload, cluster, node_net, context.memory, args.warmup, args.iters, swept)
            print(f"  oracle {found['median_s'] * 1e3:.1f} ms ({found['origin']}; of {found['swept']})", flush=True)
            rows = [table_row(r, found, workload, cluster, node_net, args.warmup) for r in runs]
            for row in rows:
                print("  " + " | ".join(str(x) for x in row), flush=True)
        pick = runs[0]["pick"]
        tables.append((domain, found, pick, rows))
    where = f", every domain on {args.stand_in} over loopback" if args.stand_in else ""
    for domain, found, pick, rows in tables:
        print(f"\n{domain} (Adam, {args.budget} trials per search{where}): oracle {found['median_s'] * 1e3:.1f} ms "
              f"({found['origin']}; best of {found['swept']} single trials, top 5 re-measured interleaved); seed "
              f"{rows[0][0]}'s {pick.summary()}")
        print("  re-measured: " + "; ".join(f"{o} {t * 1e3:.1f} ms" for o, t in found["arms"]))
        print(markdown_table(HEADERS, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
