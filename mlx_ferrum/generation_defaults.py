"""A model's own sampling defaults, from its ``generation_config.json``.

Checkpoints ship the sampling settings their authors recommend (Llama 3: temperature
0.6, top_p 0.9; Qwen: top_k 20, repetition_penalty 1.05 ...) in ``generation_config.json``.
``chat``, ``generate`` and ``serve`` start from them, as vLLM's ``--generation-config auto``
does (its default): a flag or a request field the user gives always wins, and a setting
the file does not give keeps the command's own default. As in vLLM, the keys read are
``temperature``, ``top_p``, ``top_k``, ``min_p``, ``repetition_penalty`` and
``max_new_tokens`` (which becomes ``max_tokens``); ``do_sample`` is not read (vLLM does
not read it either), so a file with only token ids and ``do_sample`` changes nothing.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional, Union

from .errors import ConfigurationError, SamplingParamsError

#: ``generation_config.json`` key -> :class:`~mlx_ferrum.engine.sampling.SamplingParams` field.
GENERATION_CONFIG_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}
GENERATION_CONFIG_FILE = "generation_config.json"
#: ``--generation-config`` values besides a folder: read the model's file, or read none.
GENERATION_CONFIG_CHOICES = ("auto", "none")


def generation_defaults(model_folder: Union[str, os.PathLike, None], source: Optional[str] = "auto") -> dict:
    """The sampling defaults a model's ``generation_config.json`` gives.

    Args:
        model_folder: the checkpoint folder (``model.path`` after :func:`mlx_ferrum.load`),
            or None (no defaults).
        source: ``"auto"`` (or None): the model folder's file; ``"none"``: no defaults (the
            command's own); any other string: a folder holding a ``generation_config.json``.

    Returns:
        ``{SamplingParams field: value}`` for the keys of :data:`GENERATION_CONFIG_KEYS` the
        file sets (``null`` values skipped); ``{}`` when there is no file.

    Raises:
        ConfigurationError: the file is not a JSON object, a folder given as ``source`` has
            no such file, or a value is not one :class:`SamplingParams` accepts (the
            message names the file, the key and ``--generation-config none`` as the fix).
    """
    if source == "none" or (model_folder is None and source in (None, "auto")):
        return {}
    if source in (None, "auto"):
        path = Path(model_folder) / GENERATION_CONFIG_FILE
        if not path.is_file():
            return {}
    else:
        path = Path(source) / GENERATION_CONFIG_FILE
        if not path.is_file():
            raise ConfigurationError(
                f"--generation-config {source!r}: {path} does not exist: give a folder holding a "
                f"{GENERATION_CONFIG_FILE}, 'auto' (the model's own) or 'none'"
            )
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigurationError(f"{path} cannot be read as JSON ({e}): fix the file, or pass "
                                 "--generation-config none to ignore it") from None
    if not isinstance(raw, dict):
        raise ConfigurationError(f"{path} is not a JSON object: fix the file, or pass --generation-config none "
                                 "to ignore it")
    defaults = {field: raw[key] for key, field in GENERATION_CONFIG_KEYS.items() if raw.get(key) is not None}
    from .engine.sampling import SamplingParams

    for field, value in defaults.items():
        try:
            SamplingParams(**{field: value})
        except (SamplingParamsError, TypeError, ValueError) as e:
            key = next(k for k, f in GENERATION_CONFIG_KEYS.items() if f == field)
            raise ConfigurationError(f"{path}: {key}={value!r} is not a valid default ({e}): fix the file, or "
                                     "pass --generation-config none to ignore it") from None
    return defaults


__all__ = ["GENERATION_CONFIG_CHOICES", "GENERATION_CONFIG_KEYS", "generation_defaults"]
