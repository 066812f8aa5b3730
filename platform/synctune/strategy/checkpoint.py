"""Activation checkpointing as part of a strategy: which modules recompute their forward in
backward instead of saving what autograd needs (Chen et al. 2016, "Training Deep Nets with
Sublinear Memory Cost"; torch's ``torch.utils.checkpoint``; torchtitan's
``activation_checkpoint.mode``).

A strategy's ``checkpoint`` maps a module (its dotted name in the model, e.g.
``transformer.h.0``) to a mode; a module it does not name saves its activations as usual:

- ``full``: the module's forward runs under ``torch.utils.checkpoint.checkpoint``
  (non-reentrant): only its inputs are saved, and backward recomputes its whole forward;
- ``selective``: the same, with torch's selective checkpointing
  (``create_selective_checkpoint_contexts``): the outputs of the compute-heavy ops
  (:data:`SAVED_OPS`: matrix products and attention) are saved in forward and reused, the rest
  (element-wise ops, norms, softmax) recomputed.

The modules that may be checkpointed are the model's **blocks** (:func:`checkpoint_blocks`):
the elements of its repeated layers (a variable name's prefix up to its first numeric part,
``transformer.h.0``, ``bert.encoder.layer.3``), or, in a model without repeated layers, its
top-level modules that hold parameters. It is what torchtitan wraps per transformer block and
what a block-level recompute saves most for; the names come from the model spec alone, so the
search can choose modes without building the model.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..spec.checks import shown
from .errors import StrategyError

__all__ = ["CHECKPOINT_MODES", "SAVED_OPS", "checkpoint_blocks", "block_of", "check_checkpoint",
           "checkpoint_from_data", "checkpoint_label"]

#: The modes a checkpointed module may have (a module not named saves its activations: ``none``).
CHECKPOINT_MODES = ("full", "selective")

#: The aten ops whose outputs selective checkpointing saves (torch op overload packets by name):
#: the matrix products and fused attention that cost the most to recompute; everything else in a
#: selectively checkpointed block is recomputed.
SAVED_OPS = ("mm", "addmm", "bmm", "baddbmm", "_scaled_dot_product_efficient_attention",
             "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu")


def block_of(variable: str) -> str:
    """The block a variable belongs to: its name up to and including its first numeric part
    (``transformer.h.0.attn.c_attn.weight`` -> ``transformer.h.0``), else its first part
    (``embed.weight`` -> ``embed``); a variable of the model's root (no dot) has none (``""``)."""
    parts = variable.split(".")
    for i, part in enumerate(parts[:-1]):
        if part.isdigit():
            return ".".join(parts[: i + 1])
    return parts[0] if len(parts) > 1 else ""


def checkpoint_blocks(variables: Iterable[str]) -> list[str]:
    """The modules of a model (given its variable names) that a strategy may checkpoint, in
    forward order (the reverse of the spec's backward order): the elements of its repeated
    layers when it has any, else its top-level modules holding parameters."""
    names = list(variables)[::-1]
    repeated = [b for b in dict.fromkeys(block_of(n) for n in names) if b and b.split(".")[-1].isdigit()]
    if repeated:
        return repeated
    return [b for b in dict.fromkeys(block_of(n) for n in names) if b]


def checkpoint_from_data(data: Any, where: str = "strategy") -> tuple[tuple[str, str], ...]:
    """The ``checkpoint`` field of a strategy's plain data (``{module: mode}``) as the sorted pairs
    a :class:`~synctune.strategy.schema.Strategy` holds; structure only (the modules are checked
    against a model by :func:`check_checkpoint`)."""
    if isinstance(data, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in data):
        data = dict(data)
    if not isinstance(data, Mapping):
        raise StrategyError(f"{where}: checkpoint: expected a mapping of module name to mode "
                            f"({' or '.join(CHECKPOINT_MODES)}), got {type(data).__name__}")
    for module, mode in data.items():
        if not (isinstance(module, str) and module and len(module) <= 1000):
            raise StrategyError(f"{where}: checkpoint: expected module names, got {shown(module)}")
        if mode not in CHECKPOINT_MODES:
            raise StrategyError(f"{where}: checkpoint: module {shown(module)}: expected a mode of "
                                f"{', '.join(CHECKPOINT_MODES)} (leave a module out for none), got {shown(mode)}")
    return tuple(sorted(data.items()))


def check_checkpoint(checkpoint: Iterable[tuple[str, str]], variables: Iterable[str], model_name: str) -> None:
    """Refuse checkpointed modules that are not blocks of the model (:func:`checkpoint_blocks`),
    naming the module and the model's blocks."""
    blocks = checkpoint_blocks(variables)
    known = set(blocks)
    for module, _mode in checkpoint:
        if module not in known:
            some = ", ".join(blocks[:6]) + (", ..." if len(blocks) > 6 else "")
            raise StrategyError(f"strategy: checkpoint: module {shown(module)} is not a block of model "
                                f"{model_name!r} (its blocks: {some or 'none'})")


def checkpoint_label(checkpoint: Iterable[tuple[str, str]], blocks: int | None = None) -> str:
    """A short description, e.g. ``checkpoint full 2/4, selective 1/4`` ('' without any)."""
    counts: dict[str, int] = {}
    for _module, mode in checkpoint:
        counts[mode] = counts.get(mode, 0) + 1
    if not counts:
        return ""
    of = f"/{blocks}" if blocks else ""
    return "checkpoint " + ", ".join(f"{m} {counts[m]}{of}" for m in CHECKPOINT_MODES if m in counts)
