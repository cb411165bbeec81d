"""LlmExecutor consistency on both KV layouts, against the model run without a cache.

The oracle is the model's own no-cache forward pass (plain causal attention over the
whole sequence): every cached path (prefill + decodes, forward_verify, truncate,
ragged batches, paged vs contiguous) must reproduce its logits.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_ferrum as mf
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.errors import (
    ExecutorError,
    KvCacheExhaustedError,
    PromptTooLongError,
    UnknownCacheError,
)
from mlx_ferrum.executor import AttentionType, DecodeInput, LlmExecutor, PrefillInput

from support.tiny_models import CONFIGS, tiny_model


def no_cache_logits(model, ids):
    return np.array(model(mx.array([ids]))[0].astype(mx.float32))


LAYOUTS = [RuntimeConfig(kv_layout="contiguous", kv_cache_step=8),
           RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64)]


def ex_for(model, cfg):
    return LlmExecutor(model, RuntimeConfig(**{k: getattr(cfg, k) for k in cfg.__dataclass_fields__}))


@pytest.fixture(params=list(CONFIGS))
def model(request):
    return tiny_model(request.param)


@pytest.mark.parametrize("cfg", LAYOUTS, ids=["contiguous", "paged"])
def test_prefill_then_decodes_equals_full_prefill(model, cfg):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 97, size=21).tolist()
    ref = no_cache_logits(model, ids)
    ex = ex_for(model, cfg)
    out = ex.prefill(PrefillInput(input_ids=mx.array([ids[:13]]), return_all_logits=True))
    assert out.logits.shape == (1, 13, 97)
    np.testing.assert_allclose(np.array(out.logits[0]), ref[:13], atol=1e-5)
    h = out.kv_cache
    for i in range(13, 21):
        step = ex.decode(DecodeInput(input_ids=mx.array([[ids[i]]]), kv_cache=h))
        h = step.kv_cache
        np.testing.assert_allclose(np.array(step.logits[0]), ref[i], atol=1e-5)
    assert h.num_tokens == 21
    last = ex.prefill(PrefillInput(input_ids=mx.array([ids])))
    assert last.logits.shape == (1, 1, 97)
    np.testing.assert_allclose(np.array(last.logits[0, 0]), ref[-1], atol=1e-5)


@pytest.mark.parametrize("cfg", LAYOUTS, ids=["contiguous", "paged"])
def test_forward_verify_equals_sequential_decodes(model, cfg):
    ids = list(range(3, 40, 3))
    ex = ex_for(model, cfg)
    a = ex.prefill(PrefillInput(input_ids=mx.array([ids[:6]]))).kv_cache
    seq = []
    h = a
    for t in ids[6:]:
        o = ex.decode(DecodeInput(input_ids=mx.array([[t]]), kv_cache=h))
        h = o.kv_cache
        seq.append(np.array(o.logits[0]))
    b = ex.prefill(PrefillInput(input_ids=mx.array([ids[:6]]))).kv_cache
    ver = ex.forward_verify([DecodeInput(input_ids=mx.array([[t]]), kv_cache=b) for t in ids[6:]])
    assert len(ver) == len(ids) - 6 and ver[-1].kv_cache.num_tokens == len(ids)
    for v, s in zip(ver, seq):
        np.testing.assert_allclose(np.array(v.logits[0]), s, atol=1e-5)


@pytest.mark.parametrize("cfg", LAYOUTS, ids=["contiguous", "paged"])
def test_truncate_then_decode_equals_fresh_prefill(model, cfg):
    ids = [5, 9, 17, 33, 2, 8, 44, 61, 70, 12, 13, 90, 1, 4, 6, 7, 11]
    ex = ex_for(model, cfg)
    h = ex.prefill(PrefillInput(input_ids=mx.array([ids]))).kv_cache
    h = ex.truncate_kv(h, 9)
    assert h.num_tokens == 9
    if cfg.kv_layout == "paged":
        assert len(h.block_table) == 2  # blocks past the new length were freed
    o = ex.decode(DecodeInput(input_ids=mx.array([[77]]), kv_cache=h))
    ref = no_cache_logits(model, ids[:9] + [77])[-1]
    np.testing.assert_allclose(np.array(o.logits[0]), ref, atol=1e-5)


@pytest.mark.parametrize("cfg", LAYOUTS, ids=["contiguous", "paged"])
def test_ragged_batch_decode_equals_separate_decodes(model, cfg):
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 97, size=n).tolist() for n in (1, 5, 8, 17, 30)]
    nxt = [int(x) for x in rng.integers(0, 97, size=len(prompts))]
    ex = ex_for(model, cfg)
    outs = ex.batch_prefill([PrefillInput(input_ids=mx.array([p])) for p in prompts])
    for o, p in zip(outs, prompts):
        np.testing.assert_allclose(np.array(o.logits[0, 0]), no_cache_logits(model, p)[-1], atol=1e-5)
    steps = ex.batch_decode([DecodeInput(input_ids=mx.array([[t]]), kv_cache=o.kv_cache) for t, o in zip(nxt, outs)])
    for s, p, t in zip(steps, prompts, nxt):
        np.testing.assert_allclose(np.array(s.logits[0]), no_cache_logits(model, p + [t])[-1], atol=1e-5)
        assert s.kv_cache.num_tokens == len(p) + 1


@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_paged_equals_contiguous_on_stories(stories_path, stories_expected, block_size):
    model, tok = mf.load(stories_path)
    exp = stories_expected["once"]
    ids = exp["prompt_ids"] + exp["generated_ids"][:45]  # 50 tokens: not a multiple of any block size
    res = {}
    for layout in ("contiguous", "paged"):
        ex = LlmExecutor(model, RuntimeConfig(kv_layout=layout, block_size=block_size, max_num_blocks=64))
        out = ex.prefill(PrefillInput(input_ids=mx.array([ids[:7]]), return_all_logits=True))
        rows = [np.array(out.logits[0])]
        h = out.kv_cache
        for t in ids[7:]:
            o = ex.decode(DecodeInput(input_ids=mx.array([[t]]), kv_cache=h))
            h = o.kv_cache
            rows.append(np.array(o.logits))
        res[layout] = np.concatenate(rows)
    # Equal up to fp32 rounding, measured against each row's largest logit. The two layouts
    # add the same products in different orders (the contiguous path runs attention over
    # one [L] key array through the BLAS matmul, whose blocking fixes its order; the paged
    # decode gathers keys block by block inside one compiled graph), and fp32 addition is
    # not associative. Each sum differs by a few ulps; five layers and the vocabulary
    # projection carry that to ~10 ulps of the row's scale (|logit| up to ~22 here). How
    # many depends on the BLAS: with MLX's bundled reference BLAS (the README's setup,
    # no LD_PRELOAD) the largest difference is 1.7e-5 = 1.2e-6 of the row's largest
    # logit; with OpenBLAS 8.6e-6 = 5.2e-7. A fixed atol of 1e-5 sat between the two.
    # 1e-5 of the row scale (~84 ulps) holds for both with an 8x margin, while one wrong
    # token in the cache moves every later row by at least 5.6e-3 of its scale here.
    scale = np.abs(res["contiguous"]).max(axis=-1, keepdims=True)
    difference = np.abs(res["paged"] - res["contiguous"])
    np.testing.assert_array_less(difference, np.broadcast_to(1e-5 * scale, difference.shape))
    assert (res["paged"].argmax(-1) == res["contiguous"].argmax(-1)).all()
    # greedy continuation predicted at each step equals the recording
    assert res["paged"][4:-1].argmax(-1).tolist() == exp["generated_ids"][:45]


def test_exhausted_pool_releases_failed_request_and_spares_others():
    model = tiny_model("llama")
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=4))
    a = ex.prefill(PrefillInput(input_ids=mx.array([list(range(20))]))).kv_cache  # 3 blocks
    before = np.array(ex.decode(DecodeInput(input_ids=mx.array([[3]]), kv_cache=a)).logits)
    ex.truncate_kv(ex._handle(a.cache_id), 20)
    free = ex.manager.num_free
    with pytest.raises(KvCacheExhaustedError):
        ex.prefill(PrefillInput(input_ids=mx.array([list(range(17))]), cache_id="big"))
    assert not ex.has_cache("big") and ex.manager.num_free == free
    after = np.array(ex.decode(DecodeInput(input_ids=mx.array([[3]]), kv_cache=ex._handle(a.cache_id))).logits)
    np.testing.assert_array_equal(before, after)
    ex.manager.check_invariants()


@pytest.mark.parametrize("cfg", LAYOUTS, ids=["contiguous", "paged"])
def test_named_errors(cfg):
    model = tiny_model("llama")
    ex = ex_for(model, cfg)
    with pytest.raises(PromptTooLongError, match="context of 256"):
        ex.prefill(PrefillInput(input_ids=mx.zeros((1, 257), dtype=mx.int32)))
    with pytest.raises(ExecutorError, match="shape"):
        ex.prefill(PrefillInput(input_ids=mx.zeros((2, 3), dtype=mx.int32)))
    with pytest.raises(ExecutorError, match="vocabulary"):
        ex.prefill(PrefillInput(input_ids=mx.array([[1, 500]])))
    h = ex.prefill(PrefillInput(input_ids=mx.array([[1, 2]]))).kv_cache
    ex.release_cache(h.cache_id)
    with pytest.raises(UnknownCacheError, match="released"):
        ex.decode(DecodeInput(input_ids=mx.array([[1]]), kv_cache=h))
    ex.shutdown()
    with pytest.raises(ExecutorError, match="shut down"):
        ex.prefill(PrefillInput(input_ids=mx.array([[1, 2]])))


@pytest.mark.parametrize("cfg", LAYOUTS, ids=["contiguous", "paged"])
def test_capabilities_and_status_tell_the_truth(cfg):
    model = tiny_model("llama")
    ex = ex_for(model, cfg)
    caps = ex.capabilities()
    assert (AttentionType.PAGED in caps.attention_mechanisms) == (cfg.kv_layout == "paged")
    assert AttentionType.GROUPED_QUERY in caps.attention_mechanisms  # 4 heads, 2 kv heads
    assert caps.supports_continuous_batching == (cfg.kv_layout == "paged")
    assert caps.max_sequence_length == ex.kv_capacity() == 256
    h = ex.prefill(PrefillInput(input_ids=mx.array([[1, 2, 3]]))).kv_cache
    for _ in range(3):
        h = ex.decode(DecodeInput(input_ids=mx.array([[4]]), kv_cache=h)).kv_cache
    st = ex.status()
    assert st.prefill_operations == 1 and st.decode_operations == 3
    assert st.avg_prefill_time_ms > 0 and st.avg_decode_time_ms > 0
    assert st.memory_usage.used_bytes > 0
    ex.warmup()
    assert ex.status().is_ready


def test_non_finite_kv_of_one_sequence_cannot_poison_the_next_owner_of_its_blocks():
    from mlx_ferrum.kernels.reference import paged_attention_decode
    from mlx_ferrum.kv_cache import PagedKvPool

    pool = PagedKvPool(1, 4, 2, 8, 8, mx.float32)
    # a diverged sequence writes NaN/inf K/V into all 16 slots of blocks 1 and 2
    pool.write(0, mx.arange(8, 24, dtype=mx.int32), mx.full((16, 2, 8), float("nan")), mx.full((16, 2, 8), float("inf")))
    assert bool(mx.all(mx.isfinite(pool.k[0]))) and bool(mx.all(mx.isfinite(pool.v[0])))
    # the blocks are reused by a sequence of 11 tokens: it overwrites slots 0..10 only
    k = mx.random.normal((11, 2, 8))
    v = mx.random.normal((11, 2, 8))
    pool.write(0, mx.array([16 + i for i in range(8)] + [8, 9, 10], dtype=mx.int32), k, v)
    q = mx.random.normal((1, 4, 8))
    tables = mx.array([[2, 1]], dtype=mx.int32)
    lens = mx.array([11], dtype=mx.int32)
    out = paged_attention_decode(q, pool.k[0], pool.v[0], tables, lens, 0.35)
    ref = mx.fast.scaled_dot_product_attention(q[:, :, None], mx.swapaxes(k, 0, 1)[None], mx.swapaxes(v, 0, 1)[None],
                                               scale=0.35)[:, :, 0]
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=1e-5)
