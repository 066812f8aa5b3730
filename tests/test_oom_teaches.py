"""Every trial teaches the memory model, an ``oom`` one first, on a library
model (a Hugging Face GPT-2 built from a config) whose distributed iterations hold memory the
single-process probe does not see (``_hidden_memory_workload``).

The rule: after a trial over the budget, the memory model's correction for that layout (the
engine's, FSDP2's) is at least the trial's under-prediction, so that strategy, and anything
the corrected model predicts as large, is never trialled again; a search whose corrected model
says nothing in its space fits stops at once with one line. So each layout costs at most one
``oom`` trial: at most 2 in all.

References: the trials' own measured peaks (the probe of each real 2-process trial), and the
budget written here."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from _searches import ROOT, search_env

pytest.importorskip("transformers")
WORKLOAD = ROOT / "tests" / "_hidden_memory_workload.py"


def _search(tmp_path, factory: str, limit_mib: float):
    exp = tmp_path / "tight.yaml"
    exp.write_text(f"name: tight\nworkload: {WORKLOAD}:{factory}\ncluster: local-1x2\nbudget: 4\n"
                   f"algorithm: random-guided\nmemory_gib: {limit_mib / 1024}\nmemory_headroom: 0\nwarmup: 1\n"
                   "iters: 2\nbaselines: [allreduce]\nddp_trials: 2\nfsdp_trials: 2\nconfirm_rounds: 2\n"
                   "confirm_iters: 2\nsimulator: analytic\n")
    home = tmp_path / "home"
    out = subprocess.run([sys.executable, "-m", "synctune", "search", str(exp)], capture_output=True, text=True,
                         env=search_env(home), cwd=ROOT, timeout=1200)
    from synctune.data import TrialDataset

    rows = TrialDataset(home / "dataset").records() if (home / "dataset").exists() else []
    return out, rows, home


def test_oom_trials_teach_the_memory_model_and_the_search_finds_what_fits(tmp_path):
    """1 MiB hidden, a budget of 2.3 MiB: replicated training is predicted to fit (1.8 MiB) and
    measures about 2.8; at most 2 trials are ``oom`` (one per layout), then the search trials
    only what fits (checkpointed blocks), and recommends a strategy whose measured peak is within
    the budget. No Optuna warning about NaN values."""
    out, rows, home = _search(tmp_path, "hides_some", 2.3)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "The value nan is not acceptable" not in out.stderr
    limit = int(2.3 * 2**20)
    trials = [r for r in rows if not r.trial_id.startswith("confirm-")]
    ooms = [r for r in trials if r.status == "oom"]
    assert 1 <= len(ooms) <= 2, [(r.trial_id, r.status) for r in trials]
    ok = [r for r in trials if r.status == "ok"]
    assert ok, [(r.trial_id, r.status, r.error) for r in trials]
    for r in ok:
        peaks = [m["peak_bytes"] for m in r.memory_breakdown or [] if m.get("peak_bytes") is not None]
        assert peaks and max(peaks) <= limit, (r.trial_id, peaks, limit, [(t.trial_id, t.status, t.runtime, [m.get("peak_bytes") for m in t.memory_breakdown or []]) for t in trials])
    # Trials after the last oom one are all within the budget (the model learned before proposing).
    last_oom = max(i for i, r in enumerate(trials) if r.status == "oom")
    assert all(r.status == "ok" for r in trials[last_oom + 1:]), [(r.trial_id, r.status) for r in trials]
    result = json.loads(next((home / "searches").glob("*-best-result.json")).read_text())
    assert max(result["memory"]["measured_peak_bytes"]) <= limit


def test_a_budget_the_trials_show_nothing_fits_stops_with_one_line(tmp_path):
    """64 MiB hidden: the first trials over the budget show that nothing fits; the search stops
    after at most 2 of them, exit 2, with one line naming the smallest measured peak, the budget
    and the levers; every trial is recorded."""
    out, rows, _home = _search(tmp_path, "hides_much", 2.3)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    assert "nothing in the search's space fits" in last and "smallest peak a trial measured" in last, last
    assert "checkpointing" in last and "sharding" in last and "smaller batch" in last, last
    assert "Traceback" not in out.stderr
    ooms = [r for r in rows if r.status == "oom"]
    assert 1 <= len(ooms) <= 2 and len(ooms) == len(rows), [(r.trial_id, r.status) for r in rows]


def test_the_rule_an_oom_trial_is_predicted_at_least_at_its_measured_peak():
    """The rule on the memory model alone: after an ``oom`` trial, that strategy is predicted at
    least at the peak it measured (refused from then on), in its layout only; the median
    under-prediction of ok trials is added too; and once even the most frugal strategies are
    predicted over the budget, ``nothing_fits`` says so in one line, unless a trial held
    within it."""
    from synctune.models import model_spec
    from synctune.simulator.memory import GIB, ActivationFigures, MemoryBudget
    from synctune.spec import cluster_preset
    from synctune.strategy import build_strategy

    model, cluster = model_spec("bert-tiny"), cluster_preset("local-1x2")
    s = build_strategy("allreduce", model, cluster)
    probe = ActivationFigures({model.batch_size: [8 << 20]})
    plain = MemoryBudget(model, cluster, gib=1.0, headroom=0.0, optimizer="adam", probe=probe)
    peak = max(plain.peaks(s))
    budget = MemoryBudget(model, cluster, gib=1.25 * peak / GIB, headroom=0.0, optimizer="adam", probe=probe)
    assert budget.fits(s) and budget.nothing_fits() is None
    measured = int(1.3 * peak)
    budget.observe(s, False, [{"peak_bytes": measured}, {"peak_bytes": measured - 1000}], oom=True)
    assert max(budget.peaks(s)) >= measured and not budget.fits(s)
    assert budget.corrections[True] == 0  # FSDP2's layout learns from its own trials
    sharded = build_strategy("shard", model, cluster, depth=1, reshard=True)
    assert max(budget.peaks(sharded, fsdp=True)) == max(plain.peaks(sharded, fsdp=True))
    # Larger ooms in both layouts: now nothing the model knows fits, sharded or checkpointed.
    assert budget.nothing_fits() is None
    budget.observe(s, False, [{"peak_bytes": 3 * peak}] * 2, oom=True)
    budget.observe(sharded, True, [{"peak_bytes": 3 * peak}] * 2, oom=True)
    line = budget.nothing_fits()
    assert line is not None and "\n" not in line and "smallest peak a trial measured" in line, line
    # A trial that held within the budget says something fits, whatever the corrections say.
    budget.observe(sharded, True, [{"peak_bytes": int(0.5 * peak)}] * 2, oom=False)
    assert budget.nothing_fits() is None
