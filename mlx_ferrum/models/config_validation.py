"""Checks of a checkpoint's ``config.json`` values and of its weight tensors, before use.

A malformed checkpoint must fail at load with an error that names the key or tensor,
instead of a raw ``ZeroDivisionError`` / ``AttributeError`` / ``std::bad_alloc`` or,
worse, a model that loads and then emits token 0 forever (NaN weights, ``rope_theta: 0``).

- :func:`validate_config`: type and range of every value the Llama-family models read
  (``MalformedConfigError`` naming the key), and ``hidden_act`` against the activations
  the model implements.
- :func:`validate_weights`: integer or bool tensors where floats belong, and NaN/Inf
  values, found with one ``all(isfinite(w))`` reduction per tensor, all evaluated
  together (``InvalidWeightError`` naming the tensor).

The upper bounds are far above any released model (e.g. 1024 layers, hidden size
65536) and only stop configs whose allocation would abort the process.
"""

from __future__ import annotations

import math
import numbers
from typing import Any, Iterable, Mapping, Optional

import mlx.core as mx

from ..errors import InvalidWeightError, MalformedConfigError

#: activations a Llama-family MLP implements (``swish`` is another name of SiLU)
SILU_ACTIVATIONS = ("silu", "swish")

# key -> (lowest, highest) for the integer sizes
_INT_RANGES = {
    "hidden_size": (1, 1 << 16),
    "num_hidden_layers": (1, 1024),
    "intermediate_size": (1, 1 << 18),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (1, 4096),
    "vocab_size": (1, 1 << 22),
    "max_position_embeddings": (1, 1 << 24),
}
_REQUIRED = ("hidden_size", "num_hidden_layers", "intermediate_size", "num_attention_heads", "vocab_size")
_BOOLS = ("tie_word_embeddings", "attention_bias", "mlp_bias")


def _bad(key: str, value: Any, accepted: str) -> MalformedConfigError:
    return MalformedConfigError(f"config.json key {key!r} = {value!r:.60} is invalid: {accepted}; fix config.json")


def _int(config: Mapping, key: str) -> Optional[int]:
    """``config[key]`` as an int in its range, or None when absent."""
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or (
        isinstance(value, float) and not value.is_integer()
    ):
        raise _bad(key, value, "it must be an integer")
    lo, hi = _INT_RANGES[key]
    if not lo <= int(value) <= hi:
        raise _bad(key, value, f"it must be in [{lo}, {hi}]")
    return int(value)


def _number(config: Mapping, key: str, lo: float, hi: float = math.inf, name: Optional[str] = None) -> None:
    """``config[key]`` absent, or a finite number in ``(lo, hi]``."""
    value = config.get(key)
    name = name or key
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise _bad(name, value, "it must be a finite number")
    if not lo < value <= hi:
        raise _bad(name, value, f"it must be in ({lo}, {hi}]")


def validate_config(config: Any, activations: Iterable[str] = SILU_ACTIVATIONS) -> None:
    """Check a HF ``config.json`` dict of a Llama-family model.

    Args:
        config: the parsed json.
        activations: accepted ``hidden_act`` values (absent means SiLU).

    Raises:
        MalformedConfigError: not a dict, a required key missing, or a value of the wrong
            type or out of range; the message names the key and the accepted values.
    """
    if not isinstance(config, dict):
        raise MalformedConfigError("config.json must hold a JSON object")
    for key in _REQUIRED:
        if config.get(key) is None:
            raise MalformedConfigError(f"config.json lacks the required key {key!r}")
    sizes = {key: _int(config, key) for key in _INT_RANGES}
    heads, kv_heads = sizes["num_attention_heads"], sizes["num_key_value_heads"] or sizes["num_attention_heads"]
    if heads % kv_heads:
        raise _bad("num_key_value_heads", kv_heads, f"num_attention_heads={heads} must be a multiple of it")
    if sizes["head_dim"] is None and sizes["hidden_size"] % heads:
        raise _bad("num_attention_heads", heads, f"hidden_size={sizes['hidden_size']} must be a multiple of it "
                   "(or give head_dim)")
    _number(config, "rms_norm_eps", 0.0, 1.0)
    _number(config, "rope_theta", 0.0)
    for key in _BOOLS:
        if key in config and config[key] is not None and not isinstance(config[key], bool):
            raise _bad(key, config[key], "it must be true or false")
    for key in ("rope_scaling", "rope_parameters"):
        rs = config.get(key)
        if rs is None:
            continue
        if not isinstance(rs, dict):
            raise _bad(key, rs, "it must be an object such as {\"rope_type\": \"llama3\", \"factor\": 8.0} or null")
        kind = rs.get("rope_type", rs.get("type", "default"))
        if not isinstance(kind, str):
            raise _bad(f"{key}.rope_type", kind, "it must be a string")
        for sub in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                    "rope_theta"):
            if sub in rs:
                _number(rs, sub, 0.0, name=f"{key}.{sub}")
        if kind == "llama3" and rs.get("low_freq_factor") is not None and (
            rs.get("low_freq_factor") == rs.get("high_freq_factor")
        ):
            raise _bad(f"{key}.high_freq_factor", rs.get("high_freq_factor"), "it must differ from low_freq_factor")
    _check_size(config, sizes)
    act = config.get("hidden_act", config.get("hidden_activation"))
    allowed = tuple(activations)
    if act is not None and act not in allowed:
        raise _bad("hidden_act", act, f"this model implements {', '.join(allowed)} only")


def _check_size(config: Mapping, sizes: dict) -> None:
    """Refuse a config whose weights alone cannot fit in memory (a lower bound: 2 bytes per
    parameter, or ``bits / 8`` when MLX-quantized), before anything is allocated."""
    from ..config import available_memory_bytes

    h, layers, inter, vocab = sizes["hidden_size"], sizes["num_hidden_layers"], sizes["intermediate_size"], sizes[
        "vocab_size"]
    heads = sizes["num_attention_heads"]
    head_dim = sizes["head_dim"] or h // heads
    kv = sizes["num_key_value_heads"] or heads
    per_layer = h * head_dim * (2 * heads + 2 * kv) + 3 * h * inter
    params = layers * per_layer + 2 * vocab * h
    quant = config.get("quantization") or config.get("quantization_config")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    if bits is None and isinstance(quant, dict) and quant.get("quant_method") in ("mxfp4", "mxfp8"):
        # most weights of such a release are the quantized experts; the float rest
        # (attention, router, embeddings) is small next to them
        bits = 4 if quant["quant_method"] == "mxfp4" else 8
    nbytes = params * (bits / 8 if isinstance(bits, (int, float)) and bits > 0 else 2)
    avail = available_memory_bytes()
    if nbytes > avail:
        raise MalformedConfigError(
            f"config.json describes about {params / 1e9:.1f} B parameters (num_hidden_layers={layers}, "
            f"hidden_size={h}, intermediate_size={inter}, vocab_size={vocab}): at least {nbytes / 2**30:.1f} GiB, "
            f"more than the {avail / 2**30:.1f} GiB available; check those keys or use a smaller model"
        )


def validate_weights(
    weights: Mapping[str, mx.array], quantized: bool = False, integer_dtypes: Iterable[mx.Dtype] = ()
) -> None:
    """Refuse integer/bool tensors (quantized codes and scales excepted) and tensors
    holding NaN or Inf.

    Args:
        weights: ``{name: array}`` as read from the checkpoint.
        quantized: the checkpoint is MLX-quantized (``uint32`` packs are then expected).
        integer_dtypes: further integer dtypes the checkpoint may store (``uint8``
            scales of the microscaling modes); their per-module use is checked by
            :func:`mlx_ferrum.models.quantization.check_quantized_dtypes`.

    Raises:
        InvalidWeightError: names the first bad tensor, its dtype or the non-finite values.
    """
    allowed = set(integer_dtypes) | ({mx.uint32} if quantized else set())
    floats = []
    for name, w in weights.items():
        if mx.issubdtype(w.dtype, mx.floating):
            floats.append((name, w))
        elif w.dtype not in allowed:
            raise InvalidWeightError(
                f"tensor {name!r} has dtype {w.dtype}: weights must be floating point "
                "(float32, float16 or bfloat16); re-export the checkpoint"
            )
    flags = [mx.all(mx.isfinite(w)) for _, w in floats]
    mx.eval(flags)
    for (name, _), ok in zip(floats, flags):
        if not ok.item():
            raise InvalidWeightError(
                f"tensor {name!r} holds NaN or Inf values: the checkpoint is corrupt; re-download or re-export it"
            )
