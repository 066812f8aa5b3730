"""Strategies: the plain-data representation, validation and the hand-optimised builders."""

from .builders import BUILDERS, BuilderInfo, build_strategy, parse_builder_options
from .schema import (
    ALLREDUCE_ALGORITHMS,
    COMPRESSORS,
    SCHEMA_VERSION,
    AllGatherSynchronizer,
    AllReduceSynchronizer,
    Compressor,
    CompressorInfo,
    PSSynchronizer,
    ShardPlan,
    Strategy,
    StrategyError,
    Synchronizer,
    VariablePlan,
    load_strategy,
)
from .validate import shard_shapes, validate

__all__ = [
    "ALLREDUCE_ALGORITHMS",
    "BUILDERS",
    "COMPRESSORS",
    "SCHEMA_VERSION",
    "AllGatherSynchronizer",
    "AllReduceSynchronizer",
    "BuilderInfo",
    "Compressor",
    "CompressorInfo",
    "PSSynchronizer",
    "ShardPlan",
    "Strategy",
    "StrategyError",
    "Synchronizer",
    "VariablePlan",
    "build_strategy",
    "load_strategy",
    "parse_builder_options",
    "shard_shapes",
    "validate",
]
