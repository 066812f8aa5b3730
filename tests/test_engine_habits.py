"""The habits of real training loops, each exact against an independent reference on 2 and 4 gloo
processes, with models that are not in the zoo: frozen, tied and unused parameters; gradient
accumulation over micro-batches with ``no_sync`` (and a clear error without it); BatchNorm
buffers broadcast or kept local, against torch DDP; autocast with a GradScaler whose skip
decision all ranks share; clipping by the global norm; a checkpoint saved under one strategy
and resumed under another."""

from __future__ import annotations

import random

import pytest
import torch

from _engine_workers import random_strategy
from _habits import reference, refusal_worker, spec_of, habits_worker
from synctune.engine.local import run_local
from synctune.spec import ClusterSpec, cluster_preset
from synctune.strategy import build_strategy, validate

SPLITS = {"local-1x2": (3, 5), "local-2x2": (3, 4, 5, 4)}


def _strategy(cluster, kind: str, builder: str | None = None, seed: int = 0, shard: bool = False, **options):
    spec = spec_of(kind)
    if builder is None:
        s = random_strategy(spec, cluster, random.Random(seed), shard=shard)
    else:
        s = build_strategy(builder, spec, cluster, **options)
    s = type(s)(**{**s.__dict__, "batch_split": SPLITS[cluster.name]})
    validate(s, spec, cluster)
    return s


def _cases(cluster_name: str) -> list[dict]:
    cluster = cluster_preset(cluster_name)
    base = {"cluster": cluster.to_dict(), "batch_split": SPLITS[cluster_name], "seed": 3, "steps": 3}
    cases = []

    def add(label, kind, strategy, **extra):
        cases.append({**base, "label": label, "model": kind, "strategy": strategy.to_dict(), "optimizer": "sgd",
                      "lr": 0.2, **extra})

    for builder, options in [("allreduce", {}), ("allreduce", {"algorithm": "hierarchical"}),
                             ("ps-lb", {"local_aggregation": True}), ("partitioned-ps", {}), ("parallax", {})]:
        label = builder + "".join(f"-{v}" for v in options.values())
        add(f"plain/{label}", "habit", _strategy(cluster, "habit", builder, **options))
    add("plain/random", "habit", _strategy(cluster, "habit", seed=1))
    # A small gradient on all-reduce is its bucket slot (autograd adds into it): a loop that sets
    # .grad to None with the module's zero_grad, or never zeroes (gradients summed over steps, as
    # one process sums them), trains as one process does.
    add("plain-module-zero/allreduce", "habit", _strategy(cluster, "habit", "allreduce"), zero="module")
    add("accumulate/allreduce", "habit", _strategy(cluster, "habit", "allreduce"), zero="never")
    add("accumulate/allreduce-hierarchical", "habit", _strategy(cluster, "habit", "allreduce", algorithm="hierarchical"),
        zero="never")
    add("micro3/allreduce", "habit", _strategy(cluster, "habit", "allreduce"), micro=3)
    add("micro3/ps-local", "habit", _strategy(cluster, "habit", "ps-lb", local_aggregation=True), micro=3)
    add("micro2/random", "habit", _strategy(cluster, "habit", seed=2), micro=2)
    # The gated parameter: used by rank 1 only, and there by the first micro-batch only (inside
    # no_sync): its gradient waits in .grad, and ranks reach its unit in different orders.
    add("micro2-gated/allreduce", "habit", _strategy(cluster, "habit", "allreduce", chunk=2), micro=2, gated=True)
    add("micro2-gated/random", "habit", _strategy(cluster, "habit", seed=6), micro=2, gated=True)
    add("plain-gated/ps-lb", "habit", _strategy(cluster, "habit", "ps-lb"), gated=True)
    add("clip/ps-lb", "habit", _strategy(cluster, "habit", "ps-lb"), clip=0.05)
    add("clip/random", "habit", _strategy(cluster, "habit", seed=3), clip=0.05)
    add("amp/ps", "habit", _strategy(cluster, "habit", "ps"), amp=True, poison_step=1)
    add("amp/random", "habit", _strategy(cluster, "habit", seed=4), amp=True, poison_step=1)
    add("amp/clip-ps-lb", "habit", _strategy(cluster, "habit", "ps-lb"), amp=True, poison_step=1, clip=0.05)
    add("checkpoint/partitioned-ps->allreduce-hierarchical", "habit",
        _strategy(cluster, "habit", "partitioned-ps", local_aggregation=True), optimizer="adam", lr=0.05, steps=4,
        switch_to=_strategy(cluster, "habit", "allreduce", algorithm="hierarchical").to_dict())
    add("checkpoint/random->ps-lb", "habit", _strategy(cluster, "habit", seed=5), optimizer="adam", lr=0.05,
        steps=4, switch_to=_strategy(cluster, "habit", "ps-lb").to_dict())
    add("error/no_sync-forgotten", "habit", _strategy(cluster, "habit", "allreduce"), micro=2,
        forget_no_sync=True, expect_error=True)
    # Sharded (ZeRO-2) units: over every replica, HSDP (groups of two: on local-2x2 two groups,
    # the slices all-reduced across them), bf16 gradients apart; composed with the other kinds
    # (random, shard=True). The tied embedding is one variable in one unit; ``unused`` (3 rows)
    # leaves the fourth rank of a group of four an empty slice.
    hsdp = {"group": 2}
    add("plain/shard", "habit", _strategy(cluster, "habit", "shard"))
    add("plain/shard-hsdp", "habit", _strategy(cluster, "habit", "shard", **hsdp))
    add("plain/shard-depth1", "habit", _strategy(cluster, "habit", "shard", depth=1))
    add("plain/random-shard", "habit", _strategy(cluster, "habit", seed=7, shard=True))
    add("micro3/shard", "habit", _strategy(cluster, "habit", "shard"), micro=3)
    add("micro2-gated/shard-hsdp", "habit", _strategy(cluster, "habit", "shard", **hsdp), micro=2, gated=True)
    add("micro2-gated/random-shard", "habit", _strategy(cluster, "habit", seed=8, shard=True), micro=2, gated=True)
    add("clip/shard", "habit", _strategy(cluster, "habit", "shard"), clip=0.05)
    add("clip/shard-hsdp", "habit", _strategy(cluster, "habit", "shard", **hsdp), clip=0.05)
    add("clip/random-shard", "habit", _strategy(cluster, "habit", seed=9, shard=True), clip=0.05)
    add("amp/shard-hsdp", "habit", _strategy(cluster, "habit", "shard", **hsdp), amp=True, poison_step=1)
    add("checkpoint/shard-hsdp->allreduce", "habit", _strategy(cluster, "habit", "shard", **hsdp),
        optimizer="adam", lr=0.05, steps=4, switch_to=_strategy(cluster, "habit", "allreduce").to_dict())
    add("checkpoint/allreduce->shard", "habit", _strategy(cluster, "habit", "allreduce"), optimizer="adam",
        lr=0.05, steps=4, switch_to=_strategy(cluster, "habit", "shard").to_dict())
    add("checkpoint/shard->shard-hsdp-depth1", "habit", _strategy(cluster, "habit", "shard"), optimizer="adam",
        lr=0.05, steps=4, switch_to=_strategy(cluster, "habit", "shard", depth=1, **hsdp).to_dict())
    for buffers in (True, False):
        for builder in ("allreduce", "ps-lb", "shard"):
            add(f"bn/{builder}/broadcast_buffers={buffers}", "bn", _strategy(cluster, "bn", builder), ddp=True,
                broadcast_buffers=buffers, batch_split=(4,) * cluster.num_devices)
    for case in cases:  # equal batches where DDP is the reference (it averages over ranks)
        if case.get("ddp"):
            strategy = case["strategy"]
            strategy["batch_split"] = [4] * cluster.num_devices
    return cases


@pytest.fixture(scope="module", params=["local-1x2", "local-2x2"])
def trained(request):
    cases = _cases(request.param)
    world = cluster_preset(request.param).num_devices
    return cases, run_local(habits_worker, world, (cases,), timeout_s=900, threads=1)


def _each(trained, prefix: str):
    cases, outputs = trained
    return [(c, [o[i] for o in outputs]) for i, c in enumerate(cases) if c["label"].startswith(prefix)]


def _same_on_every_rank(label, per_rank):
    for r, out in enumerate(per_rank[1:], 1):
        for k, v in out["state"].items():
            assert torch.equal(v, per_rank[0]["state"][k]), f"{label}: rank {r} differs on {k}"


@pytest.mark.parametrize("prefix", ["plain", "accumulate/", "micro", "clip/", "checkpoint/"])
def test_habits_train_exactly_like_one_process(trained, prefix):
    for case, per_rank in _each(trained, prefix):
        label = case["label"]
        _same_on_every_rank(label, per_rank)
        expected = reference(case)
        got = per_rank[0]["state"]
        assert got.keys() == expected.keys()
        tol = {"rtol": 1e-4, "atol": 2e-5} if case["optimizer"] == "adam" else {"rtol": 1e-5, "atol": 1e-6}
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], **tol, msg=lambda m, k=k: f"{label}: {k}: {m}")
        # The frozen layer never moved, the unused parameter neither (no gradient, zero update).
        initial = reference({**case, "steps": 0})
        for k in ("frozen.weight", "frozen.bias", "unused") + (() if case.get("gated") else ("gated",)):
            assert torch.equal(got[k], initial[k]), f"{label}: {k} changed"
        if case.get("gated"):
            assert not torch.equal(got["gated"], initial["gated"]), f"{label}: the gated parameter did not train"
        assert not torch.equal(got["emb.weight"], initial["emb.weight"]), f"{label}: nothing trained"


def test_clipping_reports_the_global_norm_on_every_rank(trained):
    for case, per_rank in _each(trained, "clip/"):
        norms = [out["norms"] for out in per_rank]
        assert all(n == norms[0] for n in norms), case["label"]
        assert all(n > case["clip"] for n in norms[0]), (case["label"], norms[0])  # so clipping did happen


def test_amp_skips_a_poisoned_step_on_every_rank(trained):
    """Rank 1's batch overflows at step 1: every rank skips that step (the scale halves on all of
    them) although some never saw an inf themselves (a PS server's gradient lives on the server
    only); the result equals single-process mixed-precision training."""
    for case, per_rank in _each(trained, "amp/"):
        label = case["label"]
        _same_on_every_rank(label, per_rank)
        scales = [out["scales"] for out in per_rank]
        assert all(s == scales[0] for s in scales), label
        assert scales[0][1] == scales[0][0] / 2, (label, scales[0])  # the poisoned step was skipped
        expected = reference(case)
        for k, v in expected.items():
            # bf16 autocast: a batch split across ranks runs other kernel shapes than the whole one.
            torch.testing.assert_close(per_rank[0]["state"][k], v, rtol=2e-2, atol=2e-3,
                                       msg=lambda m, k=k: f"{label}: {k}: {m}")


def test_a_second_backward_without_no_sync_is_a_clear_error(trained):
    (case, per_rank), = _each(trained, "error/")
    for out in per_rank:
        message = out["error"]
        assert message.startswith("SynchronizationError: variable ") and "no_sync()" in message, message
        assert "engine.step()" in message


def test_buffers_follow_torch_ddp_broadcast_buffers(trained):
    """BatchNorm statistics: broadcast from rank 0 after every step by default (DDP broadcasts
    them before every forward: the same state at every forward, so rank 0 ends as DDP's rank 0
    and the others hold rank 0's), or kept local with ``broadcast_buffers=False`` (every rank
    ends as DDP's same rank); parameters match torch DDP on every rank."""
    for case, per_rank in _each(trained, "bn/"):
        label = case["label"]
        for r, out in enumerate(per_rank):
            for k, v in out["ddp"].items():
                buffer = "running" in k or "num_batches" in k
                want = per_rank[0]["ddp"][k] if (buffer and case["broadcast_buffers"]) else v
                torch.testing.assert_close(out["state"][k], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=k, r=r: f"{label}: rank {r}: {k}: {m}")
        means = [out["state"]["bn.running_mean"] for out in per_rank]
        if case["broadcast_buffers"]:
            assert all(torch.equal(m, means[0]) for m in means), label
        else:
            assert not all(torch.equal(m, means[0]) for m in means), label


MISUSES = {"second": "got a second gradient before engine.step()",
           "late-no-sync": "a backward inside engine.no_sync() after a synchronized one",
           "after-clip": "got a gradient after the step's synchronization (clip_grad_norm_)",
           "checkpoint": "state_dict() between a backward pass and engine.step()"}


def test_every_rank_refuses_a_misused_step_together_and_the_group_trains_on():
    """A misused step (a second backward without ``no_sync``, a backward in ``no_sync`` after the
    synchronized one, a backward after ``clip_grad_norm_``, a checkpoint taken between a backward
    and ``step``), refused 24 times on 3 ranks with
    uneven splits and random per-rank delays before every backward (multi-stage units, some
    stages launched on one rank and not yet on another when the misuse comes), on random
    strategies (checkpoints also with one rank that has no gradient in flight, so sees no misuse of
    its own): every rank raises the same error every time, and a fresh engine on the same process
    group then trains exactly like one process (a refusal that left a collective behind on one
    rank would hang or corrupt it; the short collective timeout makes that a quick failure). A
    step's refusal is decided by each rank alone (what its hooks saw, never when its collectives
    launched); a checkpoint's is agreed by all."""
    base = cluster_preset("local-1x2").to_dict()
    base["nodes"][0]["num_devices"] = 3
    base["name"] = "local-1x3"
    cluster = ClusterSpec.from_dict(base)
    split = (2, 5, 3)
    refusals = []
    for i in range(24):
        s = random_strategy(spec_of("habit"), cluster, random.Random(100 + i))
        s = type(s)(**{**s.__dict__, "batch_split": split})
        validate(s, spec_of("habit"), cluster)
        kind = list(MISUSES)[i % 4]
        refusals.append({"strategy": s.to_dict(), "kind": kind, "lone": kind == "checkpoint" and i // 4 % 2 == 1})
    train = {"cluster": base, "batch_split": split, "seed": 3, "steps": 3, "label": "after-refusals", "model": "habit",
             "strategy": refusals[0]["strategy"], "optimizer": "sgd", "lr": 0.2, "micro": 2}
    case = {"cluster": base, "seed": 3, "refusals": refusals, "train": train}
    outputs = run_local(refusal_worker, 3, (case,), timeout_s=600, collective_timeout_s=20, threads=1)
    for i, refusal in enumerate(refusals):
        said = [out["errors"][i] for out in outputs]
        assert said[0] is not None and all(s == said[0] for s in said), (i, said)
        assert MISUSES[refusal["kind"]] in said[0], said[0]
        agreed = "(on rank 0; every rank refuses this checkpoint)" in said[0]
        assert agreed == (refusal["kind"] == "checkpoint"), said[0]
    _same_on_every_rank("after-refusals", [out["trained"] for out in outputs])
    expected = reference(train)
    for k, v in expected.items():
        torch.testing.assert_close(outputs[0]["trained"]["state"][k], v, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, k=k: f"after-refusals: {k}: {m}")
