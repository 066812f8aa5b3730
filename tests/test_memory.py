"""Memory, measured and predicted: per-device memory in the cluster spec, the
per-rank breakdown a trial records, and the simulator's memory model, each checked against an
independent count (torch's own sizes, hand-computed figures)."""

from __future__ import annotations

import pytest

from synctune.spec.cluster import CLUSTER_PRESETS, GIB, ClusterSpec, cluster_preset
from synctune.spec.errors import SpecError

# The public per-GPU memory of each catalog GPU (NVIDIA's data sheets: T4 16 GB GDDR6, Tesla
# M60 2 x 8 GB (one GPU per g3 "GPU"), GeForce GTX TITAN X 12 GB).
PUBLIC_GPU_MEMORY_GIB = {"T4": 16, "M60": 8, "TITAN X": 12}


def test_catalog_gpus_have_their_public_memory():
    for name in CLUSTER_PRESETS:
        for node in cluster_preset(name).nodes:
            if node.device_kind == "gpu":
                assert node.device_memory_bytes == PUBLIC_GPU_MEMORY_GIB[node.device_model] * 2**30, (name, node)
            else:
                assert node.device_memory_bytes == 0, (name, node)  # unset: the host's memory is shared


def test_memory_gib_on_a_cpu_node_sets_its_budget_and_presets_keep_their_hashes():
    spec = ClusterSpec.from_dict({"name": "c", "nodes": [{"instance_type": "local-cpu", "num_devices": 2,
                                                          "memory_gib": 1.5}]})
    assert spec.nodes[0].device_memory_bytes == 3 * 2**29
    assert spec.device_memory_budget_bytes("node0:1") == 3 * 2**29
    # memory_gib is another spelling of device_memory_bytes: the same spec, the same hash.
    same = ClusterSpec.from_dict({"name": "c", "nodes": [{"instance_type": "local-cpu", "num_devices": 2,
                                                          "device_memory_bytes": 3 * 2**29}]})
    assert same.hash == spec.hash
    # Presets keep the hashes they had before the field existed (key of every dataset row).
    assert cluster_preset("local-2x2").hash == "d4dad25a77a50ffdc954ff009e3e2dcb9e1589f7a876392e28847f05c312d869"
    assert cluster_preset("lab-2x2").hash == "567630a7b5991a019379902b97863a035e226ad9096e4f5304e6d96810e44c0a"
    assert cluster_preset("B7").hash == "f557a4c6c753260f5eb0c08498b8740fb4f64221a12f1c0f28b3dfc1af860533"
    local = cluster_preset("local-2x2")
    # Its budget defaults to the host's memory split among the cluster's four workers.
    import os

    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert local.device_memory_budget_bytes("node1:0") == host // 4
    assert cluster_preset("B7").device_memory_budget_bytes("node3:3") == 16 * GIB


@pytest.mark.parametrize("node, needle", [
    ({"instance_type": "local-cpu", "memory_gib": 0}, "memory_gib"),
    ({"instance_type": "local-cpu", "memory_gib": "4"}, "memory_gib"),
    ({"instance_type": "local-cpu", "memory_gib": 4, "device_memory_bytes": 4}, "both given"),
])
def test_bad_memory_gib_is_refused_naming_the_field(node, needle):
    with pytest.raises(SpecError, match=needle):
        ClusterSpec.from_dict({"name": "c", "nodes": [node]})


# ----------------------------------------------------------------------------- measured


def test_probe_counts_params_grads_and_saved_activations_as_torch_sizes_them():
    """One instrumented iteration of Linear(8,16)-ReLU-Linear(16,4) on a batch of 5: parameters
    and gradients are sum(numel * element_size) by torch's own sizes, and the saved activations
    are ReLU's output alone (5 x 16 float32: the Linear layers save their input, which is the
    batch or that same output, and their weight, a parameter)."""
    import torch

    from synctune.engine.memory import probe_iteration

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    batch = (torch.randn(5, 8),)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    got = probe_iteration(model=model, batch=batch, loss_fn=lambda m, b: m(b[0]).square().sum(), step=lambda: None,
                          device=torch.device("cpu"))
    assert got["params_bytes"] == params == (8 * 16 + 16 + 16 * 4 + 4) * 4
    assert got["grads_bytes"] == params
    assert got["inputs_bytes"] == 5 * 8 * 4
    # ReLU's output (5x16) and the square's input (the last Linear's output, 5x4).
    assert got["activations_bytes"] == (5 * 16 + 5 * 4) * 4
    # The allocator saw at least every gradient alive at once (end of backward), and at least
    # every saved activation alive at once (end of forward); not always both together, as
    # backward frees activations while it allocates gradients.
    assert got["iteration_peak_bytes"] >= max(params, got["activations_bytes"])
    assert got["optimizer_state_bytes"] is None and got["peak_bytes"] is None  # not exposed: not guessed


@pytest.fixture(scope="module")
def measured_trials():
    """cnn-small with Adam on local-1x2 under all-reduce and PS (one trial each, 1 + 1 iterations)."""
    from synctune.data.record import TrialRecord
    from synctune.engine.trial import TrialConfig, run_trial_local
    from synctune.models import model_spec
    from synctune.strategy import build_strategy
    from synctune.workload import zoo_workload

    spec, cluster = model_spec("cnn-small"), cluster_preset("local-1x2")
    out = {}
    for name, builder, options in (("allreduce", "allreduce", {}), ("ps", "ps", {}), ("shard", "shard", {}),
                                   ("shard-bf16", "shard", {"reduce_dtype": "bf16"})):
        strategy = build_strategy(builder, spec, cluster, **options)
        result = run_trial_local(strategy, cluster, TrialConfig(warmup=1, iters=1, optimizer="adam"),
                                 workload=zoo_workload("cnn-small"))
        assert result.ok, result.error
        record = TrialRecord.from_trial(result.to_dict(), strategy, spec, cluster, origin=name)
        out[name] = (strategy, spec, cluster, TrialRecord.from_row(record.to_row()))
    return out


def _torch_sizes():
    """Each variable of cnn-small: numel * element_size of the module torch builds."""
    from synctune.models import build_model

    model = build_model("cnn-small")
    return {n: p.numel() * p.element_size() for n, p in model.named_parameters()}


def test_recorded_breakdown_matches_torch_sizes_under_allreduce(measured_trials):
    from synctune.engine.kinds import GRAD_IN_BUCKET_MAX_ELEMENTS
    from synctune.models import build_model
    from synctune.strategy.kinds import units_of

    strategy, _spec, _cluster, record = measured_trials["allreduce"]
    sizes = _torch_sizes()
    params = sum(sizes.values())
    # A small variable's .grad is its bucket slot (counted once, in the bucket); the larger ones'
    # are autograd's own tensors.
    own = sum(p.numel() * p.element_size() for p in build_model("cnn-small").parameters()
              if p.numel() > GRAD_IN_BUCKET_MAX_ELEMENTS)
    assert 0 < own < params
    memory = record.memory_breakdown
    assert len(memory) == 2
    for rank in memory:
        assert rank["params_bytes"] == params
        assert rank["grads_bytes"] == own
        # Every rank updates every variable: Adam's two moments of each, and its 4-byte step.
        assert rank["optimizer_state_bytes"] == 2 * params + 4 * len(sizes)
        # The merge groups' buckets hold every gradient once; each group's unit also holds the
        # weight it scales by, a float32 0-dim tensor.
        assert rank["comm_buffers_bytes"] == params + 4 * len(units_of(strategy))
        assert rank["peak_bytes"] == sum(rank[k] for k in ("params_bytes", "buffers_bytes", "inputs_bytes",
                                                           "optimizer_state_bytes", "comm_buffers_bytes",
                                                           "iteration_peak_bytes"))


def test_recorded_ps_state_lives_on_the_placement_only(measured_trials):
    strategy, _spec, _cluster, record = measured_trials["ps"]
    sizes = _torch_sizes()
    placed = {r: [p.variable for p, _i, s in strategy.iter_shards() if s.synchronizer.placement == dev]
              for r, dev in enumerate(strategy.replicas)}
    memory = record.memory_breakdown
    for r, rank in enumerate(memory):
        assert rank["optimizer_state_bytes"] == sum(2 * sizes[v] + 4 for v in placed[r])
        assert rank["comm_buffers_bytes"] == sum(sizes.values())  # a PS buffer of every variable, every rank
    assert sum(m["optimizer_state_bytes"] for m in memory) == 2 * sum(sizes.values()) + 4 * len(sizes)


@pytest.mark.parametrize("name", ["shard", "shard-bf16"])
def test_recorded_shard_state_and_buffers_are_the_rows_each_rank_owns(measured_trials, name):
    """ZeRO-2 on 2 ranks, counted by hand from torch's sizes: each rank holds Adam's state of
    its ceil(n/2) rows (the rest of the rows, if any, on the other; a rank without rows of a
    variable holds no state for it), and each unit a bucket of both ranks' padded rows and one
    rank's segment (float32; with a bf16 reduce the same two again in bfloat16, half the size);
    parameters and gradients stay whole."""
    import math

    from synctune.models import build_model

    strategy, _spec, _cluster, record = measured_trials[name]
    model = build_model("cnn-small")
    params = dict(model.named_parameters())
    units: dict[int, int] = {}  # unit -> bytes of one rank's padded segment
    state = [0, 0]
    for p, _i, shard in strategy.iter_shards():
        sync = shard.synchronizer
        assert sync.kind == "shard"  # cnn-small: every variable dense float32 with rows
        t = params[p.variable]
        row = t.numel() // t.shape[0] * t.element_size()
        per = math.ceil(t.shape[0] / 2)
        units[sync.unit] = units.get(sync.unit, 0) + per * row
        for r, rows in enumerate((per, t.shape[0] - per)):
            state[r] += 2 * rows * row + 4 if rows else 0
    buffers = sum(3 * seg for seg in units.values())
    if name == "shard-bf16":
        buffers += sum(3 * seg // 2 for seg in units.values())
    total = sum(t.numel() * t.element_size() for t in params.values())
    for r, rank in enumerate(record.memory_breakdown):
        assert rank["params_bytes"] == total and rank["grads_bytes"] == total
        assert rank["optimizer_state_bytes"] == state[r], r
        assert rank["comm_buffers_bytes"] == buffers, r
    # The memory model says the same from the spec alone.
    from synctune.simulator.memory import predict_memory

    for r, got in enumerate(predict_memory(strategy, _spec, _cluster, optimizer_state_multiplier="adam")):
        assert got.optimizer_state_bytes == state[r] and got.comm_buffers_bytes == buffers, r


def test_old_rows_have_no_breakdown():
    from synctune.data.record import TrialRecord

    row = {"extra_json": "{}"}
    assert TrialRecord.memory_breakdown.fget(type("R", (), row)()) is None


# ---------------------------------------------------------------------------- predicted


def _tiny():
    from synctune.spec.model import ModelSpec, VariableSpec

    return ModelSpec(name="tiny", variables=(VariableSpec(name="b", shape=(10,)), VariableSpec(name="w", shape=(10, 6))))


def test_replicated_adam_prediction_is_the_hand_count():
    from synctune.simulator.memory import predict_memory
    from synctune.strategy import build_strategy

    spec, cluster = _tiny(), cluster_preset("local-1x2")
    strategy = build_strategy("allreduce", spec, cluster)
    got = predict_memory(strategy, spec, cluster, optimizer_state_multiplier="adam", activation_bytes=1000)
    params = (10 + 60) * 4  # 280 bytes
    # params + grads + Adam (2 moments + a 4-byte step per variable) + one bucket of every gradient + activations
    assert [r.peak_bytes for r in got] == [280 + 280 + (2 * 280 + 2 * 4) + 280 + 1000] * 2 == [2408, 2408]
    plain = predict_memory(strategy, spec, cluster, optimizer_state_multiplier=0)
    assert [r.optimizer_state_bytes for r in plain] == [0, 0]


def test_ps_server_holds_the_state_of_its_variables_only():
    from synctune.simulator.memory import predict_memory
    from synctune.strategy import build_strategy

    spec, cluster = _tiny(), cluster_preset("local-1x2")
    strategy = build_strategy("ps", spec, cluster)
    got = predict_memory(strategy, spec, cluster, optimizer_state_multiplier="adam")
    placed = {dev: [p.variable for p, _i, s in strategy.iter_shards() if s.synchronizer.placement == dev]
              for dev in strategy.replicas}
    size = {"b": 40, "w": 240}
    for r in got:
        assert r.optimizer_state_bytes == sum(2 * size[v] + 4 for v in placed[r.device])
        assert r.comm_buffers_bytes == 280  # every rank keeps a PS buffer of every variable
    # The difference between two ranks is exactly the difference of their placed state.
    diff = got[0].peak_bytes - got[1].peak_bytes
    assert diff == sum(2 * size[v] + 4 for v in placed[strategy.replicas[0]]) - sum(
        2 * size[v] + 4 for v in placed[strategy.replicas[1]])


def test_shard_prediction_zero2_and_zero3_by_hand():
    """w (10 x 6) sharded over 4 ranks: torch.chunk's cut gives rows 3, 3, 3, 1."""
    import dataclasses

    from synctune.simulator.memory import predict_memory
    from synctune.strategy import build_strategy
    from synctune.strategy.schema import ShardPlan, ShardSynchronizer

    spec, cluster = _tiny(), cluster_preset("local-1x4")
    base = build_strategy("allreduce", spec, cluster)

    def sharded(reshard):
        plans = tuple(dataclasses.replace(p, shards=(ShardPlan(synchronizer=ShardSynchronizer(unit=0, reshard=reshard)),))
                      if p.variable == "w" else p for p in base.plans)
        return dataclasses.replace(base, plans=plans)

    zero2 = predict_memory(sharded(False), spec, cluster, optimizer_state_multiplier="adam")
    rows = [3, 3, 3, 1]
    for r, got in enumerate(zero2):
        assert got.params_bytes == 280 and got.grads_bytes == 280
        assert got.optimizer_state_bytes == (2 * 40 + 4) + (2 * rows[r] * 24 + 4)
        # b's bucket; w's unit: a bucket of 4 x 3 rows (padded) and a 3-row output slice
        assert got.comm_buffers_bytes == 40 + 4 * 3 * 24 + 3 * 24
    zero3 = predict_memory(sharded(True), spec, cluster, optimizer_state_multiplier="adam")
    for r, got in enumerate(zero3):
        # b whole, w's rows of this rank, and w gathered whole (the one unit in flight)
        assert got.params_bytes == 40 + rows[r] * 24 + 240
        assert got.grads_bytes == 40 + rows[r] * 24
