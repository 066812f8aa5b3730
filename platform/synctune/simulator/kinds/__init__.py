"""The simulators' part of each synchronizer kind: one module per kind, one registry per concern.

Each built-in kind (:data:`synctune.strategy.kinds.SYNCHRONIZERS`) has a module here holding all
the simulator layer knows of it: what the memory model books for its units
(:data:`MEMORY_KINDS`), how the analytic model and the features price its rows (AutoSync §3.1,
:data:`FEATURE_KINDS`) and how the replay runs its units (dPRO §4.3, :data:`REPLAY_KINDS`). The
memory model, the features, the replay and the learned models hand each kind its rows (or units)
and never ask which kind a row is (:mod:`.registry` says what an entry is handed). A kind defined
elsewhere registers its entries with :func:`register_memory_kind`, :func:`register_feature_kind`
and :func:`register_replay_kind`, or is priced as a built-in kind
(:attr:`~synctune.strategy.kinds.Synchronizer.priced_as`) and registers its memory tally only.

Tensor parallelism, a plan beside the synchronizers rather than one of them, has its replay here
too (:mod:`.tensor_parallel`): the split a device computes, its TP collectives, and the
data-parallel strategy over the TP groups the kinds above then replay.
"""

# Each module registers its kind's entries, in the synchronizer registry's order of the kinds.
from . import ps  # noqa: F401  isort: skip
from . import allreduce  # noqa: F401  isort: skip
from . import allgather  # noqa: F401  isort: skip
from . import sfb  # noqa: F401  isort: skip
from . import shard  # noqa: F401  isort: skip
from .registry import (FEATURE_KINDS, MEMORY_KINDS, REPLAY_KINDS, AnalyticTerms, FeatureBlock, FeatureKind,
                       FeatureTerms, MemoryContext, MemoryKind, ReplayBatch, ReplayKind, Tally, by_code, index_bytes,
                       priced, register_feature_kind, register_memory_kind, register_replay_kind)

__all__ = ["MemoryContext", "MemoryKind", "MEMORY_KINDS", "Tally", "register_memory_kind", "AnalyticTerms",
           "FeatureTerms", "FeatureBlock", "FeatureKind", "FEATURE_KINDS", "register_feature_kind", "ReplayBatch",
           "ReplayKind", "REPLAY_KINDS", "register_replay_kind", "priced", "by_code", "index_bytes"]
