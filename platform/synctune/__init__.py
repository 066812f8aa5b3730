"""synctune: search the fastest synchronization strategy for data-parallel training.

The top-level package stays import-light on purpose: ``synctune --help`` and the spec,
strategy and builder layers never import torch, ray or mlflow. It holds what every layer may
use and no layer owns: the version, and the quiet import of the optional TensorFlow (the
engine's TensorFlow and Horovod runtimes and the Keras workloads need it, and neither layer
may import the other).
"""

__version__ = "0.1.0"

__all__ = ["__version__", "import_tensorflow"]


def import_tensorflow():
    """TensorFlow (and Keras 3 on it), imported without the lines its C++ runtime writes to the
    process's stderr while loading (oneDNN and absl notices, printed whatever
    ``TF_CPP_MIN_LOG_LEVEL`` says): a command's last stderr line must stay its own. An import
    that fails still raises."""
    import os
    import sys

    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("KERAS_BACKEND", "tensorflow")
    if "tensorflow" in sys.modules and "keras" in sys.modules:
        return sys.modules["tensorflow"]
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        import keras  # noqa: F401
        import tensorflow
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)
    return tensorflow
