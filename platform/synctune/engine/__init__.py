"""The execution engine: run a composed strategy with torch.distributed and time it as a trial.

Importing this package does not import torch; its submodules do.
"""

from .trial import STATUSES, TrialConfig, TrialResult, run_trial_local

__all__ = ["STATUSES", "TrialConfig", "TrialResult", "run_trial_local"]
