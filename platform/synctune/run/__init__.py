"""Orchestration: the layer that glues the others (DESIGN.md "run").

The search driver (Algorithm 1 through Ray Tune, trials on Ray worker groups), recording
each trial (MLflow run, then dataset row: "record before tell"), dataset collection and lab
calibration, and the modelled pick (what a model-only tool would deploy, untested, as a
confirmation arm). Lower layers never import this one.
"""

from .collect import collect_domain
from .lab import calibrate_lab, calibrated_cluster
from .modelled import MODELLED_LABEL, ModelledPick, candidate_pool, context_pick, modelled_arm, modelled_pick
from .profiles import (ensure_profile, file_release_profiles, profile_path, profiles_for_release, profiles_in_folders,
                       save_profile)
from .recording import record_result, record_trial
from .prepare import SearchContext, prepare_search, search_id_of
from .search import run_prepared, run_search
from .summary import Recommendation, SearchSummary

__all__ = ["calibrate_lab", "calibrated_cluster", "collect_domain", "ensure_profile", "file_release_profiles",
           "profiles_for_release", "profiles_in_folders", "profile_path", "record_result", "record_trial", "run_search",
           "run_prepared", "prepare_search", "SearchContext", "save_profile", "search_id_of", "SearchSummary",
           "Recommendation", "MODELLED_LABEL", "ModelledPick", "candidate_pool", "context_pick", "modelled_arm",
           "modelled_pick"]
