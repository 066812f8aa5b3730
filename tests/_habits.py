"""Models that are not in the zoo, with the habits of real training loops (frozen, tied and
unused parameters, BatchNorm buffers), the engine-side training loop of every habit (micro-batch
accumulation with no_sync, autocast with a GradScaler, clipping, a checkpoint saved under one
strategy and resumed under another), and their independent references: single-process training
on the concatenated batch, or torch DDP where per-replica BatchNorm makes single-process
training a different computation."""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from synctune.spec import ClusterSpec, extract_model_spec
from synctune.strategy import Strategy

VOCAB, DIM, CLASSES = 20, 8, 4


class HabitNet(nn.Module):
    """Tied input/output embedding, a frozen layer in the middle, a parameter no forward uses,
    and a gated one that only batches with gated samples use (data-dependent: some ranks' or
    some micro-batches' forward passes leave it out)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM)
        self.frozen.requires_grad_(False)
        self.hidden = nn.Linear(DIM, DIM)
        self.unused = nn.Parameter(torch.ones(3))
        self.gated = nn.Parameter(torch.full((DIM,), 0.5))

    def forward(self, tokens, target, scale=None, gate=None):
        h = self.emb(tokens).mean(1)
        if scale is not None:
            h = h * scale[:, None]
        if gate is not None and gate.device.type != "meta" and bool(gate.any()):
            h = h + self.gated * gate[:, None]
        h = torch.relu(self.frozen(h))
        h = self.hidden(h)
        logits = h @ self.emb.weight.t()  # the output layer is the input embedding, tied
        return F.cross_entropy(logits.float(), target, reduction="sum")


class BNNet(nn.Module):
    """A BatchNorm layer whose running statistics are buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(DIM, 16)
        self.bn = nn.BatchNorm1d(16)
        self.lin2 = nn.Linear(16, CLASSES)

    def forward(self, x, target):
        return F.cross_entropy(self.lin2(torch.relu(self.bn(self.lin1(x)))), target, reduction="sum")


MODELS = {"habit": HabitNet, "bn": BNNet}


def spec_of(kind: str):
    """The model spec, traced on the meta device (frozen parameters are not variables)."""
    with torch.device("meta"):
        module = MODELS[kind]()
    return extract_model_spec(module, name=f"{kind}-net", batch_size=4,
                              run_step=lambda m: m(*batch_of(kind, 2, 0, 0, 0, device="meta")))


def batch_of(kind: str, n: int, seed: int, step: int, rank: int, device="cpu", poison: bool = False,
             gated: bool = False) -> tuple:
    """Rank ``rank``'s batch of step ``step``; ``poison`` puts an overflowing sample in it;
    ``gated`` gates the first half of rank 1's samples (the other ranks' batches, and the second
    half, leave the gated parameter out). Drawn on the CPU, then moved: the same numbers on any
    device."""
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank) if device != "meta" else None
    target_device, device = device, ("meta" if device == "meta" else "cpu")
    return tuple(t.to(target_device) for t in _draw(kind, n, rank, gen, device, poison, gated))


def _draw(kind: str, n: int, rank: int, gen, device, poison: bool, gated: bool) -> tuple:
    if kind == "habit":
        tokens = torch.randint(0, VOCAB, (n, 5), generator=gen, device=device)
        target = torch.randint(0, VOCAB, (n,), generator=gen, device=device)
        scale = torch.ones(n, device=device)
        if poison:
            scale[0] = float("inf")  # an overflow in the forward pass: inf/nan gradients on this rank only
        gate = torch.zeros(n, device=device)
        if gated and rank == 1:
            gate[: n // 2] = 1.0
        return tokens, target, scale, gate
    x = torch.randn(n, DIM, generator=gen, device=device)
    return x, torch.randint(0, CLASSES, (n,), generator=gen, device=device)


def _joined(parts: list[tuple]) -> tuple:
    return tuple(torch.cat([p[i] for p in parts]) for i in range(len(parts[0])))


def make_optimizer(name: str, params, lr: float):
    return torch.optim.Adam(params, lr=lr) if name == "adam" else torch.optim.SGD(params, lr=lr, momentum=0.5)


def _state(module: nn.Module) -> dict:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


#: The autocast dtype per device type: bfloat16 on the CPU (what its autocast runs), float16 on
#: CUDA (the mixed precision a GradScaler exists for: fp16 overflows where bf16 would not).
AMP_DTYPE = {"cpu": torch.bfloat16, "cuda": torch.float16}


def device_of(case: dict, rank: int = 0) -> torch.device:
    """The case's device on this rank: ``cuda`` shares the GPUs round-robin (several processes
    may share one GPU over gloo)."""
    if case.get("device", "cpu") != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(device)
    return device


def _amp(case: dict, device: torch.device):
    """(GradScaler or None, autocast context factory) of a case on ``device``."""
    if not case.get("amp"):
        return None, contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type, init_scale=2.0 ** 8)
    return scaler, lambda: torch.autocast(device.type, dtype=AMP_DTYPE[device.type])


def reference(case: dict) -> dict:
    """Single-process training on the concatenated batch, with the case's habits."""
    device = device_of(case)
    torch.manual_seed(case["seed"])
    module = MODELS[case["model"]]().to(device)
    opt = make_optimizer(case["optimizer"], [p for p in module.parameters() if p.requires_grad], case["lr"])
    scaler, autocast = _amp(case, device)
    split = case["batch_split"]
    total = sum(split)
    for step in range(case["steps"]):
        parts = [batch_of(case["model"], n, case["seed"], step, r, poison=(r == 1 and step == case.get("poison_step")),
                          gated=case.get("gated", False), device=device) for r, n in enumerate(split)]
        if case.get("zero", "engine") != "never":
            opt.zero_grad()
        with autocast():
            loss = module(*_joined(parts)) / total
        (scaler.scale(loss) if scaler else loss).backward()
        if case.get("clip"):
            if scaler:
                scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(module.parameters(), case["clip"])
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return _state(module)


def habits_worker(rank: int, world: int, cases: list[dict]) -> list[dict]:
    """Train each case with the engine on this rank; results: final state, or the error text of
    the cases that expect the engine to refuse what the loop does."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from synctune.engine.core import StrategyEngine

    out = []
    for case in cases:
        cluster = ClusterSpec.from_dict(case["cluster"])
        spec = spec_of(case["model"])
        strategies = [Strategy.from_dict(case["strategy"])] + (
            [Strategy.from_dict(case["switch_to"])] if case.get("switch_to") else [])
        split = strategies[0].batch_split
        device = device_of(case, rank)
        scaler, autocast = _amp(case, device)
        torch.manual_seed(case["seed"])
        module = MODELS[case["model"]]().to(device)

        def engine_for(strategy, module):
            return StrategyEngine(module, strategy, spec, cluster,
                                  lambda ps: make_optimizer(case["optimizer"], ps, case["lr"]),
                                  broadcast_buffers=case.get("broadcast_buffers", True))

        engine = engine_for(strategies[0], module)
        result: dict = {}
        try:
            for step in range(case["steps"]):
                if case.get("switch_to") and step == case["steps"] // 2:
                    saved = engine.state_dict()
                    engine.close()
                    torch.manual_seed(case["seed"] + 99)  # a different start: the checkpoint must set it all
                    module = MODELS[case["model"]]().to(device)
                    engine = engine_for(strategies[1], module)
                    engine.load_state_dict(saved)
                batch = batch_of(case["model"], split[rank], case["seed"], step, rank,
                                 poison=(rank == 1 and step == case.get("poison_step")), gated=case.get("gated", False),
                                 device=device)
                micro = case.get("micro", 1)
                chunks = [tuple(t.tensor_split(micro)[i] for t in batch) for i in range(micro)]
                for i, chunk in enumerate(chunks):
                    sync = i == micro - 1 or case.get("forget_no_sync")
                    with contextlib.nullcontext() if sync else engine.no_sync():
                        with autocast():
                            # The sum over this rank's samples over the global batch size: the engine
                            # weighs ranks by their share, so a rank's loss is its mean.
                            loss = module(*chunk) / split[rank]
                        (scaler.scale(loss) if scaler else loss).backward()
                if case.get("clip"):
                    result.setdefault("norms", []).append(float(engine.clip_grad_norm_(case["clip"], scaler=scaler)))
                engine.step(scaler)
                if scaler:
                    scaler.update()
                    result.setdefault("scales", []).append(float(scaler.get_scale()))
                zero = case.get("zero", "engine")
                if zero == "engine":
                    engine.zero_grad()
                elif zero == "module":  # the module's own zero_grad: every .grad set to None
                    module.zero_grad()
                # "never": gradients accumulate from step to step, as the reference's do
        except Exception as exc:  # noqa: BLE001 - the error cases report what the engine said
            if not case.get("expect_error"):
                raise
            result["error"] = f"{type(exc).__name__}: {exc}"
            out.append(result)
            continue
        engine.close()
        result["state"] = _state(module)
        result["device"] = {p.device.type for p in module.parameters()}
        if case.get("ddp"):
            torch.manual_seed(case["seed"])
            plain = MODELS[case["model"]]().to(device)
            ddp = DDP(plain, broadcast_buffers=case.get("broadcast_buffers", True))
            opt = make_optimizer(case["optimizer"], ddp.parameters(), case["lr"])
            for step in range(case["steps"]):
                batch = batch_of(case["model"], split[rank], case["seed"], step, rank, device=device)
                opt.zero_grad()
                # DDP averages over ranks: the same global-mean loss for equal batches.
                (ddp(*batch) / split[rank]).backward()
                opt.step()
            result["ddp"] = _state(plain)
        out.append(result)
    return out


def refusal_worker(rank: int, world: int, case: dict) -> dict:
    """Refuse a misused step once per entry of ``case["refusals"]``, each on a fresh engine over
    the same process group, with this rank's own random delay before every backward (so its
    collectives start at other times than its peers'); then train ``case["train"]`` with
    :func:`habits_worker` on the same processes. Result: per refusal the error text (None: no
    error), and the trained case's result.

    The misuse (``kind``): ``second``, two backward passes without ``no_sync``; ``late-no-sync``,
    a backward inside ``no_sync`` after the synchronized one; ``after-clip``, a backward between
    ``clip_grad_norm_`` and ``step``; ``checkpoint``, ``state_dict()`` between a backward and
    ``step``. ``lone``: the last rank's misuse is one it cannot see itself (its extra backward
    touches only the gated parameter, which its first backward left out; no backward after
    clipping at all; no backward before the checkpoint), while the others see theirs."""
    import random
    import time

    from synctune.engine.core import StrategyEngine, SynchronizationError

    cluster = ClusterSpec.from_dict(case["cluster"])
    spec = spec_of("habit")
    delays = random.Random(case["seed"] * 1009 + rank)
    errors: list[str | None] = []
    for i, refusal in enumerate(case["refusals"]):
        strategy = Strategy.from_dict(refusal["strategy"])
        split = strategy.batch_split
        kind, lone = refusal["kind"], refusal["lone"] and rank == world - 1
        torch.manual_seed(case["seed"])
        module = HabitNet()
        engine = StrategyEngine(module, strategy, spec, cluster, lambda ps: torch.optim.SGD(ps, lr=0.1))
        batch = batch_of("habit", split[rank], case["seed"], i, rank)
        chunks = [tuple(t.tensor_split(2)[k] for t in batch) for k in range(2)]

        def backward(k: int) -> None:
            loss = module.gated.sum() if (k == 1 and lone) else module(*chunks[k]) / split[rank]
            time.sleep(delays.uniform(0.0, 0.02))
            loss.backward()

        try:
            if not (kind == "checkpoint" and lone):
                backward(0)
            if kind == "checkpoint":
                engine.state_dict()
            elif kind == "second":
                backward(1)
            elif kind == "late-no-sync":
                with engine.no_sync():
                    backward(1)
            elif kind == "after-clip":
                engine.clip_grad_norm_(1.0)
                if not lone:
                    backward(1)
            engine.step()
            errors.append(None)
        except SynchronizationError as exc:
            errors.append(str(exc))
        finally:
            engine.close()
    return {"errors": errors, "trained": habits_worker(rank, world, [case["train"]])[0]}
