"""``SamplingParams(prompt_logprobs=k)``: per prompt token, its log-probability under a
teacher-forced forward of the same model, computed in the engine's batched prefill.

The reference is mlx-lm's own forward of the same checkpoint over the whole prompt
(float32): ``log_softmax(logits[p])[prompt[p + 1]]``. Chunked prefill (chunks smaller than
the prompt), both layouts, the pipelined and the synchronous step, neighbours without
prompt logprobs, and prefix caching (a request that asks for them does not read the cache).
"""

import math

import mlx.core as mx
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.errors import SamplingParamsError

mlx_lm_utils = pytest.importorskip("mlx_lm.utils")

MODES = {
    "pipelined-paged": dict(kv_layout="paged", async_scheduling=True),
    "synchronous-paged": dict(kv_layout="paged", async_scheduling=False),
    "contiguous": dict(kv_layout="contiguous", async_scheduling=True),
    "speculative-ngram": dict(kv_layout="paged", async_scheduling=True, speculative="ngram",
                              speculative_disable_by_batch_size=1 << 20),
}
TEXTS = [
    "Once upon a time, there was a little girl named Lily. She loved to play outside.",
    "The cat sat on the mat and looked at the dog.",
    "Tom had a red ball.",
]


@pytest.fixture(scope="module")
def stories(stories_path):
    from mlx_ferrum import load

    model, tokenizer = load(str(stories_path), dtype=mx.float32)
    ref, _ = mlx_lm_utils.load_model(stories_path)
    return model, tokenizer, ref


def _teacher_forced(ref, ids):
    logits = ref(mx.array([ids]))[0].astype(mx.float32)
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    return logp.tolist()


@pytest.mark.parametrize("mode", list(MODES))
def test_prompt_logprobs_equal_a_teacher_forced_forward(stories, mode):
    model, tokenizer, ref = stories
    # chunks of 7 tokens: every prompt spans several prefill steps
    eng = Engine(model, tokenizer, RuntimeConfig(block_size=8, max_num_blocks=256, prefill_chunk_size=7, **MODES[mode]))
    prompts = [tokenizer.encode(t) for t in TEXTS]
    params = [SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=2),
              SamplingParams(temperature=0.0, max_tokens=3),  # a neighbour that asks for none
              SamplingParams(temperature=0.0, max_tokens=3, prompt_logprobs=0)]
    outs = eng.generate(prompts, params)
    assert outs[1].prompt_logprobs is None
    for out, ids, sp in zip(outs, prompts, params):
        if sp.prompt_logprobs is None:
            continue
        table = out.prompt_logprobs
        assert len(table) == len(ids) and table[0] is None
        want = _teacher_forced(ref, ids)
        for p in range(1, len(ids)):
            entry = table[p]
            assert ids[p] in entry
            assert abs(entry[ids[p]] - want[p - 1][ids[p]]) <= 1e-4, (p, entry[ids[p]], want[p - 1][ids[p]])
            top = sorted(range(len(want[p - 1])), key=lambda t: -want[p - 1][t])[: sp.prompt_logprobs]
            for t in top:  # the top alternatives are the reference's (ties aside)
                assert t in entry and abs(entry[t] - want[p - 1][t]) <= 1e-4
            assert len(entry) <= sp.prompt_logprobs + 1
    # the generated tokens are those of a run without prompt logprobs
    plain = eng.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=3)] * 3)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]


def test_prompt_logprobs_bypass_the_prefix_cache(stories):
    model, tokenizer, ref = stories
    eng = Engine(model, tokenizer, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=256, prefix_cache=True))
    ids = tokenizer.encode(TEXTS[0])
    eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=2))  # fills the cache
    out = eng.generate([ids], SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=0))[0]
    want = _teacher_forced(ref, ids)
    assert out.metrics.num_cached_tokens == 0
    assert all(abs(out.prompt_logprobs[p][ids[p]] - want[p - 1][ids[p]]) <= 1e-4 for p in range(1, len(ids)))


def test_multiple_choice_loglikelihood_matches_mlx_lm(stories):
    """An lm-eval style task: pick the continuation with the highest summed loglikelihood."""
    model, tokenizer, ref = stories
    eng = Engine(model, tokenizer, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=512))
    items = [
        ("Once upon a time, there was a", [" little girl", " big dog", " red car", " happy tree"]),
        ("Lily went to the park to", [" play", " sleep in the sky", " eat a rock", " run and jump"]),
        ("The sun was", [" shining", " green", " very hot and bright", " a cat"]),
    ]
    for context, endings in items:
        ctx = tokenizer.encode(context)
        seqs = [ctx + tokenizer.encode(e, add_special_tokens=False) for e in endings]
        outs = eng.generate(seqs, SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0))
        ours, theirs = [], []
        for ids, out in zip(seqs, outs):
            want = _teacher_forced(ref, ids)
            ours.append(sum(out.prompt_logprobs[p][ids[p]] for p in range(len(ctx), len(ids))))
            theirs.append(sum(want[p - 1][ids[p]] for p in range(len(ctx), len(ids))))
        assert all(math.isclose(a, b, abs_tol=1e-3) for a, b in zip(ours, theirs))
        assert max(range(len(endings)), key=ours.__getitem__) == max(range(len(endings)), key=theirs.__getitem__)


def test_prompt_logprobs_is_validated():
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=-1)
    with pytest.raises(SamplingParamsError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=1.5)
