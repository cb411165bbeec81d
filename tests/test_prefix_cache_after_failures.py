"""The prefix cache never hands out a block whose KV was not written as its key says.

A paged block's prefix-cache key is registered when the scheduler appends its slots,
before the pass that writes its KV has run. Three ways a request can leave such a block
behind, each followed here by a request that shares its prompt prefix:

- the step's pass failed: the runner raised before the pass (its KV was never written),
  or the model raised while the pass was built (whatever it queued is not relied on):
  the slots are given back;
- the request was aborted between scheduling and the pass: its row leaves the pass;
- the step's evaluation failed on the device: MLX computes what depends on the failed
  operation from an unwritten buffer, so the KV the step wrote is garbage.

The reference is the same request in a fresh engine without prefix caching: its tokens
and its chosen tokens' log-probabilities must agree (the tiny model's greedy tokens
often survive a wrong prefix; its log-probabilities do not). A request after that one
must then hit the cache again, so caching still works.
"""

import mlx.core as mx
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from support.tiny_models import tiny_model

BLOCK_SIZE = 8
PREFIX = [5, 9, 12, 40, 41, 3, 7, 8, 22, 23, 24, 25, 60, 61, 62, 63]  # two full blocks
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=0)


class InjectedFault(RuntimeError):
    pass


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=9)


def engine(model, pipelined=True, prefix_cache=True):
    return Engine(model, None, RuntimeConfig(kv_layout="paged", block_size=BLOCK_SIZE, max_num_blocks=24,
                                             prefix_cache=prefix_cache, async_scheduling=pipelined))


def assert_matches_uncached_run(model, out, prompt):
    ref = engine(model, prefix_cache=False).generate([prompt], PARAMS)[0]
    assert out.finish_reason == "length"
    assert out.token_ids == ref.token_ids
    assert out.logprobs == pytest.approx(ref.logprobs, abs=1e-4), "it read KV that was never written"


def assert_cache_still_serves(model, eng):
    """A third request with the prefix hits blocks the second one wrote, and agrees."""
    hits_before = eng.block_manager.cache_metrics_snapshot()["prefix_hit_tokens"]
    prompt = PREFIX + [4, 4, 4]
    out = eng.generate([prompt], PARAMS)[0]
    assert eng.block_manager.cache_metrics_snapshot()["prefix_hit_tokens"] - hits_before == len(PREFIX)
    assert_matches_uncached_run(model, out, prompt)
    eng.block_manager.check_invariants()


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "synchronous"])
@pytest.mark.parametrize("where", ["before the pass", "inside the model"])
def test_a_step_whose_pass_failed_leaves_no_block_in_the_prefix_cache(model, where, pipelined):
    eng = engine(model, pipelined)
    armed = {"on": True}
    if where == "before the pass":
        real_forward = eng.runner.forward

        def forward(work, prev_tokens=None, blocks=None):
            if armed.pop("on", False):
                raise InjectedFault("injected before the pass")
            return real_forward(work, prev_tokens, blocks)

        eng.runner.forward = forward
    else:
        real_model = eng.runner.model

        class FaultyModel:
            def __getattr__(self, name):
                return getattr(real_model, name)

            def __call__(self, *args, **kwargs):
                out = real_model(*args, **kwargs)
                if armed.pop("on", False):
                    raise InjectedFault("injected inside the model")
                return out

        eng.runner.model = FaultyModel()
    failed = eng.generate([PREFIX + [1]], PARAMS)[0]
    assert failed.finish_reason == "error" and "injected" in failed.error
    prompt = PREFIX + [2, 3]
    assert_matches_uncached_run(model, eng.generate([prompt], PARAMS)[0], prompt)
    assert_cache_still_serves(model, eng)


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "synchronous"])
def test_a_request_aborted_before_its_pass_leaves_no_unwritten_block_cached(model, pipelined):
    """The abort lands after the scheduler appended the request's slots (and registered
    its full prompt blocks) and before the pass: the row leaves the pass unwritten."""
    eng = engine(model, pipelined)
    real_run_step = eng._run_step
    target = {}

    def run_step(items, *args, **kwargs):
        rid = target.pop("id", None)
        if rid is not None and any(it.seq.request_id == rid for it in items):
            eng.abort(rid)
        return real_run_step(items, *args, **kwargs)

    eng._run_step = run_step
    target["id"] = eng.add_request(PREFIX + [1], PARAMS)
    outs = []
    while eng.has_unfinished_requests():
        outs.extend(o for o in eng.step() if o.finished)
    assert [o.finish_reason for o in outs] == ["abort"] and not target
    prompt = PREFIX + [2, 3]
    assert_matches_uncached_run(model, eng.generate([prompt], PARAMS)[0], prompt)
    assert_cache_still_serves(model, eng)


def _fails_late() -> mx.array:
    """A scalar whose evaluation fails on the device (LAPACK's LU factorization of a zero
    matrix raises while MLX evaluates it), after a chain of matmuls, so building the pass
    and ``mx.async_eval`` succeed and the failure surfaces at a later host wait."""
    matrix = mx.random.normal((256, 256), key=mx.random.key(4)) * (256 ** -0.5)
    slow = matrix
    for _ in range(4):
        slow = slow @ matrix
    return mx.linalg.inv(slow[:2, :2] * 0.0, stream=mx.cpu)[0, 0]


class EmbeddingFailsDuringEvaluation:
    """The model's embedding, multiplied once (when armed) by a scalar whose evaluation
    fails: every layer's KV of that pass is computed from an unwritten buffer."""

    def __init__(self, embedding):
        self.embedding, self.armed = embedding, False

    def __getattr__(self, name):
        return getattr(self.embedding, name)

    def __call__(self, input_ids):
        h = self.embedding(input_ids)
        if self.armed:
            self.armed = False
            h = h * _fails_late()
        return h


@pytest.mark.parametrize("pipelined", [True, False], ids=["pipelined", "synchronous"])
def test_a_step_whose_evaluation_failed_leaves_no_block_in_the_prefix_cache(model, pipelined):
    eng = engine(tiny_model("llama", seed=9), pipelined)
    inner = eng.runner.model.model
    faulty = EmbeddingFailsDuringEvaluation(inner.embed_tokens)
    inner.embed_tokens = faulty
    faulty.armed = True
    failed = eng.generate([PREFIX + [1]], PARAMS)[0]
    assert failed.finish_reason == "error" and not faulty.armed
    prompt = PREFIX + [2, 3]
    assert_matches_uncached_run(model, eng.generate([prompt], PARAMS)[0], prompt)
    assert_cache_still_serves(model, eng)
