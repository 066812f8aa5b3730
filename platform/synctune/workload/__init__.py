"""Workloads: what a trial needs from the user (DESIGN.md vocabulary) — how to build the model,
make a batch for one replica, build the optimizer and compute the loss, and the model spec
extracted from it. The zoo's models are workloads, and so is a user's own model described with
:func:`define` and named by an import path (:class:`ImportedWorkload`); the engine is handed
one and never imports a model itself.

Importing this package does not import torch.
"""

from .base import Workload
from .keras import KERAS_ZOO, KerasWorkload, keras_model_spec, keras_workload
from .define import ImportedWorkload, WorkloadDefinition, define, load_definition
from .zoo import ZooWorkload, resolve_workload, zoo_workload
from .source import ModelSource, model_source

__all__ = ["ImportedWorkload", "KERAS_ZOO", "KerasWorkload", "ModelSource", "Workload", "WorkloadDefinition", "ZooWorkload",
           "define", "load_definition", "keras_model_spec", "keras_workload", "model_source", "resolve_workload",
           "zoo_workload"]
