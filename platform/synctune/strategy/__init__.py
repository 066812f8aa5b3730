"""Strategies: the plain-data representation, validation and the hand-optimised builders."""

from .builders import BUILDERS, BuilderInfo, build_strategy, parse_builder_options
from .columns import KIND_CODES, StrategyColumns
from .compressors import COMPRESSORS, CompressorInfo, compressor_vocabulary, lossy_compressors
from .schema import (
    ALLREDUCE_ALGORITHMS,
    SCHEMA_VERSION,
    SYNCHRONIZER_KINDS,
    AllGatherSynchronizer,
    AllReduceSynchronizer,
    Compressor,
    PSSynchronizer,
    SFBSynchronizer,
    ShardSynchronizer,
    REDUCE_DTYPES,
    ShardPlan,
    Strategy,
    StrategyError,
    Synchronizer,
    VariablePlan,
    load_strategy,
)
from .partition import shard_rows, shard_shapes, shard_slices
from .validate import validate

__all__ = [
    "KIND_CODES",
    "StrategyColumns",
    "ALLREDUCE_ALGORITHMS",
    "BUILDERS",
    "COMPRESSORS",
    "SCHEMA_VERSION",
    "SYNCHRONIZER_KINDS",
    "AllGatherSynchronizer",
    "AllReduceSynchronizer",
    "BuilderInfo",
    "Compressor",
    "CompressorInfo",
    "PSSynchronizer",
    "SFBSynchronizer",
    "ShardSynchronizer",
    "REDUCE_DTYPES",
    "ShardPlan",
    "Strategy",
    "StrategyError",
    "Synchronizer",
    "VariablePlan",
    "build_strategy",
    "compressor_vocabulary",
    "load_strategy",
    "lossy_compressors",
    "parse_builder_options",
    "shard_shapes",
    "shard_slices",
    "shard_rows",
    "validate",
]
