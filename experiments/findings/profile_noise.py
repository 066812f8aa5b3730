"""How far apart two compute profiles of the same model are, by rule (the replay's compute input).

An unseen model is replayed from its compute profile (dPRO §4.1) and its cluster's constants
fitted on the other models' trials; whatever moves its profile moves its predicted level. A
lab profile is 4 workers on the 2-core machine, each timing 10 iterations after 3 warm-up and
keeping the median (``profile_compute``'s default). Release v0.3's transformer-small profile
on 4 workers says 11.3 ms, later ones from 15.7 to 36.6 ms, while its trials moved 15%
(findings (q), (r)).
This measures the profile's own repeat spread, by rule, interleaved:

- ``median-10``: the default, 3 warm-up and 10 timed iterations, the median;
- ``window``: 5 warm-up, then timed for at least ``--window`` seconds (and 10 iterations, and
  at most 1,000), the median (``profile_compute(min_timed_s=...)``).

Each model is profiled ``--runs`` times under each rule, the rules alternating and their order
swapped every run, every worker pinned as ``lab collect`` profiles them. Printed per model and
rule: each run's forward + backward + step (ms), max / min, and the coefficient of variation;
then per rule the median over models of max / min.

    python experiments/findings/profile_noise.py [--models cnn-small,...] [--workers 4] [--runs 4]
        [--window 2.0]

No lab needed (a preset without a quota profiles on this machine, outside the namespaces).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402

MODELS = "bert-tiny,cnn-small,lm-small,ncf-small,transformer-small"


def run(models: list[str], workers: int, runs: int, window: float) -> dict[tuple[str, str], list[float]]:
    from synctune.engine.profile import profile_compute
    from synctune.workload.zoo import zoo_workload

    rules = {"median-10": {"warmup": 3, "min_timed_s": 0.0}, "window": {"warmup": 5, "min_timed_s": window}}
    got: dict[tuple[str, str], list[float]] = {}
    for model in models:
        workload = zoo_workload(model)
        for i in range(runs):
            order = list(rules) if i % 2 == 0 else list(reversed(rules))
            for rule in order:
                t0 = time.perf_counter()
                p = profile_compute(workload, workers=workers, pin_cpus=True, **rules[rule])
                ms = (p.forward_s + p.backward_s + p.step_s) * 1e3
                got.setdefault((model, rule), []).append(ms)
                print(f"{model} {rule} run {i + 1}: {ms:.2f} ms ({time.perf_counter() - t0:.1f} s)", flush=True)
    return got


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=MODELS)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--window", type=float, default=2.0)
    args = parser.parse_args()
    got = run(args.models.split(","), args.workers, args.runs, args.window)
    lines, spread = [], {}
    for (model, rule), ms in got.items():
        ratio = max(ms) / min(ms)
        spread.setdefault(rule, []).append(ratio)
        lines.append([model, rule, ", ".join(f"{m:.2f}" for m in ms), f"{ratio:.2f}",
                      f"{statistics.stdev(ms) / statistics.fmean(ms):.1%}" if len(ms) > 1 else "-"])
    print()
    print(_common.markdown_table(["model", "rule", "runs, ms (forward + backward + step)", "max / min", "CV"], lines))
    for rule, ratios in spread.items():
        print(f"{rule}: median over models of max / min {statistics.median(ratios):.2f} (worst {max(ratios):.2f})")


if __name__ == "__main__":
    main()
