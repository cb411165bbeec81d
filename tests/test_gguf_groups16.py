"""The 16-weight-group K-quants (Q6_K, Q3_K, Q2_K) kept exact: their blocks unpacked to
codes + per-16-weight scales equal the ``gguf`` package's dequantization bit for bit,
for any finite float16 factors; the two-product matmul of
:mod:`mlx_ferrum.layers.quantized16` equals a float64 matmul of those exact weights; the
embedding gives the exact rows; a ``Q4_K_M``-like file (Q4_K layers, Q6_K embedding
and tied output, Q6_K in some ``attn_v`` / ``ffn_down``) matches transformers' GGUF
loader."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("gguf")

from support.gguf_fixtures import quantized_bytes  # noqa: E402
from mlx_ferrum.layers.quantized16 import (  # noqa: E402
    QuantizedEmbedding16,
    QuantizedLinear16,
    dequantize16,
    matmul16,
    pair_groups,
    split_input,
)

TYPES = ["Q6_K", "Q3_K", "Q2_K"]
#: byte offsets of each block's float16 factors (llama.cpp's block structs)
FACTORS = {"Q6_K": (208,), "Q3_K": (108,), "Q2_K": (80, 82)}


def _raw_with_any_factors(type_name: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random blocks whose float16 factors are any finite float16 (subnormals, large,
    negative), not only the small sane ones of the model fixtures."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    _, size = GGML_QUANT_SIZES[GGMLQuantizationType[type_name]]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    for at in FACTORS[type_name]:
        bits = rng.integers(0, 2 ** 16, (rows, cols // 256), dtype=np.uint16)
        bits = np.where((bits & 0x7C00) == 0x7C00, bits & 0x83FF, bits)  # no inf / nan: clear the exponent
        raw[..., at:at + 2] = bits.astype(np.uint16).view(np.uint8).reshape(rows, cols // 256, 2)
    return raw.reshape(rows, -1)


def _loaded(type_name: str, raw: np.ndarray, rows: int, cols: int):
    from mlx_ferrum.models.gguf.tensors import convert_tensor

    converted = convert_tensor(type_name, raw, (rows, cols))
    assert converted.group_size == 16 and converted.exact
    return converted.weight, pair_groups(converted.scales), pair_groups(converted.biases), converted.bits


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_blocks_dequantize_to_gguf_values_bit_for_bit(type_name, seed):
    from gguf import GGMLQuantizationType, quants

    rows, cols = 6, 768
    raw = _raw_with_any_factors(type_name, rows, cols, seed)
    expected = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols).astype(np.float32)
    weight, scales, biases, bits = _loaded(type_name, raw, rows, cols)
    ours = np.array(dequantize16(weight, scales, biases, bits))
    assert ours.dtype == np.float32
    assert np.array_equal(ours, expected)
    # and through MLX's own group-32 dequantization of each set: the even / odd halves
    for parity in (0, 1):
        half = np.array(mx.dequantize(weight, scales[parity], biases[parity], group_size=32, bits=bits))
        take = (np.arange(cols) // 16) % 2 == parity
        assert np.array_equal(half[:, take], expected[:, take])


def test_split_input_is_exact_and_complementary():
    x = mx.array(np.random.default_rng(0).normal(size=(3, 2, 64)).astype(np.float32))
    even, odd = split_input(x)
    groups = np.arange(64) // 16
    assert np.array_equal(np.array(even)[..., groups % 2 == 1], np.zeros((3, 2, 32), np.float32))
    assert np.array_equal(np.array(odd)[..., groups % 2 == 0], np.zeros((3, 2, 32), np.float32))
    assert np.array_equal(np.array(even + odd), np.array(x))


@pytest.mark.parametrize("type_name", TYPES)
def test_linear_is_the_exact_weights_matmul(type_name):
    rows, cols = 40, 512
    raw = quantized_bytes(type_name, np.zeros((rows, cols), np.float32), np.random.default_rng(7))
    from gguf import GGMLQuantizationType, quants

    exact = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols).astype(np.float64)
    weight, scales, biases, bits = _loaded(type_name, raw, rows, cols)
    layer = QuantizedLinear16(cols, rows, bits, bias=True)
    bias = np.random.default_rng(8).normal(size=rows).astype(np.float32)
    layer.update({"weight": weight, "scales": scales, "biases": biases, "bias": mx.array(bias)})
    x = np.random.default_rng(9).normal(size=(2, 5, cols)).astype(np.float32)
    ours = np.array(layer(mx.array(x)))
    expected = x.astype(np.float64) @ exact.T + bias
    assert ours.shape == (2, 5, rows)
    np.testing.assert_allclose(ours, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert np.array_equal(np.array(layer.dequantized()), exact.astype(np.float32))


@pytest.mark.parametrize("type_name", TYPES)
def test_embedding_rows_and_tied_output(type_name):
    from gguf import GGMLQuantizationType, quants

    rows, cols = 24, 256
    raw = quantized_bytes(type_name, np.zeros((rows, cols), np.float32), np.random.default_rng(11))
    exact = quants.dequantize(raw, GGMLQuantizationType[type_name]).reshape(rows, cols).astype(np.float32)
    weight, scales, biases, bits = _loaded(type_name, raw, rows, cols)
    table = QuantizedEmbedding16(rows, cols, bits)
    table.update({"weight": weight, "scales": scales, "biases": biases})
    ids = np.array([[3, 0, 23], [7, 7, 12]])
    assert np.array_equal(np.array(table(mx.array(ids))), exact[ids])
    h = np.random.default_rng(12).normal(size=(3, cols)).astype(np.float32)
    expected = h.astype(np.float64) @ exact.astype(np.float64).T
    np.testing.assert_allclose(np.array(table.as_linear(mx.array(h))), expected, rtol=0,
                               atol=1e-5 * np.abs(expected).max())


def test_matmul16_matches_dequantize_then_matmul_in_float16():
    """Model dtype float16: the scales cast as the loader casts them; the product still
    equals dequantize-then-matmul up to float16 rounding."""
    rows, cols = 16, 256
    raw = quantized_bytes("Q6_K", np.zeros((rows, cols), np.float32), np.random.default_rng(13))
    weight, scales, biases, bits = _loaded("Q6_K", raw, rows, cols)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    x = mx.array(np.random.default_rng(14).normal(size=(1, cols)).astype(np.float16))
    ours = matmul16(x, weight, scales, biases, bits).astype(mx.float32)
    reference = (x.astype(mx.float32) @ dequantize16(weight, scales, biases, bits).astype(mx.float32).T)
    np.testing.assert_allclose(np.array(ours), np.array(reference), rtol=0, atol=2e-2 * float(mx.abs(reference).max()))


def test_q4_k_m_like_file_matches_transformers(tmp_path):
    """Q4_K layers with the Q6_K embedding (also the tied output) and Q6_K ``attn_v`` /
    ``ffn_down`` in layer 1, as llama.cpp's Q4_K_M mixes them."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from support.gguf_fixtures import VOCAB, write_llama_gguf

    from mlx_ferrum.models import load_model

    path = tmp_path / "model.gguf"
    write_llama_gguf(path, "Q4_K", embedding_type="Q6_K",
                     tensor_types={"blk.1.attn_v.weight": "Q6_K", "blk.1.ffn_down.weight": "Q6_K"})
    model, config, _ = load_model(path, dtype="float32")
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding16)
    assert isinstance(model.model.layers[1].mlp.down_proj, QuantizedLinear16)
    assert isinstance(model.model.layers[1].self_attn.v_proj, QuantizedLinear16)
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "QuantizedLinear"
    assert set(config["gguf"]["groups16"]) == {
        "model.embed_tokens", "model.layers.1.mlp.down_proj", "model.layers.1.self_attn.v_proj"}
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="model.gguf",
                                                                  dtype=torch.float32)
    ids = [int(t) for t in np.random.default_rng(0).integers(0, VOCAB, 20)]
    with torch.no_grad():
        expected = reference(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
    ours = np.array(model(mx.array([ids]))[0])
    assert np.abs(ours - expected).max() <= 1e-3


def test_lora_beside_a_16_group_layer_equals_lora_beside_its_exact_float_weights(tmp_path):
    """A PEFT adapter over every projection of an all-Q6_K model: the same logits (1e-4) as
    over the model whose 16-group layers are replaced by float layers of their exact weights."""
    import mlx.nn as nn
    from support.lora_fixtures import random_peft_adapter
    from support.lora_support import executor_with, run_greedy
    from mlx.utils import tree_unflatten

    from support.gguf_fixtures import write_llama_gguf
    from mlx_ferrum.models import load_model

    write_llama_gguf(tmp_path / "model.gguf", "Q6_K")
    ours, _, _ = load_model(tmp_path / "model.gguf", dtype="float32")
    floats, _, _ = load_model(tmp_path / "model.gguf", dtype="float32")
    swaps = []
    for path, module in floats.named_modules():
        if isinstance(module, QuantizedLinear16):
            out_dims, in_dims = module.dequantized().shape
            layer = nn.Linear(in_dims, out_dims, bias=False)
            layer.weight = module.dequantized()
            swaps.append((path, layer))
    floats.update_modules(tree_unflatten(swaps))
    adapter = random_peft_adapter(ours, tmp_path / "adapter", seed=4, std=0.05)
    ids = [3, 9, 27, 81, 40, 12, 6, 50]
    logits = {}
    for name, model in (("ours", ours), ("floats", floats)):
        ex = executor_with(model)
        ex.add_lora("a", str(adapter))
        _, (logits[name],) = run_greedy(ex, [ids], [ex.acquire_lora("a", "r")], 1)
    base = np.array(ours(mx.array([ids]))[0])
    assert np.abs(logits["ours"] - logits["floats"]).max() <= 1e-4
    assert np.abs(logits["ours"][: len(ids)] - base).max() > 1e-2  # the adapter matters


def test_tensor_parallelism_refuses_16_group_layers_by_name(tmp_path):
    from support.gguf_fixtures import write_llama_gguf

    from mlx_ferrum.distributed.sharding import shard_model
    from mlx_ferrum.errors import ShardingError
    from mlx_ferrum.models import load_model

    class TwoRanks:
        def size(self) -> int:
            return 2

        def rank(self) -> int:
            return 0

    write_llama_gguf(tmp_path / "model.gguf", "Q4_K", tensor_types={"blk.1.ffn_down.weight": "Q3_K"})
    model, _, _ = load_model(tmp_path / "model.gguf")
    with pytest.raises(ShardingError, match=r"model\.layers\.1\.mlp\.down_proj .*16-weight groups"):
        shard_model(model, TwoRanks())
