"""Which family module builds which ``model_type``.

Every family module (``llama.py``, ``qwen3_moe.py``, ``gemma3.py``, ``gpt_oss.py``,
``phi3.py``) exposes ``ModelArgs.from_dict(config)`` and ``Model(args)`` with a
``sanitize(weights)`` that maps the Hub's tensor names and layouts onto the model's
parameters. The loader looks the family up here; nothing else names the modules.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Any

import mlx.nn as nn

from ..errors import MalformedConfigError, UnsupportedArchitectureError

# model_type (config.json) -> module under mlx_ferrum.models
FAMILIES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "qwen2": "llama",
    "qwen3": "llama",
    "qwen3_moe": "qwen3_moe",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gpt_oss": "gpt_oss",
    "phi3": "phi3",
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(FAMILIES)


def family(model_type: Any) -> ModuleType:
    """The module that implements ``model_type``.

    Raises:
        UnsupportedArchitectureError: ``model_type`` is not registered (the message
            lists every supported type).
    """
    name = FAMILIES.get(model_type) if isinstance(model_type, str) else None
    if name is None:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} is not supported; supported model types: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return importlib.import_module(f"{__package__}.{name}")


def build_model(config: dict[str, Any]) -> nn.Module:
    """An uninitialized model (random weights) of the family ``config["model_type"]`` names.

    Raises:
        MalformedConfigError: ``config`` is not a dict or has no ``model_type``.
        UnsupportedArchitectureError: see :func:`family`.
    """
    if not isinstance(config, dict):
        raise MalformedConfigError("config.json must hold a JSON object")
    if "model_type" not in config:
        raise MalformedConfigError("config.json has no 'model_type'")
    module = family(config["model_type"])
    return module.Model(module.ModelArgs.from_dict(config))
