"""The engine's public outputs, its use from several threads, and its end of life.

- Every ``RequestOutput`` (from ``Engine.stream`` and ``AsyncEngine.astream``, in every
  mode) carries only read-back tokens: ``token_ids``, ``logprobs`` and ``text`` agree, and
  the pipelined step gives the synchronous step's outputs token for token.
- One ``Engine`` driven from 8 threads at once gives every caller its own outputs.
- ``AsyncEngine`` after ``shutdown()`` raises :class:`EngineShutdownError` at once.
"""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import mlx_ferrum as mf
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.engine.async_engine import AsyncEngine
from mlx_ferrum.errors import EngineShutdownError, PromptTooLongError

PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben went to the park"]


@pytest.fixture(scope="module")
def stories(stories_path):
    return mf.load(stories_path)


def stories_config(pipelined: bool, **kw) -> RuntimeConfig:
    base = dict(kv_layout="paged", block_size=16, max_num_blocks=128, max_num_seqs=8, async_scheduling=pipelined)
    base.update(kw)
    return RuntimeConfig(**base)


def _params(mode: str, i: int, stop_text: str | None = None) -> SamplingParams:
    kw = dict(max_tokens=24, logprobs=2, seed=10 + i)
    if mode == "penalties":
        kw.update(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.2, temperature=0.8)
    elif mode == "stop":
        kw.update(temperature=0.0, stop=[stop_text])
    else:
        kw.update(temperature=0.0 if i % 2 == 0 else 0.9)
    return SamplingParams(**kw)


MODES = ["plain", "penalties", "speculative", "prefix_cache", "stop"]


def _mode_config(mode: str, pipelined: bool) -> RuntimeConfig:
    extra = {}
    if mode == "speculative":
        extra = dict(speculative="ngram", num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2,
                     speculative_disable_by_batch_size=1 << 20)
    elif mode == "prefix_cache":
        extra = dict(prefix_cache=True)
    return stories_config(pipelined, **extra)


def _stop_text(model, tok) -> str:
    """A piece of the greedy continuation of PROMPTS[0] (so the stop string does fire)."""
    out = Engine(model, tok, stories_config(False)).generate(
        [PROMPTS[0]], SamplingParams(max_tokens=24, temperature=0.0))[0]
    words = out.text.split()
    assert len(words) > 4, out.text
    return " ".join(words[2:4])


def _stream_all(model, tok, mode: str, pipelined: bool, stop_text) -> list[list]:
    """Each prompt's outputs, streamed at once through an AsyncEngine."""
    aeng = AsyncEngine(Engine(model, tok, _mode_config(mode, pipelined)))

    async def collect(i, prompt):
        return [o async for o in aeng.astream(prompt, _params(mode, i, stop_text))]

    async def main():
        return await asyncio.wait_for(asyncio.gather(*(collect(i, p) for i, p in enumerate(PROMPTS))), 60)

    try:
        return asyncio.run(main())
    finally:
        aeng.shutdown()


def _check_consistent(outs, tok, mode):
    text = ""
    for o in outs:
        assert all(t >= 0 for t in o.token_ids), f"placeholder in token_ids: {o.token_ids}"
        assert all(t >= 0 for t in o.new_token_ids), o.new_token_ids
        assert len(o.logprobs) == len(o.token_ids), (o.token_ids, o.logprobs)
        if o.top_logprobs is not None:
            assert len(o.top_logprobs) == len(o.token_ids)
        text += o.delta
        assert o.text == text
    last = outs[-1]
    assert last.finished
    if mode != "stop":  # the text continues the prompt, as decode reads prompt + output
        prompt = list(last.prompt_token_ids)
        assert last.text == tok.decode(prompt + list(last.token_ids))[len(tok.decode(prompt)):]


@pytest.mark.parametrize("mode", MODES)
def test_astream_outputs_never_carry_placeholders_and_match_synchronous_step(stories, mode):
    model, tok = stories
    stop_text = _stop_text(model, tok) if mode == "stop" else None
    pipelined = _stream_all(model, tok, mode, True, stop_text)
    synchronous = _stream_all(model, tok, mode, False, stop_text)
    for p_outs, s_outs in zip(pipelined, synchronous):
        _check_consistent(p_outs, tok, mode)
        _check_consistent(s_outs, tok, mode)
        assert [o.token_ids for o in p_outs] == [o.token_ids for o in s_outs]
        assert [o.text for o in p_outs] == [o.text for o in s_outs]
        assert p_outs[-1].finish_reason == s_outs[-1].finish_reason
    if mode == "stop":
        assert synchronous[0][-1].finish_reason == "stop"


def test_engine_stream_outputs_never_carry_placeholders(stories):
    model, tok = stories
    eng = Engine(model, tok, stories_config(True))
    outs = list(eng.stream(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)))
    _check_consistent(outs, tok, "plain")
    assert len(outs[-1].token_ids) == 12


# ------------------------------------------------------------------ threads
THREAD_PROMPTS = ["Once upon a time", "The little dog", "Lily and Ben", "One day, a bird", "Tom had a red ball",
                  "The sun was", "Mom said", "A big cat"]


def _thread_params(i):
    return SamplingParams(max_tokens=16 + i, temperature=0.0 if i % 2 == 0 else 0.9, seed=i, logprobs=0)


def _run_threads(target, n, timeout=60):
    results, errors = [None] * n, [None] * n
    barrier = threading.Barrier(n)

    def work(i):
        try:
            barrier.wait()
            results[i] = target(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[i] = e

    threads = [threading.Thread(target=work, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [i for i, t in enumerate(threads) if t.is_alive()]
    assert not stuck, f"threads {stuck} never returned"
    assert errors == [None] * n, errors
    return results


THREAD_MODES = {
    "pipelined": dict(async_scheduling=True),
    "synchronous": dict(async_scheduling=False),
    "contiguous": dict(async_scheduling=True, kv_layout="contiguous"),
    "speculative": dict(async_scheduling=True, speculative="ngram", num_speculative_tokens=3,
                        speculative_disable_by_batch_size=1 << 20),
    "prefix_cache": dict(async_scheduling=True, prefix_cache=True),
}


@pytest.mark.parametrize("mode", list(THREAD_MODES))
def test_eight_threads_sharing_one_engine_each_get_their_own_outputs(stories, mode):
    model, tok = stories
    kw = dict(THREAD_MODES[mode])
    pipelined = kw.pop("async_scheduling")
    alone = [Engine(model, tok, stories_config(pipelined, **kw)).generate([p], _thread_params(i))[0]
             for i, p in enumerate(THREAD_PROMPTS)]
    eng = Engine(model, tok, stories_config(pipelined, **kw))

    def call(i):
        if i % 2 == 0:
            return eng.generate([THREAD_PROMPTS[i]], _thread_params(i))[0]
        return list(eng.stream(THREAD_PROMPTS[i], _thread_params(i)))[-1]

    together = _run_threads(call, len(THREAD_PROMPTS))
    for i, (a, b) in enumerate(zip(alone, together)):
        assert b.finished and b.finish_reason == a.finish_reason, i
        assert b.token_ids == a.token_ids, i
        assert b.text == a.text, i
        assert b.logprobs == pytest.approx(a.logprobs, abs=1e-4), i
    assert not eng.has_unfinished_requests()
    assert not eng.stats()["kv_blocks_used"]
    assert not eng.outputs.boxes


def test_threads_each_generating_several_prompts(stories):
    model, tok = stories
    eng = Engine(model, tok, stories_config(True))
    prompts = THREAD_PROMPTS[:3]
    alone = eng.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0))
    together = _run_threads(lambda i: eng.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0)), 8)
    for outs in together:
        assert [o.token_ids for o in outs] == [o.token_ids for o in alone]


# --------------------------------------------------------------- shutdown
def test_astream_and_generate_after_shutdown_raise_engine_shutdown_error(stories):
    model, tok = stories
    aeng = AsyncEngine(Engine(model, tok, stories_config(True)))
    aeng.shutdown()

    async def stream_once():
        return [o async for o in aeng.astream("Once upon a time", SamplingParams(max_tokens=4))]

    with pytest.raises(EngineShutdownError, match="shut down"):
        asyncio.run(asyncio.wait_for(stream_once(), 10))
    with pytest.raises(EngineShutdownError):
        asyncio.run(asyncio.wait_for(aeng.generate([1, 2, 3], SamplingParams(max_tokens=4)), 10))


def test_stream_running_at_shutdown_raises_and_frees_its_blocks(stories):
    model, tok = stories
    eng = Engine(model, tok, stories_config(True))
    aeng = AsyncEngine(eng)
    seen = []

    async def main():
        async for out in aeng.astream("Once upon a time", SamplingParams(max_tokens=100_000, ignore_eos=True)):
            seen.append(out)
            if len(seen) == 3:
                await asyncio.to_thread(aeng.shutdown)

    with pytest.raises(EngineShutdownError):
        asyncio.run(asyncio.wait_for(main(), 30))
    stats = eng.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["kv_blocks_used"]) == (0, 0, 0)


# ------------------------------------------------------ a request that outgrows the pool
def _pool_config(pipelined, blocks=None, **kw):
    return RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=blocks, async_scheduling=pipelined, **kw)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "synchronous"])
def test_request_outgrowing_a_small_pool_ends_with_length_and_spares_its_neighbour(stories, pipelined, monkeypatch):
    model, tok = stories
    big = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True, logprobs=0)
    small = SamplingParams(max_tokens=6, temperature=0.7, seed=3, ignore_eos=True)
    ids = tok.encode("Once upon a time")
    roomy = Engine(model, tok, _pool_config(pipelined, blocks=256))
    long_alone, neighbour_alone = roomy.generate([ids, "The dog"], [big, small])

    monkeypatch.setenv("FERRUM_KV_MAX_BLOCKS", "4")  # 32 tokens
    eng = Engine(model, tok, _pool_config(pipelined))
    assert eng.max_sequence_tokens() == 32
    aeng = AsyncEngine(eng)

    async def collect(prompt, params):
        return [o async for o in aeng.astream(prompt, params)]

    async def main():
        return await asyncio.wait_for(asyncio.gather(collect(ids, big), collect("The dog", small)), 60)

    try:
        long_outs, neighbour_outs = asyncio.run(main())
    finally:
        aeng.shutdown()
    long_out, neighbour = long_outs[-1], neighbour_outs[-1]
    assert long_out.finish_reason == "length" and long_out.error is None
    assert len(ids) + len(long_out.token_ids) == 32
    assert long_out.token_ids == long_alone.token_ids[: len(long_out.token_ids)]
    assert long_out.text == tok.decode(long_out.token_ids)
    assert len(long_out.logprobs) == len(long_out.token_ids)
    assert (neighbour.finish_reason, neighbour.token_ids, neighbour.text) == (
        neighbour_alone.finish_reason, neighbour_alone.token_ids, neighbour_alone.text)
    stats = eng.stats()
    assert (stats["num_running"], stats["num_waiting"], stats["kv_blocks_used"]) == (0, 0, 0)


def test_prompt_that_can_never_fit_the_pool_is_refused_at_admission(stories):
    model, tok = stories
    eng = Engine(model, tok, _pool_config(True, blocks=2))
    with pytest.raises(PromptTooLongError, match="KV pool holds 16.*FERRUM_KV_MAX_BLOCKS"):
        eng.add_request(list(range(3, 20)), SamplingParams(max_tokens=4))
    # one that fits still runs, to the pool's end
    out = eng.generate([[1, 5, 6]], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 13
    assert eng.stats()["kv_blocks_used"] == 0


def test_speculative_request_outgrowing_the_pool_ends_with_length(stories):
    model, tok = stories
    cfg = _pool_config(False, blocks=4, speculative="ngram", num_speculative_tokens=3)
    eng = Engine(model, tok, cfg)
    out = eng.generate(["Once upon a time"], SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.prompt_token_ids) + len(out.token_ids) == 32
    assert eng.stats()["kv_blocks_used"] == 0


# ------------------------------------------------------------ tiny temperatures
TINY_TEMPERATURES = [1e-45, 1e-40, 5e-39, 1e-38, 1e-37, 1e-30]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_sample_with_a_temperature_that_rounds_to_zero_is_greedy(dtype):
    import mlx.core as mx
    import numpy as np

    from mlx_ferrum.engine.sampling import SamplerState, sample

    rng = np.random.default_rng(0)
    logits = mx.array((rng.normal(size=(6, 97)) * 8).astype(np.float32)).astype(getattr(mx, dtype))
    logits = mx.concatenate([logits, -mx.abs(logits[:1]) - 50])  # every logit negative
    greedy = sample(logits, [SamplerState.create(SamplingParams(temperature=0.0), [1]) for _ in range(7)]).tokens
    for t in TINY_TEMPERATURES:
        for top in (dict(), dict(top_k=5, top_p=0.9, min_p=0.05)):
            states = [SamplerState.create(SamplingParams(temperature=t, seed=i, **top), [1]) for i in range(7)]
            assert sample(logits, states).tokens.tolist() == greedy.tolist(), (t, top)
    # a row with a tiny temperature next to ordinary sampled and greedy rows
    mixed = [SamplingParams(temperature=1e-40), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0.0)]
    got = sample(logits[:3], [SamplerState.create(p, [1]) for p in mixed]).tokens.tolist()
    assert got[0] == greedy.tolist()[0] and got[2] == greedy.tolist()[2]


@pytest.mark.parametrize("speculative", [None, "ngram"])
@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "synchronous"])
def test_engine_output_at_tiny_temperature_equals_greedy(stories, pipelined, speculative):
    model, tok = stories
    cfg = stories_config(pipelined, speculative=speculative, num_speculative_tokens=3)
    prompts = PROMPTS[:2]
    greedy = Engine(model, tok, cfg).generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, logprobs=0))
    for t in (1e-40, 1e-38, 1e-37):
        outs = Engine(model, tok, cfg).generate(prompts, SamplingParams(max_tokens=20, temperature=t, seed=7, logprobs=0))
        for g, o in zip(greedy, outs):
            assert (o.token_ids, o.text, o.finish_reason) == (g.token_ids, g.text, g.finish_reason), t
            assert o.logprobs == pytest.approx(g.logprobs, abs=1e-5)
