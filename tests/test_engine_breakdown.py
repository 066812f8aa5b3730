"""The engine-vs-DDP breakdown of ``benchmarks/engine_overhead.py --breakdown``: every microsecond
of an iteration goes to one item, by the rules its docstring states, checked on hand-built profiler
events whose items are worked out by hand; and the engine's phase ranges cost nothing when off."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
HOOK = "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad"


def _benchmark():
    spec = importlib.util.spec_from_file_location("engine_overhead", ROOT / "benchmarks" / "engine_overhead.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _events():
    main, gloo = 1, 2
    engine = [
        ("synctune iteration", 0, 100), ("forward", 1, 21), ("aten::mm", 2, 12),
        ("backward", 22, 62), ("autograd::engine::evaluate_function: MmBackward0", 23, 33),
        (HOOK, 34, 50), ("torch::autograd::AccumulateGrad", 35, 49), ("aten::copy_", 36, 38),
        ("c10d::allreduce_", 40, 44),
        ("step", 63, 90), ("synctune.wait", 64, 70), ("synctune.finish", 70, 72), ("synctune.verdict", 72, 73),
        ("Optimizer.step#SGD.step", 74, 84), ("zero_grad", 91, 95),
    ]
    ddp = [
        ("ddp iteration", 200, 300), ("zero_grad", 201, 203), ("Optimizer.zero_grad#SGD.zero_grad", 201.5, 202.5),
        ("forward", 204, 234), ("DistributedDataParallel.forward", 205, 233), ("ddp.pre_forward", 206, 212),
        ("ddp.sync_buffers", 207, 211), ("c10d::broadcast_", 208, 209), ("aten::mm", 213, 223),
        ("backward", 235, 285), ("autograd::engine::evaluate_function: MmBackward0", 236, 246),
        (HOOK, 247, 257), ("torch::autograd::AccumulateGrad", 248, 249),
        ("torch::distributed::reducer::mul_out", 250, 253), ("aten::mul", 250.5, 252), ("c10d::allreduce_", 253, 256),
        ("torch.distributed.ddp.reducer::copy_bucket_to_grad", 280, 282),
        ("step", 286, 296), ("Optimizer.step#SGD.step", 286, 295),
    ]
    flights = [("gloo:all_reduce", gloo, 44, 70), ("gloo:all_reduce", gloo, 253, 281)]
    return [(n, main, a, b) for n, a, b in engine + ddp] + flights


def test_breakdown_gives_every_microsecond_to_one_item():
    bench = _benchmark()
    got = bench.breakdown_of(_events())
    assert set(got) == {"synctune", "ddp"} and len(got["synctune"]) == len(got["ddp"]) == 1
    ours, ddp = got["synctune"][0], got["ddp"][0]
    want_ours = {"forward": 20, "backward": 12, "hooks": 10, "copy_in": 2, "launch": 4, "wait": 12 + 6,
                 "copy_out": 2, "verdict": 1, "optimizer": 10, "step_other": 8, "zero_grad": 4, "other": 9,
                 "ddp_forward": 0, "buffer_broadcast": 0}
    want_ddp = {"forward": 24, "ddp_forward": 2, "buffer_broadcast": 4, "backward": 12, "hooks": 4, "copy_in": 3,
                "launch": 3, "wait": 26, "copy_out": 2, "verdict": 0, "optimizer": 9, "step_other": 1,
                "zero_grad": 2, "other": 8}
    for key, _label in bench.BREAKDOWN_ITEMS:
        assert ours[key] == pytest.approx(want_ours[key] / 1e3), key
        assert ddp[key] == pytest.approx(want_ddp[key] / 1e3), key
    assert sum(ours[k] for k, _ in bench.BREAKDOWN_ITEMS) == pytest.approx(ours["total"]) == pytest.approx(0.1)
    assert sum(ddp[k] for k, _ in bench.BREAKDOWN_ITEMS) == pytest.approx(ddp["total"]) == pytest.approx(0.1)
    assert ours["in_flight"] == pytest.approx(0.026) and ours["exposed"] == pytest.approx(0.020)
    assert ddp["in_flight"] == pytest.approx(0.028) and ddp["exposed"] == pytest.approx(0.024)
    table = bench.breakdown_table(got)
    assert "gradient hooks: dispatch" in table and "+0.006" in table  # hooks: engine 10 µs - DDP 4 µs


def test_phase_ranges_are_a_shared_no_op_unless_switched_on():
    import synctune.engine.core as core

    assert core.PROFILE_PHASES is False
    assert core._phase("synctune.wait") is core._phase("synctune.finish")  # one shared null context
    core.PROFILE_PHASES = True
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            with core._phase("synctune.wait"):
                torch.zeros(1)
    finally:
        core.PROFILE_PHASES = False
    assert "synctune.wait" in {e.name for e in prof.events()}
