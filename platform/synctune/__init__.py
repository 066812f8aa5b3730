"""synctune: search the fastest synchronization strategy for data-parallel training.

The top-level package stays import-light on purpose: ``synctune --help`` and the spec,
strategy and builder layers never import torch, ray or mlflow.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
