"""The simulator: scores strategies without running them (AutoSync §3, AutoDist §2.4).

Importing this package imports numpy only; the learned models import torch when used.
"""

from .bound import BoundSimulator, RuntimeResidual
from .evaluate import PROTOCOLS, evaluate, kendall_tau, pairwise_accuracy, protocol_folds, split_domains, \
    top_k_recall
from .replay import CalibratedReplay, ReplayConstants, ReplaySimulator, calibrate_per_cluster, calibrate_replay, profile_key
from .residual import ResidualReplay
from .features import AnalyticConstants, DomainContext, analytic_time, batch_scale, encode, message_sizes
from .models import (
    SIMULATORS,
    AnalyticSimulator,
    Domain,
    GATSimulator,
    LinearSimulator,
    RNNSimulator,
    Simulator,
    domains_from_records,
    PRETRAINED,
    load_simulator,
    pretrained_info,
    pretrained_path,
    make_simulator,
)

__all__ = [
    "calibrate_per_cluster",
    "calibrate_replay",
    "SIMULATORS",
    "AnalyticConstants",
    "AnalyticSimulator",
    "BoundSimulator",
    "RuntimeResidual",
    "CalibratedReplay",
    "ResidualReplay",
    "Domain",
    "DomainContext",
    "GATSimulator",
    "LinearSimulator",
    "RNNSimulator",
    "ReplayConstants",
    "ReplaySimulator",
    "Simulator",
    "analytic_time",
    "batch_scale",
    "domains_from_records",
    "encode",
    "evaluate",
    "PROTOCOLS",
    "protocol_folds",
    "kendall_tau",
    "PRETRAINED",
    "load_simulator",
    "pretrained_info",
    "pretrained_path",
    "make_simulator",
    "message_sizes",
    "pairwise_accuracy",
    "profile_key",
    "split_domains",
    "top_k_recall",
]
