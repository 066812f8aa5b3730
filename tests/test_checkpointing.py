"""Activation checkpointing is exact: training with some blocks checkpointed (``full`` or
``selective``) gives the parameters of single-process training WITHOUT checkpointing on the
concatenated batch (the equivalence suite's reference and tolerances), after 3 steps, on the
engine (the all-reduce builder's strategy, and sufficient-factor broadcasting, whose layer hooks
fire again in the recompute) and on torch FSDP2 (from a shard strategy's plans, and with FSDP2's
own ``checkpoint`` setting, 1-D and HSDP), on 2 and 4 gloo processes, for a zoo transformer and
for Hugging Face GPT-2 and BERT built from configs. Each case runs through the trial's own arm,
so the runtime's ``checkpoint_of`` decides what is checkpointed, and the test reads back from the
model which modules ran checkpointed. With dropout on, checkpointed training draws the same
masks as plain training; and checkpointing really holds fewer activations (a no-op would fail)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from _checkpoint_workers import lm_loss, reference_training, tiny_gpt2, token_batch, trial_arm_cases, workload_of
from _engine_workers import sfb_strategy
from _fsdp_workers import shard_strategy
from synctune.engine.fsdp import FSDPConfig, FSDPRuntime
from synctune.engine.fsdp_plans import FSDP_PLANS
from synctune.engine.local import run_local
from synctune.engine.runtimes import as_runtime
from synctune.engine.trial import TrialConfig, check_trial, trial_payload
from synctune.spec import cluster_preset
from synctune.spec.errors import SpecError
from synctune.strategy import ShardPlan, ShardSynchronizer, VariablePlan, build_strategy, validate
from synctune.strategy.checkpoint import checkpoint_blocks

pytest.importorskip("transformers")

STEPS, LR = 3, 0.1
VOCAB_BIG = 512  # the memory test's GPT-2: logits and attention outweigh its parameters


def _mixed(blocks: list[str]) -> dict[str, str]:
    """Full and selective checkpointing alternating over ``blocks`` (the first full)."""
    return {b: ("full" if i % 2 == 0 else "selective") for i, b in enumerate(blocks)}


def _blocks(workload) -> list[str]:
    return checkpoint_blocks(v.name for v in workload.spec().variables)


def _case(label: str, model: str, strategy, cluster, runtime=None, checkpoint: dict | None = None) -> dict:
    """A trial case: ``strategy`` with ``checkpoint`` set (None: as it is), checked as a trial
    is before any worker starts, and the modules the runtime will checkpoint."""
    workload = workload_of(model)
    if checkpoint is not None:
        strategy = dataclasses.replace(strategy, checkpoint=tuple(checkpoint.items()))
    runtime = as_runtime(runtime)
    spec = check_trial(workload, strategy, cluster, runtime)
    expected = dict(runtime.checkpoint_of(strategy, spec))
    assert expected, f"{label}: nothing to checkpoint"
    payload = trial_payload(workload, strategy, cluster, TrialConfig(optimizer="sgd", lr=LR), spec, runtime=runtime)
    return {"label": label, "model": model, "payload": payload, "steps": STEPS, "expected": expected}


def _check(cases: list[dict], outputs: list[list[dict]], atol: float) -> None:
    """Every rank holds the same parameters, which are single-process training's without
    checkpointing (float32 and float64, the equivalence suite's rule), and the modules that ran
    checkpointed are those the runtime named, in their modes."""
    for c, case in enumerate(cases):
        label, workload = case["label"], workload_of(case["model"])
        split = case["payload"]["strategy"]["batch_split"]
        first = outputs[0][c]
        assert first["checkpointed"] == case["expected"], f"{label}: checkpointed {first['checkpointed']}"
        for r in range(1, len(outputs)):
            for k, v in outputs[r][c]["params"].items():
                assert torch.equal(v, first["params"][k]), f"{label}: rank {r} differs from rank 0 on {k}"
        ref = reference_training(workload, split, LR, STEPS)
        exact = reference_training(workload, split, LR, STEPS, dtype=torch.float64)
        torch.manual_seed(0)
        start = workload.build_model().state_dict()
        assert set(first["params"]) == set(ref), label
        for k, v in first["params"].items():
            rounding = 2 * (ref[k].double() - exact[k]).abs().max().item()
            torch.testing.assert_close(v.double(), exact[k], rtol=1e-5, atol=atol + rounding,
                                       msg=lambda m: f"{label}: {k}: {m}")
        assert any(not torch.equal(v, start[k]) for k, v in first["params"].items()), f"{label}: nothing trained"


def _engine_cases(cluster_name: str) -> list[dict]:
    cluster = cluster_preset(cluster_name)
    cases = []
    for model in ("transformer-small", "hf-gpt2", "hf-bert"):
        workload = workload_of(model)
        strategy = build_strategy("allreduce", workload.spec(), cluster)
        cases.append(_case(f"engine/{model}/allreduce", model, strategy, cluster, checkpoint=_mixed(_blocks(workload))))
    # Sufficient-factor broadcasting keeps each linear layer's inputs from a forward hook, which
    # the recompute fires again (its output never gets a gradient), and an uneven split.
    sfb = sfb_strategy("transformer-small", cluster, tuple(range(1, cluster.num_devices + 1)))
    validate(sfb, workload_of("transformer-small").spec(), cluster)
    cases.append(_case("engine/transformer-small/sfb, all full", "transformer-small", sfb, cluster,
                       checkpoint={b: "full" for b in _blocks(workload_of("transformer-small"))}))
    return cases


@pytest.fixture(scope="module")
def arms_trained():
    """``arms_trained(cluster_name)``: the engine's cases and FSDP2's (:func:`_engine_cases`,
    :func:`_fsdp2_cases`), each with every rank's outputs, both trained in one start of the
    cluster's workers (one case after another on every rank, as each test ran its own)."""
    runs: dict[str, dict[str, tuple[list[dict], list[list[dict]]]]] = {}

    def get(cluster_name: str, kind: str):
        if cluster_name not in runs:
            groups = {"engine": _engine_cases(cluster_name), "fsdp2": _fsdp2_cases(cluster_name)}
            cases = groups["engine"] + groups["fsdp2"]
            outputs = run_local(trial_arm_cases, cluster_preset(cluster_name).num_devices, (cases,), timeout_s=600,
                                threads=1)
            n = len(groups["engine"])
            runs[cluster_name] = {"engine": (groups["engine"], [out[:n] for out in outputs]),
                                  "fsdp2": (groups["fsdp2"], [out[n:] for out in outputs])}
        return runs[cluster_name][kind]

    return get


@pytest.mark.parametrize("cluster_name", ["local-1x2", "local-2x2"])
def test_engine_with_checkpointing_trains_like_single_process(cluster_name, arms_trained):
    cases, outputs = arms_trained(cluster_name, "engine")
    _check(cases, outputs, atol=2e-6)


def _gpt2_shard_strategy(cluster):
    """The tiny GPT-2 on ``shard``: one unit per block (``transformer.h.N``), the rest the root's."""
    spec = workload_of("hf-gpt2").spec()
    base = build_strategy("allreduce", spec, cluster)
    unit = {p.variable: (int(p.variable.split(".")[2]) + 1 if p.variable.startswith("transformer.h.") else 0)
            for p in base.plans}
    plans = tuple(VariablePlan(variable=p.variable, partition=p.partition, shards=(ShardPlan(
        synchronizer=ShardSynchronizer(unit=unit[p.variable], reshard=True, prefetch=1)),)) for p in base.plans)
    return dataclasses.replace(base, plans=plans)


def _fsdp2_cases(cluster_name: str) -> list[dict]:
    cluster = cluster_preset(cluster_name)
    uneven = tuple(range(1, cluster.num_devices + 1))
    small = workload_of("transformer-small")
    plain = build_strategy("allreduce", small.spec(), cluster)
    gpt2_plain = build_strategy("allreduce", workload_of("hf-gpt2").spec(), cluster)
    cases = [
        _case("fsdp-plans/transformer-small/shard units per block, uneven", "transformer-small",
              shard_strategy("transformer-small", cluster, reshard=True, prefetch=1, split=uneven), cluster, FSDP_PLANS,
              checkpoint=_mixed(_blocks(small))),
        _case("fsdp-plans/hf-gpt2/shard units per block", "hf-gpt2", _gpt2_shard_strategy(cluster), cluster,
              FSDP_PLANS, checkpoint=_mixed(_blocks(workload_of("hf-gpt2"))[::-1])),
        _case("fsdp checkpoint=full/transformer-small", "transformer-small", plain, cluster,
              FSDPRuntime(FSDPConfig(checkpoint="full"))),
        _case("fsdp checkpoint=selective, no reshard/hf-gpt2", "hf-gpt2", gpt2_plain, cluster,
              FSDPRuntime(FSDPConfig(checkpoint="selective", reshard_after_forward=False))),
        # A strategy's own checkpoint under FSDP2's settings without one: the strategy's runs.
        _case("fsdp checkpoint=none, strategy's own/hf-gpt2", "hf-gpt2", gpt2_plain, cluster, FSDPRuntime(),
              checkpoint={"transformer.h.1": "selective"}),
    ]
    if cluster.num_devices == 4:
        cases.append(_case("fsdp HSDP (2, 2) checkpoint=full/hf-gpt2", "hf-gpt2", gpt2_plain, cluster,
                           FSDPRuntime(FSDPConfig(group=2, checkpoint="full"))))
    return cases


@pytest.mark.parametrize("cluster_name", ["local-1x2", "local-2x2"])
def test_fsdp2_with_checkpointing_trains_like_single_process(cluster_name, arms_trained):
    cases, outputs = arms_trained(cluster_name, "fsdp2")
    # test_fsdp.py's bound for FSDP2: 1e-6 on transformers, plus float32's own rounding.
    _check(cases, outputs, atol=1e-6)


def test_fsdp2_checkpoint_setting_is_refused_beside_the_strategys_own():
    cluster = cluster_preset("local-1x2")
    workload = workload_of("transformer-small")
    strategy = dataclasses.replace(build_strategy("allreduce", workload.spec(), cluster),
                                   checkpoint=(("encoder.0", "full"),))
    with pytest.raises(SpecError) as err:
        check_trial(workload, strategy, cluster, FSDPRuntime(FSDPConfig(checkpoint="selective")))
    assert str(err.value).count("\n") == 0
    assert str(err.value).startswith("fsdp config: checkpoint: 'selective' beside the strategy's own checkpoint")
    assert "set checkpoint=none" in str(err.value) and "drop the strategy's checkpoint field" in str(err.value)


def _train_single(dropout: float, checkpoint, seed: int = 0, steps: int = STEPS) -> tuple[dict, torch.Tensor]:
    """The tiny GPT-2 trained in this process (AdamW), the global seed set once before the first
    step as a training job sets it: its parameters and the random state after the last step."""
    from synctune.engine.checkpoint import apply_checkpointing

    torch.manual_seed(0)
    model = tiny_gpt2(dropout)
    apply_checkpointing(model, checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = token_batch(8, 0, torch.Generator().manual_seed(1))
    torch.manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        lm_loss(model, batch).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, torch.get_rng_state()


def test_with_dropout_checkpointed_training_draws_the_same_masks():
    """Dropout on (0.1 on embeddings, attention and residuals), one process, AdamW, 3 steps:
    checkpointed training (block 0 full, block 1 selective; and both full) gives bit for bit the
    parameters of training without checkpointing from the same seed, and leaves the global random
    state where that training leaves it: torch stashes the random state at each checkpointed
    forward, replays the recompute from it and then restores the state it found, so the recompute
    redraws the forward's dropout masks and every later draw is unchanged. Dropout really draws
    (another seed trains to other parameters), so the equality is not that of a model without it."""
    plain, state = _train_single(0.1, ())
    for checkpoint in ((("transformer.h.0", "full"), ("transformer.h.1", "selective")),
                       (("transformer.h.0", "full"), ("transformer.h.1", "full"))):
        got, got_state = _train_single(0.1, checkpoint)
        for k, v in plain.items():
            assert torch.equal(got[k], v), f"{checkpoint}: {k} differs by {(got[k] - v).abs().max().item():.3g}"
        assert torch.equal(got_state, state), f"{checkpoint}: the random state after training differs"
    other, _ = _train_single(0.1, (), seed=1)
    assert any(not torch.equal(other[k], v) for k, v in plain.items())


def test_checkpointing_holds_fewer_activations():
    """What a no-op checkpointing would fail: one instrumented iteration (the trial's memory
    probe, :func:`synctune.engine.memory.probe_iteration`) of a GPT-2 whose activations outweigh
    its parameters (4 blocks, context 256), every block none / selective / full. The activations
    held at the end of forward, and the iteration's allocation peak, fall from none to selective
    (matrix products kept, the rest recomputed) to full (a block's input only); and a full block
    runs its matrix products again in backward, a selective one does not."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from torch.utils._python_dispatch import TorchDispatchMode

    from synctune.engine.checkpoint import apply_checkpointing
    from synctune.engine.memory import probe_iteration

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm)
            return func(*args, **(kwargs or {}))

    config = GPT2Config(vocab_size=VOCAB_BIG, n_positions=256, n_embd=64, n_layer=4, n_head=2, use_cache=False,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    tokens = torch.randint(0, VOCAB_BIG, (8, 256), generator=torch.Generator().manual_seed(0))
    memory, backward_matmuls = {}, {}
    for mode in ("none", "selective", "full"):
        torch.manual_seed(0)
        model = GPT2LMHeadModel(config)
        if mode != "none":
            apply_checkpointing(model, [(f"transformer.h.{i}", mode) for i in range(4)])
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        memory[mode] = probe_iteration(model=model, batch=(tokens,), loss_fn=lm_loss, step=opt.step,
                                       device=torch.device("cpu"), optimizer=opt, units=[])
        loss = lm_loss(model, (tokens,))
        with CountMatmuls() as counter:
            loss.backward()
        backward_matmuls[mode] = counter.count
    for part in ("activations_bytes", "iteration_peak_bytes"):
        none, selective, full = (memory[m][part] for m in ("none", "selective", "full"))
        assert none > selective > full, (part, none, selective, full)
    # measured: activations 122 MB, 50 MB, 8 MB; allocation peak 127 MB, 75 MB, 42 MB
    assert memory["full"]["activations_bytes"] < 0.2 * memory["none"]["activations_bytes"]
    # Backward runs the same matrix products (of the gradients) in every mode; a full block also
    # recomputes its forward's (measured: 3 of its 4 per block, 12 more: torch stops a recompute
    # once it holds what backward needs, and the MLP's output product is not needed), a selective
    # block takes them from what forward kept.
    assert backward_matmuls["selective"] == backward_matmuls["none"], backward_matmuls
    assert backward_matmuls["full"] >= backward_matmuls["none"] + 4, backward_matmuls



def test_selective_checkpointing_around_inner_fsdp2_units_is_refused_as_torch_failed_it():
    """A GPT-2 block checkpointed ``selective`` with FSDP2 units inside it (units cut below the
    block). The reference is a real trial, recorded in release synctune-v0.4-library-memory
    before the check existed: on lab-2x2 (4 processes), under the memory probe's profiler, torch
    failed it in backward ("not found in storage": the inner units' hooks record functions in
    forward that the selective recompute does not replay alike). The check now refuses that very
    strategy, naming the field and the block, before any worker, and admits it with the block
    checkpointed ``full`` (which the same searches ran)."""
    from synctune.data import TrialDataset
    from synctune.engine.fsdp_plans import plans_refusal
    from synctune.strategy import Strategy
    from synctune.workload import resolve_workload

    from _searches import ROOT

    rows = TrialDataset(ROOT / "dataset" / "synctune-v0.4-library-memory" / "data").records()
    failed = next(r for r in rows if r.status == "failed" and r.runtime == "fsdp-plans")
    assert "not found in storage" in failed.error
    strategy = Strategy.from_json(failed.strategy_json)
    assert dict(strategy.checkpoint)["transformer.h.1"] == "selective"
    workload = resolve_workload(str(ROOT / "experiments" / "workloads" / "hf_gpt2.py") + ":workload")
    spec = workload.check()
    cluster = cluster_preset("lab-2x2")
    refusal = plans_refusal(strategy, cluster, workload.build_model(), spec, workload)
    assert refusal is not None and refusal.startswith(
        "strategy: checkpoint: block 'transformer.h.1' is checkpointed selective and holds FSDP2 unit"), refusal
    full = dataclasses.replace(strategy, checkpoint=tuple((b, "full") for b, _m in strategy.checkpoint))
    assert plans_refusal(full, cluster, workload.build_model(), spec, workload) is None
