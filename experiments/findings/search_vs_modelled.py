"""Does a measured search beat the strategy a model-only tool would deploy? The search's
recommendation against the modelled pick, re-measured interleaved, per domain.

Per domain (model @ lab preset, optionally with a memory budget in GiB per device; the lab is
brought up and calibrated here, root needed, or ``--stand-in`` runs every domain on a loopback
preset instead) and per seed:
  - the search is prepared once (``prepare_search``: the memory model's probe, the compute
    profile the replay prices with, the runtimes' checks) and, before its first trial, the
    modelled pick is made from that same prepared context (``synctune.run.modelled.context_pick``:
    the experiment's builders, Megatron's plans and draws of the search's own sampler, judged by
    the memory model as prepared, ranked by the training-free replay; no trial);
  - then the search runs on that context (``run_prepared``: tuned DDP, FSDP2 where it shards,
    Algorithm 1 with the replay simulator, the tuned builders inside ``--budget``, the
    confirmation against the best baseline) and its recommendation is taken as the summary gives
    it (the searched strategy when confirmed faster, else that baseline, with its runtime);
  - the two are re-measured as arms of one interleaved re-measurement on the same local worker
    processes (``_common.interleaved_arms``, ``--rounds`` rounds of 5 iterations, the order
    alternating), unless they are the same strategy on the same runtime, which the table says
    instead;
  - memory: one short trial of each arm on the local launcher, its largest rank's measured peak,
    beside the memory model's prediction as the search prepared it (before any trial taught it).

Table per domain and seed: the search's trials, the recommendation, the modelled pick (its
origin, the replay's predicted time, the memory model's predicted peak; each arm with its global
batch, the same for both), each arm's measured ms
per iteration (geometric mean over the rounds of each round's median), the time ratio
recommendation / modelled pick paired by round with its 95% interval (below 1: the search's
recommendation is faster; it should never be above), and each arm's peak MiB per rank predicted /
measured.

    python experiments/findings/search_vs_modelled.py                   # the default domains (root: the lab)
    python experiments/findings/search_vs_modelled.py --domains transformer-small@lab-2x2 \\
        --stand-in local-2x2 --seeds 0 --budget 8 --rounds 3            # the code path over loopback, no root

``--domains`` takes zoo models or a workload of experiments/workloads/ by file name
(``hf_llama@lab-2x2:0.05``).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import ROOT, describe_ratio, interleaved_arms, markdown_table, measured_on, stand_in_error, \
    time_ratio, use_data_folder  # noqa: E402

#: model@preset[:GiB per device]: zoo models without a budget, and one under a budget replicated
#: Adam training does not fit (memory_budget.py's transformer-small domain, 6 MiB).
DOMAINS = ("cnn-small@lab-2x2", "transformer-small@lab-2x2", "transformer-small@lab-2x2:0.006")
MIB = 1 << 20


@dataclass(frozen=True)
class Domain:
    """One domain of ``--domains``: what trains (a zoo model, or a workload file's name under
    experiments/workloads/), the cluster preset, and the memory budget in GiB per device (None:
    the cluster's device memory)."""

    model: str
    preset: str
    gib: float | None = None

    def __str__(self) -> str:
        return f"{self.model}@{self.preset}" + (f":{self.gib:g}" if self.gib is not None else "")


def parse_domains(text: str) -> list[Domain]:
    """``model@preset[:GiB],...`` as domains; :class:`ValueError` naming the first malformed one
    (an empty entry, no ``@``, an empty model or preset, a budget that is not a positive number)."""
    out = []
    for entry in text.split(","):
        entry = entry.strip()
        model, at, rest = entry.partition("@")
        preset, colon, gib_text = rest.partition(":")
        if not entry or not at or not model or not preset:
            raise ValueError(f"--domains: {entry!r}: expected model@preset or model@preset:GiB "
                             f"(e.g. transformer-small@lab-2x2:0.006)")
        gib = None
        if colon:
            try:
                gib = float(gib_text)
            except ValueError:
                gib = math.nan
            if not (math.isfinite(gib) and gib > 0):
                raise ValueError(f"--domains: {entry!r}: the memory budget {gib_text!r} is not a positive number "
                                 f"of GiB per device")
        out.append(Domain(model, preset, gib))
    return out


def workload_path(model: str) -> str | None:
    """The import path of experiments/workloads/<model>.py's ``workload``, or None: not a zoo model
    then, and no such file."""
    path = ROOT / "experiments" / "workloads" / f"{model}.py"
    return f"{path}:workload" if path.is_file() else None


def domains_error(domains: list[Domain], stand_in: str | None) -> str | None:
    """Why ``domains`` (and the ``--stand-in`` preset, if any) cannot be measured, in one line
    naming the option: a model that is neither a zoo model nor a workload file, an unknown
    preset, a stand-in that is not a loopback preset; None when they can."""
    from synctune.spec import SpecError, cluster_preset
    from synctune.workload.zoo import MODELS

    for domain in domains:
        if domain.model not in MODELS and workload_path(domain.model) is None:
            return (f"--domains: {domain}: {domain.model!r} is neither a zoo model nor a workload file of "
                    f"experiments/workloads/")
        try:
            cluster_preset(domain.preset)
        except SpecError as exc:
            return f"--domains: {domain}: {str(exc).splitlines()[0]}"
    return stand_in_error(stand_in) if stand_in is not None else None


def domain_workload(domain: Domain):
    """The workload a domain trains: a zoo model by name, else experiments/workloads/<model>.py."""
    from synctune.workload import resolve_workload
    from synctune.workload.zoo import MODELS

    return resolve_workload(domain.model if domain.model in MODELS else workload_path(domain.model))


def add_domain_options(parser: argparse.ArgumentParser, domains: tuple[str, ...]) -> None:
    """The options of a script that runs searches per domain and seed: ``--domains`` (default
    ``domains``), ``--seeds``, ``--budget``, ``--warmup``, ``--iters``, ``--stand-in``, ``--home``."""
    parser.add_argument("--domains", default=",".join(domains),
                        help="model@preset[:GiB per device], comma-separated; a model is a zoo model or a workload "
                             "file's name under experiments/workloads/")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--budget", type=int, default=30, help="trials of each search (builders included)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--stand-in", help="a non-lab cluster preset to run every domain on (loopback, no root)")
    parser.add_argument("--home", help="synctune data folder of this run (default: a new one)")


def read_domain_options(parser: argparse.ArgumentParser, args, minimums: tuple = ()) -> tuple[list[Domain], list[int]]:
    """The domains and seeds of :func:`add_domain_options`' options, each option checked (``--budget``
    and ``--iters`` at least 1, ``--warmup`` at least 0, and the script's own ``minimums``: (option,
    value, least) triples); a bad one ends the script through ``parser.error`` (one line, exit 2)."""
    try:
        domains = parse_domains(args.domains)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        parser.error(f"--seeds: {args.seeds!r}: expected integers, comma-separated")
    for name, value, low in (("--budget", args.budget, 1), ("--warmup", args.warmup, 0), ("--iters", args.iters, 1),
                             *minimums):
        if value < low:
            parser.error(f"{name}: expected at least {low}, got {value}")
    why = domains_error(domains, args.stand_in)
    if why is not None:
        parser.error(why)
    return domains, seeds


@contextlib.contextmanager
def measured_domain(domain: Domain, stand_in: str | None):
    """One domain measured: its cluster up (the lab preset, or the ``--stand-in`` over loopback),
    its heading printed, a local Ray instance for its searches; all taken down afterwards. Yields
    (workload, model spec, cluster spec, node network or None)."""
    import ray

    workload = domain_workload(domain)
    spec = workload.spec()
    with measured_on(domain.preset, stand_in, "--stand-in") as (cluster, node_net):
        print(f"\n## {domain}" + (f" (stand-in {cluster.name})" if stand_in else ""), flush=True)
        ray.init(address="local", num_cpus=cluster.num_devices + 1, include_dashboard=False, log_to_driver=False)
        try:
            yield workload, spec, cluster, node_net
        finally:
            ray.shutdown()


def experiment(domain: Domain, spec, cluster, seed: int, args):
    """The experiment of one search: autodist with the replay simulator (a training-free model
    that predicts seconds: the modelled pick ranks with it), the tuned builders, tuned DDP with
    ``--baseline-trials`` (tuned FSDP2 with its own 8 where the search shards), sharding and
    tensor parallelism where replicated training does not fit the budget, the confirmation's 10
    rounds."""
    from synctune.search import Experiment
    from synctune.workload.zoo import MODELS

    trains = {"model": domain.model} if domain.model in MODELS else {"workload": workload_path(domain.model)}
    memory = {"memory_gib": domain.gib, "memory_headroom": 0.0} if domain.gib is not None else {}
    tag = f"{domain.gib:g}gib" if domain.gib is not None else "device"
    return Experiment.from_keys(name=f"svm-{spec.name}-{cluster.name}-{tag}", **trains, cluster=cluster.name,
                                budget=args.budget, algorithm="autodist", simulator="replay",
                                proposals=args.proposals, candidates=3, warmup=args.warmup, iters=args.iters,
                                optimizer=args.optimizer, baselines=("tuned",), ddp_trials=args.baseline_trials,
                                shard="auto", tensor_parallel="auto",
                                confirm_rounds=10, confirm_iters=5, timeout_s=240, seed=seed, **memory)


def peak_cells(arms, workload, cluster, node_net, context, untaught, optimizer: str) -> list[str]:
    """Per arm ``predicted / measured`` MiB per rank (the largest rank): the memory model as the
    search prepared it, on what the arm's runtime holds, in its layout; one short trial."""
    from synctune.engine.measure import TrialConfig
    from synctune.engine.trial import run_trial_local

    out = []
    for strategy, runtime in arms:
        held = runtime.plans_of(strategy, lambda: context.module, context.model)
        predicted = max(untaught.peaks(held, fsdp=runtime.fsdp_layout)) / MIB
        trial = run_trial_local(strategy, cluster, TrialConfig(warmup=1, iters=2, optimizer=optimizer),
                                workload=workload, runtime=runtime, node_net=node_net)
        peaks = [p for p in ((trial.extra or {}).get("memory") or {}).get("peak_bytes") or [] if p]
        measured = f"{max(peaks) / MIB:.1f}" if trial.status == "ok" and peaks else f"({trial.status})"
        out.append(f"{predicted:.1f} / {measured}")
    return out


def one_seed(domain: Domain, workload, spec, cluster, node_net, seed: int, args) -> list[object]:
    """One search and its row of the table."""
    from synctune.run.modelled import context_pick, modelled_arm, untaught_memory
    from synctune.run.prepare import prepare_search
    from synctune.run.search import run_prepared

    say = lambda m: print(f"    {m}", flush=True)  # noqa: E731
    start = time.monotonic()
    exp = experiment(domain, spec, cluster, seed, args)
    context = prepare_search(exp, workload, cluster, model=spec, node_net=node_net, say=say)
    # Before the first trial: the search teaches its memory model as trials measure.
    untaught = untaught_memory(context.memory)
    pick = context_pick(context)
    modelled = modelled_arm(context, pick)
    say(pick.summary())
    summary = run_prepared(context, on_phase=say)
    rec = summary.recommended
    if rec is None:
        return [str(domain), seed, summary.all_trials, "none (no trial finished)", pick.origin] + ["n/a"] * 5 + \
            [f"{time.monotonic() - start:.0f}"]
    say(f"recommended: {rec.kind}, {rec.name} ({rec.runtime.name}; {rec.why})")
    # The global batch beside each: a tensor-parallel group trains one replica's samples, so two
    # arms' times per iteration may be of different amounts of work.
    picked = (f"{pick.origin}, global batch {pick.strategy.global_batch_size}; {pick.predicted_s * 1e3:.1f} ms, "
              f"{max(pick.peak_bytes) / MIB:.1f} MiB predicted")
    handed = f"{rec.kind}: {rec.name} ({rec.runtime.name}), global batch {rec.strategy.global_batch_size}"
    arms = [(rec.strategy, rec.runtime), (modelled.strategy, modelled.runtime)]
    same = (rec.strategy.hash == modelled.strategy.hash and rec.runtime.name == modelled.runtime.name
            and rec.runtime.config_json() == modelled.runtime.config_json())
    if same:
        times = ["same strategy, not re-measured"] * 2
        ratio = "1 (the same strategy and runtime)"
    else:
        from synctune.engine.local import WorkerFailure
        from synctune.spec import SpecError

        try:
            got = interleaved_arms(arms, cluster, workload=workload, node_net=node_net, rounds=args.rounds,
                                   warmup=args.warmup, optimizer=args.optimizer)
        except (WorkerFailure, SpecError) as exc:  # a worker died, or the arms cannot share processes
            times, ratio = [f"n/a ({str(exc)[:80]})"] * 2, "n/a"
        else:
            times = [f"{got.mean_ms(0):.1f}", f"{got.mean_ms(1):.1f}"]
            r = time_ratio(got.times_s[0], got.times_s[1])
            ratio = describe_ratio(r) + (" (search faster)" if r.high < 1 else " (search slower)" if r.low > 1
                                         else "")
    memory = peak_cells(arms, workload, cluster, node_net, context, untaught, args.optimizer)
    return [str(domain), seed, summary.all_trials, handed, picked, *times, ratio, *memory,
            f"{time.monotonic() - start:.0f}"]


HEADERS = ["domain", "seed", "trials (baselines included)", "recommendation", "modelled pick (origin; predicted)",
           "recommendation ms", "modelled pick ms", "recommendation / modelled pick, time [95%]",
           "recommendation MiB per rank predicted / measured", "modelled pick MiB predicted / measured", "wall s"]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_domain_options(parser, DOMAINS)
    parser.add_argument("--baseline-trials", type=int, default=6,
                        help="tuned torch DDP trials before each search (tuned FSDP2 takes 8 where it shards)")
    parser.add_argument("--proposals", type=int, default=400,
                        help="the search's proposals per round, and the modelled pick's sampler draws")
    parser.add_argument("--rounds", type=int, default=10, help="rounds of the interleaved re-measurement")
    parser.add_argument("--optimizer", default="adam", choices=("adam", "sgd"))
    args = parser.parse_args(argv)

    domains, seeds = read_domain_options(parser, args, (("--baseline-trials", args.baseline_trials, 0),
                                                        ("--proposals", args.proposals, 1), ("--rounds", args.rounds, 2)))
    use_data_folder(args.home, "synctune-svm-")

    rows = []
    for domain in domains:
        with measured_domain(domain, args.stand_in) as (workload, spec, cluster, node_net):
            for seed in seeds:
                rows.append(one_seed(domain, workload, spec, cluster, node_net, seed, args))
                print("  " + " | ".join(str(c) for c in rows[-1]), flush=True)
    stand_in = f", every domain on {args.stand_in} over loopback" if args.stand_in else ""
    print(f"\nThe search's recommendation against the modelled pick ({args.optimizer}, {args.budget} trials per "
          f"search, {args.rounds} interleaved rounds of 5 iterations{stand_in}); time: geometric mean of the "
          f"rounds' medians; memory: the memory model as the search prepared it / one trial's largest rank")
    print(markdown_table(HEADERS, rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
