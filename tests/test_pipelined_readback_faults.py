"""Faults while the engine READS BACK a launched step, with the next step queued behind it.

The pipelined engine (``RuntimeConfig.async_scheduling``) queues step t+1 with
``mx.async_eval`` before :meth:`StepLauncher.resolve` reads step t's tokens
(``flight.tokens.tolist()``). MLX evaluates lazily, so a computation that fails on the
device is reported at the first host read that waits for it: that read-back. These
tests make that read fail, in both modes (``async_scheduling`` True and False; the
synchronous mode reads each step back at once) and both KV layouts, and check that:

- the requests of the failed step end with ``"error"`` naming the fault (or, for
  ``KeyboardInterrupt``, the interrupt propagates after they ended and their blocks
  were released; their final outputs come from the next ``step()``);
- the step queued behind the failed one is not corrupted: a request it admitted
  completes with the tokens of its solo run;
- every other request finishes token for token as in a solo run (greedy and seeded);
- no block, cache or sequence is left behind (``check_invariants``, free blocks back
  to the whole pool) and the engine serves new requests afterwards;
- the same holds for :class:`AsyncEngine`'s stepping thread, which keeps serving.

Two ways the fault reaches the read-back:

1. :class:`ReadBackFault` replaces the chosen step's ``flight.tokens`` by an array whose
   ``tolist()`` raises, just before ``StepLauncher.resolve`` reads it (after step t+1 was queued):
   the engine sees exactly what MLX shows it when the step's evaluation failed, or a
   Ctrl-C that arrives while the host waits in that read.
2. :class:`FailsDuringEvaluation` is a real device-side failure: a model whose pass
   multiplies the embeddings by ``inv(zeros)[0, 0]``. LAPACK's LU factorization of a
   singular matrix raises ``RuntimeError`` while MLX evaluates it, after a chain of
   matmuls, so ``mx.async_eval`` has long returned and the host is waiting in the
   read-back when it fails. MLX (0.32, CPU) reports such a failure ONCE, at the first
   host read, and evaluates what depends on it from an unwritten buffer without a
   word: everything the failed step wrote, the KV of a prompt chunk it prefilled
   included, is garbage, so every request of that step must end, not only the ones
   whose tokens were sampled.
"""

import asyncio
import random
import signal
import time
import traceback

import mlx.core as mx
import pytest

import mlx_ferrum.engine.launch as engine_module
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.engine.async_engine import AsyncEngine
from support.tiny_models import tiny_model

LAYOUTS = ["paged", "contiguous"]
MODES = [True, False]  # async_scheduling: pipelined, synchronous

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, top_k=20, seed=17, ignore_eos=True)
PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16, 17], [1, 2], [30, 31, 32, 33, 34], [40, 41]]


class InjectedReadBackFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=5)


def config(layout, pipelined, **kw):
    base = dict(kv_layout=layout, max_num_seqs=3, async_scheduling=pipelined)
    if layout == "paged":
        base.update(block_size=8, max_num_blocks=64)
    base.update(kw)
    return RuntimeConfig(**base)


_solo_cache: dict = {}


def solo(model, prompt, params):
    """The request run alone in a fresh synchronous paged engine (the reference)."""
    key = (id(model), tuple(prompt), params.temperature, params.seed, params.max_tokens)
    if key not in _solo_cache:
        eng = Engine(model, None, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64,
                                                async_scheduling=False))
        _solo_cache[key] = eng.generate([prompt], params)[0].token_ids
    return _solo_cache[key]


def assert_clean(eng):
    """No sequence, cache, block or pending output is left behind."""
    ex = eng.runner
    if ex.layout == "paged":
        eng.block_manager.check_invariants()
        assert not eng.block_manager.seqs, "a KV cache was left behind"
        assert eng.block_manager.num_free == eng.block_manager.num_blocks, "blocks were left behind"
    else:
        assert not ex._contiguous, "contiguous caches were left behind"
    assert not eng.has_unfinished_requests()
    assert not eng._seqs and not eng._pending and eng.launcher.inflight is None
    assert not eng._in_flight and not eng._deferred_release


def holds_kv(eng, rid):
    return eng.block_manager.has(rid) if eng.block_manager is not None else eng.runner.has_cache(rid)


class _Unreadable:
    """Stands for a step's sampled-token array whose evaluation failed: reading it raises."""

    def __init__(self, exc):
        self.exc = exc

    def tolist(self):
        raise self.exc


class ReadBackFault:
    """Makes the read-back of one chosen launched step raise ``exc``.

    ``StepLauncher.resolve`` is wrapped on the instance; when armed, the first step whose
    rows hold ``target`` gets its ``tokens`` replaced by :class:`_Unreadable` just before
    the real ``resolve`` reads them. In the pipelined mode the next step is already
    queued at that moment (``eng.launcher.inflight`` is it); the test records it.
    """

    def __init__(self, eng, exc, target=None, when=None):
        self.eng, self.exc, self.target, self.when = eng, exc, target, when
        self.armed = False
        self.step_requests = None  # request ids of the failed step's rows
        self.queued_behind = None  # request ids of the step queued behind it
        self.on_fire = None  # optional callback, run just before the read fails
        real = eng.launcher.resolve

        def resolve(flight):
            chosen = self.when(flight) if self.when is not None else (
                self.target is None or self.target in flight.row_of)
            if self.armed and chosen:
                self.armed = False
                self.step_requests = [s.request_id for s, _, _ in flight.rows]
                behind = eng.launcher.inflight if eng.launcher.inflight is not flight else None
                self.queued_behind = [s.request_id for s, _, _ in behind.rows] if behind is not None else []
                if self.on_fire is not None:
                    self.on_fire(flight)
                flight.tokens = _Unreadable(self.exc)
            return real(flight)

        eng.launcher.resolve = resolve


def drive(eng, steps_before=None, max_steps=2000):
    """Step until nothing is left; ``steps_before(n)`` runs before the n-th step. Returns
    ``(finals, interrupts)``: each request's final output, and how many steps raised
    ``KeyboardInterrupt``."""
    finals, interrupts = {}, 0
    for n in range(max_steps):
        if steps_before is not None:
            steps_before(n)
        if n > 3 and not eng.has_unfinished_requests():
            return finals, interrupts
        try:
            outs = eng.step()
        except KeyboardInterrupt:
            interrupts += 1
            continue
        for o in outs:
            if o.finished:
                assert o.request_id not in finals, f"{o.request_id} finished twice"
                finals[o.request_id] = o
    raise AssertionError("the engine did not finish its requests")


def arm_before_step(eng, step_number: int, fault) -> None:
    """Wrap ``eng.step`` so that ``fault.armed`` is set just before step ``step_number``."""
    real_step = eng.step
    steps = {"n": 0}

    def step():
        steps["n"] += 1
        if steps["n"] == step_number:
            fault.armed = True
        return real_step()

    eng.step = step


def serve_two_waves(eng):
    """Serve five streams at once through an :class:`AsyncEngine` over ``eng``, then two
    more; returns both waves' output lists and checks the stepping thread survived."""
    aeng = AsyncEngine(eng)

    async def collect(prompt, params):
        return [o async for o in aeng.astream(prompt, params)]

    async def main():
        first = await asyncio.wait_for(asyncio.gather(*(collect(p, params_of(i)) for i, p in enumerate(PROMPTS[:5]))), 60)
        later = await asyncio.wait_for(asyncio.gather(collect(PROMPTS[5], SEEDED), collect(PROMPTS[0], GREEDY)), 60)
        return first, later

    try:
        first, later = asyncio.run(main())
        alive = aeng._thread.is_alive()
    finally:
        aeng.shutdown()
    assert alive, "the stepping thread died"
    return first, later


def params_of(i):
    return GREEDY if i % 2 == 0 else SEEDED


# ---------------------------------------------------------------- RuntimeError at read-back
@pytest.mark.parametrize("pipelined", MODES, ids=["pipelined", "synchronous"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_failed_read_back_ends_that_steps_requests_only(model, layout, pipelined):
    """Step t's read-back raises (its evaluation failed). Its requests end with the
    error; a request admitted into the step queued behind it, requests still waiting
    for a slot and a request added afterwards all match their solo runs."""
    eng = Engine(model, None, config(layout, pipelined))
    ids = [eng.add_request(p, params_of(i)) for i, p in enumerate(PROMPTS[:5])]  # 3 run, 2 wait
    fault = ReadBackFault(eng, InjectedReadBackFault("injected: the step's evaluation failed"), target=ids[0])
    extra = {}

    def before(n):
        if n == 4:
            fault.armed = True  # ids[0..2] are decoding
        if n == 4 and pipelined:
            # ids[1] was aborted after step t was launched: the failed read must not end it twice
            fault.on_fire = lambda flight: eng.abort(ids[1])
        if n == 5:
            extra["late"] = eng.add_request(PROMPTS[5], GREEDY)  # a slot frees only if the fault ended some

    finals, _ = drive(eng, before)
    assert fault.step_requests is not None, "the fault never fired"
    hit = set(fault.step_requests)
    assert hit == set(ids[:3])
    if pipelined:
        assert fault.queued_behind, "no step was queued behind the failed read-back"
    for i, rid in enumerate(ids):
        out = finals[rid]
        ref = solo(model, PROMPTS[i], params_of(i))
        assert -1 not in out.token_ids, "an in-flight placeholder leaked into an output"
        if rid in hit:
            if pipelined and rid == ids[1]:
                assert out.finish_reason == "abort"
            else:
                assert out.finish_reason == "error"
                assert "InjectedReadBackFault: injected: the step's evaluation failed" in out.error
            assert out.token_ids == ref[: len(out.token_ids)], "a token before the fault differs from the solo run"
            assert len(out.token_ids) < len(ref)
        else:
            assert (out.finish_reason, out.token_ids) == ("length", ref), f"{rid} was harmed by another's fault"
    late = finals[extra["late"]]
    assert (late.finish_reason, late.token_ids) == ("length", solo(model, PROMPTS[5], GREEDY))
    assert_clean(eng)
    # the engine keeps serving
    again = eng.generate([PROMPTS[0], PROMPTS[3]], [GREEDY, SEEDED])
    assert [o.token_ids for o in again] == [solo(model, PROMPTS[0], GREEDY), solo(model, PROMPTS[3], SEEDED)]
    assert_clean(eng)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_step_queued_behind_a_failed_read_back_completes_its_new_request(model, layout):
    """Pipelined: request C is admitted (prefilled) in step t+1, which is queued on
    the device when step t's read-back fails. Step t+1 is read back normally: C's first
    token and all the rest equal its solo run, and the failed requests' rows in step t+1
    (their next token, computed from an unread token) are dropped, not emitted."""
    eng = Engine(model, None, config(layout, True))
    ids = [eng.add_request(p, params_of(i)) for i, p in enumerate(PROMPTS[:2])]  # 2 of 3 slots
    fault = ReadBackFault(eng, InjectedReadBackFault("injected read-back fault"), target=ids[0])
    extra = {}
    seen_before_end = {}

    def before(n):
        if n == 4:
            fault.armed = True
            extra["c"] = eng.add_request(PROMPTS[4], SEEDED)  # prefilled in the step launched now

    finals = {}
    for n in range(500):
        before(n)
        if n > 5 and not eng.has_unfinished_requests():
            break
        for o in eng.step():
            if o.request_id in ids and not o.finished:
                seen_before_end.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finals[o.request_id] = o
    assert fault.queued_behind is not None and extra["c"] in fault.queued_behind, \
        "C's first token was not in the step queued behind the failed one"
    assert set(fault.step_requests) == set(ids)
    for i, rid in enumerate(ids):
        assert finals[rid].finish_reason == "error"
        # what was streamed before the error is exactly the final token list (nothing more)
        assert seen_before_end.get(rid, []) == finals[rid].token_ids
        assert finals[rid].token_ids == solo(model, PROMPTS[i], params_of(i))[: len(finals[rid].token_ids)]
    c = finals[extra["c"]]
    assert (c.finish_reason, c.token_ids) == ("length", solo(model, PROMPTS[4], SEEDED))
    assert_clean(eng)


# ---------------------------------------------------------------- KeyboardInterrupt at read-back
@pytest.mark.parametrize("pipelined", MODES, ids=["pipelined", "synchronous"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ctrl_c_during_read_back_ends_the_steps_requests_then_propagates(model, layout, pipelined):
    """Ctrl-C while the host waits in step t's ``tolist()``. ``step()`` raises
    ``KeyboardInterrupt``; by then step t's requests are finished and hold no KV, the
    step queued behind (pipelined) is still in flight, and the next ``step()`` returns
    their final ``"error"`` outputs and goes on. Everything else matches its solo run."""
    eng = Engine(model, None, config(layout, pipelined))
    ids = [eng.add_request(p, params_of(i)) for i, p in enumerate(PROMPTS[:5])]
    fault = ReadBackFault(eng, KeyboardInterrupt(), target=ids[1])
    extra = {}
    checked = {}

    def before(n):
        if n == 3:
            fault.armed = True
        if n == 4:
            extra["late"] = eng.add_request(PROMPTS[5], SEEDED)

    finals = {}
    interrupts = 0
    for n in range(1000):
        before(n)
        if n > 5 and not eng.has_unfinished_requests():
            break
        try:
            outs = eng.step()
        except KeyboardInterrupt:
            interrupts += 1
            # right at the interrupt: the failed step's requests ended and released their KV
            for rid in fault.step_requests:
                assert rid not in eng._seqs and not holds_kv(eng, rid)
            if layout == "paged":
                eng.block_manager.check_invariants()
            if pipelined:
                assert eng.launcher.inflight is not None, "the step queued behind the read-back was lost"
                assert [s.request_id for s, _, _ in eng.launcher.inflight.rows] == fault.queued_behind
            checked["at_interrupt"] = True
            continue
        for o in outs:
            if o.finished:
                assert o.request_id not in finals
                finals[o.request_id] = o
    assert interrupts == 1 and checked
    hit = set(fault.step_requests)
    assert hit == set(ids[:3])
    for i, rid in enumerate(ids):
        out = finals[rid]
        ref = solo(model, PROMPTS[i], params_of(i))
        if rid in hit:
            assert out.finish_reason == "error" and out.error.startswith("KeyboardInterrupt")
            assert out.token_ids == ref[: len(out.token_ids)] and -1 not in out.token_ids
        else:
            assert (out.finish_reason, out.token_ids) == ("length", ref)
    late = finals[extra["late"]]
    assert (late.finish_reason, late.token_ids) == ("length", solo(model, PROMPTS[5], SEEDED))
    assert_clean(eng)
    again = eng.generate([PROMPTS[2]], SEEDED)
    assert again[0].token_ids == solo(model, PROMPTS[2], SEEDED)
    assert_clean(eng)


# ---------------------------------------------------------------- a real device-side failure
def _fails_late(matrix: mx.array, delay_matmuls: int) -> mx.array:
    """A scalar whose evaluation fails (the inverse of a zero matrix), but only after a
    chain of ``delay_matmuls`` matmuls of ``matrix``: the failure lands late in a step."""
    slow = matrix
    for _ in range(delay_matmuls):
        slow = slow @ matrix
    singular = slow[:2, :2] * 0.0  # known to be singular only once the chain ran
    return mx.linalg.inv(singular, stream=mx.cpu)[0, 0]


class FailsDuringEvaluation:
    """A tiny llama whose next pass, once armed, fails while MLX EVALUATES it.

    The final hidden states are multiplied by ``inv(M)[0, 0]`` where ``M`` is the zero
    matrix, computed at the end of a chain of matmuls: building the graph and
    ``mx.async_eval`` succeed, and LAPACK's LU factorization raises ``RuntimeError``
    on the device later. MLX (0.32, CPU) reports it once, at the first host wait after
    it, and computes what depends on it from the unwritten output buffer without a
    word. The fault sits after the last attention layer, so the wait that sees it is
    the step's read-back (``tolist()`` in ``StepLauncher.resolve``) when nothing else waits first;
    in the pipelined mode ``mx.async_eval`` of step t+1 waits first (on the CPU it waits
    for the queued work its attention reads, step t's tokens included).
    """

    def __init__(self, model, delay_matmuls=6, size=512):
        self._model = model
        self.armed = False
        self.fired = 0
        self._delay_matmuls = delay_matmuls
        self._matrix = mx.random.normal((size, size), key=mx.random.key(3)) * (size ** -0.5)
        mx.eval(self._matrix)

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, input_ids, meta=None):
        if not self.armed:
            return self._model(input_ids, meta)
        self.armed = False
        self.fired += 1
        scale = _fails_late(self._matrix, self._delay_matmuls)
        inner = self._model
        h = inner.model(input_ids, meta) * scale
        idx = getattr(meta, "logits_indices", None) if meta is not None else None
        if idx is not None:
            h = h.reshape(-1, h.shape[-1])[idx][None]
        return inner.lm_head(h)


class FailingSampler:
    """``sample`` whose result, once armed, fails while MLX evaluates it.

    The sampled tokens go through ``where(inv(M)[0, 0] == 1, tokens, 0)`` with ``M`` the
    zero matrix at the end of a short chain of matmuls, so the failure is among the
    last operations of the step and happens after ``mx.async_eval`` returned. MLX
    reports it at the next host wait: the step's read-back (``tolist()`` in
    ``StepLauncher.resolve``), or in the pipelined mode possibly ``mx.async_eval`` of step t+1
    first. The failed value reads back as 0 (a valid token id), so a token "computed"
    by the failed step would be silently wrong, not out of range.
    """

    def __init__(self, real, delay_matmuls=4, size=384):
        self._real = real
        self.armed = False
        self.fired = 0
        self._delay_matmuls = delay_matmuls
        self._matrix = mx.random.normal((size, size), key=mx.random.key(4)) * (size ** -0.5)
        mx.eval(self._matrix)

    def __call__(self, logits, states, *args, **kwargs):
        res = self._real(logits, states, *args, **kwargs)
        if not self.armed:
            return res
        self.armed = False
        self.fired += 1
        scale = _fails_late(self._matrix, self._delay_matmuls)
        res.tokens = mx.where(scale == 1.0, res.tokens, 0).astype(mx.int32)
        return res


def where_raised(eng):
    """Records the engine function in which each step failure reached the engine."""
    places = []
    real = eng._fail_seqs

    def fail_seqs(seqs, exc):
        frames = [f.name for f in traceback.extract_tb(exc.__traceback__)] if exc.__traceback__ else []
        engine_frames = [f for f in frames if f in ("sample", "resolve")]
        places.append(engine_frames[-1] if engine_frames else None)
        return real(seqs, exc)

    eng._fail_seqs = fail_seqs
    return places


LONG_PROMPT = [(7 * i + 3) % 90 for i in range(40)]


@pytest.mark.parametrize("fault_in", ["model", "sampler"])
@pytest.mark.parametrize("pipelined", MODES, ids=["pipelined", "synchronous"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_evaluation_failure_ends_every_request_of_that_step_and_no_other(model, layout, pipelined, fault_in,
                                                                          monkeypatch):
    """A real failure inside the device computation of step t. Step t decoded A and B,
    sampled the LAST token of D (``max_tokens`` reached, so the scheduler does not run D
    in step t+1) and prefilled a chunk of the long prompt L (not sampled at step t).
    All four end with the error: none may keep a token computed from the failed
    evaluation (D's would be its final token, reported as ``"length"``), and L's step
    failed like the others. W, waiting for a slot, and later requests match their solo
    runs; nothing leaks."""
    eng = Engine(model, None, config(layout, pipelined, max_num_seqs=4, prefill_chunk_size=8,
                                     max_num_batched_tokens=16))
    if fault_in == "model":
        faulty = FailsDuringEvaluation(model)
        eng.runner.model = faulty
    else:
        faulty = FailingSampler(engine_module.sample)
        monkeypatch.setattr(engine_module, "sample", faulty)
    places = where_raised(eng)
    d_params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    a = eng.add_request(PROMPTS[0], GREEDY)
    b = eng.add_request(PROMPTS[1], SEEDED)
    d = eng.add_request(PROMPTS[4], d_params)
    extra = {}

    def before(n):
        if n == 2:
            extra["L"] = eng.add_request(LONG_PROMPT, GREEDY)  # 40 tokens: 5 chunks of 8
            extra["W"] = eng.add_request(PROMPTS[2], SEEDED)  # waits: no slot left
        if n == 4:
            assert eng._seqs[extra["L"]].num_computed < len(LONG_PROMPT) - 8, "L is not mid-prefill"
            assert len(eng._seqs[d].output_ids) == d_params.max_tokens - 1, "D's last token is not sampled now"
            faulty.armed = True

    finals, _ = drive(eng, before)
    assert faulty.fired == 1
    print(f"\nthe failure reached the engine in {places[0]}")
    if fault_in == "sampler" and not pipelined:
        # the evaluation runs on MLX's worker while the step is still being launched: on a
        # loaded machine it can fail before the launch's last MLX call, which then raises
        assert places[0] in ("resolve", "sample"), f"the failure did not surface in the step: {places}"
    for rid, prompt, params in ((a, PROMPTS[0], GREEDY), (b, PROMPTS[1], SEEDED), (d, PROMPTS[4], d_params),
                                (extra["L"], LONG_PROMPT, GREEDY)):
        out = finals[rid]
        assert out.finish_reason == "error", f"{rid} went on after its step failed: {out.finish_reason} {out.token_ids}"
        assert "LU factorization failed" in out.error
        assert out.token_ids == solo(model, prompt, params)[: len(out.token_ids)], "a token from the failed step was kept"
    w = finals[extra["W"]]
    assert (w.finish_reason, w.token_ids) == ("length", solo(model, PROMPTS[2], SEEDED))
    assert_clean(eng)
    again = eng.generate([LONG_PROMPT, PROMPTS[4]], [GREEDY, SEEDED])
    assert [o.token_ids for o in again] == [solo(model, LONG_PROMPT, GREEDY), solo(model, PROMPTS[4], SEEDED)]
    assert_clean(eng)


# ---------------------------------------------------------------- AsyncEngine
@pytest.mark.parametrize("pipelined", MODES, ids=["pipelined", "synchronous"])
def test_async_engine_loop_survives_a_failed_read_back(model, pipelined):
    """The same fault under :class:`AsyncEngine`: the stepping thread hits the failed
    read-back; the affected clients get a final ``"error"`` output, the other clients'
    streams equal their solo runs, and the thread keeps serving new requests."""
    eng = Engine(model, None, config("paged", pipelined, max_num_seqs=3))
    fault = ReadBackFault(eng, InjectedReadBackFault("injected read-back fault (async)"))
    arm_before_step(eng, 5, fault)
    first, later = serve_two_waves(eng)
    assert fault.step_requests, "the fault never fired"
    errors = 0
    for i, outs in enumerate(first):
        final = outs[-1]
        assert final.finished and sum(o.finished for o in outs) == 1
        ref = solo(model, PROMPTS[i], params_of(i))
        streamed = [t for o in outs for t in o.new_token_ids]
        assert streamed == final.token_ids, "the stream and the final output disagree"
        so_far = []
        for o in outs:  # every output, not only the last: the pipelined step's lag never shows
            so_far += o.new_token_ids
            assert o.token_ids == so_far, f"an output carries a placeholder: {o.token_ids}"
        if final.request_id in fault.step_requests:
            errors += 1
            assert final.finish_reason == "error" and "injected read-back fault (async)" in final.error
            assert final.token_ids == ref[: len(final.token_ids)]
        else:
            assert (final.finish_reason, final.token_ids) == ("length", ref)
    assert errors == len(fault.step_requests) > 0
    assert [o[-1].token_ids for o in later] == [solo(model, PROMPTS[5], SEEDED), solo(model, PROMPTS[0], GREEDY)]
    assert_clean(eng)


@pytest.mark.parametrize("pipelined", MODES, ids=["pipelined", "synchronous"])
def test_failed_read_back_while_six_threads_share_the_engine(model, pipelined):
    """Six threads call ``generate`` / ``stream`` on one engine; whichever thread steps
    hits a failed read-back. Every caller returns with its own requests' outputs (the
    stepping thread routes them), the failed step's requests end with the error, every
    other request equals its solo run, no streamed output carries a placeholder, and
    nothing is left behind."""
    import threading

    eng = Engine(model, None, config("paged", pipelined, max_num_seqs=4))
    fault = ReadBackFault(eng, InjectedReadBackFault("injected read-back fault (threads)"))
    arm_before_step(eng, 6, fault)
    results, errors = [None] * 6, [None] * 6

    def call(i):
        try:
            if i % 2 == 0:
                results[i] = eng.generate([PROMPTS[i]], params_of(i))[0]
            else:
                outs = list(eng.stream(PROMPTS[i], params_of(i)))
                so_far = []
                for o in outs:
                    so_far += o.new_token_ids
                    assert o.request_id == outs[0].request_id, "another caller's output"
                    assert o.token_ids == so_far, f"an output carries a placeholder: {o.token_ids}"
                results[i] = outs[-1]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors[i] = e

    threads = [threading.Thread(target=call, args=(i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "a caller never returned"
    assert errors == [None] * 6, errors
    assert fault.step_requests, "the fault never fired"
    for i, out in enumerate(results):
        assert out.finished and out.prompt_token_ids == PROMPTS[i]
        ref = solo(model, PROMPTS[i], params_of(i))
        if out.request_id in fault.step_requests:
            assert out.finish_reason == "error" and "injected read-back fault (threads)" in out.error
            assert out.token_ids == ref[: len(out.token_ids)]
        else:
            assert (out.finish_reason, out.token_ids) == ("length", ref)
    assert_clean(eng)
    assert not eng.outputs.boxes


# ---------------------------------------------------------------- Ctrl-C while async_eval waits
@pytest.mark.parametrize("pipelined", MODES, ids=["pipelined", "synchronous"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_ctrl_c_while_async_eval_waits_ends_that_steps_sampled_requests(model, layout, pipelined, monkeypatch):
    """On MLX's CPU backend ``mx.async_eval`` waits for most of the step it queues, so
    that is where a Ctrl-C usually lands. Python raises it when the call returns: the
    step is queued, its tokens will never be read back. ``step()`` propagates the
    interrupt with that step's sampled requests ended and released (final ``"error"``
    outputs on the next call); the previous step still in flight (pipelined) and every
    other request go on and match their solo runs; the engine keeps serving."""
    eng = Engine(model, None, config(layout, pipelined, max_num_seqs=4, prefill_chunk_size=8,
                                     max_num_batched_tokens=16))
    real_async_eval = mx.async_eval
    state = {"armed": False, "fired": None}

    def async_eval(*arrays):
        real_async_eval(*arrays)
        if state["armed"]:
            state["armed"] = False
            with eng._lock:  # the requests this step sampled: their newest token is a placeholder
                state["fired"] = {s.request_id for s in eng._seqs.values() if s.output_ids and s.output_ids[-1] == -1}
            raise KeyboardInterrupt

    monkeypatch.setattr(mx, "async_eval", async_eval)
    ids = [eng.add_request(p, params_of(i)) for i, p in enumerate(PROMPTS[:3])]
    extra = {}
    finals, interrupts = {}, 0
    for n in range(1000):
        if n == 2:
            extra["L"] = eng.add_request(LONG_PROMPT, GREEDY)  # mid-prefill at the interrupt
            extra["W"] = eng.add_request(PROMPTS[4], SEEDED)  # waits for a slot
        if n == 4:
            state["armed"] = True
        if n > 5 and not eng.has_unfinished_requests():
            break
        try:
            outs = eng.step()
        except KeyboardInterrupt:
            interrupts += 1
            for rid in state["fired"]:
                assert rid not in eng._seqs and not holds_kv(eng, rid)
            if layout == "paged":
                eng.block_manager.check_invariants()
            continue
        for o in outs:
            if o.finished:
                assert o.request_id not in finals
                finals[o.request_id] = o
    assert interrupts == 1 and state["fired"] == set(ids)
    for i, rid in enumerate(ids):
        out = finals[rid]
        assert out.finish_reason == "error" and out.error.startswith("KeyboardInterrupt")
        assert -1 not in out.token_ids
        assert out.token_ids == solo(model, PROMPTS[i], params_of(i))[: len(out.token_ids)]
    for rid, prompt, params in ((extra["L"], LONG_PROMPT, GREEDY), (extra["W"], PROMPTS[4], SEEDED)):
        assert (finals[rid].finish_reason, finals[rid].token_ids) == ("length", solo(model, prompt, params))
    assert_clean(eng)
    again = eng.generate([PROMPTS[0]], SEEDED)
    assert again[0].token_ids == solo(model, PROMPTS[0], SEEDED)
    assert_clean(eng)


@pytest.mark.parametrize("pipelined", MODES, ids=["pipelined", "synchronous"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_async_engine_serves_on_after_an_evaluation_failure(model, layout, pipelined, monkeypatch):
    """:class:`FailingSampler` under :class:`AsyncEngine`: one step's evaluation fails
    on the device while the stepping thread runs. The clients of that step (and, when
    MLX reported it at the next launch, of the step launched then) get one final
    ``"error"`` output naming it, with no token from the failed evaluation; every other
    client's stream equals its solo run; the thread keeps serving."""
    eng = Engine(model, None, config(layout, pipelined, max_num_seqs=3))
    faulty = FailingSampler(engine_module.sample)
    monkeypatch.setattr(engine_module, "sample", faulty)
    arm_before_step(eng, 4, faulty)
    first, later = serve_two_waves(eng)
    assert faulty.fired == 1
    errors = 0
    for i, outs in enumerate(first):
        final = outs[-1]
        assert final.finished and sum(o.finished for o in outs) == 1
        assert [t for o in outs for t in o.new_token_ids] == final.token_ids
        ref = solo(model, PROMPTS[i], params_of(i))
        if final.finish_reason == "error":
            errors += 1
            assert "LU factorization failed" in final.error
            assert final.token_ids == ref[: len(final.token_ids)], "a token from the failed evaluation reached a client"
        else:
            assert (final.finish_reason, final.token_ids) == ("length", ref)
    assert 1 <= errors <= 3, "the failure ended requests beyond the steps it touched"
    assert [o[-1].token_ids for o in later] == [solo(model, PROMPTS[5], SEEDED), solo(model, PROMPTS[0], GREEDY)]
    assert_clean(eng)


@pytest.mark.parametrize("pipelined", MODES, ids=["pipelined", "synchronous"])
def test_ctrl_c_in_the_client_thread_of_an_async_engine_releases_everything(model, pipelined):
    """Ctrl-C reaches the main thread (signals go there), not :class:`AsyncEngine`'s
    stepping thread, which may be inside a read-back at that moment. ``asyncio.run``
    cancels the clients; each ``astream`` aborts its request, the stepping thread ends
    them between its steps (a step in flight is read back and dropped), every block is
    released, and the same engine serves the next ``asyncio.run`` identically to a solo
    run."""
    eng = Engine(model, None, config("paged", pipelined, max_num_seqs=4))
    aeng = AsyncEngine(eng)
    long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)

    async def stream_until_interrupted():
        seen = {"n": 0}

        async def client(prompt):
            async for _ in aeng.astream(prompt, long):
                seen["n"] += 1
                if seen["n"] == 12:  # mid-stream: several steps in, one in flight
                    signal.raise_signal(signal.SIGINT)

        await asyncio.gather(*(client(p) for p in PROMPTS[:4]))

    async def later():
        return await asyncio.wait_for(aeng.generate(PROMPTS[1], SEEDED), 60)

    # a process started in the background by a non-interactive shell (as CI may be)
    # inherits SIGINT ignored; install Python's handler so the signal becomes Ctrl-C
    previous_handler = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            asyncio.run(stream_until_interrupted())
        for _ in range(2000):  # the stepping thread ends the aborted requests between steps
            if not eng.has_unfinished_requests():
                break
            time.sleep(0.005)
        assert aeng._thread.is_alive(), "the stepping thread died"
        assert_clean(eng)
        out = asyncio.run(later())
    finally:
        signal.signal(signal.SIGINT, previous_handler)
        aeng.shutdown()
    assert (out.finish_reason, out.token_ids) == ("length", solo(model, PROMPTS[1], SEEDED))
    assert_clean(eng)


@pytest.mark.parametrize("exc", [InjectedReadBackFault("injected read-back fault"), KeyboardInterrupt()],
                         ids=["error", "ctrl-c"])
def test_read_back_fault_of_a_step_whose_request_was_preempted_inside_the_lag(model, exc):
    """Pipelined, paged, a pool small enough to preempt: the read-back of step t fails
    after step t+1's schedule preempted one of step t's requests (its blocks were freed,
    its in-flight token not read yet). That request ends with the step's error like the
    others of the step, exactly once; every request outside the step matches its solo
    run; no block leaks."""
    r = random.Random(5)
    reqs = []
    for i in range(40):
        prompt = [r.randrange(97) for _ in range(r.randint(4, 30))]
        reqs.append((prompt, GREEDY if i % 2 else SamplingParams(max_tokens=12, temperature=0.8, seed=300 + i,
                                                               ignore_eos=True)))
    eng = Engine(model, None, config("paged", True, max_num_blocks=20, max_num_seqs=12, max_num_batched_tokens=96))

    def preempted_row(flight):
        return any(s.status.value == "waiting" for s, _, _ in flight.rows)

    fault = ReadBackFault(eng, exc, when=preempted_row)
    fault.armed = True
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    finals, interrupts = drive(eng)
    assert fault.step_requests is not None, "no request was preempted inside the lag: the test is too easy"
    assert interrupts == (1 if isinstance(exc, KeyboardInterrupt) else 0)
    assert set(finals) == set(ids)
    hit = set(fault.step_requests)
    name = type(exc).__name__
    for rid, (prompt, params) in zip(ids, reqs):
        out = finals[rid]
        ref = solo(model, prompt, params)
        assert -1 not in out.token_ids
        if rid in hit:
            assert out.finish_reason == "error" and out.error.startswith(name)
            assert out.token_ids == ref[: len(out.token_ids)]
        else:
            assert (out.finish_reason, out.token_ids) == ("length", ref), f"{rid} was harmed by another's fault"
    assert eng.stats()["num_preemptions"] > 0
    assert_clean(eng)
