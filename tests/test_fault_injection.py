"""Fault injection over 1,000+ requests per KV layout.

Random failures are injected into the executor (before the forward pass, inside the
model after the paged slots were appended, and after a completed pass), into the
sampler (a request's sampler state is poisoned) and into the detokenizer (a request's
detokenizer raises), while a thread aborts random live requests. Afterwards:

- every request ended exactly once;
- the engine and KV invariants hold, and no sequence, cache or block is left;
- every request that no fault hit (finish_reason "length") equals its solo run, token
  for token (greedy and seeded sampling), computed in a separate engine.
"""

import random
import threading
import time

import pytest

import mlx_ferrum.engine.launch as engine_module
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.errors import RequestError
from support.tiny_models import tiny_model

NUM_REQUESTS = 1000
VOCAB = 97


class InjectedFault(RuntimeError):
    pass


class ExplodingDetokenizer:
    def add_token(self, token):
        raise InjectedFault("injected detokenizer fault")

    def finalize(self):
        raise InjectedFault("injected detokenizer fault")


def due(rng, calls, period, offset, rate=0.005):
    """A fault now? Every ``period``-th call (so each kind surely fires) and at random."""
    return calls % period == offset or rng.random() < rate


class FaultyModel:
    def __init__(self, model, rng, period):
        self._model, self._rng, self.period, self.faults, self.calls = model, rng, period, 0, 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        out = self._model(*args, **kwargs)
        self.calls += 1
        if due(self._rng, self.calls, self.period, 5, rate=0.002):
            self.faults += 1
            raise InjectedFault("injected fault inside the forward pass")
        return out


def requests(n, seed):
    r = random.Random(seed)
    shared = [r.randrange(VOCAB) for _ in range(24)]  # a common prefix for the prefix cache
    out = []
    for i in range(n):
        tail = [r.randrange(VOCAB) for _ in range(r.randint(1, 20))]
        prompt = shared[: r.choice([0, 8, 16, 24])] + tail
        # logprobs: a wrong KV (a stale prefix-cache block) shows in them even where the
        # tiny model's tokens survive it
        if r.random() < 0.6:
            p = SamplingParams(max_tokens=r.randint(1, 8), temperature=0.0, ignore_eos=True, logprobs=0)
        else:
            p = SamplingParams(max_tokens=r.randint(1, 8), temperature=0.8, top_k=r.choice([0, 10, 10**30]),
                               top_p=r.choice([1.0, 0.9]), seed=50_000 + i, ignore_eos=True, logprobs=0)
        out.append((prompt, p))
    return out


def config(layout):
    if layout == "paged":
        return RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=24, max_num_seqs=24,
                             max_num_batched_tokens=256, prefix_cache=True)
    return RuntimeConfig(kv_layout="contiguous", max_num_seqs=24, max_num_batched_tokens=256)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_random_faults_and_aborts_over_1000_requests(layout, monkeypatch):
    rng = random.Random(1234 if layout == "paged" else 4321)
    model = tiny_model("llama", seed=9)
    eng = Engine(model, None, config(layout))
    # the contiguous layout calls the model once per prompt-length group, so more often
    faulty = FaultyModel(model, rng, period=83 if layout == "paged" else 307)
    eng.runner.model = faulty
    counts = {"executor_before": 0, "executor_after": 0, "sampler": 0, "detokenizer": 0, "aborts": 0}

    # the engine's executor entry is forward() (the pipelined step queues it lazily)
    real_forward = eng.runner.forward
    calls = {"run": 0, "sample": 0}

    def forward(work, prev_tokens=None, blocks=None):
        calls["run"] += 1
        if due(rng, calls["run"], 97, 13):
            counts["executor_before"] += 1
            raise InjectedFault("injected executor fault before the pass")
        out = real_forward(work, prev_tokens, blocks)
        if due(rng, calls["run"], 89, 7):
            counts["executor_after"] += 1
            raise InjectedFault("injected executor fault after the pass")
        return out

    eng.runner.forward = forward

    poisoned = set()
    real_sample = engine_module.sample

    def sample(logits, states, *a, **k):
        calls["sample"] += 1
        if due(rng, calls["sample"], 79, 3):
            poisoned.add(id(rng.choice(list(states))))
            counts["sampler"] += 1
        if any(id(s) in poisoned for s in states):
            raise InjectedFault("injected sampler fault")
        return real_sample(logits, states, *a, **k)

    monkeypatch.setattr(engine_module, "sample", sample)

    reqs = requests(NUM_REQUESTS, seed=99)
    finals = {}
    live = []
    live_lock = threading.Lock()
    stop = threading.Event()

    def aborter():
        arng = random.Random(7)
        while not stop.is_set():
            time.sleep(arng.uniform(0.0005, 0.004))
            with live_lock:
                rid = arng.choice(live) if live else None
            if rid is not None and arng.random() < 0.1:
                try:
                    eng.abort(rid)
                    counts["aborts"] += 1
                except RequestError:
                    pass  # it finished meanwhile

    thread = threading.Thread(target=aborter)
    thread.start()
    ids = []
    try:
        pending = list(reqs)
        while pending or eng.has_unfinished_requests():
            for _ in range(min(len(pending), rng.randint(0, 12))):
                prompt, params = pending.pop(0)
                rid = eng.add_request(prompt, params)
                ids.append(rid)
                if len(ids) % 100 == 50 or rng.random() < 0.005:
                    eng._seqs[rid].detok = ExplodingDetokenizer()
                    counts["detokenizer"] += 1
                with live_lock:
                    live.append(rid)
            for out in eng.step():
                _check_output_agrees(out)
                if out.finished:
                    assert out.request_id not in finals, f"{out.request_id} finished twice"
                    finals[out.request_id] = out
                    with live_lock:
                        live.remove(out.request_id)
    finally:
        stop.set()
        thread.join()

    # every request ended exactly once, and every fault kind actually fired
    assert set(finals) == set(ids) and len(ids) == NUM_REQUESTS
    assert all(v > 0 for v in counts.values()) and faulty.faults > 0, counts
    reasons = [o.finish_reason for o in finals.values()]
    print(f"\n{layout}: faults {counts}, inside the model {faulty.faults}, preemptions "
          f"{eng.scheduler.num_preemptions}, outcomes { {r: reasons.count(r) for r in set(reasons)} }")
    assert set(reasons) <= {"length", "error", "abort"}
    assert reasons.count("length") > NUM_REQUESTS // 2, "faults hit too many requests for the check to mean much"

    # nothing leaked, invariants hold
    ex = eng.runner
    if layout == "paged":
        eng.block_manager.check_invariants()
        assert not eng.block_manager.seqs and eng.block_manager.num_free == eng.block_manager.num_blocks
    else:
        assert not ex._contiguous
    assert not eng._seqs and not eng._pending and not eng._in_flight and not eng._deferred_release
    assert not eng.scheduler.running and not eng.scheduler.waiting

    # every request not hit equals its solo run
    monkeypatch.setattr(engine_module, "sample", real_sample)
    solo = Engine(tiny_model("llama", seed=9), None, RuntimeConfig(kv_layout="paged", block_size=8,
                                                                   max_num_blocks=64))
    for rid, (prompt, params) in zip(ids, reqs):
        out = finals[rid]
        if out.finish_reason != "length":
            continue
        ref = solo.generate([prompt], params)[0]
        assert out.token_ids == ref.token_ids, f"{rid} differs from its solo run"
        assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4), f"{rid}'s logprobs differ from its solo run"


# --------------------------------------------- threads sharing one engine, on a tiny pool
POOL_BLOCKS, POOL_BLOCK_SIZE = 6, 8  # 48 tokens: long requests outgrow it while neighbours run


def _check_output_agrees(out):
    """No public output carries an in-flight placeholder, and ids and logprobs agree."""
    assert all(t >= 0 for t in out.token_ids), f"placeholder in {out.token_ids}"
    assert all(t >= 0 for t in out.new_token_ids), f"placeholder in {out.new_token_ids}"
    if out.logprobs is not None:
        assert len(out.logprobs) == len(out.token_ids)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "synchronous"])
def test_faults_while_eight_threads_share_an_engine_on_a_tiny_pool(pipelined, monkeypatch):
    """8 threads call ``generate`` / ``stream`` on one engine whose pool holds 48 tokens,
    while faults hit the model, the sampler and detokenizers and a thread aborts. Every
    caller returns with its own outputs; a request that outgrows the pool ends with
    ``"length"`` (never an error); every request no fault hit equals its solo run; no
    output carries a placeholder; nothing is left behind."""
    rng = random.Random(77 if pipelined else 78)
    model = tiny_model("llama", seed=9)
    cfg = RuntimeConfig(kv_layout="paged", block_size=POOL_BLOCK_SIZE, max_num_blocks=POOL_BLOCKS, max_num_seqs=8,
                        async_scheduling=pipelined)
    eng = Engine(model, None, cfg)
    cap = eng.max_sequence_tokens()
    assert cap == POOL_BLOCKS * POOL_BLOCK_SIZE
    faulty = FaultyModel(model, rng, period=41)
    eng.runner.model = faulty
    real_sample = engine_module.sample
    poisoned, calls = set(), {"sample": 0}
    fault_lock = threading.Lock()

    def sample(logits, states, *a, **k):
        with fault_lock:
            calls["sample"] += 1
            if due(rng, calls["sample"], 37, 3):
                poisoned.add(id(rng.choice(list(states))))
        if any(id(s) in poisoned for s in states):
            raise InjectedFault("injected sampler fault")
        return real_sample(logits, states, *a, **k)

    monkeypatch.setattr(engine_module, "sample", sample)
    real_add = eng.add_request

    def add_request(prompt, params=None, request_id=None, **kwargs):
        rid = real_add(prompt, params, request_id, **kwargs)
        with fault_lock:
            explode = rng.random() < 0.05
        if explode:
            with eng._lock:
                seq = eng._seqs.get(rid)
                if seq is not None:
                    seq.detok = ExplodingDetokenizer()
        return rid

    eng.add_request = add_request

    per_thread = []
    r = random.Random(5)
    for t in range(8):
        reqs = []
        for i in range(4):
            prompt = [r.randrange(VOCAB) for _ in range(r.randint(2, 20))]
            max_tokens = r.choice([4, 8, 60])  # 60 always outgrows the 48-token pool
            if r.random() < 0.5:
                p = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
            else:
                p = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=900 + 10 * t + i, ignore_eos=True,
                                   logprobs=0)
            reqs.append((prompt, p))
        per_thread.append(reqs)

    results, errors = [None] * 8, [None] * 8
    stop = threading.Event()

    def caller(t):
        try:
            reqs = per_thread[t]
            if t % 2 == 0:
                outs = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
                for o in outs:
                    _check_output_agrees(o)
                results[t] = outs
            else:
                finals = []
                for prompt, sp in reqs:
                    streamed = list(eng.stream(prompt, sp))
                    for o in streamed:
                        _check_output_agrees(o)
                        assert o.request_id == streamed[0].request_id, "another caller's output"
                    finals.append(streamed[-1])
                results[t] = finals
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[t] = e

    def aborter():
        arng = random.Random(11)
        while not stop.is_set():
            time.sleep(arng.uniform(0.002, 0.01))
            with eng._lock:
                live = list(eng._seqs)
            if live and arng.random() < 0.15:
                try:
                    eng.abort(arng.choice(live))
                except RequestError:
                    pass

    threads = [threading.Thread(target=caller, args=(t,), daemon=True) for t in range(8)]
    abort_thread = threading.Thread(target=aborter, daemon=True)
    abort_thread.start()
    for th in threads:
        th.start()
    deadline = time.monotonic() + 120
    for th in threads:
        th.join(max(0.0, deadline - time.monotonic()))
    stop.set()
    abort_thread.join(5)
    assert not [t for t, th in enumerate(threads) if th.is_alive()], "a caller never returned"
    assert errors == [None] * 8, errors
    monkeypatch.setattr(engine_module, "sample", real_sample)

    solo = Engine(tiny_model("llama", seed=9), None, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64))
    reasons = []
    for reqs, outs in zip(per_thread, results):
        assert len(outs) == len(reqs)
        for (prompt, sp), out in zip(reqs, outs):
            assert out.finished and out.prompt_token_ids == prompt, "a caller got another request's output"
            reasons.append(out.finish_reason)
            if out.finish_reason == "error":
                assert "injected" in out.error, f"not an injected fault: {out.error}"
                continue
            if out.finish_reason == "abort":
                continue
            assert out.finish_reason == "length"
            assert len(out.token_ids) == min(sp.max_tokens, cap - len(prompt))
            ref = solo.generate([prompt], sp)[0].token_ids
            assert out.token_ids == ref[: len(out.token_ids)], "a request no fault hit differs from its solo run"
    # enough requests ran untouched for the solo comparison above to mean something (the
    # share varies with the machine's speed: the aborter and the faults act on a clock)
    assert reasons.count("length") >= len(reasons) // 5, reasons
    assert any(len(prompt) + sp.max_tokens > cap for reqs in per_thread for prompt, sp in reqs)

    mgr = eng.block_manager
    mgr.check_invariants()
    assert not mgr.seqs and mgr.num_free == mgr.num_blocks
    assert not eng._seqs and not eng.outputs.boxes
    assert not eng.scheduler.running and not eng.scheduler.waiting
