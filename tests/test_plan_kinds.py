"""A plan kind added from outside the package (tests/_toy_kind.py: an all-reduce that also
counts its calls) runs through every layer that has a registry for it: validation and the JSON
form, strategy columns, the engine (2 gloo processes, against single-process training on the
concatenated batch), the memory model (against the bytes worked by hand), the replay (priced
as an all-reduce, against the iteration worked by hand in tests/test_replay.py) and the search
(the guided sampler draws it at the rate it is given; the local searches offer its choice). No
file of the package names it. It runs in a process of its own: a registered kind is in the vocabulary
saved simulators check, so the test runner's process never registers it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from synctune.engine.kinds import ENGINE_KINDS
from synctune.search.kinds import SEARCH_KINDS
from synctune.simulator.kinds import MEMORY_KINDS
from synctune.strategy.kinds import KIND_CODES, SYNCHRONIZER_KINDS, Synchronizer

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def toy() -> dict:
    done = subprocess.run([sys.executable, str(HERE / "_toy_kind.py")], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_toy_kind_validates_round_trips_and_becomes_columns(toy):
    assert toy["round_trip"] and toy["schema"] == 2  # a kind of schema 2: the strategy stays schema 2
    assert toy["stats"] == {"num_shards": 12, "num_merge_groups": 2, "num_allreduce_shards": 0}
    assert toy["columns_round_trip"] and toy["columns_groups"] == [2.0]
    assert toy["sparse_refused"] == ("variable 'item_embedding.weight': shards[0].synchronizer: counted-allreduce "
                                     "takes dense gradients only; use allreduce")
    # A compressor that does not name the kind refuses to wrap it, naming both.
    assert toy["lossy_refused"].endswith("compressor: fp16 wraps ps or allreduce or allgather only, not "
                                         "counted-allreduce")


def test_the_toy_kind_trains_exactly_in_the_engine_through_its_own_unit(toy):
    assert toy["ranks_equal"]
    # Held to the float64 training as closely as single-process float32 training is.
    assert toy["engine_excess_error"] <= 2e-6
    assert toy["calls"] == [[3, 3], [3, 3]]  # its own units ran: two groups, three steps, on each rank


def test_the_memory_model_books_the_toy_kind_as_worked_by_hand(toy):
    expected = toy["memory_expected"]
    for rank in toy["memory"]:
        assert {k: rank[k] for k in expected} == expected
        assert rank["peak_bytes"] == sum(expected.values())


def test_the_replay_prices_the_toy_kind_as_an_all_reduce_worked_by_hand(toy):
    # tests/test_replay.py::test_all_reduce_worked_by_hand: one merge group of 1,004,000 bytes
    # on two nodes, launched when 'a' is ready at 20 ms of a 31 ms backward after a 10 ms forward.
    d_both = 2 * (1e-4 + 1_004_000 / (2 * 1e9)) + 5e-5
    assert toy["replay_fallbacks"] == 0
    assert toy["replay_s"] == pytest.approx(max(0.031, 0.030 + d_both) + 0.003 + 5e-4, rel=1e-9)


def test_the_sampler_draws_the_toy_kind_from_its_registration_alone(toy):
    """The toy kind's search part (registered from tests/_toy_kind.py) is drawn by the guided
    sampler's columns at the rate given it: some of 80 draws hold it, every draw validates, is
    in canonical form, and comes back the same through objects and columns; registered without
    a rate it is never drawn and the built-in kinds' stream is this process's (the reference:
    the same sampler here, where the kind does not exist). Its local-search choice is offered
    and applied."""
    import hashlib

    from synctune.models import model_spec
    from synctune.search import GuidedSampler
    from synctune.spec import cluster_preset

    assert 10 <= toy["sampled_holding"] < 80 and toy["sampled_rows"] >= toy["sampled_holding"]
    assert toy["sampled_validated"] == 80 and toy["sampled_round_trip"] and toy["sampled_canonical"]
    plain = GuidedSampler(model_spec("cnn-small"), cluster_preset("local-2x2"), seed=0).sample_columns(80)
    assert toy["unsampled_rows"] == 0
    assert toy["unsampled_digest"] == hashlib.sha256(plain.digests().tobytes()).hexdigest()
    assert toy["choice_offered"] == 1 and toy["choice_kinds"] == ["counted-allreduce"]


def test_this_process_has_only_the_built_in_kinds():
    builtin = ("ps", "allreduce", "allgather", "sfb", "shard")
    assert tuple(SYNCHRONIZER_KINDS) == builtin and [KIND_CODES[k] for k in builtin] == [0, 1, 2, 3, 4]
    assert ENGINE_KINDS.names() == list(builtin) and MEMORY_KINDS.names() == list(builtin)
    assert sorted(SEARCH_KINDS.names()) == sorted(builtin)


def test_a_kind_registers_once_and_a_miss_lists_the_kinds():
    from synctune.spec import SpecError
    from synctune.strategy.kinds import AllReduceSynchronizer, register_synchronizer

    with pytest.raises(ValueError, match="'allreduce' is already registered"):
        register_synchronizer(AllReduceSynchronizer)
    with pytest.raises(SpecError, match="valid: ps, allreduce, allgather, sfb, shard"):
        ENGINE_KINDS.get("counted-allreduce")
    with pytest.raises(TypeError, match="dataclass subclassing Synchronizer"):
        register_synchronizer(Synchronizer)


def test_a_search_kind_registers_once_for_a_known_kind_and_owns_its_choices():
    from synctune.search.kinds import Choice, SearchKind, choice_owner, register_search_kind
    from synctune.spec import SpecError

    with pytest.raises(ValueError, match="'allreduce' is already registered"):
        register_search_kind("allreduce", SearchKind())
    with pytest.raises(SpecError, match="valid: ps, allreduce, allgather, sfb, shard"):
        register_search_kind("counted-allreduce", SearchKind())
    with pytest.raises(SpecError, match="unknown choice kind 'nope'; valid: ar, ps, pps, sfb, shard"):
        choice_owner("nope")
    with pytest.raises(ValueError, match=r"choice_kinds \['pps'\] are ps's already"):
        register_search_kind("allreduce", SearchKind(choice_kinds=("pps",), apply=lambda *args: None))
    with pytest.raises(ValueError, match="apply"):
        SearchKind(choice_kinds=("x",))
    assert choice_owner(Choice("pps").kind) is SEARCH_KINDS.get("ps")
