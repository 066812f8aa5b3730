"""How a compute profile of a lab node under a CPU quota comes out, run after run, by rule.

A lab-b10c node's workers run in a cgroup with a CFS quota (a g3-like node a quarter of a core
per worker, a g4dn-like one half: ``synctune.lab.cpu``). The kernel grants a quota per 100 ms
period: a worker runs at a whole core's speed until its group's quota is spent, then waits for
the next period. A profile of a few short iterations is then one burst, or not, and its median
says either. Per model, profiled ``--repeats`` times under each rule, the rules interleaved:

- ``median-10``: ``--iters`` timed iterations, the median (every profile before this script's
  commit, release v0.3's first quota profiles among them; ``quota_window_s=0``);
- ``window``: a quota-held worker timed for at least ``QUOTA_WINDOW_S`` (ten periods), the mean
  (``synctune.engine.profile``'s default).

Printed per model, rule and run: the g3 and g4dn profiles' milliseconds per iteration (forward +
backward + step, the slowest worker of the type) and their ratio, which the quotas make 2 where
compute dominates; and, once per model, the same 4 workers with no quota (the ``cpu`` profile
lab-2x2 and lab-4x1 replay with) as the reference speed. Root needed (the lab).

    python experiments/findings/quota_profiles.py [--models cnn-small,lm-small] [--repeats 2] [--iters 10]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

MODELS = ("cnn-small", "ncf-small", "lm-small", "transformer-small", "bert-tiny")
PRESET = "lab-b10c"


def _total_ms(profile) -> float:
    return 1e3 * (profile.forward_s + profile.backward_s + profile.step_s)


def measure(models: list[str], repeats: int, iters: int) -> list[dict]:
    """Per model, rule and run: the g3 and g4dn profiles' totals; per model a no-quota profile."""
    from _common import lab

    from synctune.engine.local import rank_networks
    from synctune.engine.profile import QUOTA_WINDOW_S, profile_compute, profile_per_device_type
    from synctune.workload import zoo_workload

    rules = {"median-10": 0.0, "window": QUOTA_WINDOW_S}
    rows = []
    with lab(PRESET) as (cluster, net):
        nets = rank_networks(cluster, list(cluster.devices), net)
        for name in models:
            workload = zoo_workload(name)
            free = profile_compute(workload, workers=cluster.num_devices, pin_cpus=True, iters=iters)
            rows.append({"model": name, "rule": "no quota", "run": 1, "cpu": _total_ms(free)})
            for run in range(1, repeats + 1):
                order = list(rules) if run % 2 else list(reversed(rules))  # interleaved, alternating
                for rule in order:
                    started = time.perf_counter()
                    got = {p.device: _total_ms(p) for p in profile_per_device_type(
                        workload, cluster, nets=nets, pin_cpus=True, iters=iters, quota_window_s=rules[rule])}
                    rows.append({"model": name, "rule": rule, "run": run, **got,
                                 "seconds": time.perf_counter() - started})
                    print(f"{name} {rule} run {run}: g3 {got['cpu-g3']:.2f} ms, g4dn {got['cpu-g4dn']:.2f} ms",
                          file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict]) -> str:
    """The Markdown table: per model and rule, each run's g3 / g4dn (ratio), and the spread."""
    lines = ["| model | rule | runs: g3 / g4dn ms (ratio) | ratios, min-max | no quota (4 workers) ms |",
             "| --- | --- | --- | --- | --- |"]
    free = {r["model"]: r["cpu"] for r in rows if r["rule"] == "no quota"}
    for model in dict.fromkeys(r["model"] for r in rows):
        for rule in ("median-10", "window"):
            runs = [r for r in rows if r["model"] == model and r["rule"] == rule]
            ratios = [r["cpu-g3"] / r["cpu-g4dn"] for r in runs]
            cells = "; ".join(f"{r['cpu-g3']:.1f} / {r['cpu-g4dn']:.1f} ({q:.2f})" for r, q in zip(runs, ratios))
            lines.append(f"| {model} | {rule} | {cells} | {min(ratios):.2f}-{max(ratios):.2f} | {free[model]:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(MODELS), help="zoo models, comma-separated")
    parser.add_argument("--repeats", type=int, default=2, help="profiles per model and rule")
    parser.add_argument("--iters", type=int, default=10, help="timed iterations (at least, with the window)")
    args = parser.parse_args()
    if args.repeats < 1 or args.iters < 1:
        parser.error("--repeats and --iters: at least 1")
    started = time.perf_counter()
    rows = measure([m for m in args.models.split(",") if m], args.repeats, args.iters)
    print(table(rows))
    spread = {rule: statistics.median(abs(r["cpu-g3"] / r["cpu-g4dn"] - 2.0) for r in rows if r["rule"] == rule)
              for rule in ("median-10", "window")}
    print(f"\nmedian distance of the g3/g4dn ratio from the quotas' 2: median-10 {spread['median-10']:.2f}, "
          f"window {spread['window']:.2f} ({(time.perf_counter() - started) / 60:.1f} min)")


if __name__ == "__main__":
    main()
