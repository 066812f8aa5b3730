"""Executing a strategy's activation checkpointing (:mod:`synctune.strategy.checkpoint`) with
torch's own ``torch.utils.checkpoint``.

Each checkpointed module's ``forward`` is replaced, on the instance, by one that runs the
original under ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, with torch's
selective-checkpoint context (``create_selective_checkpoint_contexts``) for ``selective``. The
module keeps its class, its name and its parameters' names, so every runtime finds the
variables it synchronizes where the model spec says; it is done on the freshly built model,
before any runtime wraps it (torch's documented order for FSDP2: checkpoint, then
``fully_shard``, as torchtitan applies ``checkpoint_wrapper`` per block before sharding).

Recomputation replays the forward with the random state it had (``preserve_rng_state``, torch's
default) and puts the state back after it: with dropout on, a checkpointed block draws in its
recompute the masks it drew in forward, and every later draw is the one a run without
checkpointing makes, so the numbers are those of training without checkpointing (the
equivalence suite checks it with dropout off and on).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator

from ..spec.errors import SpecError

__all__ = ["apply_checkpointing", "selective_policy", "observe_selective_saves"]

#: Who is told what selective checkpointing saves in forward (:func:`observe_selective_saves`).
_OBSERVERS: list[Callable[[Any], None]] = []


@contextlib.contextmanager
def observe_selective_saves(observer: Callable[[Any], None]) -> Iterator[None]:
    """While inside, ``observer(output)`` is called with each op output a ``selective`` block
    saves for backward. torch keeps those outputs in its selective-checkpoint storage, not
    through ``saved_tensors_hooks``, so a count of saved activations (the memory probe:
    :func:`synctune.engine.memory.probe_iteration`) learns of them here."""
    _OBSERVERS.append(observer)
    try:
        yield
    finally:
        _OBSERVERS.remove(observer)


def selective_policy():
    """The policy of ``selective`` checkpointing: save the outputs of
    :data:`~synctune.strategy.checkpoint.SAVED_OPS` (matrix products, fused attention), recompute
    every other op (``torch.utils.checkpoint.CheckpointPolicy``).

    While :func:`observe_selective_saves` is active, each output the policy keeps goes to the
    observers: torch 2.12 and later call the policy after the op with the output
    (``ctx.op_output``); torch 2.11 calls it before the op without one, so the op is left in
    ``policy.pending`` for :func:`_selective_contexts`' dispatch mode, which hands over its output
    once the op has run. torch 2.11 also asks the policy again during recompute
    (``ctx.is_recompute``): the same answer, and nothing observed twice."""
    import torch
    from torch.utils.checkpoint import CheckpointPolicy

    from ..strategy.checkpoint import SAVED_OPS

    saved = {getattr(torch.ops.aten, name) for name in SAVED_OPS if hasattr(torch.ops.aten, name)}
    pending: list = []

    def policy(ctx, op, *_args, **_kwargs):
        packet = getattr(op, "overloadpacket", op)
        if packet not in saved:
            return CheckpointPolicy.PREFER_RECOMPUTE
        if _OBSERVERS and not ctx.is_recompute:
            if hasattr(ctx, "op_output"):
                _observe(ctx.op_output)
            else:
                pending.append(op)
        return CheckpointPolicy.MUST_SAVE

    policy.pending = pending
    return policy


def _observe(output) -> None:
    for observe in _OBSERVERS:
        observe(output)


def _policy_sees_outputs() -> bool:
    """Whether this torch hands the selective policy each op's output (``op_output``, torch 2.12 on)."""
    import inspect

    from torch.utils.checkpoint import SelectiveCheckpointContext

    return "op_output" in inspect.signature(SelectiveCheckpointContext).parameters


def _selective_contexts(policy):
    """``create_selective_checkpoint_contexts(policy)``; on a torch whose policy runs before the op
    (2.11) and while someone observes, its forward context also delivers the outputs of the
    ops the policy kept (:func:`selective_policy`): a dispatch mode entered just below torch's
    caching mode sees each op the caching mode runs, and its output, and changes nothing."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts
    from torch.utils._python_dispatch import TorchDispatchMode

    forward, recompute = create_selective_checkpoint_contexts(policy)
    if not _OBSERVERS or _policy_sees_outputs():
        return forward, recompute

    class _DeliverSaved(TorchDispatchMode):
        def __enter__(self):
            super().__enter__()
            forward.__enter__()
            return self

        def __exit__(self, *exc):
            try:
                forward.__exit__(*exc)
            finally:
                super().__exit__(*exc)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if policy.pending and policy.pending[-1] is func:
                policy.pending.pop()
                _observe(out)
            return out

    return _DeliverSaved(), recompute


def _checkpointed(forward, mode: str):
    from torch.utils.checkpoint import checkpoint

    if mode == "selective":
        policy = selective_policy()
        context_fn = functools.partial(_selective_contexts, policy)
    else:
        context_fn = None

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if context_fn is None:
            return checkpoint(forward, *args, use_reentrant=False, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, context_fn=context_fn, **kwargs)

    return run


def apply_checkpointing(model: Any, checkpoint: Iterable[tuple[str, str]]) -> list[str]:
    """Checkpoint ``model``'s modules as ``checkpoint`` (``(module name, mode)`` pairs) says, in
    place, before any runtime wraps the model; returns the modules checkpointed. A name that is
    not a module of ``model`` is refused (:class:`SpecError` naming it)."""
    pairs = list(checkpoint)
    if not pairs:
        return []
    modules = dict(model.named_modules())
    done = []
    for name, mode in pairs:
        module = modules.get(name)
        if module is None:
            raise SpecError(f"strategy: checkpoint: the workload's model has no module {name!r} to checkpoint")
        if getattr(module, "_synctune_checkpoint", None) is not None:
            continue
        module.forward = _checkpointed(module.forward, mode)
        module._synctune_checkpoint = mode
        done.append(name)
    return done
