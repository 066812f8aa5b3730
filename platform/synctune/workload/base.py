"""The workload interface the engine runs: a picklable object (it travels to every worker
process and Ray actor) whose methods build what one replica needs."""

from __future__ import annotations

from typing import Any, Iterator

from ..spec.model import ModelSpec

__all__ = ["Workload"]


class Workload:
    """What a trial needs from the user. Subclasses set ``name``, ``batch_size`` (the default
    per-replica batch) and implement :meth:`build_model`, :meth:`make_batch` and :meth:`spec`;
    :meth:`loss` and :meth:`make_optimizer` have defaults.

    Instances must be picklable: the engine sends them to its worker processes.
    """

    name: str = ""
    batch_size: int = 1
    #: Where the workload comes from (an import path, ``zoo:NAME``): recorded as provenance.
    source: str = ""
    #: What the model is written in: ``torch`` (every runtime) or ``tensorflow`` (a Keras
    #: model, :class:`synctune.workload.keras.KerasWorkload`, run by the ``tensorflow`` runtime).
    framework: str = "torch"

    def build_model(self) -> Any:
        """A new ``nn.Module`` on the current default device (callers wrap the call in
        ``with torch.device(...)``); every replica builds its own, seeded alike."""
        raise NotImplementedError

    def make_batch(self, batch_size: int, *, rank: int, generator: Any, device: Any) -> tuple:
        """The batch of replica ``rank`` (``batch_size`` samples): the arguments of :meth:`loss`."""
        raise NotImplementedError

    def loss(self, model: Any, batch: tuple) -> Any:
        """The scalar loss of ``batch`` (default: the model returns it, ``model(*batch)``)."""
        return model(*batch)

    def make_optimizer(self, params: list, *, name: str = "sgd", lr: float = 0.01) -> Any:
        """The optimizer over ``params`` (the shards this rank updates); default: the trial's
        choice, ``sgd`` or ``adam`` at ``lr``."""
        import torch

        if name == "adam":
            return torch.optim.Adam(params, lr=lr)
        return torch.optim.SGD(params, lr=lr)

    def spec(self) -> ModelSpec:
        """The model spec: trainable variables in backward order (traced, not guessed)."""
        raise NotImplementedError

    def batches(self, batch_size: int, rank: int, world: int, seed: int = 0) -> Iterator[tuple]:
        """Replica ``rank``'s batches for training, on the CPU, without end (a training file's
        data): by default one batch per step from :meth:`make_batch`, drawn from (seed, step, rank)."""
        import torch

        step = 0
        while True:
            generator = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
            yield self.make_batch(batch_size, rank=rank, generator=generator, device="cpu")
            step += 1
