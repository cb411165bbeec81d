"""The shortcuts the CPU backend takes (attention, SwiGLU), against independent references.

- ``sdpa_base2`` (the softmax in base 2) against MLX's ``mx.fast.scaled_dot_product_attention``
  and a numpy softmax, for every mask kind, GQA and attention sinks.
- ``swiglu`` (SiLU in base 2, one fused kernel) against ``nn.silu(gate) * up`` and numpy.
- The reference decode attention with the index arrays a pass shares across layers
  (``kernels.reference.decode_index``), against numpy, built once per pass.
- Batched "fresh" prefill runs (new prompts of equal length attend to their own K/V in
  one SDPA) against the model's own no-cache forward pass, in batches that mix fresh
  runs of several lengths, a chunk continuing a cached prompt, and decodes.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.executor import LlmExecutor, SeqWork
from mlx_ferrum.layers.attention import PagedAttentionBackend, PagedMetadata, prefill_runs, sdpa_base2

from support.tiny_models import tiny_model

# B, heads, kv heads, L_q, L_k; (1, 8, 2, 64, 80) has over 2**15 scores, which take the
# compiled 2**x; the last two over PREFILL_GROUP_SCORES, so a causal mask takes query tiles
SHAPES = [(2, 8, 4, 5, 9), (1, 4, 1, 7, 7), (3, 6, 6, 1, 10), (1, 8, 2, 64, 80), (1, 8, 2, 150, 200),
          (2, 4, 4, 130, 130)]


def _numpy_attention(q, k, v, scale, additive, sinks):
    """Plain softmax attention in float64 (numpy), GQA by repeating K/V heads."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.swapaxes(-1, -2) * scale + additive
    top = scores.max(-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, np.asarray(sinks, dtype=np.float64)[None, :, None, None])
    weights = np.exp(scores - top)
    denom = weights.sum(-1, keepdims=True)
    if sinks is not None:
        denom = denom + np.exp(np.asarray(sinks, dtype=np.float64)[None, :, None, None] - top)
    return (weights / denom) @ v


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mask_kind", ["none", "causal", "additive_4d", "additive_2d", "boolean_4d", "per_head_4d"])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_sdpa_base2_equals_fused_sdpa_and_numpy(shape, mask_kind, with_sinks):
    b, heads, kv_heads, lq, lk = shape
    rng = np.random.default_rng(sum(shape))
    q, k, v = (mx.array(rng.normal(size=s).astype(np.float32))
               for s in ((b, heads, lq, 8), (b, kv_heads, lk, 8), (b, kv_heads, lk, 8)))
    sinks = mx.array(rng.normal(size=heads).astype(np.float32)) if with_sinks else None
    allowed = rng.uniform(size=(b, 1, lq, lk)) > 0.3
    allowed[..., 0] = True
    additive = np.where(allowed, 0.0, -np.inf).astype(np.float32)
    if mask_kind == "none":
        mask, ref_add = None, np.zeros((1, 1, lq, lk))
    elif mask_kind == "causal":
        mask = "causal"
        ref_add = np.where(np.arange(lk)[None, :] <= np.arange(lq)[:, None] + lk - lq, 0.0, -np.inf)
    elif mask_kind == "additive_4d":
        mask, ref_add = mx.array(additive), additive
    elif mask_kind == "additive_2d":
        mask, ref_add = mx.array(additive[0, 0]), additive[0, 0]
    elif mask_kind == "boolean_4d":
        mask, ref_add = mx.array(allowed), additive
    else:  # one mask per query head
        per_head = np.where(rng.uniform(size=(b, heads, lq, lk)) > 0.3, 0.0, -np.inf).astype(np.float32)
        per_head[..., 0] = 0.0
        mask, ref_add = mx.array(per_head), per_head
    got = sdpa_base2(q, k, v, 0.3, mask, sinks)
    extra = {} if sinks is None else {"sinks": sinks}
    fused = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=mask, **extra)
    np.testing.assert_allclose(np.array(got), np.array(fused), rtol=1e-5, atol=1e-6)
    expect = _numpy_attention(q, k, v, 0.3, ref_add, None if sinks is None else np.array(sinks))
    np.testing.assert_allclose(np.array(got), expect, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lq", [1, 6])  # score rows under and over head_dim
def test_sdpa_base2_in_bfloat16_normalises_in_float32(lq):
    # bfloat16 values: the denominator is summed from the float32 weights, not through a
    # bfloat16 product (which would round a long row's sum), then the output divided
    rng = np.random.default_rng(lq)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((2, 4, lq, 8), (2, 2, 300, 8), (2, 2, 300, 8)))
    got = sdpa_base2(*(mx.array(x).astype(mx.bfloat16) for x in (q, k, v)), 0.3, "causal")
    assert got.dtype == mx.bfloat16
    rounded = [np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32)) for x in (q, k, v)]
    causal = np.where(np.arange(300)[None, :] <= np.arange(lq)[:, None] + 300 - lq, 0.0, -np.inf)
    expect = _numpy_attention(*rounded, 0.3, causal, None)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), expect, rtol=2e-2, atol=1e-2)


def _meta(context_lens, query_lens, num_decode):
    starts = np.concatenate([[0], np.cumsum(query_lens)]).tolist()
    return PagedMetadata(backend=PagedAttentionBackend(), pool=None, positions=None, context_lens=None, num_decode_seqs=num_decode,
                         layer_groups=[], groups=[], host_context_lens=list(context_lens),
                         host_query_start_loc=starts)


def test_prefill_runs_group_only_fresh_prompts_of_equal_length():
    # decode, then fresh 4, fresh 4, fresh 6, a chunk continuing a cached prompt (ctx 9, new 3), fresh 4
    meta = _meta([10, 4, 4, 6, 9, 4], [1, 4, 4, 6, 3, 4], num_decode=1)
    assert prefill_runs(meta, 1, None) == [(1, 3, True), (3, 4, True), (4, 5, False), (5, 6, True)]
    # a window shorter than the prompt sends it to the paged path
    assert prefill_runs(meta, 1, 5) == [(1, 3, True), (3, 5, False), (5, 6, True)]


def _no_cache_last_logits(model, ids):
    return np.array(model(mx.array([ids]))[0, -1])


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "llama3"])
def test_mixed_prefill_batch_equals_the_no_cache_forward(family):
    from support.tiny_models import CONFIGS

    if family not in CONFIGS:
        pytest.skip(f"no tiny {family} config")
    model = tiny_model(family)
    rng = np.random.default_rng(3)
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=128))
    old = rng.integers(0, 97, size=12).tolist()
    ex.run([SeqWork("old", old[:9])])  # continues below with a 3-token chunk
    decoding = rng.integers(0, 97, size=6).tolist()
    ex.run([SeqWork("dec", decoding[:5])])
    prompts = {f"fresh{i}": rng.integers(0, 97, size=n).tolist() for i, n in enumerate((5, 5, 5, 9, 5))}
    work = [SeqWork("dec", decoding[5:]), SeqWork("old", old[9:])] + [SeqWork(c, p) for c, p in prompts.items()]
    out = ex.run(work)
    expect = [_no_cache_last_logits(model, decoding), _no_cache_last_logits(model, old)] + [
        _no_cache_last_logits(model, p) for p in prompts.values()]
    for got, want in zip(out, expect):
        np.testing.assert_allclose(np.array(got[0]), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_swiglu_equals_silu_times_up(dtype):
    import mlx.nn as nn

    from mlx_ferrum.layers.dense import swiglu

    rng = np.random.default_rng(5)
    gate32 = mx.array((rng.normal(size=(7, 33)) * 6).astype(np.float32))
    up32 = mx.array(rng.normal(size=(7, 33)).astype(np.float32))
    gate, up = gate32.astype(getattr(mx, dtype)), up32.astype(getattr(mx, dtype))
    got = swiglu(gate, up)
    assert got.dtype == gate.dtype and got.shape == gate.shape
    g64, u64 = np.array(gate.astype(mx.float32), dtype=np.float64), np.array(up.astype(mx.float32), dtype=np.float64)
    expect = g64 / (1 + np.exp(-g64)) * u64
    # within the dtype's own rounding of nn.silu(gate) * up
    mlx_error = np.abs(np.array((nn.silu(gate) * up).astype(mx.float32)) - expect).max()
    tolerance = max(2 * mlx_error, 1e-5)
    np.testing.assert_allclose(np.array(got.astype(mx.float32)), expect, atol=tolerance, rtol=0)


ROPE_KINDS = [
    dict(rope_type="default", rope_theta=10000.0),
    dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5),
    dict(rope_type="linear", factor=2.0, rope_theta=10000.0),
    dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=64),
    dict(rope_type="dynamic", factor=4.0, rope_theta=10000.0, original_max_position_embeddings=64),
    dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, rope_theta=150000.0),
    dict(rope_type="longrope", rope_theta=10000.0, original_max_position_embeddings=256,
         short_factor=[1.0 + i / 8 for i in range(8)], long_factor=[2.0 + i / 8 for i in range(8)]),
]


@pytest.mark.parametrize("params", ROPE_KINDS, ids=[p["rope_type"] + ("_partial" if "partial_rotary_factor" in p else "")
                                                    for p in ROPE_KINDS])
def test_rope_table_equals_the_fast_rope_of_every_kind(params):
    """The paged path's per-pass cos/sin table rotates exactly as ``mx.fast.rope`` with the
    rope's own settings (the eager and contiguous paths' call)."""
    from mlx_ferrum.layers.rope import Rope

    rope = Rope(16, params, 256)
    if not rope.has_table:
        pytest.skip("this rope switches factors on the pass's last position: no table")
    x = mx.array(np.random.default_rng(9).normal(size=(7, 3, 16)).astype(np.float32))
    positions = mx.array([0, 5, 9, 100, 3, 200, 1], dtype=mx.int32)
    want = rope(x[:, :, None, :], positions)[:, :, 0, :]
    np.testing.assert_allclose(np.array(rope.apply_table(x, rope.table(positions))), np.array(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("partial", [False, True])
def test_rope_table_rotation_is_the_same_bits_as_a_product_and_as_copies(partial, monkeypatch):
    """``apply_table`` turns small inputs with a constant +-1 matrix and large ones by
    slicing the halves: both equal transformers' ``rotate_half`` formula in numpy, and
    each other bit for bit, in float32 and bfloat16."""
    from mlx_ferrum.layers import rope as rope_module

    params = dict(rope_type="default", rope_theta=10000.0)
    if partial:
        params["partial_rotary_factor"] = 0.5
    rope = rope_module.Rope(16, params, 256)
    rng = np.random.default_rng(3)
    positions = mx.array(rng.integers(0, 256, 9), dtype=mx.int32)
    table = rope.table(positions)
    for dtype in (mx.float32, mx.bfloat16):
        x = mx.array(rng.normal(size=(9, 3, 16)).astype(np.float32)).astype(dtype)
        monkeypatch.setattr(rope_module, "MAX_PRODUCT_ROTATION_SIZE", 1 << 30)
        by_product = np.array(rope.apply_table(x, table).astype(mx.float32))
        monkeypatch.setattr(rope_module, "MAX_PRODUCT_ROTATION_SIZE", 0)
        by_copies = np.array(rope.apply_table(x, table).astype(mx.float32))
        assert np.array_equal(by_product, by_copies)
        d, half = rope.dims, rope.dims // 2
        xs = np.array(x.astype(mx.float32)).astype(np.float64)
        angles = np.array(positions)[:, None].astype(np.float64) * (1.0 / 10000.0 ** (np.arange(0, d, 2) / d))
        cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
        x1, x2 = xs[..., :half], xs[..., half:d]
        want = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xs[..., d:]], axis=-1)
        tolerance = 1e-5 if dtype == mx.float32 else 2e-2
        np.testing.assert_allclose(by_product, want, rtol=tolerance, atol=tolerance)


# ------------------------------------------------------ reference decode: per-pass index arrays
from mlx_ferrum.kernels import reference  # noqa: E402


@pytest.mark.parametrize("window", [None, 5])
def test_decode_with_a_shared_index_equals_numpy(window):
    rng = np.random.default_rng(11)
    num_blocks, kv_heads, block_size, head_dim, heads = 10, 2, 4, 8, 4
    k_pool, v_pool = (rng.normal(size=(num_blocks, kv_heads, block_size, head_dim)).astype(np.float32) for _ in range(2))
    tables = np.array([[3, 7, 1], [5, 0, 9], [8, 2, 4]], dtype=np.int32)
    lens = [2, 7, 12]
    q = rng.normal(size=(3, heads, head_dim)).astype(np.float32)
    scale = head_dim ** -0.5
    args = (mx.array(q), mx.array(k_pool), mx.array(v_pool), mx.array(tables), mx.array(lens, dtype=mx.int32), scale)
    index = reference.decode_index(args[3], args[4], kv_heads, block_size)
    shared = np.asarray(reference.paged_attention_decode(*args, window=window, index=index))
    own = np.asarray(reference.paged_attention_decode(*args, window=window))
    assert np.array_equal(shared, own)
    for i, n in enumerate(lens):
        start = max(0, n - window) if window else 0
        keys = k_pool[tables[i]].transpose(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[None, :, start:n]
        values = v_pool[tables[i]].transpose(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[None, :, start:n]
        want = _numpy_attention(q[i][None, :, None], keys, values, scale, np.zeros((1, 1, 1, n - start)), None)[0, :, 0]
        np.testing.assert_allclose(shared[i], want, rtol=1e-5, atol=1e-5)


def test_a_decode_pass_builds_its_index_once_for_every_layer(monkeypatch):
    built = []
    real = reference.decode_index
    monkeypatch.setattr(reference, "decode_index", lambda *a: built.append(a[0].shape) or real(*a))
    model = tiny_model("llama")
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=32, enforce_eager=True))
    ex.run([SeqWork("a", [1, 2, 3]), SeqWork("b", [4, 5])])
    built.clear()
    ex.run([SeqWork("a", [6]), SeqWork("b", [7])])
    assert model.args.num_hidden_layers > 1 and built == [(2, 1)]


def test_a_long_causal_pass_takes_query_tiles_over_the_keys_each_tile_sees(monkeypatch):
    """A fresh 300-token prompt: tiles of queries, each over the keys up to its last query
    (so about half the square of scores), giving numpy's causal attention."""
    from mlx_ferrum.kernels import reference

    seen = []
    real = reference._masked_attention_base2
    monkeypatch.setattr(reference, "_masked_attention_base2",
                        lambda q, k, *a: seen.append((q.shape[2], k.shape[2])) or real(q, k, *a))
    rng = np.random.default_rng(7)
    q, k, v = (rng.normal(size=s).astype(np.float32) for s in ((1, 8, 300, 8), (1, 4, 300, 8), (1, 4, 300, 8)))
    out = sdpa_base2(mx.array(q), mx.array(k), mx.array(v), 0.3, "causal")
    causal = np.where(np.arange(300)[None, :] <= np.arange(300)[:, None], 0.0, -np.inf)
    np.testing.assert_allclose(np.array(out), _numpy_attention(q, k, v, 0.3, causal, None), atol=2e-5)
    assert len(seen) > 1 and sum(rows for rows, _ in seen) == 300
    assert [keys for _, keys in seen] == sorted(keys for _, keys in seen) and seen[-1][1] == 300
    assert sum(rows * keys for rows, keys in seen) < 0.7 * 300 * 300


# ------------------------------------------------------ the kernels: chosen once per backend
def test_the_paged_backend_chooses_its_kernels_once_when_it_is_built(monkeypatch):
    """No attention call asks again whether the Metal path is on: the backend built by the
    executor holds the reference functions, and a pass with decode, fresh and continuing
    prefill rows runs without consulting the flag."""
    from mlx_ferrum import kernels

    asked = []
    real = kernels.metal_path_enabled
    monkeypatch.setattr(kernels, "metal_path_enabled", lambda *a: asked.append(a) or real(*a))
    model = tiny_model("llama")
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=32, enforce_eager=True,
                                          metal_kernels=False))
    assert len(asked) == 1
    chosen = ex.runner.store.backend.kernels
    asked.clear()
    ex.run([SeqWork("a", [1, 2, 3]), SeqWork("b", [4, 5, 6])])
    ex.run([SeqWork("a", [7]), SeqWork("b", [8, 9]), SeqWork("c", [10, 11, 12, 13])])
    assert asked == []
    assert chosen.decode is reference.paged_attention_decode and chosen.prefill is reference.paged_prefill_attention


def test_the_environment_flag_is_read_when_the_backend_is_built(monkeypatch):
    """``FERRUM_METAL_KERNELS=0`` set before a backend is built forces the reference even with
    a launcher installed; a backend built with the launcher and no flag takes the Metal path."""
    from mlx_ferrum.kernels import metal
    from mlx_ferrum.kernels.reference import paged_attention_decode as reference_decode

    with metal.use_launcher(lambda **kw: None):
        monkeypatch.setenv("FERRUM_METAL_KERNELS", "0")
        off = PagedAttentionBackend()
        monkeypatch.delenv("FERRUM_METAL_KERNELS")
        on = PagedAttentionBackend()
    assert not off.kernels.metal and off.kernels.decode is reference_decode
    assert on.kernels.metal and on.kernels.decode is not reference_decode
