"""Tensor parallelism as strategy columns: Megatron's plan per block (none, pairs, pairs with
sequence parallelism), the loss-parallel head and the row-wise token embedding, held per strategy
beside the data-parallel rows; the megatron builder's strategies round-trip exactly, a plan the
columns cannot hold is refused naming its module, and the simulators' columns never price a split
strategy as its data-parallel part alone."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from synctune.models import model_spec
from synctune.search.draw import splice
from synctune.simulator import DomainContext, encode
from synctune.spec import cluster_preset
from synctune.strategy import StrategyColumns, build_strategy, validate
from synctune.strategy.builders import megatron_block_styles
from synctune.strategy.errors import StrategyError

OPTIONS = [{}, {"sequence_parallel": True}, {"embedding": "rowwise"}, {"dp": "shard"}, {"dp": "allreduce"},
           {"degree": 2, "dp": "allreduce", "sequence_parallel": True}, {"reshard": False}]


def _megatrons(spec, cluster):
    out = []
    for options in OPTIONS:
        try:
            out.append(build_strategy("megatron", spec, cluster, **options))
        except StrategyError:  # an option the model or cluster does not admit (degree 2 on 1x4 is admitted)
            continue
    return out


@pytest.mark.parametrize("model", ["bert-tiny", "transformer-small"])
@pytest.mark.parametrize("cluster", ["local-2x2", "local-1x2", "local-1x4"])
def test_the_megatron_builders_strategies_round_trip_through_columns(model, cluster):
    spec, cl = model_spec(model), cluster_preset(cluster)
    plain = build_strategy("allreduce", spec, cl)
    strategies = _megatrons(spec, cl) + [plain]
    assert len(strategies) >= 5
    cols = StrategyColumns.from_strategies(spec, cl, strategies)
    assert cols.splits_modules().tolist() == [True] * (len(strategies) - 1) + [False]
    for i, s in enumerate(strategies):
        back = cols.strategy(i)
        assert back == s and back.hash == s.hash
    # Equal strategies (dp auto is shard on local-2x2) have equal digests; the split ones differ
    # from the replicated one and from each other otherwise.
    digests = cols.digests()
    for i in range(len(strategies)):
        for j in range(len(strategies)):
            assert (digests[i] == digests[j]) == (strategies[i].hash == strategies[j].hash)
    # A piece of the columns keeps its strategies' split.
    piece = cols.take(1, len(strategies))
    assert [piece.strategy(i).hash for i in range(piece.size)] == [s.hash for s in strategies[1:]]


def test_the_loss_parallel_head_round_trips():
    pytest.importorskip("transformers")
    from _tp_workers import workload_of

    spec, cl = workload_of("hf-llama").spec(), cluster_preset("local-2x2")
    strategies = [build_strategy("megatron", spec, cl, loss_parallel=True),
                  build_strategy("megatron", spec, cl, loss_parallel=True, sequence_parallel=True, dp="allreduce"),
                  build_strategy("megatron", spec, cl, loss_parallel=True, embedding="rowwise")]
    cols = StrategyColumns.from_strategies(spec, cl, strategies)
    assert cols.tp_logits.tolist() == [True, True, True] and cols.tp_embedding.tolist() == [False, False, True]
    assert cols.tp_blocks.tolist()[1] == [2] * len(cols.blocks())
    assert [cols.strategy(i).hash for i in range(3)] == [s.hash for s in strategies]


def test_a_plan_on_some_blocks_is_a_valid_strategy_and_round_trips():
    """Columns written by hand: the first block split, the second whole (what a draw writes)."""
    spec, cl = model_spec("bert-tiny"), cluster_preset("local-1x2")
    plain = StrategyColumns.from_strategies(spec, cl, [build_strategy("allreduce", spec, cl)])
    blocks = plain.blocks()
    assert blocks == ["layers.0", "layers.1"]
    cols = dataclasses.replace(plain, tp_degree=np.array([2], np.int16), tp_blocks=np.array([[1, 0]], np.int8))
    s = cols.strategy(0)
    validate(s, spec, cl)
    split = {m for m, _style in s.tensor_parallel.styles}
    assert split and all(m.startswith("layers.0.") for m in split)
    assert split == set(megatron_block_styles(spec, 2, {"layers.0": "pairs"}))
    again = StrategyColumns.from_strategies(spec, cl, [s])
    assert again.tp_blocks.tolist() == [[1, 0]] and again.strategy(0).hash == s.hash


def test_a_plan_the_columns_cannot_hold_is_refused_naming_its_module():
    spec, cl = model_spec("bert-tiny"), cluster_preset("local-1x2")
    s = build_strategy("megatron", spec, cl, dp="allreduce")
    modules = dict(s.tensor_parallel.styles)
    del modules["layers.0.ffn.intermediate"], modules["layers.0.ffn.output"]  # attention split, MLP whole
    odd = dataclasses.replace(s, tensor_parallel={"degree": 2, "modules": modules})
    validate(odd, spec, cl)  # it runs as a trial
    with pytest.raises(StrategyError, match=r"'layers\.0\.ffn\.intermediate' is 'whole' where Megatron's plan .* "
                                            r"'colwise'.*synctune trial"):
        StrategyColumns.from_strategies(spec, cl, [odd])


def test_sequence_parallelism_on_some_blocks_only_is_refused_naming_the_block():
    spec = model_spec("bert-tiny")
    with pytest.raises(StrategyError, match=r"block 'layers\.1': plan 'pairs' beside sequence-parallel blocks"):
        megatron_block_styles(spec, 2, {"layers.0": "sequence", "layers.1": "pairs"})
    with pytest.raises(StrategyError, match="does not split"):  # an unsplit block inside the sequence's region
        megatron_block_styles(spec, 2, {"layers.0": "sequence"})
    with pytest.raises(StrategyError, match=r"block 'layers\.0': .*degree of 3"):
        megatron_block_styles(spec, 3, {"layers.0": "pairs"})


def test_columns_with_a_split_strategy_keep_it_through_a_splice():
    spec, cl = model_spec("bert-tiny"), cluster_preset("local-1x2")
    plain = build_strategy("allreduce", spec, cl)
    split = build_strategy("megatron", spec, cl, sequence_parallel=True)
    cols = StrategyColumns.from_strategies(spec, cl, [plain, plain])
    out = splice(cols, {1: StrategyColumns.from_strategies(spec, cl, [split])})
    assert [out.strategy(i).hash for i in range(2)] == [plain.hash, split.hash]
    back = splice(out, {1: StrategyColumns.from_strategies(spec, cl, [plain])})
    assert [back.strategy(i).hash for i in range(2)] == [plain.hash, plain.hash]


def test_the_simulators_columns_refuse_a_split_strategy():
    """The features price rows, the data-parallel part alone: a split strategy is refused there
    (the replay replays it whole)."""
    spec, cl = model_spec("bert-tiny"), cluster_preset("local-1x2")
    with pytest.raises(StrategyError, match="not priced as columns.*replay"):
        encode([build_strategy("megatron", spec, cl)], DomainContext(spec, cl))
