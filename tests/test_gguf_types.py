"""Every supported GGUF tensor type, on a tiny llama written with the ``gguf`` package:
the weights we load, dequantized, equal the ``gguf`` package's own dequantization
exactly (the 16-weight-group types Q6_K / Q3_K / Q2_K too, embedding and tied output
included); logits match transformers' GGUF loader in float32 at every position; 32
greedy tokens agree in both KV layouts."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("gguf")

from support.gguf_fixtures import HEADS, KV_HEADS, VOCAB, unpermute, write_llama_gguf  # noqa: E402
from mlx_ferrum.config import RuntimeConfig  # noqa: E402
from mlx_ferrum.executor import LlmExecutor  # noqa: E402
from mlx_ferrum.models import load_model  # noqa: E402
from mlx_ferrum.models.gguf.config import hf_name  # noqa: E402
from mlx_ferrum.models.gguf.reader import read_gguf  # noqa: E402

EXACT = ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "Q3_K", "Q2_K"]
#: code bits of each quantized type as loaded (the 16-weight-group types keep their own)
BITS = {"Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "Q3_K": 3, "Q2_K": 2}
GROUPS16 = ("Q6_K", "Q3_K", "Q2_K")
ATOL = 1e-3
NEW_TOKENS = 32


def _module_weight(model, name: str) -> np.ndarray:
    """The float32 weight of the parameter ``name`` (dequantized when quantized)."""
    path = name.rsplit(".", 1)[0]
    module = dict(model.named_modules())[path]
    if hasattr(module, "dequantized"):  # the 16-weight-group layers
        return np.array(module.dequantized().astype(mx.float32))
    if hasattr(module, "scales"):
        return np.array(mx.dequantize(module.weight, module.scales, module.biases, group_size=module.group_size,
                                      bits=module.bits).astype(mx.float32))
    return np.array(module.weight.astype(mx.float32))


def _reference_rows(name: str, values: np.ndarray) -> np.ndarray:
    if ".attn_q." in name:
        return unpermute(values, HEADS)
    if ".attn_k." in name:
        return unpermute(values, KV_HEADS)
    return values


@pytest.fixture(scope="module", params=EXACT)
def case(request, tmp_path_factory):
    type_name = request.param
    folder = tmp_path_factory.mktemp(type_name)
    reference = write_llama_gguf(folder / "model.gguf", type_name)
    model, config, _ = load_model(folder / "model.gguf", dtype="float32")
    return type_name, folder, reference, model


def test_loaded_weights_equal_gguf_dequantization(case):
    type_name, _, reference, model = case
    for name, values in reference.items():
        ours = _module_weight(model, hf_name(name))
        expected = _reference_rows(name, values)
        assert np.array_equal(ours, expected), (type_name, name)


def test_quantized_types_stay_quantized(case):
    type_name, _, _, model = case
    module = model.model.layers[0].mlp.down_proj
    if type_name in ("F32", "F16", "BF16"):
        assert not hasattr(module, "scales")
    else:
        assert (module.bits, module.group_size) == (BITS[type_name], 16 if type_name in GROUPS16 else 32)


@pytest.fixture(scope="module")
def transformers_case(case):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    type_name, folder, _, model = case
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file="model.gguf", dtype=torch.float32)
    ref.eval()
    for seed in range(8):
        prompt = [int(t) for t in np.random.default_rng(seed).integers(0, VOCAB, 12)]
        with torch.no_grad():
            out = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                               do_sample=False, pad_token_id=0, eos_token_id=None)
            ids = [int(t) for t in out[0]]
            logits = ref(torch.tensor([ids]), use_cache=False).logits[0].float().numpy()
        top2 = np.sort(logits[len(prompt) - 1:-1], axis=-1)[:, -2:]
        if (top2[:, 1] - top2[:, 0]).min() > 10 * ATOL:
            return type_name, model, prompt, ids[len(prompt):], logits
    pytest.skip("no prompt without near-ties in the reference")


def test_logits_match_transformers_gguf_loader(transformers_case):
    type_name, model, prompt, expected, ref_logits = transformers_case
    ours = np.array(model(mx.array([prompt + expected]))[0].astype(mx.float32))
    assert np.abs(ours - ref_logits).max() <= ATOL, type_name


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_greedy_tokens_match_transformers(transformers_case, layout):
    from support.hf_reference import executor_greedy

    type_name, model, prompt, expected, ref_logits = transformers_case
    cfg = RuntimeConfig(kv_layout=layout, kv_capacity=128, block_size=8, max_num_blocks=64 if layout == "paged" else None)
    tokens, ours = executor_greedy(LlmExecutor(model, config=cfg), prompt, len(prompt) // 2 if layout == "paged" else
                                   len(prompt), NEW_TOKENS)
    assert tokens == expected, type_name
    assert np.abs(ours - ref_logits[: ours.shape[0]]).max() <= ATOL, type_name


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_packed_codes_are_what_mlx_dequantizes(bits):
    from mlx_ferrum.models.gguf.tensors import pack_codes

    codes = np.random.default_rng(bits).integers(0, 2 ** bits, (3, 96)).astype(np.uint8)
    unpacked = mx.dequantize(mx.array(pack_codes(codes, bits)), mx.ones((3, 3)), mx.zeros((3, 3)), group_size=32,
                             bits=bits)
    assert np.array_equal(np.array(unpacked), codes)


#: loaded bytes / file tensor bytes: the legacy types store float16 scale + bias per 32
#: weights (Q4_0: 5 bits against 4.5), the K-quants float32 ones (Q4_K: 6 against 4.5);
#: the 16-weight-group types a float32 scale + bias per 16 weights (Q6_K: 6 + 4 bits
#: against 6.5625, Q3_K: 3 + 4 against 3.4375, Q2_K: 2 + 4 against 2.625)
MEMORY_BOUND = {"Q8_0": 1.15, "Q4_0": 1.15, "Q4_1": 1.15, "Q5_0": 1.15, "Q5_1": 1.15, "Q4_K": 1.4, "Q5_K": 1.4,
                "Q6_K": 1.55, "Q3_K": 2.1, "Q2_K": 2.35}


def test_loaded_bytes_stay_near_the_file(case):
    from mlx.utils import tree_flatten

    from mlx_ferrum.models.gguf.reader import read_gguf

    type_name, folder, _, _ = case
    if type_name not in MEMORY_BOUND:
        pytest.skip("float types are stored as they are")
    model, _, _ = load_model(folder / "model.gguf")  # the stored dtypes, no float32 cast
    loaded = sum(p.nbytes for _, p in tree_flatten(model.parameters()))
    stored = sum(np.asarray(t.data).nbytes for t in read_gguf(folder / "model.gguf").tensors.values())
    assert loaded <= MEMORY_BOUND[type_name] * stored, (type_name, loaded / stored)


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K"])
def test_codes_written_into_an_mlx_array_equal_the_numpy_conversion(type_name):
    """The loader writes packed codes straight into MLX arrays through numpy views; the
    array must hold what the plain conversion returns, and dequantize to gguf's values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    from support.gguf_fixtures import quantized_bytes

    from mlx_ferrum.models.gguf.tensors import convert_numpy, packed_shape, to_mlx

    rng = np.random.default_rng(7)
    raw = quantized_bytes(type_name, rng.normal(0, 0.05, (6, 512)).astype(np.float32), rng)
    plain = convert_numpy(type_name, raw, (6, 512))
    target = mx.zeros(packed_shape(type_name, (6, 512)), dtype=mx.uint32)
    mx.eval(target)
    written = to_mlx(convert_numpy(type_name, raw, (6, 512), out=np.asarray(target)), weight=target)
    assert np.array_equal(np.array(written.weight), plain.weight)
    values = mx.dequantize(written.weight, written.scales.astype(mx.float32), written.biases.astype(mx.float32),
                           group_size=32, bits=written.bits)
    assert np.array_equal(np.array(values), dequantize(raw, GGMLQuantizationType[type_name]).reshape(6, 512))


def test_the_readers_own_type_table_agrees_with_gguf():
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    from mlx_ferrum.models.gguf.reader import _COMMON_TYPES

    for type_id, (name, block, size) in _COMMON_TYPES.items():
        assert GGMLQuantizationType(type_id).name == name
        assert GGML_QUANT_SIZES[GGMLQuantizationType(type_id)] == (block, size)


@pytest.mark.parametrize("type_name", ["F16", "Q8_0", "Q4_0", "Q4_1"])
def test_mlx_reader_reads_its_types_as_the_numpy_conversion(type_name, tmp_path):
    """Files of these types are read by ``mx.load``: it must take every tensor (so the
    dequantization test above covers that path) with the numpy converter's bytes and dtypes."""
    from mlx_ferrum.models.gguf.checkpoint import _mlx_load, _mlx_reader_tensors
    from mlx_ferrum.models.gguf.tensors import convert_tensor

    write_llama_gguf(tmp_path / "model.gguf", type_name)
    model_file = read_gguf(tmp_path / "model.gguf")
    wanted = [(n, t) for n, t in model_file.tensors.items() if hf_name(n) is not None]
    taken = _mlx_reader_tensors(_mlx_load(model_file.files), wanted)
    assert sorted(taken) == sorted(n for n, _ in wanted)
    for name, tensor in wanted:
        plain = convert_tensor(tensor.type_name, tensor.data, tensor.shape)
        for ours, theirs in ((taken[name].weight, plain.weight), (taken[name].scales, plain.scales),
                             (taken[name].biases, plain.biases)):
            assert (ours is None) == (theirs is None), name
            if ours is not None:
                assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, name
                assert np.array_equal(np.array(ours).view(np.uint8), np.array(theirs).view(np.uint8)), name


def test_q4_0_bias_overflowing_float16_is_left_to_the_numpy_converter(tmp_path):
    """``-8 d`` of a Q4_0 block with d = 32768 overflows float16: MLX's reader would give
    -inf, the numpy converter widens to float32; the loader must give the latter."""
    from mlx_ferrum.models.gguf.checkpoint import load_gguf_checkpoint

    path = tmp_path / "model.gguf"
    write_llama_gguf(path, "Q4_0")
    tensor = read_gguf(path).tensors["blk.0.ffn_down.weight"]
    original = bytes(np.asarray(tensor.data).reshape(-1)[:64])
    del tensor
    content = bytearray(path.read_bytes())
    at = content.find(original)
    assert at > 0 and content.find(original, at + 1) < 0
    content[at:at + 2] = np.float16(32768).tobytes()  # the first block's d
    path.write_bytes(bytes(content))
    _, weights, _ = load_gguf_checkpoint(path)
    biases = weights["model.layers.0.mlp.down_proj.biases"]
    assert biases.dtype == mx.float32
    assert biases[0, 0].item() == -8 * 32768.0
    assert bool(mx.all(mx.isfinite(biases)).item())
