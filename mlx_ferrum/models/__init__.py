"""Model architectures (one file per family) and the checkpoint loader.

``load_model(path_or_repo_id, dtype=None) -> (model, config, folder)`` builds a
:class:`Model` from a Hugging Face checkpoint folder or hub id; see
:mod:`mlx_ferrum.models.loader`.
"""

from .llama import SUPPORTED_MODEL_TYPES, Model, ModelArgs
from .loader import load_config, load_model, load_weights, resolve_model_path

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "Model",
    "ModelArgs",
    "load_config",
    "load_model",
    "load_weights",
    "resolve_model_path",
]
