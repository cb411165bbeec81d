"""Engine: continuous batching, preemption, abort, prefix caching, chunked prefill, threads, stops.

The reference for every batched run is the same request run alone in a fresh engine
with a roomy pool: greedy (and seeded) outputs must match token for token.
"""

import asyncio
import random
import threading

import pytest

import mlx_ferrum as mf
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.errors import PromptTooLongError, RequestError
from support.tiny_models import finish_all, tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def paged(**kw):
    base = dict(kv_layout="paged", block_size=8, max_num_blocks=512, prefill_chunk_size=512, max_num_seqs=32)
    base.update(kw)
    return RuntimeConfig(**base)


def solo(model, prompt, params, cfg=None):
    eng = Engine(model, None, cfg or paged())
    return eng.generate([prompt], params)[0]


def random_requests(n, seed, vocab=97):
    r = random.Random(seed)
    reqs = []
    for i in range(n):
        prompt = [r.randrange(vocab) for _ in range(r.randint(1, 60))]
        if r.random() < 0.6:
            p = SamplingParams(max_tokens=r.randint(1, 24), temperature=0.0, ignore_eos=True)
        else:
            p = SamplingParams(max_tokens=r.randint(1, 24), temperature=r.choice([0.7, 1.0]), top_p=r.choice([1.0, 0.9]),
                               top_k=r.choice([0, 20]), seed=1000 + i, ignore_eos=True)
        reqs.append((prompt, p))
    return reqs


def test_preemption_under_kv_pressure_completes_everything_without_leaks(model):
    reqs = random_requests(110, seed=7)
    # 40 blocks of 8 tokens = 320 token slots for 110 requests of up to 84 tokens
    eng = Engine(model, None, paged(max_num_blocks=40, max_num_seqs=16, max_num_batched_tokens=256))
    outs = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    st = eng.stats()
    assert st["num_preemptions"] > 0, "the pool was never under pressure: the test is too easy"
    assert all(o.finished and o.finish_reason == "length" for o in outs)
    for (prompt, sp), o in zip(reqs, outs):
        assert len(o.token_ids) == sp.max_tokens
        assert o.token_ids == solo(model, prompt, sp).token_ids, f"request {o.request_id} differs from its solo run"
    mgr = eng.block_manager
    mgr.check_invariants()
    assert mgr.num_free == mgr.num_blocks and not mgr.seqs
    assert st["num_running"] == 0 and st["num_waiting"] == 0


def test_request_too_large_for_the_pool_gets_a_clear_error(model):
    eng = Engine(model, None, paged(max_num_blocks=4))
    # refused at admission: the prompt alone outgrows the pool, so it could never run
    with pytest.raises(PromptTooLongError, match="FERRUM_KV_MAX_BLOCKS"):
        eng.add_request(list(range(50)), SamplingParams(max_tokens=4, temperature=0))
    ok = eng.add_request([1, 2, 3], SamplingParams(max_tokens=4, temperature=0))
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done[ok].finish_reason == "length" and len(done[ok].token_ids) == 4
    with pytest.raises(PromptTooLongError):
        eng.add_request([i % 97 for i in range(300)])
    with pytest.raises(RequestError):
        eng.abort("no-such-request")


def test_abort_frees_blocks_at_once_and_spares_the_others(model):
    reqs = random_requests(6, seed=11)
    reqs = [(p, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)) for p, _ in reqs]
    eng = Engine(model, None, paged())
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    for _ in range(4):
        eng.step()
    mgr = eng.block_manager
    used_before = mgr.num_in_use
    held = len(mgr.block_table(ids[2]))
    assert held > 0
    eng.abort(ids[2])
    assert not mgr.has(ids[2]) and mgr.num_in_use == used_before - held
    final = finish_all(eng)
    assert final[ids[2]].finish_reason == "abort"
    for rid, (p, sp) in zip(ids, reqs):
        if rid != ids[2]:
            assert final[rid].token_ids == solo(model, p, sp).token_ids
    assert mgr.num_free == mgr.num_blocks


def test_prefix_cache_prefills_only_the_suffix_and_matches_no_cache(model):
    r = random.Random(5)
    shared = [r.randrange(97) for _ in range(100)]
    a = shared + [1, 2, 3]
    b = shared + [r.randrange(97) for _ in range(20)]
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng = Engine(model, None, paged(prefix_cache=True))
    out_a = eng.generate([a], sp)[0]
    out_b = eng.generate([b], sp)[0]
    assert out_b.metrics.num_cached_tokens == 96  # 12 full blocks of 8 tokens of the shared 100
    assert out_b.metrics.num_prefilled_tokens == len(b) - 96
    assert eng.stats()["prefix_cache_hit_rate"] > 0
    assert out_a.token_ids == solo(model, a, sp).token_ids
    assert out_b.token_ids == solo(model, b, sp).token_ids
    # a full-prompt hit still recomputes the last token so it has logits
    out_a2 = eng.generate([a], sp)[0]
    assert out_a2.metrics.num_prefilled_tokens >= 1 and out_a2.token_ids == out_a.token_ids


def test_prefix_cache_eviction_when_the_pool_is_full(model):
    r = random.Random(9)
    prompts = [[r.randrange(97) for _ in range(40)] for _ in range(12)]
    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    eng = Engine(model, None, paged(prefix_cache=True, max_num_blocks=24, max_num_seqs=2))
    outs = eng.generate(prompts + prompts[:2], sp)
    kv = eng.stats()["kv"]
    assert kv["evictions"] > 0
    for p, o in zip(prompts + prompts[:2], outs):
        assert o.token_ids == solo(model, p, sp).token_ids
    eng.block_manager.check_invariants()


def test_chunked_prefill_mixes_with_decodes_and_matches_solo(model):
    r = random.Random(2)
    long_prompt = [r.randrange(97) for _ in range(200)]
    short = [[r.randrange(97) for _ in range(5)] for _ in range(3)]
    sp = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    eng = Engine(model, None, paged(prefill_chunk_size=32))
    calls = []
    real_forward = eng.runner.forward

    def spy(work, prev_tokens=None, blocks=None):
        calls.append([len(w.tokens) for w in work])
        return real_forward(work, prev_tokens, blocks)

    eng.runner.forward = spy
    ids = [eng.add_request(p, sp) for p in short]
    for _ in range(3):
        eng.step()  # the short ones are decoding now
    lid = eng.add_request(long_prompt, sp)
    final = finish_all(eng)
    mixed = [c for c in calls if 1 in c and 32 in c]
    assert len(mixed) >= 5, f"no step mixed a prefill chunk with decodes: {calls[:10]}"
    assert final[lid].token_ids == solo(model, long_prompt, sp).token_ids
    for rid, p in zip(ids, short):
        assert final[rid].token_ids == solo(model, p, sp).token_ids


def test_concurrent_submission_from_threads_loses_nothing(model):
    eng = Engine(model, None, paged())
    stop = threading.Event()
    finished = {}

    def driver():
        while not stop.is_set() or eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    finished[o.request_id] = o

    submitted = []
    lock = threading.Lock()

    def submitter(k):
        r = random.Random(k)
        for i in range(10):
            rid = eng.add_request([r.randrange(97) for _ in range(r.randint(1, 20))],
                                  SamplingParams(max_tokens=r.randint(1, 8), temperature=0.0, ignore_eos=True),
                                  request_id=f"t{k}-{i}")
            with lock:
                submitted.append(rid)

    d = threading.Thread(target=driver)
    d.start()
    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    d.join(timeout=120)
    assert sorted(submitted) == sorted(finished) and len(finished) == 80
    assert eng.block_manager.num_free == eng.block_manager.num_blocks


def test_asyncio_stream_runs_beside_other_requests(model):
    eng = Engine(model, None, paged())
    aeng = mf.AsyncEngine(eng)
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]

    async def one(p):
        toks = []
        async for out in aeng.astream(p, sp):
            toks.extend(out.new_token_ids)
        return toks

    async def main():
        return await asyncio.gather(*(one(p) for p in prompts))

    try:
        got = asyncio.run(main())
    finally:
        aeng.shutdown()
    for p, toks in zip(prompts, got):
        assert toks == solo(model, p, sp).token_ids


def test_contiguous_layout_engine_matches_solo(model):
    reqs = random_requests(8, seed=4)
    eng = Engine(model, None, RuntimeConfig(kv_layout="contiguous"))
    outs = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    for (p, sp), o in zip(reqs, outs):
        assert o.token_ids == solo(model, p, sp).token_ids


def test_stop_strings_spanning_tokens_are_trimmed(stories_path, stories_expected):
    model, tok = mf.load(stories_path)
    exp = stories_expected["once"]["completion_text"]
    stop = "little girl"
    eng = Engine(model, tok, paged(block_size=16))
    # check the stop string really spans several tokens of the recorded output
    assert not any(stop in tok.decode([t]) for t in stories_expected["once"]["generated_ids"])
    out = eng.generate(["Once upon a time"], SamplingParams(max_tokens=200, temperature=0.0, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == exp[: exp.index(stop)]


@pytest.mark.parametrize("which", ["once", "bos"])
def test_real_model_among_16_concurrent_requests(stories_path, stories_expected, which):
    model, tok = mf.load(stories_path)
    exp = stories_expected[which]
    r = random.Random(1)
    others = [[1] + [r.randrange(3, 512) for _ in range(r.randint(1, 40))] for _ in range(16)]
    params = [SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)]
    params += [SamplingParams(max_tokens=r.randint(10, 120), temperature=0.8, seed=i) for i in range(16)]
    eng = Engine(model, tok, paged(block_size=16, max_num_blocks=256))
    outs = eng.generate([exp["prompt_ids"]] + others, params)
    assert outs[0].token_ids == exp["generated_ids"]
    assert outs[0].text == exp["completion_text"]
    assert eng.stats()["kv_blocks_used"] == 0


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8, max_tokens=6),
                                    SamplingParams(temperature=0.0, max_tokens=6),
                                    SamplingParams(temperature=0.8, seed=5, max_tokens=6)],
                         ids=["unseeded", "greedy", "seeded"])
def test_adding_a_request_waits_for_no_device_work(model, params, monkeypatch):
    """A server admits requests while a step is in flight: ``add_request`` must not
    evaluate anything (an ``mx.eval`` there waits for the whole step on the device).
    An unseeded request's key is drawn from MLX's generator when it is first sampled,
    so ``mx.random.seed`` still makes it reproducible."""
    import mlx.core as mx

    eng = Engine(model, None, paged())
    busy = eng.add_request([1, 2, 3, 4], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    eng.step()
    eng.step()
    evaluations = []
    real_eval = mx.eval
    monkeypatch.setattr(mx, "eval", lambda *a: (evaluations.append(a), real_eval(*a))[1])
    rid = eng.add_request([5, 6, 7], params)
    monkeypatch.setattr(mx, "eval", real_eval)
    assert not evaluations, "add_request evaluated arrays"
    outputs = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                outputs[out.request_id] = out
    assert outputs[busy].finish_reason == "length" and outputs[rid].finish_reason in ("length", "stop")

    def seeded_run():
        mx.random.seed(21)
        return Engine(model, None, paged()).generate([[5, 6, 7]], SamplingParams(temperature=1.0, max_tokens=8,
                                                                                 ignore_eos=True))[0].token_ids

    assert seeded_run() == seeded_run()


def _shared_prefix_wave(seed, n=12, prefix_len=70):
    r = random.Random(seed)
    prefix = [r.randrange(97) for _ in range(prefix_len)]
    return [prefix + [r.randrange(97) for _ in range(r.randint(1, 12))] for _ in range(n)]


def test_a_wave_sharing_a_prefix_computes_it_once(model):
    """Requests that arrive together with a long common prefix: the first computes it,
    the others wait one step and take it from the prefix cache, so the prefix is
    prefilled once instead of once per request, with the outputs of caching off."""
    prompts = _shared_prefix_wave(1)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    eng = Engine(model, None, paged(prefix_cache=True))
    cached = eng.generate(prompts, params)
    plain = Engine(model, None, paged(prefix_cache=False)).generate(prompts, params)
    assert [o.token_ids for o in cached] == [o.token_ids for o in plain]
    block = 8
    shared = 70 // block * block
    # the shared blocks once, then every prompt's own tokens past them
    assert eng.stats()["prefilled_tokens"] == shared + sum(len(p) - shared for p in prompts)
    assert all(o.metrics.num_cached_tokens == shared for o in cached[1:])


def test_a_request_without_the_shared_prefix_is_not_held_back(model):
    prompts = _shared_prefix_wave(2, n=4)
    other = [(5 + i) % 97 for i in range(40)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng = Engine(model, None, paged(prefix_cache=True))
    ids = [eng.add_request(p, params) for p in prompts] + [eng.add_request(other, params)]
    eng.step()
    with eng._lock:
        first_step = {rid for rid, seq in eng._seqs.items() if seq.num_computed > 0}
    assert ids[0] in first_step and ids[-1] in first_step
    assert not first_step & set(ids[1:-1]), "requests sharing the in-flight prefix ran it again"
    while eng.has_unfinished_requests():
        eng.step()


def test_a_request_waiting_for_a_prefix_runs_when_its_producer_is_aborted(model):
    prompts = _shared_prefix_wave(3, n=3)
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    want = Engine(model, None, paged(prefix_cache=False)).generate(prompts, params)
    eng = Engine(model, None, paged(prefix_cache=True, prefill_chunk_size=16, max_num_batched_tokens=16))
    ids = [eng.add_request(p, params) for p in prompts]
    eng.step()  # the first request computes its first chunk; the others wait for the rest
    eng.abort(ids[0])
    final = finish_all(eng)
    assert final[ids[0]].finish_reason == "abort"
    assert [final[i].token_ids for i in ids[1:]] == [o.token_ids for o in want[1:]]
    assert not eng._seqs and not eng.scheduler.has_unfinished()
