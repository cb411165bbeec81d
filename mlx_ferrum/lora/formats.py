"""Reading LoRA adapters: PEFT's and mlx-lm's folder formats, into one form.

- **PEFT** (``peft``'s ``save_pretrained``): ``adapter_config.json`` with ``peft_type``
  ``"LORA"``, ``r``, ``lora_alpha``, ``use_rslora``, ``rank_pattern``, ``alpha_pattern``,
  and ``adapter_model.safetensors`` holding ``base_model.model.<module>.lora_A.weight``
  ``[r, in]`` and ``lora_B.weight`` ``[out, r]``. Scale ``lora_alpha / r``, or
  ``lora_alpha / sqrt(r)`` with rsLoRA (Kalajdzievski 2023), per module after the
  patterns.
- **mlx-lm** (``mlx_lm.lora``): ``adapter_config.json`` with ``fine_tune_type: "lora"``,
  ``num_layers`` and ``lora_parameters: {rank, scale, keys}``, and
  ``adapters.safetensors`` holding ``<module>.lora_a`` ``[in, r]`` and ``lora_b``
  ``[r, out]``. Scale as given.

Both become a :class:`LoraAdapter`: per module path (the model's own names, e.g.
``model.layers.0.self_attn.q_proj``) a float32 ``A`` ``[in, r]`` and ``B`` ``[r, out]``
with the scale folded into ``B``. Nothing here knows the base model; matching an
adapter against a model is :func:`mlx_ferrum.lora.registry.match_adapter`'s job.

Refused by name (:class:`~mlx_ferrum.errors.LoraError`): DoRA (``use_dora``,
``fine_tune_type: dora``, magnitude vectors), PEFT types other than LoRA (IA3, LoHa,
prefix tuning ...), full fine-tunes, LoRA biases, ``modules_to_save`` (whole trained
copies of modules), ``target_parameters`` (raw MoE expert tensors), pickled
``adapter_model.bin`` files, and tensors that are not LoRA factors.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

import mlx.core as mx

from ..errors import LoraError

#: files fetched for an adapter given as a hub repo id
ADAPTER_ALLOW_PATTERNS = ("adapter_config.json", "adapter_model.safetensors", "adapters.safetensors")

_PEFT_PREFIX = "base_model.model."


@dataclass
class LoraModule:
    """One adapted projection: ``delta(x) = (x @ a) @ b`` (scale folded into ``b``).

    Attributes:
        a: ``[in, r]`` float32.
        b: ``[r, out]`` float32, already multiplied by the module's scale.
        scale: the scale folded into ``b`` (for reports).
    """

    a: mx.array
    b: mx.array
    scale: float

    @property
    def rank(self) -> int:
        """``r``."""
        return int(self.a.shape[1])


@dataclass
class LoraAdapter:
    """A loaded adapter, independent of any model.

    Attributes:
        name: the name it is served under.
        path: the folder it was read from.
        format: ``"peft"`` or ``"mlx_lm"``.
        modules: module path (model naming) -> :class:`LoraModule`.
        base_model: the base model the adapter names (PEFT ``base_model_name_or_path``), or None.
    """

    name: str
    path: str
    format: str
    modules: dict[str, LoraModule] = field(default_factory=dict)
    base_model: Optional[str] = None

    @property
    def rank(self) -> int:
        """The largest rank of its modules."""
        return max((m.rank for m in self.modules.values()), default=0)

    @property
    def nbytes(self) -> int:
        """Bytes of its factors."""
        return sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())


def resolve_adapter_path(path_or_repo_id: Union[str, os.PathLike]) -> Path:
    """The local folder of an adapter: an existing folder as given (no network), else a
    hub repo id fetched with ``huggingface_hub.snapshot_download`` (adapter files only).

    Raises:
        LoraError: a file instead of a folder, a local-looking path that does not exist,
            or a failed hub download (the message says why and how to fix it).
    """
    from ..models.loader import _looks_like_local_path, hub_error_message

    name = os.fspath(path_or_repo_id)
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    if local.exists():
        raise LoraError(f"LoRA adapter {name!r} is a file; pass the folder that holds adapter_config.json")
    if _looks_like_local_path(name) or not name:
        raise LoraError(f"no LoRA adapter folder at {name!r} (and it is not a hub repo id of the form 'owner/name')")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=name, allow_patterns=list(ADAPTER_ALLOW_PATTERNS)))
    except Exception as exc:  # hub errors have many types (HTTP, offline, validation, OS)
        raise LoraError(hub_error_message(name, exc)) from exc


def load_adapter(path_or_repo_id: Union[str, os.PathLike], name: Optional[str] = None) -> LoraAdapter:
    """Read a PEFT or mlx-lm LoRA adapter folder (or hub repo id).

    Args:
        path_or_repo_id: the adapter folder (``adapter_config.json`` plus
            ``adapter_model.safetensors`` or ``adapters.safetensors``) or a hub repo id.
        name: the name to serve it under; default the folder's name.

    Returns:
        A :class:`LoraAdapter` with float32 factors.

    Raises:
        LoraError: missing or malformed files, or an adapter kind this package does not
            serve (see the module docstring); the message names the folder and the item.
    """
    folder = resolve_adapter_path(path_or_repo_id)
    config_file = folder / "adapter_config.json"
    if not config_file.is_file():
        raise LoraError(f"{folder} has no adapter_config.json: pass a PEFT or mlx-lm LoRA adapter folder")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as e:
        raise LoraError(f"{config_file} cannot be read as JSON: {e}") from None
    if not isinstance(config, dict):
        raise LoraError(f"{config_file} must hold a JSON object")
    name = name or folder.name
    if "peft_type" in config:
        return _load_peft(folder, config, name)
    if "fine_tune_type" in config or "lora_parameters" in config:
        return _load_mlx_lm(folder, config, name)
    raise LoraError(
        f"{config_file} is neither PEFT's (no 'peft_type') nor mlx-lm's (no 'fine_tune_type' or "
        "'lora_parameters') adapter config"
    )


def _read_tensors(file: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(file))
    except Exception as e:  # MLX raises plain RuntimeError/ValueError for unreadable files
        raise LoraError(f"{file} cannot be read as safetensors: {e}") from None


def _check_float(name: str, module: str, *factors: mx.array) -> None:
    """LoRA factors are trained floats: integer (or boolean) tensors would round the update
    to nothing, or mean a quantization this loader does not know.

    Raises:
        LoraError: naming the module and the dtype.
    """
    for factor in factors:
        if not mx.issubdtype(factor.dtype, mx.floating):
            raise LoraError(f"adapter {name!r}: module {module!r} has a LoRA factor of dtype {str(factor.dtype).rpartition('.')[2]}; LoRA factors "
                            "must be floating point (float32, float16 or bfloat16): save the adapter unquantized")


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's ``rank_pattern`` / ``alpha_pattern`` lookup: the first key that names the
    module exactly, or matches its dotted suffix as a regular expression."""
    for key, value in (patterns or {}).items():
        if key == module or re.fullmatch(rf"(?:.*\.)?(?:{key})", module):
            return value
    return default


def _load_peft(folder: Path, config: dict, name: str) -> LoraAdapter:
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise LoraError(f"adapter {name!r} ({folder}) is a PEFT {peft_type or 'unknown'} adapter; only LORA adapters "
                        "are served")
    if config.get("use_dora"):
        raise LoraError(f"adapter {name!r} ({folder}) is a DoRA adapter (use_dora: true); DoRA is not served: "
                        "merge it into the base model, or train a plain LoRA")
    if config.get("lora_bias"):
        raise LoraError(f"adapter {name!r} ({folder}) trains a LoRA bias (lora_bias: true), which is not served")
    if config.get("modules_to_save"):
        raise LoraError(f"adapter {name!r} ({folder}) saves whole modules {config['modules_to_save']} "
                        "(modules_to_save); only LoRA factors are served: merge the adapter instead")
    if config.get("target_parameters"):
        raise LoraError(f"adapter {name!r} ({folder}) adapts raw parameters {config['target_parameters']} "
                        "(target_parameters, e.g. mixture-of-experts weights), which is not served")
    weights_file = folder / "adapter_model.safetensors"
    if not weights_file.is_file():
        if (folder / "adapter_model.bin").is_file():
            raise LoraError(f"adapter {name!r} has only a pickled adapter_model.bin; save it as safetensors "
                            "(peft's save_pretrained(safe_serialization=True))")
        raise LoraError(f"adapter {name!r}: {weights_file} is missing")
    try:
        int(config["r"])  # the factors' shapes give each module's rank; r must still be sound
        default_alpha = float(config.get("lora_alpha", 8))  # peft's default
    except (KeyError, TypeError, ValueError):
        raise LoraError(f"adapter {name!r}: adapter_config.json needs an integer 'r' and a number 'lora_alpha'") from None
    rslora = bool(config.get("use_rslora", False))
    tensors = _read_tensors(weights_file)
    factors: dict[str, dict[str, mx.array]] = {}
    for key, value in tensors.items():
        match = re.fullmatch(r"(.+)\.lora_([AB])(?:\.[^.]+)?\.weight", key)
        if match is None:
            what = "a DoRA magnitude vector" if "lora_magnitude_vector" in key else (
                "an embedding LoRA" if "lora_embedding" in key else "not a LoRA factor")
            raise LoraError(f"adapter {name!r}: tensor {key!r} is {what}; only lora_A/lora_B weights are served")
        module = match.group(1)
        module = module[len(_PEFT_PREFIX):] if module.startswith(_PEFT_PREFIX) else module
        factors.setdefault(module, {})[match.group(2)] = value
    modules = {}
    for module, pair in factors.items():
        if set(pair) != {"A", "B"}:
            raise LoraError(f"adapter {name!r}: module {module!r} has lora_{''.join(pair)} but not both lora_A and lora_B")
        a, b = pair["A"], pair["B"]  # [r, in], [out, r]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraError(f"adapter {name!r}: module {module!r} has lora_A {tuple(a.shape)} and lora_B "
                            f"{tuple(b.shape)}; expected [r, in] and [out, r]")
        _check_float(name, module, a, b)
        rank = int(a.shape[0])
        declared = _pattern_value(config.get("rank_pattern"), module, config["r"])
        if int(declared) != rank:
            # the scale is lora_alpha / r: a wrong r would scale the update silently wrong
            raise LoraError(f"adapter {name!r}: module {module!r} has r = {int(declared)} in adapter_config.json but its "
                            f"factors have rank {rank} (lora_A {tuple(a.shape)}): adapter_config.json and the weights "
                            "disagree; fix 'r' (or 'rank_pattern')")
        alpha = float(_pattern_value(config.get("alpha_pattern"), module, default_alpha))
        scale = alpha / math.sqrt(rank) if rslora else alpha / rank
        modules[module] = LoraModule(a.T.astype(mx.float32), (b.T.astype(mx.float32) * scale), scale)
    if not modules:
        raise LoraError(f"adapter {name!r}: {weights_file} holds no LoRA factors")
    mx.eval([(m.a, m.b) for m in modules.values()])
    return LoraAdapter(name, str(folder), "peft", modules, config.get("base_model_name_or_path"))


def _load_mlx_lm(folder: Path, config: dict, name: str) -> LoraAdapter:
    kind = config.get("fine_tune_type", "lora")
    if kind == "dora":
        raise LoraError(f"adapter {name!r} ({folder}) is an mlx-lm DoRA adapter (fine_tune_type: dora); DoRA is not "
                        "served: fuse it with mlx_lm.fuse, or train with --fine-tune-type lora")
    if kind != "lora":
        raise LoraError(f"adapter {name!r} ({folder}) has fine_tune_type {kind!r}; only 'lora' adapters are served "
                        "(a full fine-tune is a model: load it as one)")
    params = config.get("lora_parameters")
    if not isinstance(params, dict) or "scale" not in params:
        raise LoraError(f"adapter {name!r}: adapter_config.json needs lora_parameters with a 'scale' (mlx-lm's format)")
    try:
        scale = float(params["scale"])
    except (TypeError, ValueError):
        raise LoraError(f"adapter {name!r}: lora_parameters.scale must be a number, found {params['scale']!r}") from None
    weights_file = folder / "adapters.safetensors"
    if not weights_file.is_file():
        raise LoraError(f"adapter {name!r}: {weights_file} is missing")
    tensors = _read_tensors(weights_file)
    factors: dict[str, dict[str, mx.array]] = {}
    for key, value in tensors.items():
        module, _, leaf = key.rpartition(".")
        if leaf == "m":
            raise LoraError(f"adapter {name!r}: tensor {key!r} is a DoRA magnitude; DoRA is not served")
        if leaf not in ("lora_a", "lora_b"):
            raise LoraError(f"adapter {name!r}: tensor {key!r} is not a LoRA factor (lora_a / lora_b)")
        factors.setdefault(module, {})[leaf] = value
    modules = {}
    for module, pair in factors.items():
        if set(pair) != {"lora_a", "lora_b"}:
            raise LoraError(f"adapter {name!r}: module {module!r} lacks one of lora_a / lora_b")
        a, b = pair["lora_a"], pair["lora_b"]  # [in, r], [r, out]
        if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[0]:
            raise LoraError(f"adapter {name!r}: module {module!r} has lora_a {tuple(a.shape)} and lora_b "
                            f"{tuple(b.shape)}; expected [in, r] and [r, out] (a 3-D factor is a mixture-of-"
                            "experts LoRA, which is not served)")
        _check_float(name, module, a, b)
        declared = params.get("rank")
        if declared is not None and int(declared) != int(a.shape[1]):
            raise LoraError(f"adapter {name!r}: module {module!r} has lora_parameters.rank = {declared} in "
                            f"adapter_config.json but its factors have rank {int(a.shape[1])} (lora_a {tuple(a.shape)}): "
                            "adapter_config.json and the weights disagree; fix lora_parameters.rank")
        modules[module] = LoraModule(a.astype(mx.float32), b.astype(mx.float32) * scale, scale)
    if not modules:
        raise LoraError(f"adapter {name!r}: {weights_file} holds no LoRA factors")
    mx.eval([(m.a, m.b) for m in modules.values()])
    return LoraAdapter(name, str(folder), "mlx_lm", modules, None)
