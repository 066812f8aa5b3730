"""The model zoo (plain PyTorch; torch is imported only when a model is built)."""

from .zoo import MODELS, ZooEntry, build_model, get_model, make_batch, model_spec

__all__ = ["MODELS", "ZooEntry", "build_model", "get_model", "make_batch", "model_spec"]
