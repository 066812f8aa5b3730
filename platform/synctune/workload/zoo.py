"""The model zoo as workloads: model, synthetic batches and spec of a zoo entry."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

from ..models.zoo import MODELS, make_batch, model_spec
from ..spec.errors import SpecError
from ..spec.model import ModelSpec
from .base import Workload
from .extract import CPU_CHECK_BYTES, touched_rows

__all__ = ["ZooWorkload", "zoo_workload", "resolve_workload"]


@dataclass(frozen=True)
class ZooWorkload(Workload):
    """Zoo model ``model``: its ``forward(*batch)`` returns the mean loss; batches are synthetic,
    of the model's shapes (trials time synchronization and compute, not input pipelines)."""

    model: str

    def __post_init__(self) -> None:
        MODELS.get(self.model)  # unknown names fail here, listing the zoo

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.model

    @property
    def batch_size(self) -> int:  # type: ignore[override]
        return MODELS.get(self.model).batch_size

    @property
    def source(self) -> str:  # type: ignore[override]
        return f"zoo:{self.model}"

    def build_model(self) -> Any:
        return MODELS.get(self.model).build()

    def make_batch(self, batch_size: int, *, rank: int, generator: Any, device: Any) -> tuple:
        return make_batch(self.model, batch_size, generator=generator, device=device)

    def spec(self) -> ModelSpec:
        return _zoo_spec(self.model)


@functools.lru_cache(maxsize=None)
def _zoo_spec(name: str) -> ModelSpec:
    """The zoo model's spec with, for its sparse embeddings, the distinct rows one batch of the
    model's size reads, measured on a real batch (the simulator's sparse message sizes; counted
    once per process). Models too large to build on the CPU keep the simulator's estimate."""
    spec = model_spec(name)
    if not spec.num_sparse or spec.num_bytes > CPU_CHECK_BYTES:
        return spec
    import torch

    workload = ZooWorkload(name)
    module = workload.build_model()
    batch = workload.make_batch(spec.batch_size, rank=0, generator=torch.Generator().manual_seed(0), device="cpu")
    rows = touched_rows(module, workload, batch)
    return dataclasses.replace(spec, touched_rows=tuple(rows.get(v.name) if v.sparse else None
                                                        for v in spec.variables))


def zoo_workload(name: str) -> ZooWorkload:
    """The workload of zoo model ``name`` (the error lists the zoo)."""
    return ZooWorkload(name)


def resolve_workload(name: str) -> Workload:
    """A workload: a zoo model by name, or a user's factory by import path
    (``package.module:factory``, ``path/to/file.py:factory``)."""
    if isinstance(name, str) and name in MODELS:
        return ZooWorkload(name)
    if isinstance(name, str) and name.startswith("keras-"):
        from .keras import keras_workload

        return keras_workload(name)
    if isinstance(name, str) and ":" in name:
        from .define import ImportedWorkload

        return ImportedWorkload(name)
    raise SpecError(f"unknown model {str(name)[:60]!r}: not in the zoo ({', '.join(MODELS)}) nor a workload "
                    f"import path (package.module:factory or file.py:factory)")
