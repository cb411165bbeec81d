"""MLX's microscaling quantization modes (mxfp4, mxfp8, nvfp4) and gpt-oss's MXFP4 release.

References, independent of this project's code:
- mlx-lm writes the checkpoints (``mlx_lm.convert(quantize=True, q_mode=...)``) and its
  own forward, with its float parameters cast to fp32, gives the expected logits and
  greedy tokens;
- for the gpt-oss release, the tensors are written here with numpy following the
  release's layout, and transformers' dequantizing loader (``Mxfp4Config(dequantize=True)``)
  gives the expected logits; a numpy decoder of the E2M1/E8M0 codes checks the repack.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_map

from support.checkpoints import make_checkpoint as make_tiny_checkpoint
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine
from mlx_ferrum.engine.sampling import SamplingParams
from mlx_ferrum.errors import InvalidWeightError, UnsupportedQuantizationError
from mlx_ferrum.executor import DecodeInput, LlmExecutor, PrefillInput
from mlx_ferrum.layers.moe import QuantizedSwitchLinear
from mlx_ferrum.models import load_model

mlx_lm_utils = pytest.importorskip("mlx_lm.utils")
mlx_lm_generate = pytest.importorskip("mlx_lm.generate")
mlx_lm_convert = pytest.importorskip("mlx_lm.convert")

MODES = ("mxfp4", "mxfp8", "nvfp4")
LOGIT_ATOL = 2e-3
NEW_TOKENS = 32


def _convert(src: Path, out: Path, mode: str, predicate=None) -> Path:
    mlx_lm_convert.convert(str(src), str(out), quantize=True, q_mode=mode, quant_predicate=predicate)
    return out


@pytest.fixture(scope="module")
def dense_source(tmp_path_factory) -> Path:
    # Llama-3.2-shaped: tied embeddings, so the embedding is quantized too and serves as the head
    return make_tiny_checkpoint(tmp_path_factory.mktemp("dense") / "src", "llama3")


@pytest.fixture(scope="module")
def moe_source(tmp_path_factory) -> Path:
    hf_reference = pytest.importorskip("support.hf_reference")
    root = tmp_path_factory.mktemp("moe")
    hf_reference.make_checkpoint("qwen3_moe", root / "src")
    cfg = json.loads((root / "src" / "config.json").read_text())
    # mlx-lm 0.32 reads the older key spellings
    cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    (root / "src" / "config.json").write_text(json.dumps(cfg))
    return root / "src"


def _mlx_lm_fp32(folder: Path):
    ref, _ = mlx_lm_utils.load_model(folder)
    ref.update(tree_map(lambda a: a.astype(mx.float32) if mx.issubdtype(a.dtype, mx.floating) else a,
                        ref.parameters()))
    return ref


def _prompt(vocab: int, seed: int, length: int = 24) -> list[int]:
    return [int(t) for t in mx.random.randint(3, vocab, (length,), key=mx.random.key(seed)).tolist()]


def _executor_greedy(model, prompt: list[int], layout: str) -> list[int]:
    cfg = RuntimeConfig(kv_layout=layout, kv_capacity=256, max_num_blocks=64 if layout == "paged" else None)
    executor = LlmExecutor(model, config=cfg)
    out = executor.prefill(PrefillInput(input_ids=mx.array([prompt])))
    tokens, handle = [int(mx.argmax(out.logits[0, -1]).item())], out.kv_cache
    for _ in range(NEW_TOKENS - 1):
        step = executor.decode(DecodeInput(input_ids=mx.array([[tokens[-1]]]), kv_cache=handle))
        handle = step.kv_cache
        tokens.append(int(mx.argmax(step.logits.reshape(-1)).item()))
    executor.release_cache(handle.cache_id)
    return tokens


def _engine_greedy(model, prompts: list[list[int]], layout: str, **config) -> list[list[int]]:
    engine = Engine(model, None, RuntimeConfig(kv_layout=layout, kv_capacity=256, **config))
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    return [list(r.token_ids) for r in engine.generate(prompts, params)]


def _check_against_mlx_lm(folder: Path, expected_layer_type, mode: str) -> None:
    ours, config, _ = load_model(folder, dtype=mx.float32)
    ref = _mlx_lm_fp32(folder)
    quantized = [m for _, m in ours.named_modules() if getattr(m, "mode", None) == mode]
    assert quantized and any(isinstance(m, expected_layer_type) for m in quantized)
    for seed in range(8):  # a prompt whose greedy path has no near-tie at fp32 rounding
        prompt = _prompt(config["vocab_size"], seed)
        expected = [int(t) for t, _ in mlx_lm_generate.generate_step(mx.array(prompt), ref, max_tokens=NEW_TOKENS)]
        sequence = mx.array([prompt + expected])
        ref_logits = ref(sequence)[0]
        top2 = mx.sort(ref_logits[len(prompt) - 1: -1], axis=-1)[:, -2:]
        if (top2[:, 1] - top2[:, 0]).min().item() > 10 * LOGIT_ATOL:
            break
    err = mx.abs(ours(sequence)[0] - ref_logits).max().item()
    assert err <= LOGIT_ATOL, f"{mode}: max |logits - mlx-lm| = {err:.3g}"
    for layout in ("contiguous", "paged"):
        assert _executor_greedy(ours, prompt, layout) == expected, (mode, layout)
        assert _engine_greedy(ours, [prompt], layout) == [expected], (mode, layout)


@pytest.mark.parametrize("mode", MODES)
def test_dense_checkpoint_in_each_mode_matches_mlx_lm(dense_source, tmp_path, mode):
    import mlx.nn as nn

    _check_against_mlx_lm(_convert(dense_source, tmp_path / mode, mode), nn.QuantizedLinear, mode)


@pytest.mark.parametrize("mode", MODES)
def test_moe_checkpoint_in_each_mode_matches_mlx_lm(moe_source, tmp_path, mode):
    folder = _convert(moe_source, tmp_path / mode, mode)
    _check_against_mlx_lm(folder, QuantizedSwitchLinear, mode)
    ours, _, _ = load_model(folder)
    experts = ours.model.layers[0].mlp.switch_mlp.gate_proj
    assert isinstance(experts, QuantizedSwitchLinear) and experts.mode == mode and "biases" not in experts


def test_per_module_modes_and_float_modules(dense_source, tmp_path):
    """One checkpoint mixing modes: the default mxfp4, one module in mxfp8, one in affine
    8-bit, one left in float; each module gets its own mode, as mlx-lm records it."""

    def predicate(path, module):
        if path == "model.layers.0.mlp.down_proj":
            return {"group_size": 32, "bits": 8, "mode": "mxfp8"}
        if path == "model.layers.1.mlp.up_proj":
            return {"group_size": 64, "bits": 8, "mode": "affine"}
        if path == "model.layers.1.self_attn.v_proj":
            return False
        return True

    folder = _convert(dense_source, tmp_path / "mixed", "mxfp4", predicate)
    ours, _, _ = load_model(folder, dtype=mx.float32)
    layers = ours.model.layers
    assert layers[0].mlp.down_proj.mode == "mxfp8"
    assert (layers[1].mlp.up_proj.mode, layers[1].mlp.up_proj.bits) == ("affine", 8)
    assert not hasattr(layers[1].self_attn.v_proj, "mode")
    assert layers[0].self_attn.q_proj.mode == "mxfp4"
    ref = _mlx_lm_fp32(folder)
    ids = mx.array([_prompt(ours.args.vocab_size, 0, 40)])
    assert mx.abs(ours(ids) - ref(ids)).max().item() <= LOGIT_ATOL


def test_microscaling_checkpoint_with_speculation_and_prefix_cache(dense_source, tmp_path):
    """An mxfp4 base under the paged engine with n-gram speculation and prefix caching
    gives the tokens of the plain contiguous run."""
    ours, config, _ = load_model(_convert(dense_source, tmp_path / "m", "mxfp4"), dtype=mx.float32)
    prompts = [_prompt(config["vocab_size"], s, 12) * 2 for s in range(3)]  # repetitive: the n-gram proposer fires
    plain = _engine_greedy(ours, prompts, "contiguous")
    assert _engine_greedy(ours, prompts, "paged", speculative="ngram", prefix_cache=True,
                          speculative_disable_by_batch_size=1 << 20) == plain


# ----------------------------------------------------------------------------- errors


def _with_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_unknown_mode_is_refused_by_name(dense_source, tmp_path):
    folder = _convert(dense_source, tmp_path / "m", "mxfp4")
    bad = _with_config(folder, tmp_path / "bad", quantization={"group_size": 32, "bits": 4, "mode": "int3x"})
    with pytest.raises(UnsupportedQuantizationError, match="'int3x'") as info:
        load_model(bad)
    assert "mxfp4" in str(info.value) and "mlx_lm.convert" in str(info.value)
    assert "re-export" not in str(info.value)


def test_unsupported_hf_method_names_method_and_conversion(dense_source, tmp_path):
    bad = _with_config(dense_source, tmp_path / "awq",
                       quantization_config={"quant_method": "awq", "bits": 4, "group_size": 128})
    with pytest.raises(UnsupportedQuantizationError, match="'awq'") as info:
        load_model(bad)
    message = str(info.value)
    assert "mlx_lm.convert" in message and "--q-mode" in message and "mxfp4" in message


def test_scales_dtype_disagreeing_with_mode_is_named(dense_source, tmp_path):
    """uint8 scales under a config that says affine name the tensor and the mode."""
    folder = _convert(dense_source, tmp_path / "m", "mxfp4")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization"]["model.layers.0.self_attn.q_proj"] = {"group_size": 32, "bits": 4, "mode": "affine"}
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(InvalidWeightError, match=r"q_proj\.scales.*affine"):
        load_model(folder)


# ----------------------------------------------------------------------------- gpt-oss MXFP4 release

FP4_E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
                    dtype=np.float32)


def mxfp4_encode(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``[..., rows, in]`` float -> the release's ``blocks [..., rows, in/32, 16]`` and
    ``scales [..., rows, in/32]`` uint8 (OCP MX v1.0: shared exponent floor(log2 amax) - 2,
    elements rounded to the nearest E2M1 value)."""
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    exponent = np.where(amax > 0, np.floor(np.log2(np.maximum(amax, 1e-30))) - 2, -127).astype(np.int32)
    scaled = groups / np.exp2(exponent.astype(np.float32))
    codes = np.abs(np.abs(scaled)[..., None] - FP4_E2M1[:8]).argmin(axis=-1).astype(np.uint8)
    codes = np.where(scaled < 0, codes | 8, codes).astype(np.uint8)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)
    return blocks, (exponent[..., 0] + 127).astype(np.uint8)


def mxfp4_decode(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """The inverse of :func:`mxfp4_encode`: ``[..., rows, in]`` float32."""
    out = np.empty((*blocks.shape[:-1], 32), dtype=np.float32)
    out[..., 0::2] = FP4_E2M1[blocks & 0x0F]
    out[..., 1::2] = FP4_E2M1[blocks >> 4]
    out = out * np.exp2(scales.astype(np.float32) - 127)[..., None]
    return out.reshape(*blocks.shape[:-2], -1)


@pytest.fixture(scope="module")
def gpt_oss_release(tmp_path_factory):
    """A tiny gpt-oss checkpoint in the Hub's MXFP4 layout: bf16 attention, router and
    embeddings; experts as blocks and scales, written with numpy."""
    hf_reference = pytest.importorskip("support.hf_reference")
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file
    from safetensors.torch import save_file

    root = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf_reference.make_checkpoint("gpt_oss", root / "src")
    tensors = load_file(str(root / "src" / "model.safetensors"))
    out = {}
    for name, value in tensors.items():
        if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            # transformers stores [E, in, out]; the release stores [E, out, in] blocks
            blocks, scales = mxfp4_encode(np.ascontiguousarray(np.swapaxes(value.astype(np.float32), -1, -2)))
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
        else:
            out[name] = value.astype(np.float32)
    bf16 = {k: v for k, v in out.items() if v.dtype == np.float32}
    folder = root / "release"
    folder.mkdir()
    save_file({k: (torch.from_numpy(v).to(torch.bfloat16) if k in bf16 else torch.from_numpy(v))
                for k, v in out.items()}, str(folder / "model.safetensors"))
    cfg = json.loads((root / "src" / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder, out


def test_mxfp4_encoder_round_trips_e2m1_values():
    values = (FP4_E2M1[np.arange(64) % 16] * 4.0).reshape(2, 32)
    blocks, scales = mxfp4_encode(values)
    np.testing.assert_array_equal(mxfp4_decode(blocks, scales), values)


def test_gpt_oss_release_experts_repack_without_dequantizing(gpt_oss_release):
    folder, tensors = gpt_oss_release
    model, config, _ = load_model(folder)
    experts = model.model.layers[0].mlp.experts
    for proj in (experts.gate_proj, experts.up_proj, experts.down_proj):
        assert isinstance(proj, QuantizedSwitchLinear) and proj.mode == "mxfp4" and proj.bits == 4
        assert proj.weight.dtype == mx.uint32 and proj.scales.dtype == mx.uint8
    # modules_to_not_convert stay in the release's float dtype
    assert model.model.layers[0].self_attn.q_proj.weight.dtype == mx.bfloat16
    assert model.model.layers[0].mlp.router.weight.dtype == mx.bfloat16
    # MLX's own dequantization of the repacked codes equals the numpy decoding of the release's bytes
    name = "model.layers.0.mlp.experts.gate_up_proj"
    expected = mxfp4_decode(tensors[name + "_blocks"], tensors[name + "_scales"])  # [E, 2I, H]
    for proj, rows in ((experts.gate_proj, slice(0, None, 2)), (experts.up_proj, slice(1, None, 2))):
        decoded = mx.dequantize(proj.weight, proj.scales, None, group_size=32, bits=4, mode="mxfp4")
        np.testing.assert_array_equal(np.array(decoded.astype(mx.float32)), expected[:, rows])
    # resident expert bytes (codes + scales) against the same matrices in bf16
    resident = sum(p.weight.nbytes + p.scales.nbytes for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    bf16_bytes = 2 * sum(int(np.prod(p.weight.shape[:-1])) * p.weight.shape[-1] * 8
                         for p in (experts.gate_proj, experts.up_proj, experts.down_proj))
    assert resident / bf16_bytes <= 0.30


def test_gpt_oss_release_matches_transformers_dequantized(gpt_oss_release):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    folder, _ = gpt_oss_release
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(folder), quantization_config=transformers.Mxfp4Config(dequantize=True),
        dtype=torch.float32, attn_implementation="eager",
    ).float().eval()
    ours, config, _ = load_model(folder, dtype=mx.float32)
    ids = _prompt(config["vocab_size"], 1, 48)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0].numpy()
    got = np.array(ours(mx.array([ids]))[0])
    err = np.abs(got - expected).max()
    assert err <= 1e-3, f"max |logits - transformers (Mxfp4Config(dequantize=True))| = {err:.3g}"
    for layout in ("contiguous", "paged"):
        tokens = _executor_greedy(ours, ids[:16], layout)
        with torch.no_grad():
            full = reference(torch.tensor([ids[:16] + tokens])).logits[0].numpy()
        assert tokens == [int(t) for t in full[15:-1].argmax(-1)], layout


def test_gpt_oss_release_with_missing_scales_is_named(gpt_oss_release, tmp_path):
    pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    folder, _ = gpt_oss_release
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    tensors = {k: v for k, v in load_file(str(broken / "model.safetensors")).items()
               if k != "model.layers.1.mlp.experts.down_proj_scales"}
    save_file(tensors, str(broken / "model.safetensors"))
    from mlx_ferrum.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="down_proj_scales"):
        load_model(broken)


# ----------------------------------------------------------------------------- warnings


def test_device_queries_use_mx_device_info_without_deprecation_warning(monkeypatch):
    """On a Mac, pool sizing, the memory check and the kernels' core count read the device;
    MLX 0.32 deprecates ``mx.metal.device_info`` with a warning on every call, so none of
    them may call it when ``mx.device_info`` exists."""
    import warnings

    from mlx_ferrum import config as config_module
    from mlx_ferrum.kernels import metal
    from mlx_ferrum.kv_cache.store import default_num_blocks

    def deprecated():
        warnings.warn("mx.metal.device_info is deprecated, use mx.device_info", DeprecationWarning, stacklevel=2)
        return {"max_recommended_working_set_size": 8 << 30, "architecture": "applegpu_g15s"}

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx.metal, "device_info", deprecated)
    monkeypatch.setattr(mx, "device_info", lambda: {"max_recommended_working_set_size": 8 << 30,
                                                    "architecture": "applegpu_g15s"}, raising=False)
    metal.gpu_cores.cache_clear()
    try:
        # recorded, not raised: pool sizing treats device queries as best effort and would swallow an error
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert config_module.available_memory_bytes() == 8 << 30
            assert metal.gpu_cores() == 18  # the 's' (Pro) chip class
            per_block = 2 * 2 * 2 * 16 * 16 * 2
            blocks = default_num_blocks(2, 2, 16, 16, mx.float16, weight_bytes=0, memory_fraction=0.5)
            assert blocks == (4 << 30) // per_block  # the budget came from the device's working set
        assert not [w for w in caught if issubclass(w.category, DeprecationWarning)]
    finally:
        metal.gpu_cores.cache_clear()
