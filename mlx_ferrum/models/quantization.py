"""Which modules of a checkpoint are quantized, and how: MLX's quantization modes.

MLX quantizes a weight ``[out, in]`` in groups of ``group_size`` consecutive input
elements, packing the codes into ``uint32`` words (``weight`` ``[out, in * bits / 32]``)
with one scale per group (``scales`` ``[out, in / group_size]``). The modes differ in the
code and the scale (MLX's ``mx.quantize`` documentation, "quantization modes"):

| mode | bits | group_size | code | scales | biases |
|---|---|---|---|---|---|
| ``affine`` | 2, 3, 4, 5, 6, 8 | 32, 64, 128 | unsigned integer | model dtype | model dtype |
| ``mxfp4`` | 4 | 32 | FP4 E2M1 | uint8, E8M0 (a power of two) | none |
| ``mxfp8`` | 8 | 32 | FP8 E4M3 | uint8, E8M0 | none |
| ``nvfp4`` | 4 | 16 | FP4 E2M1 | uint8, FP8 E4M3 | none |

``mxfp4`` / ``mxfp8`` are the OCP Microscaling formats (OCP, "Microscaling Formats
(MX) Specification v1.0", 2023); ``nvfp4`` is NVIDIA's 16-element FP4 block format.

Checkpoints say which mode in one of two ways:

- mlx-lm's ``convert`` (``--q-mode``) writes ``config["quantization"] = {"group_size",
  "bits", "mode", <per-module entries>}``, and the packed tensors under the module's
  own names (``p.weight``, ``p.scales``, ``p.biases`` for affine only).
- A Hugging Face ``quantization_config`` with ``quant_method: "mxfp4"`` (OpenAI's
  gpt-oss release) stores the experts as ``*_blocks`` / ``*_scales``; the family's
  ``sanitize`` repacks them under MLX's names (see :mod:`mlx_ferrum.models.gpt_oss`),
  and ``modules_to_not_convert`` lists the modules kept in float.

A mode MLX adds later with the same fields works without change here: a mode is
accepted when ``mx.quantize`` accepts it, and its scale dtype and whether it stores
biases are read from what ``mx.quantize`` returns.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Union

import mlx.core as mx
import mlx.nn as nn

from ..errors import InvalidWeightError, MalformedConfigError, UnsupportedQuantizationError

#: modes this loader has been tested with, in the order error messages list them
KNOWN_MODES = ("affine", "mxfp4", "mxfp8", "nvfp4")

#: Hugging Face ``quant_method`` values that are MLX modes under another name
#: (OpenAI's gpt-oss release says ``mxfp4``), as ``(group_size, bits, mode)``
HF_QUANT_METHODS = {
    "mxfp4": (32, 4, "mxfp4"),
    "mxfp8": (32, 8, "mxfp8"),
}

_CONVERT_HINT = (
    "convert the float checkpoint with mlx-lm: "
    "`mlx_lm.convert --model PATH_OR_HUB_ID --mlx-path OUT -q --q-mode {affine|mxfp4|mxfp8|nvfp4}`"
)


@dataclass(frozen=True)
class ModeLayout:
    """What one quantization mode stores, as MLX reports it.

    Attributes:
        mode: the mode's name.
        scales_dtype: dtype of ``scales`` (``None``: the model's float dtype, as affine).
        has_biases: whether ``biases`` are stored beside the scales.
    """

    mode: str
    scales_dtype: Optional[mx.Dtype]
    has_biases: bool


@lru_cache(maxsize=None)
def mode_layout(mode: str, group_size: int, bits: int) -> ModeLayout:
    """Ask MLX how ``mode`` stores a weight (one tiny ``mx.quantize`` call, cached).

    Args:
        mode: a quantization mode name (``"affine"``, ``"mxfp4"``, ...).
        group_size: elements per scale.
        bits: bits per code.

    Returns:
        The mode's :class:`ModeLayout`.

    Raises:
        UnsupportedQuantizationError: MLX refuses the mode, or refuses this
            ``group_size`` / ``bits`` for it (the message lists the known modes).
    """
    if not isinstance(mode, str):
        raise UnsupportedQuantizationError(
            f"quantization mode {mode!r} is not a string; supported modes: {', '.join(KNOWN_MODES)}"
        )
    probe = mx.zeros((1, max(int(group_size), 1) * 8), dtype=mx.float32)
    try:
        packed = mx.quantize(probe, group_size=int(group_size), bits=int(bits), mode=mode)
    except (ValueError, RuntimeError, TypeError) as error:
        raise UnsupportedQuantizationError(
            f"quantization mode {mode!r} with group_size={group_size}, bits={bits} is not supported by "
            f"MLX {mx.__version__} ({error}); supported modes: {', '.join(KNOWN_MODES)} "
            "(mxfp4: bits 4, group 32; mxfp8: bits 8, group 32; nvfp4: bits 4, group 16; "
            "affine: bits 2-8, group 32/64/128). Or " + _CONVERT_HINT
        ) from None
    scales = packed[1]
    scales_dtype = None if mx.issubdtype(scales.dtype, mx.floating) else scales.dtype
    return ModeLayout(mode=mode, scales_dtype=scales_dtype, has_biases=len(packed) > 2)


@dataclass
class QuantizationSpec:
    """A checkpoint's quantization, normalised from either config spelling.

    Attributes:
        group_size, bits, mode: the default for every quantized module.
        overrides: per-module ``{path: {"group_size", "bits", "mode"}}`` entries (mlx-lm's
            per-module dicts; a missing ``mode`` means affine, as in mlx-lm), or
            ``{path: False}`` for a module mlx-lm kept in float.
        not_converted: glob patterns of modules kept in float (Hugging Face's
            ``modules_to_not_convert``); a module matching one is never quantized.
        source: ``"mlx"`` (``config["quantization"]``) or the Hugging Face
            ``quant_method`` it came from.
    """

    group_size: int
    bits: int
    mode: str = "affine"
    overrides: dict = field(default_factory=dict)
    not_converted: tuple = ()
    source: str = "mlx"

    def default(self) -> dict:
        """The default ``{"group_size", "bits", "mode"}`` for ``nn.quantize``."""
        return {"group_size": self.group_size, "bits": self.bits, "mode": self.mode}

    def keeps_float(self, path: str) -> bool:
        """True when ``modules_to_not_convert`` names ``path`` (exactly, as a glob, or as a parent)."""
        for pattern in self.not_converted:
            if fnmatch.fnmatchcase(path, pattern) or path.startswith(pattern.rstrip(".") + "."):
                return True
        return False


def quantization_spec(config: dict) -> Optional[QuantizationSpec]:
    """The quantization of a ``config.json`` dict, or None for a float checkpoint.

    Args:
        config: the checkpoint's ``config.json``.

    Returns:
        A :class:`QuantizationSpec`, or None.

    Raises:
        UnsupportedQuantizationError: a ``quant_method`` that is not an MLX mode
            (AWQ, GPTQ, bitsandbytes, fp8, ...), or a mode MLX does not know; the
            message names it, lists the supported ones and the convert command.
        MalformedConfigError: ``quantization`` is not a dict with ``group_size`` and ``bits``.
    """
    quant = config.get("quantization")
    if quant is None:
        quant = config.get("quantization_config")
        if isinstance(quant, dict) and "quant_method" in quant:
            return _hf_spec(quant)
    if quant is None:
        return None
    if not isinstance(quant, dict) or "group_size" not in quant or "bits" not in quant:
        raise MalformedConfigError(
            f"config 'quantization' must be a dict with group_size and bits (and optionally mode), found {quant!r}"
        )
    mode = quant.get("mode", "affine")
    mode_layout(mode, quant["group_size"], quant["bits"])  # refuse an unknown mode by name, now
    overrides = {}
    for path, entry in quant.items():
        if isinstance(entry, dict):
            entry = {k: v for k, v in entry.items() if k in ("group_size", "bits", "mode")}
            # an entry without "mode" is affine whatever the default: mlx-lm passes the
            # entry to ``to_quantized`` as it is, whose mode defaults to affine (its
            # MoE routers are written so, as {"group_size": 64, "bits": 8})
            full = {"group_size": quant["group_size"], "bits": quant["bits"], "mode": "affine", **entry}
            mode_layout(full["mode"], full["group_size"], full["bits"])
            overrides[path] = full
        elif entry is False:
            overrides[path] = False
    return QuantizationSpec(int(quant["group_size"]), int(quant["bits"]), mode, overrides)


def _hf_spec(quant: dict) -> QuantizationSpec:
    method = quant["quant_method"]
    if method not in HF_QUANT_METHODS:
        raise UnsupportedQuantizationError(
            f"quantization method {method!r} (config 'quantization_config.quant_method') is not supported; "
            f"supported: MLX checkpoints (config 'quantization' with mode {', '.join(KNOWN_MODES)}) and "
            f"Hugging Face quant_method {', '.join(sorted(HF_QUANT_METHODS))}. To use this model, "
            + _CONVERT_HINT.replace("the float checkpoint", "a float (bf16/fp16) copy of it")
        )
    group_size, bits, mode = HF_QUANT_METHODS[method]
    not_converted = quant.get("modules_to_not_convert") or ()
    if not isinstance(not_converted, (list, tuple)) or not all(isinstance(p, str) for p in not_converted):
        raise MalformedConfigError(
            f"quantization_config.modules_to_not_convert must be a list of module names, found {not_converted!r}"
        )
    return QuantizationSpec(group_size, bits, mode, not_converted=tuple(not_converted), source=method)


def quantize_modules(model: nn.Module, spec: QuantizationSpec, weights: dict[str, mx.array]) -> None:
    """Swap in MLX's quantized modules exactly where ``p.scales`` is stored.

    The stored tensors decide *where*; the per-module config entry, else the shapes
    and dtypes of the stored tensors (:func:`infer_module_params`), else the
    default decide *how*. A module that ``modules_to_not_convert`` names stays float.
    What still disagrees is caught afterwards by :func:`check_quantized_dtypes` and
    the loader's shape check, naming the tensor.

    Args:
        model: the float model, before its weights are loaded (modified in place).
        spec: the checkpoint's :class:`QuantizationSpec`.
        weights: ``{name: array}`` after the family's ``sanitize``.
    """

    def predicate(path: str, module: nn.Module) -> Union[bool, dict]:
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        if spec.keeps_float(path):
            return False
        entry = spec.overrides.get(path)
        if isinstance(entry, dict):
            return dict(entry)
        return infer_module_params(path, module, weights, spec) or spec.default()

    nn.quantize(model, class_predicate=predicate)


def infer_module_params(
    path: str, module: nn.Module, weights: dict[str, mx.array], spec: Optional[QuantizationSpec] = None
) -> Optional[dict]:
    """``group_size``, ``bits`` and ``mode`` implied by a module's stored tensors.

    ``bits`` follows from the packed width, ``group_size`` from the number of scales
    per row. Float scales mean ``affine``; ``uint8`` scales mean one of the
    microscaling modes, told apart by ``(bits, group_size)``: ``(4, 32)`` mxfp4,
    ``(8, 32)`` mxfp8, ``(4, 16)`` nvfp4 (the spec's default mode wins when it fits).

    Args:
        path: the module's path (``model.layers.0.mlp.down_proj``).
        module: the float module (its ``weight`` gives the unpacked input width).
        weights: the stored tensors.
        spec: the checkpoint default, preferred when it is consistent.

    Returns:
        ``{"group_size", "bits", "mode"}``, or None when the shapes fit no mode.
    """
    in_dims = module.weight.shape[-1]
    packed, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
    if packed.dtype != mx.uint32 or scales.shape[-1] < 1:
        return None
    bits, rem_b = divmod(packed.shape[-1] * 32, in_dims)
    group_size, rem_g = divmod(in_dims, scales.shape[-1])
    if rem_b or rem_g:
        return None
    if mx.issubdtype(scales.dtype, mx.floating):
        candidates = ["affine"]
    else:
        candidates = [m for m in KNOWN_MODES if m != "affine"]
    if spec is not None and spec.mode not in candidates and spec.mode not in KNOWN_MODES:
        candidates.insert(0, spec.mode)  # a mode newer than this list
    if spec is not None and spec.mode in candidates:
        candidates.remove(spec.mode)
        candidates.insert(0, spec.mode)
    for mode in candidates:
        try:
            layout = mode_layout(mode, group_size, bits)
        except UnsupportedQuantizationError:
            continue
        if (layout.scales_dtype is None) == mx.issubdtype(scales.dtype, mx.floating):
            return {"group_size": group_size, "bits": bits, "mode": mode}
    return None


def check_quantized_dtypes(model: nn.Module, weights: dict[str, mx.array]) -> None:
    """Every quantized module's stored ``weight`` / ``scales`` / ``biases`` have the dtypes its mode needs.

    Args:
        model: the model after :func:`quantize_modules`.
        weights: the stored tensors.

    Raises:
        InvalidWeightError: names the tensor, its dtype, the module's mode and the dtype
            that mode stores (e.g. float scales in an ``mxfp4`` module).
    """
    for path, module in model.named_modules():
        mode = getattr(module, "mode", None)
        if mode is None or not hasattr(module, "group_size") or f"{path}.scales" not in weights:
            continue
        layout = mode_layout(mode, module.group_size, module.bits)
        packed, scales = weights.get(f"{path}.weight"), weights[f"{path}.scales"]
        if packed is not None and packed.dtype != mx.uint32:
            raise InvalidWeightError(
                f"tensor '{path}.weight' has dtype {packed.dtype}, but a {mode}-quantized module stores its codes "
                "packed in uint32; the checkpoint's 'quantization' entry and its tensors disagree"
            )
        if layout.scales_dtype is None and not mx.issubdtype(scales.dtype, mx.floating):
            raise InvalidWeightError(
                f"tensor '{path}.scales' has dtype {scales.dtype}, but mode {mode!r} stores float scales; "
                "uint8 scales belong to mxfp4 / mxfp8 / nvfp4: set 'mode' in the config's 'quantization'"
            )
        if layout.scales_dtype is not None and scales.dtype != layout.scales_dtype:
            raise InvalidWeightError(
                f"tensor '{path}.scales' has dtype {scales.dtype}, but mode {mode!r} stores "
                f"{layout.scales_dtype} scales; the checkpoint's 'quantization' mode and its tensors disagree"
            )
        if not layout.has_biases and f"{path}.biases" in weights:
            raise InvalidWeightError(
                f"tensor '{path}.biases' is stored, but mode {mode!r} has no biases (only affine does); "
                "the checkpoint's 'quantization' mode and its tensors disagree"
            )


def allowed_integer_dtypes(spec: Optional[QuantizationSpec]) -> tuple:
    """Integer dtypes a checkpoint may store: packed ``uint32`` codes, and ``uint8``
    scales of the microscaling modes (and the raw ``uint8`` blocks of a Hugging Face
    ``mxfp4`` release, before its family repacks them)."""
    if spec is None:
        return ()
    return (mx.uint32, mx.uint8)


__all__ = [
    "HF_QUANT_METHODS",
    "KNOWN_MODES",
    "ModeLayout",
    "QuantizationSpec",
    "allowed_integer_dtypes",
    "check_quantized_dtypes",
    "infer_module_params",
    "mode_layout",
    "quantization_spec",
    "quantize_modules",
]
