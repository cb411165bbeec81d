"""Malformed checkpoints fail at load with an error naming the key or tensor.

Before, these raised ZeroDivisionError, ValueError, AttributeError, std::bad_alloc, or
loaded silently and emitted token 0 forever.
"""

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import mlx_ferrum as mf
from support.checkpoints import cached_checkpoint
from mlx_ferrum.errors import InvalidWeightError, MalformedConfigError
from mlx_ferrum.models.config_validation import validate_weights
from mlx_ferrum.models.llama import ModelArgs

BASE = dict(model_type="llama", hidden_size=32, num_hidden_layers=2, intermediate_size=64, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=97, max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=1e4,
            hidden_act="silu")


@pytest.mark.parametrize(
    "key, value",
    [
        ("num_attention_heads", 0),
        ("num_attention_heads", "four"),
        ("hidden_size", "32"),
        ("hidden_size", 31.5),
        ("vocab_size", True),
        ("num_hidden_layers", 200000),
        ("num_hidden_layers", -1),
        ("intermediate_size", None),
        ("num_key_value_heads", 3),
        ("max_position_embeddings", "4k"),
        ("rope_theta", 0),
        ("rope_theta", "1e4"),
        ("rope_theta", float("nan")),
        ("rms_norm_eps", -1e-6),
        ("rope_scaling", "linear"),
        ("rope_scaling", {"rope_type": "linear", "factor": "2"}),
        ("tie_word_embeddings", "yes"),
        ("hidden_act", "gelu"),
        ("hidden_act", "relu"),
    ],
)
def test_each_malformed_value_is_refused_naming_its_key(key, value):
    cfg = dict(BASE, **{key: value})
    with pytest.raises(MalformedConfigError, match=key):
        ModelArgs.from_dict(cfg)


def test_a_config_too_large_for_memory_is_refused_before_allocating(monkeypatch):
    import mlx_ferrum.config as config_module

    monkeypatch.setattr(config_module, "available_memory_bytes", lambda: 1 << 30)
    big = dict(BASE, num_hidden_layers=1000, hidden_size=8192, intermediate_size=28672, num_attention_heads=64,
               num_key_value_heads=8)
    with pytest.raises(MalformedConfigError, match="num_hidden_layers=1000"):
        ModelArgs.from_dict(big)
    ModelArgs.from_dict(BASE)


def test_valid_variants_still_load():
    for extra in ({}, {"hidden_act": "swish"}, {"num_key_value_heads": None}, {"rope_scaling": None},
                  {"hidden_size": 32.0}, {"rope_scaling": {"rope_type": "linear", "factor": 2.0}}):
        ModelArgs.from_dict(dict(BASE, **extra))


def _copy(tmp_path, mutate_weights=None, mutate_config=None):
    src = cached_checkpoint("llama2")
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    if mutate_weights is not None:
        (f,) = list(dst.glob("*.safetensors"))
        w = load_file(str(f))
        mutate_weights(w)
        save_file(w, str(f))
    if mutate_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        mutate_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _first_float(w):
    return next(k for k, v in w.items() if v.dtype.kind == "f" and v.ndim == 2)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_weights_are_detected_at_load(tmp_path, bad):
    def poison(w):
        k = _first_float(w)
        w[k] = w[k].copy()
        w[k].flat[7] = bad

    with pytest.raises(InvalidWeightError, match="NaN or Inf"):
        mf.load(_copy(tmp_path, poison))


@pytest.mark.parametrize("dtype", [np.int32, np.int8, np.bool_])
def test_integer_and_bool_weights_are_refused(tmp_path, dtype):
    def to_int(w):
        k = _first_float(w)
        w[k] = (w[k] > 0).astype(dtype)

    with pytest.raises(InvalidWeightError, match="floating point"):
        mf.load(_copy(tmp_path, to_int))


def test_rope_theta_zero_and_gelu_refused_through_load(tmp_path):
    with pytest.raises(MalformedConfigError, match="rope_theta"):
        mf.load(_copy(tmp_path, mutate_config=lambda c: c.update(rope_theta=0)))
    shutil.rmtree(tmp_path / "ckpt")
    with pytest.raises(MalformedConfigError, match="hidden_act"):
        mf.load(_copy(tmp_path, mutate_config=lambda c: c.update(hidden_act="gelu")))


def test_validate_weights_accepts_floats_and_quantized_packs():
    validate_weights({"a": mx.ones((3, 3)), "b": mx.zeros((2,), dtype=mx.bfloat16)})
    validate_weights({"q": mx.zeros((4, 2), dtype=mx.uint32), "s": mx.ones((4, 1))}, quantized=True)
    with pytest.raises(InvalidWeightError):
        validate_weights({"q": mx.zeros((4, 2), dtype=mx.uint32)})
