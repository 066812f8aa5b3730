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


def _wrong_pick_rate(screen_max_rounds: int, runs: int, rng: random.Random) -> float:
    """How often a screening of candidates 5% apart (sd 6% per round and arm) picks a slower
    candidate than the fastest: 5 rounds fixed, or sequential up to ``screen_max_rounds``."""
    true_s = [1.05, 1.00, 1.25, 1.30, 1.40]  # candidates 0-2 (1 the fastest), baselines 3-4
    rule = SequentialRule(min_rounds=10, max_rounds=40, step=5, width=0.10)
    wrong = 0
    for _ in range(runs):
        done = interleave(_arms(true_s, rng, noise=0.06), 5, rule=rule, rounds=2, screen_rounds=5,
                          screen_max_rounds=screen_max_rounds, candidates=3)
        wrong += done.picked != 1
    return wrong / runs


def test_a_sequential_screening_tells_apart_the_finds_a_fixed_one_passes_over():
    """Two searched finds 5% apart, 5-round screenings: the fixed screening picks the slower one
    about one time in six (what the lab measured twice); adding rounds until the leader is told
    apart (up to 20) picks it a few times in a hundred at most. The truth is the simulated arms'
    known times. 400 screenings each; the binomial standard error near 15% is 1.8%."""
    rng = random.Random(5)
    fixed = _wrong_pick_rate(0, 400, rng)
    sequential = _wrong_pick_rate(20, 400, rng)
    assert fixed > 0.08, fixed
    assert sequential < 0.05 and sequential < fixed / 2, (sequential, fixed)


def test_a_sequential_screening_stops_timing_what_is_clearly_slower_and_stops_when_settled():
    """Arms far apart are settled at the first look (5 rounds each, no more); between two close
    candidates the screening goes on, timing only them and the baseline leader, and picks the
    faster; equal arms measured precisely end as a tie at the first look."""
    rule = SequentialRule(min_rounds=10, max_rounds=40, step=5, width=0.10)
    calls = []

    def counted(timed):
        def inner(which: int) -> float:
            calls.append(which)
            return timed(which)
        return inner

    apart = interleave(counted(_arms([1.0, 2.0, 1.5, 3.0], random.Random(1), noise=0.02)), 4, rule=rule,
                       screen_rounds=5, screen_max_rounds=20, candidates=2)
    assert [len(t) for t in apart.screen] == [5, 5, 5, 5] and (apart.picked, apart.picked_baseline) == (0, 2)
    close = interleave(_arms([1.0, 1.03, 2.0, 1.5, 3.0], random.Random(2), noise=0.03), 5, rule=rule,
                       screen_rounds=5, screen_max_rounds=20, candidates=3)
    lengths = [len(t) for t in close.screen]
    assert lengths[2] == lengths[4] == 5 and lengths[0] == lengths[1] == lengths[3] > 5, lengths
    assert (close.picked, close.picked_baseline) == (0, 3)
    tie = interleave(_arms([1.0, 1.0, 1.6], random.Random(3), noise=0.001), 3, rule=rule, screen_rounds=5,
                     screen_max_rounds=20, candidates=2)
    assert [len(t) for t in tie.screen] == [5, 5, 5]


def test_a_sequential_screening_out_of_range_is_refused_and_the_search_settings_derive_it():
    from synctune.engine.trial import check_confirm_shape
    from synctune.search.experiment import ConfirmSection
    from synctune.spec.errors import SpecError

    with pytest.raises(SpecError, match="screen_max_rounds must be 0 .* got 3 with screen_rounds 5"):
        check_confirm_shape(4, 5, 5, 2, 3)
    assert (ConfirmSection().screen_rounds, ConfirmSection().screen_max_rounds) == (5, 20)
    fixed = ConfirmSection(rounds=10, max_rounds=10)
    assert fixed.screen_max_rounds == fixed.screen_rounds == 5


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


def test_the_screening_line_says_how_long_it_ran_and_what_it_stopped_timing():
    from synctune.run.search import screening_extent

    assert screening_extent([[1.0] * 5, [1.0] * 10, [1.0] * 10], ["r1-0", "r2-0", "tuned DDP"]) == (
        " after 10 round(s); shown slower and no longer timed: r1-0 after 5")
    assert screening_extent([[1.0] * 5] * 3, ["a", "b", "c"]) == " after 5 round(s)"
    assert screening_extent(None, []) == ""
