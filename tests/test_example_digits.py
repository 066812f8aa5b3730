"""The example of your own model, shortened: search, apply, train to the target accuracy with
plain DDP and with the applied strategy; both reach it and end with the same parameters."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_digits_example_reaches_its_target_both_ways(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "platform"))
    env.pop("RAY_ADDRESS", None)
    figures = tmp_path / "figures.json"
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "digits" / "train_digits.py"), "--budget", "5",
                           "--target", "0.9", "--max-epochs", "15", "--home", str(tmp_path / "home"), "--json",
                           str(figures)], env=env, capture_output=True, text=True, timeout=900,
                          start_new_session=True)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(figures.read_text())
    assert result["ddp_curve"][-1][2] >= 0.9 and result["best_curve"][-1][2] >= 0.9, result
    if result["lossless"]:  # the same training, either way (a lossy DDP hook may have won instead)
        assert result["max_param_difference"] < 1e-4, result
    assert "reached 90%: DDP yes" in done.stdout and "best strategy yes" in done.stdout
