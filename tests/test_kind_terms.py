"""A plan kind with cost terms of its own (tests/_own_terms_kind.py: a tree all-reduce, not priced
as another kind) is priced through what it registers: the replay and the analytic model against
the seconds worked by hand, its features where it put them; and a kind that registers no terms
and names no kind to be priced as is refused, naming the registry. It runs in a process of its
own: registering a kind changes the vocabulary saved simulators check."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def tree() -> dict:
    done = subprocess.run([sys.executable, str(HERE / "_own_terms_kind.py")], capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_replay_runs_a_kind_through_its_own_terms(tree):
    # One group of 1,004,000 bytes on two nodes (1e9 bytes/s, alpha 0.1 ms), launched when 'a' is
    # ready at 20 ms of a 31 ms backward after a 10 ms forward: up and down a tree of two, 2 steps
    # of the whole message, plus the launch (50 us); then the 3 ms step and 0.5 ms per iteration.
    # (The ring all-reduce of tests/test_replay.py sends half the message per step: 34.754 ms.)
    unit = 2 * (1e-4 + 1_004_000 / 1e9) + 5e-5
    assert tree["replay_s"] == pytest.approx(max(0.031, 0.030 + unit) + 0.003 + 5e-4, rel=1e-9)


def test_the_analytic_model_and_the_features_use_its_own_terms(tree):
    # Per shard: 2 steps of its bytes at 1e9 bytes/s, plus delta (20 us); the group pays the
    # merge group's 2(N-1) message overheads once (phi, 50 us each); compute is far below.
    assert tree["t_comp"] < 1e-3
    assert tree["analytic_s"] == pytest.approx(2 * 1_004_000 / 1e9 + 2 * 2e-5 + 2 * 5e-5, rel=1e-9)
    assert tree["ar_transfer"] == pytest.approx([2 * 4_000 / 1e9, 2 * 1_000_000 / 1e9], rel=1e-12)
    assert tree["is_ar"] == [1.0, 1.0]


def test_a_kind_without_terms_or_priced_as_is_refused_naming_the_registry(tree):
    for name, registry in (("replay", "replay synchronizer kind"), ("analytic", "feature-term synchronizer kind")):
        message = tree[f"unpriced_{name}"]
        assert message.startswith(f"synchronizer kind 'unpriced' is not in the {registry} registry (ps, allreduce, "
                                   f"allgather, sfb, shard, tree-allreduce)"), message
        assert "priced_as" in message
