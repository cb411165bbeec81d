"""Model architectures (one file per family, looked up by ``model_type`` in
:mod:`mlx_ferrum.models.registry`) and the checkpoint loader.

``load_model(path_or_repo_id, dtype=None) -> (model, config, folder)`` builds a
:class:`Model` from a Hugging Face checkpoint folder or hub id; see
:mod:`mlx_ferrum.models.loader`.
"""

from .llama import Model, ModelArgs
from .loader import load_config, load_model, load_weights, resolve_model_path
from .registry import FAMILIES, SUPPORTED_MODEL_TYPES, build_model, family

__all__ = [
    "FAMILIES",
    "SUPPORTED_MODEL_TYPES",
    "build_model",
    "family",
    "Model",
    "ModelArgs",
    "load_config",
    "load_model",
    "load_weights",
    "resolve_model_path",
]
