"""The confirmation's statistics and schedule (DESIGN.md "confirmed speed-up"): baselines
screened like the candidates, and rounds added until the interval decides, at a stated error
rate. Arms here are simulated times (lognormal noise, known true ratios), so the rule's error
rate and coverage are checked against what is true, not against the code's own output."""

from __future__ import annotations

import math
import random

import pytest

from synctune.engine.trial import interleave, screen_picks
from synctune.stats import SequentialRule, paired_ratio


def _simulate(rule: SequentialRule, true_ratio: float, sd: float, rng: random.Random) -> tuple[str, object]:
    """One confirmation of a candidate ``true_ratio`` times faster than its baseline, each
    round's log ratio normal with ``sd``: (why it stopped, the interval it reported)."""
    base, cand = [], []
    while True:
        b = math.exp(rng.gauss(0.0, sd / math.sqrt(2)))
        c = math.exp(rng.gauss(-math.log(true_ratio), sd / math.sqrt(2)))
        base.append(b)
        cand.append(c)
        stopped = rule.stop_reason(base, cand)
        if stopped:
            return stopped, rule.interval(base, cand)


class _NaiveRule(SequentialRule):
    """The same looks, each at a plain 95%: what the rule would be without its correction."""

    @property
    def confidence(self) -> float:
        return 0.95


def test_sequential_rule_keeps_its_error_rate_where_naive_looks_do_not():
    """Arms that do not differ: the rule's "faster"/"slower" verdicts come at most alpha (5%)
    of the time over its 7 looks, where looking 7 times at a plain 95% interval errs well
    above 5%. 3,000 simulated confirmations each; the binomial standard error at 5% is 0.4%."""
    rule = SequentialRule(min_rounds=10, max_rounds=40, step=5, width=0.0)  # width 0: only verdicts stop early
    assert rule.looks == (10, 15, 20, 25, 30, 35, 40)
    rng = random.Random(7)
    runs = 3000
    ours = sum(_simulate(rule, 1.0, 0.15, rng)[1].verdict != "no difference" for _ in range(runs)) / runs
    naive_rule = _NaiveRule(min_rounds=10, max_rounds=40, step=5, width=0.0)
    naive = sum(_simulate(naive_rule, 1.0, 0.15, rng)[1].verdict != "no difference" for _ in range(runs)) / runs
    assert ours <= 0.05, ours
    assert naive > 0.08, naive  # the correction is needed: without it the error rate is well above 5%


def test_sequential_interval_covers_the_true_ratio_whenever_it_stops():
    """A candidate truly 1.25x faster, noisy rounds (sd 0.3 of the log ratio, bursty as on
    CPU-quota presets), stopping on verdict or width: the reported interval holds the true
    ratio at least 95% of the time (minus the simulation's error), and the rounds used vary."""
    rule = SequentialRule(min_rounds=8, max_rounds=40, step=4, width=0.10)
    rng = random.Random(11)
    outs = [_simulate(rule, 1.25, 0.3, rng) for _ in range(2000)]
    covered = sum(r.low <= 1.25 <= r.high for _s, r in outs) / len(outs)
    assert covered >= 0.94, covered
    assert {r.rounds for _s, r in outs} > {8}  # some confirmations needed more rounds than the first look


def test_sequential_rule_stops_at_a_clear_verdict_and_goes_on_when_unclear():
    rule = SequentialRule(min_rounds=8, max_rounds=24, step=4, width=0.02)
    clear_base, clear_cand = [1.0 + 0.01 * (i % 3) for i in range(8)], [0.5] * 8
    assert rule.stop_reason(clear_base[:7], clear_cand[:7]) is None  # not a look yet
    assert rule.stop_reason(clear_base, clear_cand) == "verdict"
    noisy_base = [1.0, 1.6, 0.7, 1.3, 0.9, 1.5, 0.8, 1.2]
    noisy_cand = [1.1, 1.0, 1.2, 0.9, 1.4, 1.0, 1.1, 1.0]
    assert rule.stop_reason(noisy_base, noisy_cand) is None  # wide and undecided: more rounds
    assert rule.stop_reason(noisy_base * 3, noisy_cand * 3) == "cap"
    tie = [1.0, 1.001, 0.999, 1.0, 1.0005, 0.9995, 1.0, 1.0]
    assert rule.stop_reason(tie, [1.0] * 8) == "narrow"
    # The fixed design: one look, a plain 95% interval.
    fixed = SequentialRule.fixed(6)
    assert fixed.looks == (6,) and fixed.confidence == 0.95
    assert fixed.interval(noisy_base[:6], noisy_cand[:6]) == paired_ratio(noisy_base[:6], noisy_cand[:6])
    with pytest.raises(ValueError):
        SequentialRule(min_rounds=10, max_rounds=5)


def _arms(true_s: list[float], rng: random.Random, noise: float = 0.05):
    """``timed(arm)`` for arms whose true times are ``true_s``, with lognormal noise and a
    machine that drifts slower round by round (every arm alike)."""
    calls = [0]

    def timed(which: int) -> float:
        calls[0] += 1
        return true_s[which] * (1 + calls[0] / 500) * math.exp(rng.gauss(0, noise))

    return timed


def test_screening_picks_the_fastest_baseline_not_the_last_one():
    """Candidates 0-1, baselines 2-4; baseline 3 is the fastest (an unlucky single trial had put
    it behind): the screening must pick it, and the confirmation then measures the candidate
    against it (a ratio near 1.25/1.1), not against the slow baseline placed last (near 1.6)."""
    true_s = [0.80, 0.95, 1.10, 0.80 * 1.25, 1.28]  # candidate 0 is 1.25x faster than baseline 3
    rng = random.Random(3)
    rule = SequentialRule(min_rounds=10, max_rounds=40, step=5, width=0.05)
    done = interleave(_arms(true_s, rng), 5, rule=rule, screen_rounds=6, candidates=2)
    assert (done.picked, done.picked_baseline) == (0, 3), done
    ratio = rule.interval(done.medians[1], done.medians[0])
    assert ratio.low <= true_s[3] / true_s[0] <= ratio.high, ratio
    assert ratio.high < true_s[4] / true_s[0]
    assert [len(s) for s in done.screen] == [6] * 5
    assert done.stopped in ("verdict", "narrow", "cap")


def test_screen_picks_are_insensitive_to_a_slow_round():
    """One round where the whole machine ran 3x slower changes no pick: each arm is scored
    relative to its round's mean over every arm."""
    screen = [[1.0, 3.0, 1.0], [1.2, 3.6, 1.2], [1.1, 3.3, 1.1], [0.9, 2.7, 0.9]]
    assert screen_picks(screen, 2) == (0, 3)


def test_interleave_without_screening_compares_the_first_and_last_arms_for_exactly_the_rounds_asked():
    order = []

    def timed(which: int) -> float:
        order.append(which)
        return 1.0 + 0.01 * len(order)

    done = interleave(timed, 2, rounds=4)
    assert order == [0, 1, 1, 0, 0, 1, 1, 0] and done.stopped == "cap" and len(done.medians[0]) == 4
    with pytest.raises(ValueError, match="no baseline"):
        interleave(timed, 3, rounds=2, screen_rounds=2, candidates=3)


def test_a_search_with_nothing_to_confirm_says_so_and_not_that_its_confirmation_failed():
    """A search whose budget went to the builders has no searched arm: its recommendation (the
    best baseline) says nothing was confirmed; one whose confirmation broke says it did not finish."""
    from synctune.data.confirmation import NOTHING_TO_CONFIRM, Confirmation
    from synctune.run.summary import SearchSummary, recommend
    from synctune.spec import cluster_preset
    from synctune.strategy import build_strategy
    from synctune.workload.zoo import model_spec

    spec = model_spec("cnn-small")
    skeleton = build_strategy("allreduce", spec, cluster_preset("local-2x2"))

    def why(confirmation):
        summary = SearchSummary(search_id="s", trials=1, failed=0, best_mean_s=0.02, best_origin="allreduce",
                                best_strategy=skeleton, best_baseline_s=0.02, speedup_over_best_baseline=1.0,
                                hit_rate=None, trials_to_1_1x=None, trials_to_1_2x=None, best_builder_baseline_s=0.02,
                                best_baseline_strategy=skeleton, best_baseline_origin="allreduce",
                                confirmed=confirmation)
        chosen = recommend(summary, skeleton)
        assert chosen.kind == "baseline" and chosen.strategy == skeleton
        return chosen.why

    nothing = Confirmation.failed(f"{NOTHING_TO_CONFIRM}: no searched strategy and baseline both finished")
    assert nothing.nothing_to_confirm
    assert why(nothing).startswith("nothing was confirmed (nothing to confirm: no searched strategy")
    broken = Confirmation.failed("a worker died: rank 1 exited with -9")
    assert not broken.nothing_to_confirm
    assert why(broken) == "the confirmation did not finish (a worker died: rank 1 exited with -9)"
