"""``SamplingParams.logit_bias``: an additive per-request bias on the device, batched.

Checked in every engine mode that samples: the pipelined step (paged, compiled decode),
the synchronous step, the contiguous layout and prompt-lookup speculative decoding.
"""

import mlx.core as mx
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.engine.sampling import SamplerState, apply_logit_bias, sample
from mlx_ferrum.errors import ExecutorError, SamplingParamsError
from support.tiny_models import tiny_model

VOCAB = 97
MODES = {
    "pipelined-paged": dict(kv_layout="paged", async_scheduling=True),
    "synchronous-paged": dict(kv_layout="paged", async_scheduling=False),
    "eager-paged": dict(kv_layout="paged", async_scheduling=True, enforce_eager=True),
    "contiguous": dict(kv_layout="contiguous", async_scheduling=True),
    "speculative-ngram": dict(kv_layout="paged", async_scheduling=True, speculative="ngram",
                              speculative_disable_by_batch_size=1 << 20),
}
PROMPTS = [[5, 17, 3, 44, 9], [60, 2, 2, 81], [7, 7, 7, 30, 12, 19]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=11, vocab_size=VOCAB)


def engine(model, mode):
    return Engine(model, None, RuntimeConfig(block_size=8, max_num_blocks=256, max_num_seqs=16, **MODES[mode]))


def greedy(max_tokens=12, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.mark.parametrize("mode", list(MODES))
def test_a_large_bias_forces_its_token_and_minus_100_bans_the_greedy_one(model, mode):
    eng = engine(model, mode)
    base = [o.token_ids for o in eng.generate(PROMPTS, greedy())]
    forced_id = next(t for t in range(VOCAB) if all(t not in ids for ids in base))
    forced = eng.generate(PROMPTS, greedy(logit_bias={forced_id: 100}))
    assert all(o.token_ids == [forced_id] * 12 for o in forced)
    # banning each prompt's first greedy token changes that first token
    for prompt, ids in zip(PROMPTS, base):
        out = eng.generate([prompt], greedy(logit_bias={ids[0]: -100}))[0].token_ids
        assert out[0] != ids[0] and ids[0] not in out


@pytest.mark.parametrize("mode", list(MODES))
def test_rows_with_and_without_bias_in_one_batch_get_their_solo_outputs(model, mode):
    eng = engine(model, mode)
    base = [o.token_ids for o in eng.generate(PROMPTS, greedy())]
    params = [greedy(), greedy(logit_bias={base[1][0]: -100, base[1][3]: -100}), greedy(logit_bias={3: 8.0})]
    solo = [eng.generate([p], [sp])[0].token_ids for p, sp in zip(PROMPTS, params)]
    batched = [o.token_ids for o in eng.generate(PROMPTS, params)]
    assert batched == solo
    assert solo[0] == base[0] and solo[1] != base[1]


def test_sampled_rows_follow_the_bias():
    logits = mx.zeros((2, VOCAB))
    states = [SamplerState.create(SamplingParams(temperature=1.0, seed=s, logit_bias={42: 100})) for s in range(2)]
    for _ in range(5):
        assert sample(logits, states).tokens.tolist() == [42, 42]


def test_apply_logit_bias_adds_per_row_in_one_call():
    logits = mx.arange(2 * 6, dtype=mx.float32).reshape(2, 6)
    out = apply_logit_bias(logits, [{1: 2.5, 4: -1.0}, None])
    expected = logits.tolist()
    expected[0][1] += 2.5
    expected[0][4] -= 1.0
    assert out.tolist() == expected
    with pytest.raises(ExecutorError, match="vocabulary"):
        apply_logit_bias(logits, [{6: 1.0}, None])


@pytest.mark.parametrize("bias, match", [
    ({1: 101}, r"logit_bias\[1\]"), ({1: float("nan")}, r"logit_bias\[1\]"), ({-1: 1}, "key -1"),
    ({"1": 1}, "key '1'"), ([1, 2], "logit_bias"),
])
def test_bad_logit_bias_is_refused_by_name(bias, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(logit_bias=bias)


def test_an_id_outside_the_vocabulary_is_refused_at_add_request(model):
    eng = engine(model, "pipelined-paged")
    with pytest.raises(SamplingParamsError, match=r"outside the vocabulary \[0, 97\)"):
        eng.add_request([1, 2, 3], greedy(logit_bias={VOCAB: 5}))
    assert not eng.has_unfinished_requests()
