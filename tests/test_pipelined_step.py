"""The pipelined engine step (``RuntimeConfig.async_scheduling``) against the synchronous one.

The reference is the same engine with ``async_scheduling=False``, which reads every
step's tokens before it builds the next. Token ids and finish reasons must be equal,
including when a request stops, is aborted or is preempted while its next token is
already queued (the one-step lag), and no KV block may be left behind.
"""

import random

import mlx.core as mx
import pytest

import mlx_ferrum as mf
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.kernels import metal
from support.tiny_models import finish_all, tiny_model

LAYOUTS = ["paged", "contiguous"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=5)


def config(layout, pipelined, **kw):
    base = dict(kv_layout=layout, block_size=8, max_num_blocks=512, max_num_seqs=32, async_scheduling=pipelined)
    base.update(kw)
    return RuntimeConfig(**base)


def requests(n, seed, vocab=97, stop_ids=()):
    r = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [r.randrange(vocab) for _ in range(r.randint(1, 40))]
        kw = dict(max_tokens=r.randint(1, 20), ignore_eos=True, stop_token_ids=list(stop_ids))
        if r.random() < 0.5:
            sp = SamplingParams(temperature=0.0, **kw)
        else:
            sp = SamplingParams(temperature=r.choice([0.8, 1.0]), top_p=r.choice([1.0, 0.9]), top_k=r.choice([0, 20]),
                                min_p=r.choice([0.0, 0.05]), seed=100 + i, **kw)
        out.append((prompt, sp))
    return out


def run_all(model, cfg, reqs):
    eng = Engine(model, None, cfg)
    outs = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    return eng, [(o.token_ids, o.finish_reason) for o in outs]


def assert_no_leak(eng):
    mgr = eng.block_manager
    if mgr is not None:
        assert mgr.num_in_use == 0, "blocks were left behind"
        assert not mgr.seqs
    else:
        assert not eng.runner._contiguous, "contiguous caches were left behind"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipelined_equals_synchronous_greedy_and_seeded(model, layout):
    reqs = requests(24, seed=1)
    eng_p, pipelined = run_all(model, config(layout, True), reqs)
    eng_s, synchronous = run_all(model, config(layout, False), reqs)
    assert pipelined == synchronous
    assert all(reason == "length" for _, reason in pipelined)
    assert_no_leak(eng_p)
    assert_no_leak(eng_s)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stop_tokens_inside_the_lag_drop_the_queued_token(model, layout):
    # Stop ids that the tiny model produces often, so many requests stop while their
    # next token is already queued.
    _, free_run = run_all(model, config(layout, False), requests(24, seed=2))
    counts: dict[int, int] = {}
    for ids, _ in free_run:
        for t in ids[1:]:
            counts[t] = counts.get(t, 0) + 1
    stop_ids = sorted(counts, key=counts.get, reverse=True)[:3]
    reqs = requests(24, seed=2, stop_ids=stop_ids)
    eng_p, pipelined = run_all(model, config(layout, True), reqs)
    _, synchronous = run_all(model, config(layout, False), reqs)
    stopped = [ids for ids, reason in pipelined if reason == "stop"]
    assert len(stopped) >= 3, "too few requests stopped on a token: the test is too easy"
    assert pipelined == synchronous
    for ids in stopped:
        assert ids[-1] in stop_ids and not any(t in stop_ids for t in ids[:-1])
    assert_no_leak(eng_p)


def test_preemption_inside_the_lag_matches_synchronous(model):
    reqs = requests(60, seed=3)
    cfg = dict(max_num_blocks=24, max_num_seqs=16, max_num_batched_tokens=128)
    eng_p, pipelined = run_all(model, config("paged", True, **cfg), reqs)
    eng_s, synchronous = run_all(model, config("paged", False, **cfg), reqs)
    assert eng_p.stats()["num_preemptions"] > 0, "the pool was never under pressure: the test is too easy"
    assert pipelined == synchronous
    assert_no_leak(eng_p)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_abort_while_a_token_is_in_flight(model, layout):
    reqs = requests(8, seed=4)
    reqs = [(p, SamplingParams(**{**sp.__dict__, "max_tokens": 30})) for p, sp in reqs]
    _, reference = run_all(model, config(layout, False), reqs)
    eng = Engine(model, None, config(layout, True))
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    final = {}
    steps = 0
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                final[o.request_id] = o
        steps += 1
        if steps == 6:
            assert eng.launcher.inflight is not None, "nothing in flight: the abort would not land in the lag"
            eng.abort(ids[0])
            eng.abort(ids[3])
    for i, (rid, (ref_ids, ref_reason)) in enumerate(zip(ids, reference)):
        out = final[rid]
        if i in (0, 3):
            assert out.finish_reason == "abort"
            assert -1 not in out.token_ids
            assert out.token_ids == ref_ids[: len(out.token_ids)]
        else:
            assert (out.token_ids, out.finish_reason) == (ref_ids, ref_reason)
    assert_no_leak(eng)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_abort_between_scheduling_and_the_forward_pass_touches_no_other_request(model, layout):
    """Another thread may abort a request after the step scheduled it and before the
    step built its tokens; the abort takes back the token still in flight, so the row
    is dropped, and the rest of the batch runs on as if the request never existed."""
    reqs = requests(6, seed=8)
    reqs = [(p, SamplingParams(**{**sp.__dict__, "max_tokens": 24})) for p, sp in reqs]
    _, reference = run_all(model, config(layout, False), reqs)
    eng = Engine(model, None, config(layout, True))
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    real_schedule = eng._schedule
    aborted = []

    def schedule(outputs):
        items, plan = real_schedule(outputs)
        if not aborted and eng.num_steps >= 5:
            in_flight = [it.seq.request_id for it in items if it.seq.output_ids and it.seq.output_ids[-1] == -1]
            if in_flight:
                aborted.append(in_flight[0])
                eng.abort(in_flight[0])  # as another thread would, between the two locked sections
        return items, plan

    eng._schedule = schedule
    final = finish_all(eng)
    assert aborted, "no request was scheduled with its token in flight"
    for rid, (ref_ids, ref_reason) in zip(ids, reference):
        out = final[rid]
        if rid in aborted:
            assert out.finish_reason == "abort" and out.error is None
            assert out.token_ids == ref_ids[: len(out.token_ids)]
        else:
            assert (out.token_ids, out.finish_reason, out.error) == (ref_ids, ref_reason, None)
    assert_no_leak(eng)


def test_repetition_penalty_rows_fall_back_to_a_synchronous_step(model):
    reqs = [([1, 2, 3, 4], SamplingParams(max_tokens=12, temperature=0.0, repetition_penalty=1.3, ignore_eos=True)),
            ([5, 6], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))]
    _, pipelined = run_all(model, config("paged", True), reqs)
    _, synchronous = run_all(model, config("paged", False), reqs)
    assert pipelined == synchronous


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_presence_and_frequency_penalty_rows_fall_back_to_a_synchronous_step(model, layout):
    reqs = [([1, 2, 3, 4], SamplingParams(max_tokens=16, temperature=0.0, presence_penalty=1.5, ignore_eos=True)),
            ([7, 8, 9], SamplingParams(max_tokens=16, temperature=0.0, frequency_penalty=1.2, ignore_eos=True)),
            ([5, 6], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))]
    _, pipelined = run_all(model, config(layout, True), reqs)
    _, synchronous = run_all(model, config(layout, False), reqs)
    assert pipelined == synchronous


def test_explicit_metal_kernels_false_is_honoured(model, monkeypatch):
    monkeypatch.delenv("FERRUM_METAL_KERNELS", raising=False)
    calls = []
    with metal.use_launcher(lambda **kw: calls.append(kw)):
        ex = mf.LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=32, metal_kernels=False))
        out = ex.prefill(mf.PrefillInput(input_ids=mx.array([[1, 2, 3]])))
        ex.decode(mf.DecodeInput(input_ids=mx.array([[4]]), kv_cache=out.kv_cache))
    assert not calls, "RuntimeConfig(metal_kernels=False) was ignored: the Metal kernels were launched"


def test_explicit_metal_kernels_true_beats_the_environment(model, monkeypatch):
    monkeypatch.setenv("FERRUM_METAL_KERNELS", "0")
    calls = []
    with metal.use_launcher(lambda **kw: calls.append(kw)):
        ex = mf.LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=32, metal_kernels=True))
        with pytest.raises(Exception):  # the recording launcher returns no kernel to call
            ex.prefill(mf.PrefillInput(input_ids=mx.array([[1, 2, 3]])))
    assert calls, "RuntimeConfig(metal_kernels=True) lost to FERRUM_METAL_KERNELS=0"


def test_ferrum_async_scheduling_variable_turns_pipelining_off_and_every_mode_keeps_it(model, monkeypatch):
    monkeypatch.setenv("FERRUM_ASYNC_SCHEDULING", "0")
    assert not Engine(model, None, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64))._pipelined
    monkeypatch.delenv("FERRUM_ASYNC_SCHEDULING")
    assert Engine(model, None, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64))._pipelined
    # prefix caching and speculation run on the same pipelined step
    assert Engine(model, None, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64,
                                             prefix_cache=True, speculative="ngram"))._pipelined


# ----------------------------------------------------------------------------- every mode


def mixed_requests(n, seed, vocab=97, shared_prefix=24):
    """Requests mixing every mode: penalties, stop strings are not available without a
    tokenizer, so stop token ids; seeds; greedy and sampled; repeated text (n-gram drafts
    fire) and a shared prefix (prefix-cache hits)."""
    r = random.Random(seed)
    prefix = [r.randrange(vocab) for _ in range(shared_prefix)]
    out = []
    for i in range(n):
        body = [r.randrange(vocab) for _ in range(r.randint(1, 12))]
        prompt = prefix + body * r.choice([1, 3])
        kw = dict(max_tokens=r.randint(4, 24), ignore_eos=True, stop_token_ids=[r.randrange(vocab)])
        if r.random() < 0.4:
            kw.update(repetition_penalty=r.choice([1.2, 0.8]), presence_penalty=r.choice([0.0, 0.5]),
                      frequency_penalty=r.choice([0.0, 0.3]))
        if r.random() < 0.5:
            sp = SamplingParams(temperature=0.0, **kw)
        else:
            sp = SamplingParams(temperature=0.9, top_k=r.choice([0, 20]), seed=1000 + i, **kw)
        out.append((prompt, sp))
    return out


MODES = {
    "plain": {},
    "prefix_cache": {"prefix_cache": True},
    "ngram": {"speculative": "ngram", "speculative_disable_by_batch_size": 1 << 20,
              "speculative_min_acceptance": 0.0},
    "ngram_policy": {"speculative": "ngram", "speculative_disable_by_batch_size": 8},
    "all": {"speculative": "ngram", "prefix_cache": True, "speculative_disable_by_batch_size": 1 << 20},
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_pipelined_equals_synchronous_in_every_mode(model, layout, mode):
    """Penalties, seeds, stop ids, prefix caching and speculation, alone and together: the
    pipelined step gives exactly the tokens of the synchronous one, and of a plain run
    (greedy rows; sampled rows under speculation keep their distribution, not their draws)."""
    if layout == "contiguous" and "prefix_cache" in MODES[mode]:
        pytest.skip("prefix caching is a paged-layout feature")
    reqs = mixed_requests(16, seed=7)
    eng_p, pipelined = run_all(model, config(layout, True, **MODES[mode]), reqs)
    eng_s, synchronous = run_all(model, config(layout, False, **MODES[mode]), reqs)
    assert pipelined == synchronous
    if "speculative" not in MODES[mode]:
        _, plain = run_all(model, config(layout, False), reqs)
        assert pipelined == plain
    else:
        _, plain = run_all(model, config(layout, False), reqs)
        greedy = [i for i, (_, sp) in enumerate(reqs) if sp.temperature == 0.0]
        assert [pipelined[i] for i in greedy] == [plain[i] for i in greedy]
    assert_no_leak(eng_p)
    assert_no_leak(eng_s)


@pytest.mark.parametrize("pipelined", [True, False])
def test_abort_while_drafts_are_proposed_frees_the_request_once_the_step_is_done(model, pipelined):
    """The proposer runs outside the engine's lock: a request aborted meanwhile keeps its
    draft state until the step is done (the step still reads it), then loses all of it,
    and the other requests' tokens are those of a run without the abort."""
    reqs = requests(6, seed=12)
    reqs = [(p, SamplingParams(**{**sp.__dict__, "max_tokens": 20, "temperature": 0.0})) for p, sp in reqs]
    cfg = config("paged", pipelined, speculative="ngram", speculative_disable_by_batch_size=1 << 20,
                 speculative_min_acceptance=0.0)
    _, reference = run_all(model, cfg, reqs)
    eng = Engine(model, None, cfg)
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    real_propose = eng._proposer.propose
    aborted = []

    def propose(requests_):
        found = real_propose(requests_)
        if not aborted and eng.num_steps >= 3:
            # prefer a request that found no draft: its back-off record is written after this
            pick = next((r for r, f in zip(requests_, found) if not f.token_ids), requests_[0])
            aborted.append(pick.request_id)
            eng.abort(pick.request_id)
        return found

    eng._proposer.propose = propose
    final = finish_all(eng)
    assert aborted, "no draft was proposed"
    for rid, (ref_ids, ref_reason) in zip(ids, reference):
        out = final[rid]
        if rid in aborted:
            assert out.finish_reason == "abort"
            assert out.token_ids == ref_ids[: len(out.token_ids)]
        else:
            assert (out.token_ids, out.finish_reason, out.error) == (ref_ids, ref_reason, None)
    assert not eng._policy._records, "a finished request's speculation record was left behind"
    assert_no_leak(eng)


def test_prefix_cache_hits_on_the_pipelined_step_equal_no_cache(model):
    """Two waves of requests sharing a long prefix: the second wave hits the blocks the
    first wrote while its tokens were being read back one step late; outputs equal a run
    without prefix caching, and the hits are counted."""
    reqs = mixed_requests(8, seed=11, shared_prefix=40)
    cfg = config("paged", True, prefix_cache=True)
    eng = Engine(model, None, cfg)
    first = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    second = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    assert eng.stats()["prefix_cache_hit_rate"] > 0.3
    _, plain = run_all(model, config("paged", True, prefix_cache=False), reqs)
    assert [(o.token_ids, o.finish_reason) for o in first] == plain
    assert [(o.token_ids, o.finish_reason) for o in second] == plain
    assert_no_leak(eng)


def test_generated_blocks_are_hashed_once_read_back(model):
    """A block completed by a token still in flight is registered under the token's real
    id: a later prompt equal to that request's prompt + output hits every full block."""
    prompt = [5, 6, 7, 8, 9, 10, 11]
    params = SamplingParams(temperature=0.0, max_tokens=18, ignore_eos=True)
    eng = Engine(model, None, config("paged", True, prefix_cache=True))
    out = eng.generate([prompt], params)[0]
    # the KV holds the prompt and every output but the last: 24 tokens, 3 full blocks of 8;
    # token 23 (output 16) was stored while it was still being sampled
    full = prompt + out.token_ids[:-1]
    mgr = eng.block_manager
    assert mgr.longest_cached_prefix(full + [1]) == 24


def test_preemption_and_aborts_inside_the_lag_in_every_mode(model):
    """A pool small enough to preempt, aborts while tokens are in flight, prefix caching and
    speculation on: the pipelined and synchronous steps agree and no block is left."""
    results = []
    for pipelined in (True, False):
        cfg = config("paged", pipelined, max_num_blocks=24, max_num_seqs=8, prefix_cache=True, speculative="ngram",
                     speculative_disable_by_batch_size=1 << 20, speculative_min_acceptance=0.0)
        eng = Engine(model, None, cfg)
        reqs = mixed_requests(12, seed=13)
        ids = [eng.add_request(p, sp) for p, sp in reqs]
        done, steps = {}, 0
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = (o.token_ids, o.finish_reason)
            steps += 1
            if steps == 6:
                eng.abort(ids[3])
            eng.block_manager.check_invariants()
        assert eng.stats()["num_preemptions"] > 0
        results.append([done[i] for i in ids])
        assert_no_leak(eng)
    # the abort lands one token earlier in the pipelined run (its outputs trail by a step)
    pipelined_abort, synchronous_abort = results[0].pop(3), results[1].pop(3)
    assert pipelined_abort[1] == synchronous_abort[1] == "abort"
    assert synchronous_abort[0][: len(pipelined_abort[0])] == pipelined_abort[0]
    assert results[0] == results[1]
