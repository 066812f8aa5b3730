"""Records of trials: the Parquet dataset, its releases, and MLflow logging.

Importing this package imports neither pyarrow, pandas nor mlflow; the functions that need
them do.
"""

from .paths import artifact_root, data_home, dataset_dir, default_tracking_uri, profiles_dir
from .record import RECORD_SCHEMA_VERSION, TrialRecord, arrow_schema, dedup_key, environment
from .release import pull_release, push_release, read_manifest
from .store import TrialDataset
from .tracking import MlflowLogger, sync_records

__all__ = [
    "RECORD_SCHEMA_VERSION",
    "MlflowLogger",
    "TrialDataset",
    "TrialRecord",
    "arrow_schema",
    "artifact_root",
    "data_home",
    "dataset_dir",
    "dedup_key",
    "default_tracking_uri",
    "environment",
    "profiles_dir",
    "pull_release",
    "push_release",
    "read_manifest",
    "sync_records",
]
