"""Checkpoint loader: a Hugging Face folder or hub id -> a ready MLX model.

The folder layout is the one ``transformers``' ``save_pretrained`` writes:
``config.json``, and ``model.safetensors`` or ``model-0000i-of-0000n.safetensors``
shards listed by ``model.safetensors.index.json``. MLX-quantized checkpoints
(written by mlx-lm's ``convert``, in any of MLX's modes: affine, mxfp4, mxfp8,
nvfp4) add ``config["quantization"] = {"group_size", "bits", [mode], [per-module
entries]}`` and, for every quantized module ``p``, the tensors ``p.weight`` (packed
uint32), ``p.scales`` and, for affine only, ``p.biases``; gpt-oss's MXFP4 release
(``quantization_config.quant_method: "mxfp4"``) loads too. See
:mod:`mlx_ferrum.models.quantization`.

Reference: the checkpoint format of Hugging Face ``transformers``
(``PreTrainedModel.save_pretrained``) and the quantized format of mlx-lm
(``mlx_lm/utils.py``: ``load_model``, ``quantize_model``). The code here is
written from those formats, not copied.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..errors import (
    ConfigNotFoundError,
    ConfigurationError,
    MalformedConfigError,
    MissingShardError,
    MissingWeightError,
    ModelLoadError,
    UnsupportedArchitectureError,
    VocabularyMismatchError,
    WeightShapeError,
)
from .config_validation import validate_weights
from .quantization import (
    allowed_integer_dtypes,
    check_quantized_dtypes,
    quantization_spec,
    quantize_modules,
)
from .registry import SUPPORTED_MODEL_TYPES, family

CONFIG_FILE = "config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Only what loading needs: configs and tokenizer json, the HF-named weight files
# (never Mistral's duplicate ``consolidated.safetensors``), chat templates, and
# the SentencePiece / tiktoken files some tokenizers ship instead of tokenizer.json.
HUB_ALLOW_PATTERNS = (
    "*.json",
    "model*.safetensors",
    "tokenizer.model",
    "*.tiktoken",
    "*.jinja",
)

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def _looks_like_local_path(name: str) -> bool:
    """True when ``name`` cannot be a hub repo id (``name`` or ``owner/name``)."""
    return (
        os.path.isabs(name)
        or name.startswith((".", "~"))
        or "\\" in name
        or name.count("/") > 1
    )


def resolve_model_path(path_or_repo_id: Union[str, os.PathLike], revision: Optional[str] = None) -> Path:
    """Return the local folder of a checkpoint, downloading it from the hub if needed.

    Args:
        path_or_repo_id: a local checkpoint folder, or a Hugging Face hub repo id
            (``"Qwen/Qwen2.5-0.5B-Instruct"``).
        revision: hub branch, tag or commit; ignored for a local folder.

    Returns:
        The folder holding ``config.json`` and the weights. An existing local folder
        is returned as given and the network is never touched. Anything else is a
        hub id fetched with ``huggingface_hub.snapshot_download`` (with its progress
        bar; it honours ``HF_HUB_OFFLINE`` and the local cache), restricted to
        :data:`HUB_ALLOW_PATTERNS`.

    Raises:
        ModelLoadError: the path exists but is not a folder; the name looks like a
            local path (absolute, ``./``, ``~``, more than one ``/``) but no such
            folder exists; or the hub download failed (unknown repo, no network,
            offline mode without a cached copy). The message names the repo id.
    """
    name = os.fspath(path_or_repo_id)
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        if name.endswith(".gguf"):
            raise ModelLoadError(
                f"{name!r} is a GGUF file, which loads on one process (mf.load / --model) but not in a "
                "pipeline-parallel run: convert it to an MLX folder for that"
            )
        raise ModelLoadError(
            f"{name!r} is a file but not a .gguf model; pass the checkpoint folder that holds config.json, "
            "or a .gguf file"
        )
    if _looks_like_local_path(name):
        raise ModelLoadError(
            f"no checkpoint folder at {name!r} (and it is not a hub repo id of the form 'owner/name')"
        )
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=name, revision=revision, allow_patterns=list(HUB_ALLOW_PATTERNS)))
    except Exception as exc:  # hub errors have many types (HTTP, offline, validation, OS)
        raise ModelLoadError(hub_error_message(name, exc)) from exc


def hub_error_message(repo_id: str, exc: Exception) -> str:
    """One line for a failed hub download of ``repo_id``: what went wrong, in words, and
    the fix (``hf download``, the ``hf`` command that ships with huggingface_hub, or a
    local folder), instead of huggingface_hub's multi-line message about its internals."""
    from huggingface_hub import errors as hub_errors

    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    where = f"{repo_id!r} is not a local folder, so it was looked up on the Hugging Face hub"
    if isinstance(exc, hub_errors.LocalEntryNotFoundError):
        reason = (
            "HF_HUB_OFFLINE is set and it is not in the local cache" if offline
            else "the hub cannot be reached (no network) and it is not in the local cache"
        )
        return (f"{where}: {reason}; download it once with `hf download {repo_id}` (online), "
                "or pass the path of a local checkpoint folder")
    if isinstance(exc, hub_errors.GatedRepoError):
        return (f"{where}: it is gated; accept its terms on huggingface.co, run `hf auth login`, then "
                f"`hf download {repo_id}`")
    if isinstance(exc, hub_errors.RepositoryNotFoundError):
        return (f"{where}: no such repo (or it is private); check the id, or run `hf auth login` for a "
                "private repo, or pass the path of a local checkpoint folder")
    if isinstance(exc, hub_errors.RevisionNotFoundError):
        return f"{where}: it has no such revision; check the branch, tag or commit"
    if isinstance(exc, hub_errors.HFValidationError):
        return (f"{where}: it is not a valid repo id either ('owner/name'); pass the path of a local "
                "checkpoint folder or a hub repo id")
    detail = " ".join(str(exc).split())  # one line: hub messages span several
    if len(detail) > 200:
        detail = detail[:200] + "..."
    return (f"{where}: the download failed ({type(exc).__name__}: {detail}); check the repo id and your "
            f"network, try `hf download {repo_id}`, or pass the path of a local checkpoint folder")


def load_config(path: Union[str, os.PathLike]) -> dict:
    """Read ``config.json`` from a checkpoint folder.

    Args:
        path: the checkpoint folder.

    Returns:
        The parsed json object (a dict), unchanged.

    Raises:
        ConfigNotFoundError: ``{path}/config.json`` does not exist (message names the path).
        MalformedConfigError: the file is not valid json, or not a json object.
    """
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise ConfigNotFoundError(
            f"{file} not found: a checkpoint folder needs a config.json (for a GGUF model, pass the .gguf "
            "file, or name it with --gguf-file / gguf_file=)"
        )
    return _read_json(file)


def _read_json(file: Path) -> dict:
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MalformedConfigError(f"{file} is not valid json: {exc}") from exc
    if not isinstance(data, dict):
        raise MalformedConfigError(f"{file} must hold a json object, found {type(data).__name__}")
    return data


def _load_safetensors(file: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(file), format="safetensors")
    except Exception as exc:  # mlx raises RuntimeError/ValueError on a corrupt header
        raise ModelLoadError(f"cannot read {file}: {exc}") from exc


def load_weights(path: Union[str, os.PathLike], wanted: Optional[Callable[[str], bool]] = None) -> dict[str, mx.array]:
    """Read every tensor of a checkpoint folder, in the dtype it is stored in.

    Args:
        path: the checkpoint folder.
        wanted: a predicate on tensor names (a pipeline stage's layers): only the
            tensors it accepts are returned, and with an index file only the shards
            holding one of them are opened.

    Returns:
        ``{name: array}`` with the checkpoint's names and dtypes (bf16 stays bf16;
        packed quantized weights are uint32). When ``model.safetensors.index.json``
        exists it decides which shards are read; else ``model.safetensors``.

    Raises:
        MissingShardError: a shard named by the index is absent (message names the
            shard), or the folder has neither weights file.
        MissingWeightError: a tensor the index maps to a shard is not in that shard.
        MalformedConfigError: the index is not valid json or lacks ``weight_map``.
        ModelLoadError: a safetensors file cannot be parsed.
    """
    folder = Path(path)
    index_file = folder / INDEX_FILE
    if index_file.is_file():
        weight_map = _read_json(index_file).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise MalformedConfigError(f"{index_file} has no 'weight_map' object")
        if wanted is not None:
            weight_map = {k: shard for k, shard in weight_map.items() if wanted(k)}
        shards = sorted(set(weight_map.values()))
        for shard in shards:
            if not (folder / shard).is_file():
                raise MissingShardError(
                    f"shard {shard!r} listed in {index_file} is missing from {folder}; "
                    "re-download the checkpoint"
                )
        weights: dict[str, mx.array] = {}
        for shard in shards:
            weights.update(_load_safetensors(folder / shard))
        if wanted is not None:
            weights = {k: v for k, v in weights.items() if wanted(k)}
        absent = sorted(k for k, shard in weight_map.items() if k not in weights)
        if absent:
            raise MissingWeightError(
                f"{len(absent)} tensors listed in {index_file} are not in their shards: {_preview(absent)}"
            )
        return weights
    single = folder / SINGLE_WEIGHTS_FILE
    if single.is_file():
        weights = _load_safetensors(single)  # lazy: unwanted tensors are never read
        return weights if wanted is None else {k: v for k, v in weights.items() if wanted(k)}
    found = sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []
    hint = ""
    if any(n.endswith(".bin") or n.endswith(".pt") or n.endswith(".pth") for n in found):
        hint = " (PyTorch .bin/.pt weights are not read: convert them to safetensors)"
    raise MissingShardError(
        f"no weights in {folder}: expected {SINGLE_WEIGHTS_FILE} or {INDEX_FILE}{hint}; found {found}"
    )


def _preview(names: list[str], n: int = 8) -> str:
    more = f", ... ({len(names) - n} more)" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def check_weights(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Check that ``weights`` holds exactly the model's parameters, with their shapes.

    Args:
        model: the (possibly quantized) model, before its weights are loaded.
        weights: ``{name: array}`` after ``model.sanitize``.

    Raises:
        MissingWeightError: parameters absent from the checkpoint, or tensors the
            model has no parameter for (both lists are named).
        WeightShapeError: a tensor's shape differs from the parameter's (names the
            tensor, the expected and the found shape).
    """
    expected = dict(tree_flatten(model.parameters()))
    missing = sorted(set(expected) - set(weights))
    unexpected = sorted(set(weights) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {_preview(missing)}")
        if unexpected:
            parts.append(f"not parameters of the model: {_preview(unexpected)}")
        raise MissingWeightError(
            "checkpoint tensors do not match the config (" + "; ".join(parts) + ")"
        )
    for name, param in expected.items():
        found = weights[name]
        if tuple(found.shape) != tuple(param.shape):
            raise WeightShapeError(
                f"tensor {name!r} has shape {tuple(found.shape)}, but the config implies "
                f"{tuple(param.shape)}: config.json and the weights disagree"
            )


def _resolve_dtype(dtype: Any) -> Optional[mx.Dtype]:
    if dtype is None:
        return None
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ConfigurationError(f"dtype={dtype!r} is not supported: use one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    if isinstance(dtype, mx.Dtype) and mx.issubdtype(dtype, mx.floating):
        return dtype
    raise ConfigurationError(f"dtype={dtype!r} is not a floating type: use mx.float16, mx.bfloat16 or mx.float32")


def load_model(
    path_or_repo_id: Union[str, os.PathLike], dtype: Any = None, revision: Optional[str] = None,
    shard: Optional[Callable[[nn.Module], Any]] = None,
    stage: Any = None,
    gguf_file: Optional[str] = None,
) -> tuple[nn.Module, dict, Path]:
    """Load a checkpoint folder or hub id into an evaluated model of its family
    (see :mod:`mlx_ferrum.models.registry`).

    Args:
        path_or_repo_id: local folder or hub repo id (see :func:`resolve_model_path`).
        dtype: ``None`` keeps each tensor's stored dtype; ``mx.float16`` /
            ``mx.bfloat16`` / ``mx.float32`` (or their names) casts every floating
            tensor, including quantization scales and biases. Packed uint32
            quantized weights are never cast.
        revision: hub revision, for hub ids only.
        shard: called with the model once its weights are set and before they are
            evaluated (a parallel run's sharding plan, :mod:`mlx_ferrum.distributed`):
            only what the model holds after it is materialized, so a rank keeps only
            its slices. It may raise ``ShardingError``.
        stage: a pipeline stage (:class:`~mlx_ferrum.distributed.pipeline.PipelineStage`):
            ``stage.wants(name)`` selects the tensors (and shards) read, and
            ``stage.prune(model, weights)`` keeps the stage's layers in the model and
            returns the weights renamed to them, before they are checked and set.
        gguf_file: the GGUF file to load inside a folder or hub repo (see
            :func:`~mlx_ferrum.models.gguf.find_gguf`). A ``.gguf`` path, or a folder
            holding one ``.gguf`` and no ``config.json``, loads without it.

    Returns:
        ``(model, config, folder)``: the model in eval mode with its parameters
        evaluated, the ``config.json`` dict, and the local folder it came from (for a
        GGUF model: the config built from its metadata, and the ``.gguf`` file's path).

    Raises:
        ConfigNotFoundError, MalformedConfigError: see :func:`load_config`.
        UnsupportedArchitectureError: ``model_type`` is not in ``SUPPORTED_MODEL_TYPES``
            (the message lists them).
        MissingShardError: see :func:`load_weights`.
        MissingWeightError, WeightShapeError: see :func:`check_weights`.
        ModelLoadError: download failure, or unreadable safetensors.
        UnsupportedQuantizationError: a quantization method or mode this loader does
            not read (see :mod:`mlx_ferrum.models.quantization`).
        InvalidWeightError: a quantized tensor's dtype disagrees with its mode.
        ConfigurationError: ``dtype`` is not a floating type.
        GGUFFormatError, UnsupportedTensorTypeError, AmbiguousCheckpointError: a GGUF
            source that is damaged, holds tensor types not read, or is not one file
            (see :mod:`mlx_ferrum.models.gguf`).
    """
    target = _resolve_dtype(dtype)
    from .gguf import find_gguf, load_gguf_checkpoint, use_group16_modules

    gguf_path = find_gguf(path_or_repo_id, gguf_file=gguf_file, revision=revision)
    if gguf_path is not None:
        config, gguf_weights, _file = load_gguf_checkpoint(gguf_path)
        folder = gguf_path
    else:
        gguf_weights = None
        folder = resolve_model_path(path_or_repo_id, revision=revision)
        config = load_config(folder)
    model_type = config.get("model_type")
    if model_type is None:
        raise MalformedConfigError(f"{folder / CONFIG_FILE} has no 'model_type'")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitectureError(
            f"model_type {model_type!r} ({folder / CONFIG_FILE}) is not supported; "
            f"supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    module = family(model_type)
    args = module.ModelArgs.from_dict(config)
    quant = quantization_spec(config)
    if gguf_weights is not None:
        weights = gguf_weights if stage is None else {k: v for k, v in gguf_weights.items() if stage.wants(k)}
        del gguf_weights
    else:
        weights = load_weights(folder, wanted=stage.wants if stage is not None else None)
    model = module.Model(args)
    weights = model.sanitize(weights)
    # int/bool dtypes (beyond quantized codes and scales) and NaN/Inf refused
    validate_weights(weights, integer_dtypes=allowed_integer_dtypes(quant))
    if gguf_path is not None:
        use_group16_modules(model, config)
    if quant is not None:
        quantize_modules(model, quant, weights)
        check_quantized_dtypes(model, weights)
    if stage is not None:
        weights = stage.prune(model, weights)
    check_weights(model, weights)
    if target is not None:
        weights = {k: v.astype(target) if mx.issubdtype(v.dtype, mx.floating) else v for k, v in weights.items()}
    model.load_weights(list(weights.items()))
    if shard is not None:
        shard(model)
    del weights  # the full tensors; the model holds only what it keeps
    mx.eval(model.parameters())
    model.eval()
    return model, config, folder


__all__ = [
    "HUB_ALLOW_PATTERNS",
    "check_weights",
    "load_config",
    "load_model",
    "load_weights",
    "resolve_model_path",
]


#: Checkpoints pad the embedding past the tokenizer to a multiple of this (or a larger
#: power of two) for faster matmuls: Qwen2/2.5/3 (151936 rows, 151665 tokens), Phi-3
#: (32064, 32011), GPT-NeoX (50432, 50277), DeepSeek LLM (102400, 100015).
_PAD_MULTIPLE = 64


def tokenizer_id_limit(tokenizer) -> Optional[int]:
    """One past the largest id ``tokenizer`` can decode (added tokens included), or None
    when it cannot tell (no tokenizer, or an object without a vocabulary)."""
    if tokenizer is None:
        return None
    backend = getattr(tokenizer, "backend", None)
    get_vocab = getattr(backend, "get_vocab", None)
    if callable(get_vocab):
        vocab = get_vocab(with_added_tokens=True)
        if vocab:
            return max(vocab.values()) + 1
    size = getattr(tokenizer, "vocab_size", None)
    return size if isinstance(size, int) and not isinstance(size, bool) else None


def check_tokenizer_vocabulary(vocab_size: int, tokenizer) -> Optional[int]:
    """Check that ``tokenizer`` can decode what a model of ``vocab_size`` logits emits.

    The rule: a tokenizer at least as large as the model's vocabulary is fine. A smaller
    one is accepted only when the model's extra embedding rows are padding, as real
    checkpoints pad (Qwen's embedding has 271 rows more than its tokenizer): the model's
    ``vocab_size`` is a multiple of 64 and exceeds the tokenizer by less than
    ``max(64, vocab_size / 20)``. Then the ids the tokenizer cannot decode are never
    sampled: the :class:`~mlx_ferrum.engine.Engine` masks their logits to ``-inf``, so
    no output is ever an id without text. Anything else is a mismatched pair (another
    model's tokenizer), whose output would be undecodable ids or the wrong text.

    Args:
        vocab_size: the model's ``vocab_size`` (logits per position).
        tokenizer: a :class:`~mlx_ferrum.tokenizer.Tokenizer` (or None: nothing to check).

    Returns:
        The tokenizer's id limit when the model's padding rows must be masked, else None.

    Raises:
        VocabularyMismatchError: the tokenizer is smaller than the model's vocabulary by
            more than padding (the message names both sizes).
    """
    limit = tokenizer_id_limit(tokenizer)
    if limit is None or limit >= vocab_size:
        return None
    if vocab_size % _PAD_MULTIPLE == 0 and vocab_size - limit < max(_PAD_MULTIPLE, vocab_size // 20):
        return limit
    raise VocabularyMismatchError(
        f"the tokenizer decodes ids below {limit} but the model's vocab_size is {vocab_size}: ids {limit}.."
        f"{vocab_size - 1} would be generated without text. Load the model with the tokenizer it was "
        "trained with (tokenizer.json from the same checkpoint), or fix vocab_size in config.json"
    )
