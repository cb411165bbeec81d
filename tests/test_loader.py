"""Checkpoint loader: every named error, sharding, dtype, MLX quantization, hub access.

The checkpoints come from tests/support/checkpoints.py (real HF layout); the quantized one
is written by mlx-lm's converter, so the placement of quantized layers is checked
against tensors another tool produced.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import json
import shutil
import socket
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from safetensors.numpy import load_file, save_file

from support.checkpoints import QUANT_KEPT_FLOAT, QUANT_OVERRIDE_8BIT, cached_checkpoint
from mlx_ferrum.errors import (
    ConfigNotFoundError,
    ConfigurationError,
    MalformedConfigError,
    MissingShardError,
    MissingWeightError,
    ModelLoadError,
    UnsupportedArchitectureError,
    WeightShapeError,
)
from mlx_ferrum.layers.dense import Linear
from mlx_ferrum.models import SUPPORTED_MODEL_TYPES, load_model, resolve_model_path
from mlx_ferrum.models import loader as loader_mod

IDS = mx.array([[1, 7, 42, 100, 3, 250, 17, 9]])
# The quantized checkpoints are written by mlx-lm's converter (the dev extra).
needs_mlx_lm = pytest.mark.skipif(importlib.util.find_spec("mlx_lm") is None, reason="mlx-lm not installed")


def _copy(family: str, tmp_path: Path, **kw) -> Path:
    dst = tmp_path / f"{family}-copy"
    shutil.copytree(cached_checkpoint(family, **kw), dst)
    return dst


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def _edit_weights(folder: Path, fn) -> None:
    tensors = load_file(str(folder / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})


# ----------------------------------------------------------------------------- errors


def test_missing_config_names_the_path(tmp_path):
    folder = _copy("llama2", tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ConfigNotFoundError) as e:
        load_model(folder)
    assert str(folder / "config.json") in str(e.value)


def test_malformed_config(tmp_path):
    folder = _copy("llama2", tmp_path)
    (folder / "config.json").write_text('{"model_type": "llama", ')
    with pytest.raises(MalformedConfigError, match="not valid json"):
        load_model(folder)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(MalformedConfigError, match="json object"):
        load_model(folder)


def test_config_without_model_type(tmp_path):
    folder = _copy("llama2", tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["model_type"]
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(MalformedConfigError, match="model_type"):
        load_model(folder)


def test_unsupported_model_type_lists_supported(tmp_path):
    folder = _copy("llama2", tmp_path)
    _edit_config(folder, model_type="gpt2")
    with pytest.raises(UnsupportedArchitectureError) as e:
        load_model(folder)
    msg = str(e.value)
    assert "gpt2" in msg
    for name in SUPPORTED_MODEL_TYPES:
        assert name in msg


def test_missing_shard_names_the_shard(tmp_path):
    folder = _copy("llama3", tmp_path, sharded=True)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(MissingShardError) as e:
        load_model(folder)
    assert "model-00002-of-00002.safetensors" in str(e.value)


def test_no_weights_at_all(tmp_path):
    folder = _copy("llama2", tmp_path)
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(MissingShardError, match="no weights") as e:
        load_model(folder)
    assert ".bin" in str(e.value)


def test_index_names_a_tensor_its_shard_lacks(tmp_path):
    folder = _copy("llama3", tmp_path, sharded=True)
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = "model-00001-of-00002.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(MissingWeightError, match="model.layers.0.mlp.extra.weight"):
        load_model(folder)


def test_wrong_tensor_shape_names_tensor_expected_and_found(tmp_path):
    folder = _copy("qwen2", tmp_path)
    name = "model.layers.1.self_attn.k_proj.weight"

    def shrink(t):
        t[name] = t[name][:-8]

    _edit_weights(folder, shrink)
    with pytest.raises(WeightShapeError) as e:
        load_model(folder)
    msg = str(e.value)
    assert name in msg and "(32, 64)" in msg and "(24, 64)" in msg


def test_config_disagreeing_with_weights_is_a_shape_error(tmp_path):
    folder = _copy("mistral", tmp_path)
    _edit_config(folder, intermediate_size=96)
    with pytest.raises(WeightShapeError, match=r"mlp\.(gate|up|down)_proj\.weight") as e:
        load_model(folder)
    assert "96" in str(e.value) and "128" in str(e.value)


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    folder = _copy("llama2", tmp_path)
    _edit_weights(folder, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(MissingWeightError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(folder)

    folder2 = _copy("qwen3", tmp_path / "b")
    _edit_weights(folder2, lambda t: t.__setitem__("model.layers.0.self_attn.extra.weight", np.zeros(3, np.float32)))
    with pytest.raises(MissingWeightError, match=r"model\.layers\.0\.self_attn\.extra\.weight"):
        load_model(folder2)


def test_corrupt_safetensors(tmp_path):
    folder = _copy("llama2", tmp_path)
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(ModelLoadError, match="model.safetensors"):
        load_model(folder)


def test_non_mlx_quantization_is_refused(tmp_path):
    folder = _copy("llama2", tmp_path)
    _edit_config(folder, quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128})
    with pytest.raises(ModelLoadError, match="awq"):
        load_model(folder)


def test_bad_dtype_argument():
    with pytest.raises(ConfigurationError, match="dtype"):
        load_model(cached_checkpoint("llama2"), dtype="float8")
    with pytest.raises(ConfigurationError, match="dtype"):
        load_model(cached_checkpoint("llama2"), dtype=mx.int32)


# ----------------------------------------------------------------------------- weights


def test_sharded_equals_unsharded():
    a, _, _ = load_model(cached_checkpoint("llama3"))
    b, _, _ = load_model(cached_checkpoint("llama3", sharded=True))
    pa, pb = dict(tree_flatten(a.parameters())), dict(tree_flatten(b.parameters()))
    assert pa.keys() == pb.keys()
    for k in pa:
        assert mx.array_equal(pa[k], pb[k]), k
    assert mx.array_equal(a(IDS), b(IDS))


def test_tensors_match_the_files_and_inv_freq_is_dropped():
    folder = cached_checkpoint("llama2")
    model, config, path = load_model(folder)
    assert path == folder and config["model_type"] == "llama"
    stored = load_file(str(folder / "model.safetensors"))
    params = dict(tree_flatten(model.parameters()))
    assert any("rotary_emb.inv_freq" in k for k in stored)
    assert set(params) == {k for k in stored if "inv_freq" not in k}
    for k, v in params.items():
        np.testing.assert_array_equal(np.array(v), stored[k])


def test_tied_embeddings_have_no_lm_head():
    model, _, _ = load_model(cached_checkpoint("qwen2"))
    assert not any(k.startswith("lm_head") for k, _ in tree_flatten(model.parameters()))


def _float_dtypes(model) -> set:
    return {v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)}


def test_dtype_default_keeps_checkpoint_dtype_and_override_casts():
    bf16 = cached_checkpoint("qwen3", dtype="bfloat16")
    model, _, _ = load_model(bf16)
    assert _float_dtypes(model) == {mx.bfloat16}
    assert model(IDS).dtype == mx.bfloat16

    model32, _, _ = load_model(bf16, dtype=mx.float32)
    assert _float_dtypes(model32) == {mx.float32}
    # The cast is exact for bf16 -> f32, so values equal the bf16 ones.
    a = dict(tree_flatten(model.parameters()))
    for k, v in tree_flatten(model32.parameters()):
        assert mx.array_equal(v, a[k].astype(mx.float32)), k

    model16, _, _ = load_model(cached_checkpoint("qwen3"), dtype="float16")
    assert _float_dtypes(model16) == {mx.float16}


@needs_mlx_lm
def test_quantized_dtype_override_keeps_packed_weights():
    model, _, _ = load_model(cached_checkpoint("llama3", quantized=True), dtype=mx.float16)
    params = dict(tree_flatten(model.parameters()))
    assert params["model.layers.0.mlp.up_proj.weight"].dtype == mx.uint32
    assert params["model.layers.0.mlp.up_proj.scales"].dtype == mx.float16
    assert model(IDS).dtype == mx.float16


# ----------------------------------------------------------------------------- quantization


def _module_kinds(model) -> dict[str, nn.Module]:
    return {p: m for p, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding, nn.QuantizedLinear, nn.QuantizedEmbedding))}


def _assert_quantized_exactly_where_scales_are(model, stored: dict):
    kinds = _module_kinds(model)
    assert kinds, "no linear/embedding modules found"
    for path, m in kinds.items():
        has_scales = f"{path}.scales" in stored
        quantized = isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
        assert quantized == has_scales, path
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)


@needs_mlx_lm
def test_quantized_layers_are_exactly_where_the_checkpoint_has_scales():
    folder = cached_checkpoint("llama3", quantized=True)
    stored = mx.load(str(folder / "model.safetensors"))
    model, config, _ = load_model(folder)
    _assert_quantized_exactly_where_scales_are(model, stored)
    kinds = _module_kinds(model)
    # mlx-lm recorded a per-layer 8-bit entry and left one module in float.
    assert config["quantization"][QUANT_OVERRIDE_8BIT]["bits"] == 8
    assert kinds[QUANT_OVERRIDE_8BIT].bits == 8
    assert type(kinds[QUANT_KEPT_FLOAT]) is Linear  # float, not quantized
    assert kinds["model.layers.0.mlp.up_proj"].bits == 4
    assert {m.group_size for m in kinds.values() if hasattr(m, "group_size")} == {32}


@needs_mlx_lm
def test_quantized_with_bias_and_tied_embedding():
    folder = cached_checkpoint("qwen2", quantized=True)
    stored = mx.load(str(folder / "model.safetensors"))
    model, _, _ = load_model(folder)
    _assert_quantized_exactly_where_scales_are(model, stored)
    q = model.model.layers[0].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and "bias" in q


@needs_mlx_lm
def test_per_layer_false_entry_and_inferred_bits(tmp_path):
    folder = _copy("llama3", tmp_path, quantized=True)
    cfg = json.loads((folder / "config.json").read_text())
    ref, _, _ = load_model(folder)
    # A ``false`` entry for the module kept in float (the form mlx-lm's mixed recipes
    # write), and no entry for the 8-bit one: its bits come from the stored shapes.
    for key in ("quantization", "quantization_config"):
        cfg[key][QUANT_KEPT_FLOAT] = False
        del cfg[key][QUANT_OVERRIDE_8BIT]
    (folder / "config.json").write_text(json.dumps(cfg))
    model, _, _ = load_model(folder)
    kinds = _module_kinds(model)
    assert type(kinds[QUANT_KEPT_FLOAT]) is Linear  # float, not quantized
    assert kinds[QUANT_OVERRIDE_8BIT].bits == 8
    assert mx.array_equal(model(IDS), ref(IDS))


@needs_mlx_lm
def test_quantization_config_alone_is_read(tmp_path):
    folder = _copy("llama3", tmp_path, quantized=True)
    ref, _, _ = load_model(folder)
    cfg = json.loads((folder / "config.json").read_text())
    del cfg["quantization"]  # older MLX exports carry only quantization_config
    (folder / "config.json").write_text(json.dumps(cfg))
    model, _, _ = load_model(folder)
    assert isinstance(model.model.embed_tokens, nn.QuantizedEmbedding)
    assert mx.array_equal(model(IDS), ref(IDS))


@needs_mlx_lm
def test_per_layer_entry_disagreeing_with_tensors_is_a_shape_error(tmp_path):
    folder = _copy("llama3", tmp_path, quantized=True)
    cfg = json.loads((folder / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        cfg[key][QUANT_OVERRIDE_8BIT] = {"group_size": 32, "bits": 4}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(WeightShapeError, match=QUANT_OVERRIDE_8BIT.replace(".", r"\.")):
        load_model(folder)


# ----------------------------------------------------------------------------- hub access


def _no_network(monkeypatch):
    import huggingface_hub

    def refuse(*a, **k):
        raise AssertionError("snapshot_download must not be called")

    def no_connect(*a, **k):
        raise AssertionError("network access attempted")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    monkeypatch.setattr(socket.socket, "connect", no_connect)


def test_local_path_never_touches_the_network(monkeypatch):
    _no_network(monkeypatch)
    folder = cached_checkpoint("llama2")
    assert resolve_model_path(folder) == folder
    assert resolve_model_path(str(folder)) == folder
    model, _, path = load_model(str(folder))
    assert path == folder


def test_path_like_name_that_does_not_exist(monkeypatch, tmp_path):
    _no_network(monkeypatch)
    for name in (str(tmp_path / "absent"), "./absent/model", "a/b/c"):
        with pytest.raises(ModelLoadError, match="no checkpoint folder"):
            resolve_model_path(name)
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(ModelLoadError, match="file"):
        resolve_model_path(f)


def test_hub_id_uses_snapshot_download_with_allow_patterns(monkeypatch):
    import huggingface_hub

    folder = cached_checkpoint("qwen2")
    calls = []

    def fake(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    model, _, path = load_model("Qwen/Qwen2.5-0.5B-Instruct")
    assert path == folder and isinstance(model.model.embed_tokens, nn.Embedding)
    (repo_id, kwargs), = calls
    assert repo_id == "Qwen/Qwen2.5-0.5B-Instruct"
    patterns = kwargs["allow_patterns"]

    def allowed(name):
        return any(fnmatch.fnmatch(name, p) for p in patterns)

    for needed in ("config.json", "model.safetensors", "model-00001-of-00004.safetensors",
                   "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                   "generation_config.json", "chat_template.jinja", "tokenizer.model"):
        assert allowed(needed), needed
    for unneeded in ("pytorch_model.bin", "consolidated.safetensors", "model.gguf", "onnx/model.onnx",
                     "original/consolidated.00.pth", "README.md"):
        assert not allowed(unneeded), unneeded


def test_hub_errors_are_wrapped_naming_the_repo(monkeypatch):
    import huggingface_hub

    def boom(repo_id, **kwargs):
        raise OSError("connection refused")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", boom)
    with pytest.raises(ModelLoadError, match="someone/missing-model") as e:
        load_model("someone/missing-model")
    assert "connection refused" in str(e.value)


def test_offline_mode_without_cache_is_a_clear_error(monkeypatch, tmp_path):
    import huggingface_hub.constants as const

    monkeypatch.setattr(socket.socket, "connect", lambda *a, **k: (_ for _ in ()).throw(AssertionError("network")))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(const, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(const, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    with pytest.raises(ModelLoadError, match="org/not-cached") as e:
        resolve_model_path("org/not-cached")
    assert "HF_HUB_OFFLINE" in str(e.value)


def test_allow_patterns_constant_is_what_is_passed():
    assert "model*.safetensors" in loader_mod.HUB_ALLOW_PATTERNS
