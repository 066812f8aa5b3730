"""Simulator throughput: strategies scored per second, analytic, replay and RNN, on B7.

Strategies come from the random sampler. Scoring runs on pre-encoded batches (the search keeps
proposals encoded), and the encoding rate from Strategy objects is printed separately, next to
the rate at which the guided sampler draws proposals as objects (``sample``) and as columns
(``sample_columns``: what a search round does, the form every simulator reads; the median over
rounds after the first, which also pays for touching fresh memory, shown apart), and a round's
proposals drawn and scored by the analytic model (``round/s``: what a search round costs). For the
analytic model, 1,000 distinct strategies are encoded once and tiled to 30,000 proposals (the
papers' scale per round). Its throughput does not depend on its
weights: it is fitted briefly on analytic estimates so its normalisation is realistic. It scores
proposals in batches of 1,024 (a search round scores thousands at once).
The replay simulator replays the same tiled batch (its speed does not depend on whether its
compute profile was measured or estimated, so the estimate stands in here).
Goals: analytic >= 50,000 strategies/s and RNN >= 500 strategies/s on BERT-large; replay
>= 5,000 strategies/s on BERT-base; proposals drawn as columns >= 20,000 strategies/s on
BERT-large.

    python benchmarks/simulator_throughput.py [--proposals 30000]
"""

from __future__ import annotations

import argparse
import time

import numpy as np


def tile(batch, reps: int):
    """``reps`` copies of the columns ``batch``, one after the other."""
    import dataclasses

    shards = batch.offsets[-1]
    return dataclasses.replace(
        batch, offsets=np.concatenate([[0], (batch.offsets[1:][None, :] + (np.arange(reps) * shards)[:, None]).ravel()]),
        sid=(batch.sid[None, :] + (np.arange(reps) * batch.size)[:, None]).ravel(), ngroups=np.tile(batch.ngroups, reps),
        batch_split=None if batch.batch_split is None else np.tile(batch.batch_split, (reps, 1)),
        **{k: np.tile(getattr(batch, k), reps) for k in ("var", "frac", "nshards", "axis", "kind", "node", "local",
                                                          "group", "hier", "comp", "rank", "ratio", "group_order")})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--proposals", type=int, default=30_000)
    parser.add_argument("--cluster", default="B7")
    parser.add_argument("--rounds", type=int, default=4,
                        help="rounds of proposals drawn and encoded; columns/s is the median after the first")
    args = parser.parse_args()

    import torch

    from synctune.models import model_spec
    from synctune.search import GuidedSampler, RandomSampler
    from synctune.simulator import Domain, DomainContext, ReplaySimulator, RNNSimulator, analytic_time, encode
    from synctune.spec import cluster_preset

    torch.set_num_threads(2)
    cluster = cluster_preset(args.cluster)
    print(f"cluster {cluster.name}, {torch.get_num_threads()} torch threads")
    print(f"{'model':<12}{'shards/strategy':>16}{'encode/s':>10}{'guided/s':>10}{'columns/s':>11}{'round/s':>9}"
          f"{'analytic/s':>12}{'replay/s':>10}{'rnn/s':>9}{'first round/s':>15}")
    for name in ("vgg16", "bert-base", "bert-large"):
        spec = model_spec(name)
        ctx = DomainContext(spec, cluster)
        strategies = RandomSampler(spec, cluster, seed=0).sample_many(1000)
        t0 = time.perf_counter()
        batch = encode(strategies, ctx)
        encode_rate = len(strategies) / (time.perf_counter() - t0)
        guided = GuidedSampler(spec, cluster, seed=0)
        t0 = time.perf_counter()
        guided.sample_many(200)
        guided_rate = 200 / (time.perf_counter() - t0)
        guided.sample_columns(64)  # tables built and the sampler's loop compiled, once per process
        rates, rounds = [], []
        for _ in range(args.rounds):  # a search draws round after round
            t0 = time.perf_counter()
            cols = guided.sample_columns(args.proposals // 3)
            t1 = time.perf_counter()
            analytic_time(cols, ctx)
            rates.append((args.proposals // 3) / (t1 - t0))
            rounds.append((args.proposals // 3) / (time.perf_counter() - t0))
        first_rate, columns_rate = rates[0], float(np.median(rates[1:] if len(rates) > 1 else rates))
        round_rate = float(np.median(rounds[1:] if len(rounds) > 1 else rounds))
        big = tile(batch, max(1, args.proposals // batch.size))
        analytic_time(big, ctx)  # warm
        t0 = time.perf_counter()
        analytic_time(big, ctx)
        analytic_rate = big.size / (time.perf_counter() - t0)
        replay = ReplaySimulator()
        replay._predict_batch(batch, ctx)  # warm
        t0 = time.perf_counter()
        replay._predict_batch(big, ctx)
        replay_rate = big.size / (time.perf_counter() - t0)

        labels = analytic_time(batch, ctx)
        rnn = RNNSimulator(epochs=1, batch=32)
        rnn.fit([Domain(ctx, strategies[:64], labels[:64])])
        sub = encode(strategies[:1000], ctx)
        rnn._predict_batch(sub, ctx)  # warm
        t0 = time.perf_counter()
        rnn._predict_batch(sub, ctx)
        rnn_rate = sub.size / (time.perf_counter() - t0)
        per = batch.offsets[-1] / batch.size
        print(f"{name:<12}{per:>16.0f}{encode_rate:>10.0f}{guided_rate:>10.0f}{columns_rate:>11.0f}{round_rate:>9.0f}"
              f"{analytic_rate:>12.0f}{replay_rate:>10.0f}{rnn_rate:>9.0f}{first_rate:>15.0f}")


if __name__ == "__main__":
    main()
