"""The model spec of a user's workload, extracted from the workload itself: the real backward
order of one traced step (on the ``meta`` device when the model allows it, else on the CPU),
sparse embeddings detected, frozen parameters left out, and, for every sparse variable, the
number of distinct rows one replica's batch really touches (its sparse message size, measured
on the user's batch, not assumed).

Every step that can fail on a user's code is run here, before any trial: building the model,
making a batch, the forward and backward pass. A failure is one :class:`SpecError` naming the
workload and the step."""

from __future__ import annotations

from typing import Any

from ..spec.errors import SpecError
from ..spec.model import ModelSpec, extract_model_spec

__all__ = ["workload_spec", "touched_rows", "CPU_CHECK_BYTES"]

#: Models up to this size also run one real step on the CPU while their spec is extracted.
CPU_CHECK_BYTES = 2 * 1024**3


def _step(workload, batch: tuple):
    import torch

    def run(module: Any):
        loss = workload.loss(module, batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise SpecError(f"workload {workload.source!r}: the loss must be a scalar tensor, got "
                            f"{type(loss).__name__}{tuple(getattr(loss, 'shape', ()))}")
        # A real step (not a meta trace): a loss that is NaN or infinite from the first step
        # would train on garbage in every trial, measured as if it were fine.
        if loss.device.type != "meta" and not bool(torch.isfinite(loss.detach()).all()):
            raise SpecError(f"workload {workload.source!r}: the loss is {float(loss.detach())} on the first step "
                            f"(a batch of {len(batch[0]) if batch else 0} on the CPU): every trial would train "
                            f"on it; check the data and the model")
        return loss.reshape(())

    return run


def touched_rows(module: Any, workload, batch: tuple) -> dict[str, int]:
    """Distinct rows of each sparse embedding that a forward pass over ``batch`` reads."""
    import torch
    import torch.nn as nn

    counts: dict[str, int] = {}
    handles = []
    for name, mod in module.named_modules():
        if isinstance(mod, (nn.Embedding, nn.EmbeddingBag)) and mod.sparse:
            key = f"{name}.weight" if name else "weight"

            def hook(_mod, inputs, _key=key):
                counts[_key] = max(counts.get(_key, 0), int(torch.unique(inputs[0]).numel()))

            handles.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            workload.loss(module, batch)
    finally:
        for h in handles:
            h.remove()
    return counts


def workload_spec(workload) -> ModelSpec:
    """The model spec of ``workload`` (an :class:`~synctune.workload.ImportedWorkload`)."""
    import torch

    d = workload.definition
    where = f"workload {workload.source!r}"
    try:
        batch = workload.make_batch(d.batch_size, rank=0, generator=torch.Generator().manual_seed(0), device="cpu")
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's batch code
        raise SpecError(f"{where}: making a batch of {d.batch_size} failed: {type(exc).__name__}: "
                        f"{str(exc)[:300]}") from None
    spec = None
    try:
        with torch.device("meta"):
            module = d.model()
        meta_batch = tuple(t.to("meta") for t in batch)
        spec = extract_model_spec(module, name=d.name, batch_size=d.batch_size, family=d.family,
                                  run_step=_step(workload, meta_batch), step_batch=d.batch_size, strict=True)
    except Exception:  # noqa: BLE001 - not every model runs on meta: trace it on the CPU instead
        spec = None
    # One real step on the CPU as well, unless the model is too large for that: meta tensors
    # check shapes, not values (an index out of range, a NaN from the data).
    if spec is not None and spec.num_bytes > CPU_CHECK_BYTES and not spec.num_sparse:
        return spec
    try:
        cpu_module = d.model()
    except Exception as exc:  # noqa: BLE001 - the user's model code
        raise SpecError(f"{where}: building the model failed: {type(exc).__name__}: {str(exc)[:300]}") from None
    if not isinstance(cpu_module, torch.nn.Module):
        raise SpecError(f"{where}: model() returned {type(cpu_module).__name__}, not an nn.Module")
    try:
        traced = extract_model_spec(cpu_module, name=d.name, batch_size=d.batch_size, family=d.family,
                                    run_step=_step(workload, batch), step_batch=d.batch_size, strict=True)
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's forward/backward on the user's batch
        first = str(exc).splitlines()[0][:300] if str(exc) else ""
        raise SpecError(f"{where}: the forward and backward pass on a batch of {d.batch_size} failed: "
                        f"{type(exc).__name__}: {first}") from None
    cpu_module.zero_grad(set_to_none=True)
    spec = spec or traced
    if spec.num_sparse:
        rows = touched_rows(cpu_module, workload, batch)
        spec = ModelSpec(name=spec.name, variables=spec.variables, batch_size=spec.batch_size, family=spec.family,
                         flops_per_sample=spec.flops_per_sample, factor_rows=spec.factor_rows,
                         embeddings=spec.embeddings,
                         touched_rows=tuple(rows.get(v.name) if v.sparse else None for v in spec.variables))
    return spec
