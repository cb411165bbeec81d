"""Quantized KV attention backends (kv_cache_dtype int8 / int4) wired through the runner and
the engine, in both layouts, eager and compiled.

The oracle is the model run with no cache whose attention sees K and V exactly as the
cache stores them: each token's keys rotated and both quantized and dequantized
by the storage format (whose functions test_kv_quantization.py checks against a float64
numpy implementation), queries rotated to match. What is under test here is the wiring:
which tokens are quantized when, which blocks each row reads, the query rotation, the
compiled step over the quantized pool, prefix sharing, preemption and rollback.
"""

from __future__ import annotations

import random
from typing import Optional

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.errors import ConfigurationError
from mlx_ferrum.kernels.quantized_reference import dequantize_kv, quantize_kv, rotate
from mlx_ferrum.kv_cache.quantized import QuantizedContiguousKvCache, QuantizedPagedKvPool
from mlx_ferrum.layers.attention import NoCacheAttentionBackend, NoCacheMetadata
from mlx_ferrum.layers.quantized_backends import QuantizedContiguousAttentionBackend, QuantizedPagedAttentionBackend
from mlx_ferrum.executor import LlmExecutor
from mlx_ferrum.runner import LlmRunner, SeqWork
from support.tiny_models import tiny_model

KINDS = ["int8", "int4"]
WINDOW = 8


class StoredKvOracle(NoCacheAttentionBackend):
    """Causal attention over K/V as a quantized cache stores them (no cache involved).

    With ``float_window`` (int4's float window), the query at position ``t`` reads the keys
    and values at positions ``t - float_window + 1 .. t`` and ``0 .. 3`` (those at or after
    ``window_start``) as float16 copies, every other position as stored codes, in one
    softmax: written here from that definition alone (masks over the two key sets side
    by side), not from the runtime's ring of entries. ``window_start`` applies to the
    queries from position ``window_from`` on (default: ``window_start``), the earlier
    ones having run with 0: a prefix-cache hit of ``window_start`` tokens (the shared
    tokens' queries ran in the sequence that computed them), or a cache cut back after
    ``window_from`` tokens.
    """

    def __init__(self, kind: str, float_window: int = 0, window_start: int = 0, window_from: Optional[int] = None):
        self.kind, self.rotated = kind, True  # keys are rotated in both formats
        self.float_window, self.window_start = float_window, window_start
        self.window_from = window_start if window_from is None else window_from

    def _stored(self, x, rotated):
        d = x.shape[-1]
        if rotated:
            x = rotate(x, d)
        codes, scales, biases = quantize_kv(x, self.kind)
        return dequantize_kv(codes, scales, biases, self.kind, d, x.dtype)

    def attend(self, layer, q, k, v, meta, scale, window=None, sinks=None):
        if self.rotated:
            q = rotate(q, q.shape[-1])
        keys, values = self._stored(k, self.rotated), self._stored(v, False)
        if not self.float_window:
            return super().attend(layer, q, keys, values, meta, scale, window, sinks)
        length = q.shape[2]
        t = mx.arange(length)[:, None]
        p = mx.arange(length)[None, :]
        start = mx.where(t >= self.window_from, self.window_start, 0)
        in_float = (p >= start) & ((p > t - self.float_window) | (p < 4))
        seen = p <= t
        if window is not None:
            seen = seen & (p > t - window)
        allowed = mx.concatenate([seen & ~in_float, seen & in_float], axis=1)
        mask = mx.where(allowed, 0.0, float("-inf")).astype(q.dtype)
        float_keys = (rotate(k, k.shape[-1]) if self.rotated else k).astype(mx.float16).astype(q.dtype)
        float_values = v.astype(mx.float16).astype(q.dtype)
        extra = {} if sinks is None else {"sinks": sinks.astype(q.dtype)}
        return mx.fast.scaled_dot_product_attention(
            q, mx.concatenate([keys, float_keys], axis=2), mx.concatenate([values, float_values], axis=2),
            scale=scale, mask=mask, **extra)


#: the float window the int4 tests run with: shorter than their sequences, so that every
#: query reads some positions from codes and some from floats
FLOAT_WINDOW = 4


def float_window_of(kind: str) -> int:
    return FLOAT_WINDOW if kind == "int4" else 0


def oracle_last_logits(model, ids, kind, window_start=0, float_window=None, window_from=None):
    oracle = StoredKvOracle(kind, float_window_of(kind) if float_window is None else float_window, window_start,
                            window_from)
    return np.array(model(mx.array([ids]), NoCacheMetadata(backend=oracle))[0, -1])


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama", seed=5)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    """Sliding and full layers mixed: two layer groups with their own block ids."""
    from support import hf_reference  # skips when torch/transformers are missing

    from mlx_ferrum.models import load_model

    folder = tmp_path_factory.mktemp("gemma3_text")
    hf_reference.make_checkpoint("gemma3_text", folder, window=WINDOW)
    return load_model(folder)[0]


def config(layout, kind, compiled=False, **kw):
    base = dict(kv_layout=layout, block_size=8, max_num_blocks=128, kv_capacity=128, enforce_eager=not compiled,
                kv_cache_dtype=kind, kv_float_window=float_window_of(kind))
    base.update(kw)
    return RuntimeConfig(**base)


def prompts_for(model, lengths, seed):
    r = random.Random(seed)
    return [[r.randrange(model.args.vocab_size) for _ in range(n)] for n in lengths]


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compiled", [False, True])
def test_every_step_equals_attention_over_the_stored_kv(llama, layout, kind, compiled):
    """Fresh prompts of two lengths, a chunked one, then greedy decode steps of the whole
    batch: each row's logits equal the no-cache oracle's over its whole sequence."""
    runner = LlmExecutor(llama, config(layout, kind, compiled))  # the low-level API: it owns its block manager
    assert runner.store.backend.kv_cache_dtype == kind
    a, b, c, d = prompts_for(llama, [7, 7, 13, 9], seed=11)
    seqs = {"a": a, "b": b, "c": c[:5], "d": d}
    out = runner.run([SeqWork(k, v) for k, v in seqs.items()])
    out += runner.run([SeqWork("c", c[5:])])  # a chunk after 5 cached tokens
    seqs["c"] = c
    last = {k: o for k, o in zip(["a", "b", "c", "d"], out[:2] + [out[4]] + [out[3]])}
    for _ in range(4):
        for k, o in last.items():
            np.testing.assert_allclose(np.array(o[-1]), oracle_last_logits(llama, seqs[k], kind), atol=1e-4,
                                       rtol=1e-4, err_msg=f"sequence {k} at {len(seqs[k])} tokens")
        for k, o in last.items():
            seqs[k] = seqs[k] + [int(mx.argmax(o[-1]))]
        out = runner.run([SeqWork(k, [seqs[k][-1]]) for k in last])
        last = dict(zip(last, out))
    assert runner.compiled_decode == (compiled and layout == "paged")


@pytest.mark.parametrize("kind", ["int8"])
def test_layer_groups_and_windows_read_only_their_own_blocks(gemma3, kind):
    """Gemma 3: sliding layers (window 8) free blocks their window left; every step still
    equals the oracle, which applies the same windows to the stored K/V.

    int8 only: a paged pass takes RoPE from per-pass tables and the oracle from
    ``mx.fast.rope``, which differ in the last bit; on this model that moves one int4 code
    by a whole step (scale / 15), so int4 could not be compared to this tolerance (its
    windows and groups run the same code, and every attention call of such a pass equals
    the oracle's on the same q/k/v: test_attention_calls_equal_the_oracle_on_the_same_inputs)."""
    runner = LlmExecutor(gemma3, config("paged", kind, compiled=True))  # the low-level API: it owns its block manager
    assert len(runner.manager.groups) == 2
    seqs = dict(zip("xy", prompts_for(gemma3, [11, 5], seed=3)))
    out = dict(zip(seqs, runner.run([SeqWork(k, v) for k, v in seqs.items()])))
    for _ in range(8):
        for k, o in out.items():
            np.testing.assert_allclose(np.array(o[-1]), oracle_last_logits(gemma3, seqs[k], kind), atol=1e-4,
                                       rtol=1e-4)
            seqs[k] = seqs[k] + [int(mx.argmax(o[-1]))]
        out = dict(zip(seqs, runner.run([SeqWork(k, [seqs[k][-1]]) for k in seqs])))
    assert runner.manager.block_table("x", 0) != runner.manager.block_table("x", 1)


@pytest.mark.parametrize("kind", KINDS)
def test_attention_calls_equal_the_oracle_on_the_same_inputs(gemma3, kind, monkeypatch):
    """Every attention call of a paged prefill (fresh full layers, windowed sliding layers
    read back from the pool) equals the oracle on the call's own q/k/v."""
    oracle = StoredKvOracle(kind, float_window_of(kind))
    errors = []
    attend = QuantizedPagedAttentionBackend.packed_attention

    def checked(self, q, k, v, meta, layer, scale, window=None, sinks=None):
        out = attend(self, q, k, v, meta, layer, scale, window, sinks)
        as_batch = lambda x: x.transpose(1, 0, 2)[None]  # noqa: E731
        ref = oracle.attend(layer, as_batch(q), as_batch(k), as_batch(v), None, scale, window, sinks)
        errors.append((window, float(mx.abs(out - ref[0].transpose(1, 0, 2)).max())))
        return out

    monkeypatch.setattr(QuantizedPagedAttentionBackend, "packed_attention", checked)
    runner = LlmExecutor(gemma3, config("paged", kind))  # the low-level API: it owns its block manager
    runner.run([SeqWork("x", prompts_for(gemma3, [19], seed=3)[0])])
    assert {w for w, _ in errors} == {None, WINDOW}
    assert max(e for _, e in errors) < 1e-5, errors


@pytest.mark.harness
@pytest.mark.parametrize("kind,float_window,compiled", [
    ("int8", 0, False), ("int4", 0, False), ("int4", 4, False), ("int4", 4, True),
])
def test_with_the_metal_path_the_quantized_kernels_run_and_match_the_oracle(llama, kind, float_window, compiled):
    """Where the Metal kernels are enabled (the CPU harness stands in for Metal), decode and
    short prefill rows run the quantized kernels (codes dequantized in registers, int4
    queries rotated before the launch), and the logits equal the oracle over the stored K/V.
    With int4's float window, decode rows run the kernel over the codes the window does not
    cover, merged with the window's entries (eager and in the compiled step; the window
    slides past the first decode steps); prefill rows with a window run the pure-MLX path."""
    from mlx_ferrum.kernels import metal
    from support import metal_harness as mh

    if not mh.clang_available():
        pytest.skip("clang++-19 not installed: the Metal harness compiles kernels with it")
    prompts = prompts_for(llama, [6, 6, 11], seed=2)
    steps = [[1], [5], [2]]
    before = mh.LAUNCHES.copy()
    with metal.use_launcher(mh.metal_kernel), mh.options(schedules=("random",)):
        runner = LlmExecutor(llama, config("paged", kind, compiled=compiled, metal_kernels=True,
                                           kv_float_window=float_window))  # the low-level API: it owns its block manager
        out = runner.run([SeqWork(str(i), p) for i, p in enumerate(prompts)])
        decoded = [runner.run([SeqWork(str(i), token) for i in range(3)]) for token in steps]
    assert mh.LAUNCHES["paged_attention_decode"] >= before["paged_attention_decode"] + len(steps)
    if not float_window:
        assert mh.LAUNCHES["paged_prefill_attention"] > before["paged_prefill_attention"]
    for i, (p, o) in enumerate(zip(prompts, out)):
        np.testing.assert_allclose(np.array(o[-1]), oracle_last_logits(llama, p, kind, float_window=float_window),
                                   atol=1e-4, rtol=1e-4)
        seen = list(p)
        for token, step in zip(steps, decoded):
            seen += token
            want = oracle_last_logits(llama, seen, kind, float_window=float_window)
            np.testing.assert_allclose(np.array(step[i][-1]), want, atol=1e-4, rtol=1e-4)


def test_the_store_holds_quantized_storage_and_the_backend_of_its_dtype(llama):
    paged = LlmRunner(llama, config("paged", "int4"))
    assert isinstance(paged.pool, QuantizedPagedKvPool) and paged.pool.rotate_keys
    assert isinstance(paged.store.backend, QuantizedPagedAttentionBackend) and paged.store.backend.rotate_keys
    contiguous = LlmRunner(llama, config("contiguous", "int8"))
    assert isinstance(contiguous.store.backend, QuantizedContiguousAttentionBackend)
    assert contiguous.store.backend.rotate_keys  # int8 keys are rotated too
    contiguous.run([SeqWork("a", [1, 2, 3])])
    assert isinstance(contiguous._contiguous["a"][0], QuantizedContiguousKvCache)
    # bytes per token: int8 codes (head_dim 8) + one float16 scale per group, K and V, per layer
    args = llama.args
    assert contiguous.store.bytes_per_token == args.num_hidden_layers * 2 * args.num_key_value_heads * (8 + 2)
    # reported per token and layer, as stored (auto: float32 K and V)
    from mlx_ferrum.executor import LlmExecutor

    for kind, per_value in (("int8", 8 + 2), ("int4", 4 + 4), ("auto", 8 * 4)):
        caps = LlmExecutor(llama, config("paged", kind)).capabilities()
        assert caps.memory_requirements.kv_cache_memory_per_token == 2 * args.num_key_value_heads * per_value, kind


def test_int4_refuses_an_odd_head_dim():
    model = tiny_model("llama")
    model.args.head_dim = 7  # only the check reads it before anything is allocated
    with pytest.raises(ConfigurationError, match="int8"):
        LlmRunner(model, config("paged", "int4"))


# ------------------------------------------------------------------------------ engine


def engine_config(layout, kind, **kw):
    base = dict(kv_layout=layout, block_size=8, max_num_blocks=256, max_num_seqs=16, prefill_chunk_size=512,
                kv_cache_dtype=kind, kv_float_window=float_window_of(kind))
    base.update(kw)
    return RuntimeConfig(**base)


def generate(model, cfg, prompts, max_tokens=10):
    eng = Engine(model, None, cfg)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    outs = eng.generate(prompts, [params] * len(prompts))
    return [o.token_ids for o in outs], eng.stats()


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("kind", KINDS)
def test_a_batch_equals_its_requests_run_one_at_a_time(llama, layout, kind):
    prompts = prompts_for(llama, [3, 17, 9, 9, 30, 1], seed=21)
    batched, _ = generate(llama, engine_config(layout, kind), prompts)
    for prompt, got in zip(prompts, batched):
        alone, _ = generate(llama, engine_config(layout, kind), [prompt])
        assert got == alone[0]


@pytest.mark.parametrize("kind", KINDS)
def test_a_prefix_cache_hit_shares_quantized_blocks_and_changes_no_output(llama, kind):
    shared = prompts_for(llama, [24], seed=5)[0]
    tails = prompts_for(llama, [3, 6, 1], seed=6)
    prompts = [shared + t for t in tails]
    off, _ = generate(llama, engine_config("paged", kind, prefix_cache=False), prompts)
    eng = Engine(llama, None, engine_config("paged", kind, prefix_cache=True))
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    first = eng.generate(prompts[:1], [params])[0].token_ids
    rest = [o.token_ids for o in eng.generate(prompts[1:], [params] * 2)]
    assert eng.stats()["kv"]["prefix_hit_tokens"] >= 2 * 24 - 2 * 8, "the prefix was not shared"
    assert [first] + rest == off


@pytest.mark.parametrize("kind", KINDS)
def test_preemption_and_recompute_change_no_output(llama, kind):
    """A pool too small for the batch preempts sequences (their blocks freed, their tokens
    recomputed into fresh quantized blocks later): the outputs equal a roomy pool's."""
    prompts = prompts_for(llama, [20, 25, 18, 30, 22, 27], seed=8)
    roomy, _ = generate(llama, engine_config("paged", kind), prompts, max_tokens=12)
    tight, stats = generate(llama, engine_config("paged", kind, max_num_blocks=14, prefix_cache=False), prompts,
                            max_tokens=12)
    assert stats["num_preemptions"] > 0, "the pool was never under pressure"
    assert tight == roomy


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("kind", KINDS)
def test_speculative_rollback_on_a_quantized_cache_keeps_greedy_output(llama, layout, kind):
    """n-gram drafts are verified and the rejected ones trimmed from the quantized cache
    (int4: its float window too, whose ring has room for a draft's tokens): the greedy
    output equals decoding without speculation on the same cache dtype."""
    story = prompts_for(llama, [10], seed=4)[0]
    prompts = [story * 3, story[:5] * 4]
    plain, _ = generate(llama, engine_config(layout, kind), prompts, max_tokens=16)
    spec, stats = generate(llama, engine_config(layout, kind, speculative="ngram", prompt_lookup_min=1,
                                                num_speculative_tokens=3, speculative_disable_by_batch_size=1 << 20),
                           prompts, max_tokens=16)
    assert stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"], "no draft was rejected"
    assert spec == plain


STORY_PROMPTS = ["Once upon a time", "Lily and Tom went to the park", "The little dog", "One day, a girl named Sue",
                 "Tim had a red ball", "The sun was hot and", "Mom said", "There was a big tree"]


def test_int8_greedy_on_stories260k_mostly_matches_auto(stories_path):
    """int8 against the same requests on an "auto" cache (stories260K: head_dim 8, one
    scale per head and token): run free, most greedy tokens agree (a first difference
    sends a sequence elsewhere, so later tokens differ for that reason alone); forced
    along auto's tokens, int8 picks auto's token almost everywhere."""
    import mlx_ferrum as mf

    model, tokenizer = mf.load(str(stories_path))
    prompts = [tokenizer.encode(p) for p in STORY_PROMPTS]
    auto, _ = generate(model, engine_config("paged", "auto"), prompts, max_tokens=48)
    int8, _ = generate(model, engine_config("paged", "int8"), prompts, max_tokens=48)
    agree = np.mean([a == b for x, y in zip(auto, int8) for a, b in zip(x, y)])
    assert agree > 0.5, f"int8 greedy agrees with auto on {agree:.0%} of tokens"

    def forced(kind):
        runner = LlmExecutor(model, engine_config("paged", kind))  # the low-level API: it owns its block manager
        work = [SeqWork(f"s{i}", p + a, all_logits=True) for i, (p, a) in enumerate(zip(prompts, auto))]
        return np.concatenate([np.array(o).argmax(-1) for o in runner.run(work)])

    top1 = np.mean(forced("auto") == forced("int8"))
    assert top1 >= 0.95, f"teacher-forced, int8 picks auto's token at {top1:.1%} of positions"


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_stats_and_metrics_report_the_bytes_as_stored(llama, layout):
    """``engine.stats()["kv"]`` and the server's ``/metrics`` exposition give the bytes a
    token takes as stored (codes, scales and biases), which fall with the cache dtype; the
    paged pool's allocated bytes are the arrays' own."""
    from mlx_ferrum.server.metrics import ServerMetrics

    per_token = {}
    for kind in ("auto", "int8", "int4"):
        engine = Engine(llama, None, config(layout, kind))
        engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, temperature=0.0))
        kv = engine.stats()["kv"]
        assert kv["kv_cache_dtype"] == kind
        per_token[kind] = kv["bytes_per_token"]
        if layout == "paged":
            pool = engine.runner.pool
            assert kv["allocated_bytes"] == sum(int(a.nbytes) for a in pool.arrays())
            windows = sum(int(a.nbytes) for a in getattr(pool, "k_window", []) + getattr(pool, "v_window", []))
            assert kv["float_window_bytes"] == windows and (windows > 0) == (kind == "int4")
            assert kv["bytes_per_token"] * pool.num_blocks * pool.block_size + windows == kv["allocated_bytes"]
        text = ServerMetrics(engine).render().decode()
        assert f'mlx_ferrum:kv_cache_bytes_per_token{{kv_cache_dtype="{kind}"}} {float(per_token[kind])}' in text
        assert "mlx_ferrum:kv_cache_allocated_bytes" in text and "mlx_ferrum:kv_cache_used_bytes" in text
    assert per_token["int4"] < per_token["int8"] < per_token["auto"]


def test_a_prefix_cache_hit_reads_the_shared_tokens_from_codes_with_a_float_window(llama):
    """int4 with a float window: a sequence whose first 16 tokens came from the prefix cache
    holds no float copies of them, so its queries read those positions from the codes
    (its window starts at the hit); every later position is read as for a fresh prompt.
    The logits equal the oracle with that window start, and differ from a fresh prefill's."""
    prompt = prompts_for(llama, [21], seed=13)[0]
    runner = LlmExecutor(llama, config("paged", "int4", prefix_cache=True))
    fresh = runner.run([SeqWork("first", prompt)])[0]
    runner.claim_prefix("second", prompt, 16)
    hit = runner.run([SeqWork("second", prompt[16:])])[0]
    np.testing.assert_allclose(np.array(fresh[-1]), oracle_last_logits(llama, prompt, "int4"), atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(np.array(hit[-1]), oracle_last_logits(llama, prompt, "int4", window_start=16),
                               atol=1e-4, rtol=1e-4)
    assert float(mx.abs(hit[-1] - fresh[-1]).max()) > 1e-4, "the first 4 tokens should have come from floats"


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("cut", [1, 3])
def test_a_cache_cut_back_reads_no_float_entry_the_dropped_tokens_overwrote(llama, layout, cut):
    """int4, float window 4, no lookahead (no speculation): 20 tokens, then ``cut``
    more, cut back to 20, then one token. A cut of one token overwrote nothing a later
    query reads; a longer one overwrote the ring entries of positions 16 .. 18, so the
    window then starts at 23 - 4 = 19 and the next query reads what lies before from the
    codes, as the oracle does from that definition."""
    prompt, extra = prompts_for(llama, [20, 4], seed=17)
    runner = LlmExecutor(llama, config(layout, "int4"))
    runner.run([SeqWork("s", prompt)])
    runner.run([SeqWork("s", extra[:cut], all_logits=True)])
    runner.trim_cache("s", 20)
    got = runner.run([SeqWork("s", [extra[3]])])[0]
    start = 19 if cut > 1 else 0
    want = oracle_last_logits(llama, prompt + [extra[3]], "int4", window_start=start, window_from=20)
    np.testing.assert_allclose(np.array(got[-1]), want, atol=1e-4, rtol=1e-4)
