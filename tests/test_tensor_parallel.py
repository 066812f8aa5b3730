"""Tensor parallelism (``tensor_parallel`` in a strategy, the ``tp`` runtime: torch's DTensor on a
("dp", "tp") mesh with FSDP2 or an all-reduce on the data-parallel axis): trained on 2 and 4
gloo processes, meshes (1, 2) and (2, 2), on the zoo's transformers and on Hugging Face's BERT
and Llama built from configs, it gives the parameters of single-process training on the
concatenation of the TP groups' batches; plans torch would run differently from what they say
are refused before any worker starts, or on every rank together.

Reference: single-process training (float32 and float64) of the same model on the same data."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _tp_workers import reference, tp_train_cases, workload_of
from synctune.engine.local import run_local
from synctune.engine.runtimes import executor_for, runtime_from_options
from synctune.engine.trial import check_trial
from synctune.spec import cluster_preset
from synctune.spec.errors import SpecError
from synctune.strategy import Strategy, build_strategy, validate
from synctune.strategy.errors import StrategyError

pytest.importorskip("transformers")

STEPS = 3


def _case(label: str, model: str, cluster_name: str, *, dp: str = "allreduce", split=None, optimizer: str = "sgd",
          lr: float = 0.1, tp: dict | None = None) -> dict:
    cluster = cluster_preset(cluster_name)
    spec = workload_of(model).spec()
    strategy = build_strategy("megatron", spec, cluster, dp=dp)
    if split is not None:
        strategy = dataclasses.replace(strategy, batch_split=tuple(split))
    if tp is not None:
        strategy = dataclasses.replace(strategy, tensor_parallel=tp)
    validate(strategy, spec, cluster)
    return {"label": label, "model": model, "strategy": strategy.to_dict(), "cluster": cluster.to_dict(),
            "spec": spec.to_dict(), "optimizer": optimizer, "lr": lr, "steps": STEPS}


def _check_against_reference(cases: list[dict], outputs: list[list[dict]], world: int) -> None:
    for c, case in enumerate(cases):
        label = case["label"]
        strategy = Strategy.from_dict(case["strategy"])
        first = outputs[0][c]
        assert "refused" not in first, f"{label}: {first.get('refused')}"
        assert first["split"], f"{label}: no parameter is a DTensor"
        for r in range(1, world):
            for k, v in outputs[r][c]["params"].items():
                assert torch.equal(v, first["params"][k]), f"{label}: rank {r} differs from rank 0 on {k}"
        group_split = strategy.batch_split[::strategy.tensor_parallel.degree]
        args = (case["model"], group_split, case["optimizer"], case["lr"], case["steps"])
        ref, exact = reference(*args), reference(*args, dtype=torch.float64)
        atol = 1e-6 if case["optimizer"] == "sgd" else 0.01 * case["lr"]
        moved = False
        for k, v in first["params"].items():
            rounding = 2 * (ref[k].double() - exact[k]).abs().max().item()
            torch.testing.assert_close(v.double(), exact[k], rtol=1e-5, atol=atol + rounding,
                                       msg=lambda m: f"{label}: {k}: {m}")
        start = reference(case["model"], group_split, case["optimizer"], case["lr"], 0)
        moved = any(not torch.equal(v, start[k]) for k, v in first["params"].items())
        assert moved, f"{label}: nothing trained"


def test_tp_on_a_1x2_mesh_trains_like_single_process():
    """t = 2 on 2 processes: mesh (1, 2), the data-parallel axis of one group (all-reduce, and
    FSDP2 over one rank), the zoo's transformers and both library models, SGD and AdamW-free Adam."""
    cases = [
        _case("transformer-small/allreduce", "transformer-small", "local-1x2"),
        _case("bert-tiny/shard", "bert-tiny", "local-1x2", dp="shard"),
        _case("hf-bert/allreduce", "hf-bert", "local-1x2"),
        _case("hf-llama/shard", "hf-llama", "local-1x2", dp="shard"),
        _case("hf-llama/adam", "hf-llama", "local-1x2", optimizer="adam", lr=0.01),
    ]
    outputs = run_local(tp_train_cases, 2, (cases,), timeout_s=900, threads=1)
    _check_against_reference(cases, outputs, 2)


def test_tp_with_fsdp2_on_a_2x2_mesh_trains_like_single_process():
    """t = 2 on 4 processes: mesh (2, 2), TP inside each node and FSDP2 (or an all-reduce) across
    the two TP groups, with an uneven split between the groups."""
    cases = [
        _case("transformer-small/shard", "transformer-small", "local-2x2", dp="shard"),
        _case("bert-tiny/allreduce/uneven", "bert-tiny", "local-2x2", split=(2, 2, 6, 6)),
        _case("hf-bert/shard/uneven", "hf-bert", "local-2x2", dp="shard", split=(3, 3, 5, 5)),
        _case("hf-llama/allreduce", "hf-llama", "local-2x2"),
    ]
    outputs = run_local(tp_train_cases, 4, (cases,), timeout_s=900, threads=1)
    _check_against_reference(cases, outputs, 4)
