"""Sampling parameters, logits processors and the batched sampler, against numpy references."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.engine.sampling import (
    SamplerState,
    SamplingParams,
    apply_min_p,
    apply_repetition_penalty,
    apply_temperature,
    apply_top_k,
    apply_top_p,
    sample,
)
from mlx_ferrum.errors import SamplingParamsError

# ---------------------------------------------------------------------------
# numpy references, written from the papers' definitions
# ---------------------------------------------------------------------------


def np_softmax(x):
    x = np.asarray(x, dtype=np.float64)
    e = np.exp(x - np.max(x, axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def np_repetition_penalty(logits, history, penalty):
    out = np.array(logits, dtype=np.float64)
    for b, ids in enumerate(history):
        for t in set(ids):
            v = out[b, t]
            out[b, t] = v * penalty[b] if v < 0 else v / penalty[b]
    return out


def np_top_k_keep(logits, k):
    keep = np.ones_like(logits, dtype=bool)
    for b, kb in enumerate(k):
        if kb > 0:
            kth = np.sort(logits[b])[::-1][min(kb, logits.shape[1]) - 1]
            keep[b] = logits[b] >= kth
    return keep


def np_top_p_keep(logits, p):
    """Smallest set of most likely tokens whose probability sum reaches p (Holtzman et al.)."""
    keep = np.zeros_like(logits, dtype=bool)
    for b, pb in enumerate(p):
        probs = np_softmax(logits[b])
        total = 0.0
        for idx in np.argsort(-probs, kind="stable"):
            keep[b, idx] = True
            total += probs[idx]
            if total >= pb:
                break
    return keep


def np_min_p_keep(logits, m):
    probs = np_softmax(logits)
    return probs >= np.asarray(m)[:, None] * probs.max(axis=-1, keepdims=True)


def random_logits(rows, vocab, seed=0, scale=3.0):
    return np.random.default_rng(seed).normal(scale=scale, size=(rows, vocab)).astype(np.float32)


def kept(arr: mx.array) -> np.ndarray:
    return np.isfinite(np.array(arr))


# ---------------------------------------------------------------------------
# SamplingParams validation
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.1),
        ("min_p", 1.1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("max_tokens", 0),
        ("seed", -1),
        ("seed", 1.5),
        ("stop", [""]),
        ("stop", [3]),
        ("stop_token_ids", [-1]),
        ("logprobs", -1),
    ],
)
def test_params_validation(field, value):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})


def test_params_defaults_and_normalisation():
    p = SamplingParams(stop="###", top_k=-1, temperature=0)
    assert p.stop == ["###"] and p.greedy
    assert not SamplingParams().greedy
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    SamplingParams(top_p=1.0, min_p=1.0, top_k=0, seed=2**64 - 1, logprobs=0)


# ---------------------------------------------------------------------------
# processors
# ---------------------------------------------------------------------------


def test_repetition_penalty_matches_reference():
    logits = random_logits(3, 50)
    history = [[1, 2, 2, 7, 49], [], [0, 10, 10, 11]]
    penalty = [1.3, 2.0, 0.7]
    out = apply_repetition_penalty(mx.array(logits), history, penalty)
    np.testing.assert_allclose(np.array(out), np_repetition_penalty(logits, history, penalty), rtol=1e-6)
    # input untouched
    np.testing.assert_array_equal(np.array(mx.array(logits)), logits)


def test_temperature():
    logits = random_logits(2, 10)
    out = apply_temperature(mx.array(logits), [0.5, 2.0])
    np.testing.assert_allclose(np.array(out), logits / np.array([[0.5], [2.0]]), rtol=1e-6)


@pytest.mark.parametrize("k", [[1, 5, 0, 64, 100], [3, 3, 3, 3, 3]])
def test_top_k_matches_reference(k):
    logits = random_logits(5, 64, seed=1)
    shared = k[0] if len(set(k)) == 1 else k
    out = apply_top_k(mx.array(logits), shared)
    np.testing.assert_array_equal(kept(out), np_top_k_keep(logits, k))
    np.testing.assert_array_equal(np.array(out)[kept(out)], logits[np_top_k_keep(logits, k)])


def test_top_p_matches_reference():
    logits = random_logits(6, 64, seed=2)
    p = [0.05, 0.3, 0.5, 0.9, 0.999, 1.0]
    out = apply_top_p(mx.array(logits), p)
    np.testing.assert_array_equal(kept(out), np_top_p_keep(logits, p))
    assert kept(out)[5].all()


def test_min_p_matches_reference():
    logits = random_logits(4, 64, seed=3)
    m = [0.0, 0.05, 0.3, 1.0]
    out = apply_min_p(mx.array(logits), m)
    np.testing.assert_array_equal(kept(out), np_min_p_keep(logits, m))
    assert kept(out)[3].sum() == 1


# ---------------------------------------------------------------------------
# the sampler
# ---------------------------------------------------------------------------


def states_for(params_list, prompts=None):
    prompts = prompts or [()] * len(params_list)
    return [SamplerState.create(p, ids) for p, ids in zip(params_list, prompts)]


def test_greedy_is_argmax_and_records_history():
    logits = random_logits(4, 100, seed=4)
    states = states_for([SamplingParams(temperature=0)] * 4)
    res = sample(mx.array(logits), states)
    assert res.tokens.dtype == mx.int32 and res.tokens.shape == (4,)
    np.testing.assert_array_equal(np.array(res.tokens), logits.argmax(-1))
    assert [s.history for s in states] == [[t] for t in logits.argmax(-1).tolist()]


def test_greedy_with_repetition_penalty():
    logits = random_logits(2, 30, seed=5)
    prompts = [np.argsort(-logits[0])[:3].tolist(), []]
    states = states_for([SamplingParams(temperature=0, repetition_penalty=5.0)] * 2, prompts)
    res = sample(mx.array(logits), states)
    ref = np_repetition_penalty(logits, prompts, [5.0, 5.0]).argmax(-1)
    np.testing.assert_array_equal(np.array(res.tokens), ref)
    assert int(res.tokens[0]) != int(logits[0].argmax())


def test_mixed_batch_greedy_rows_are_argmax():
    logits = random_logits(4, 100, seed=6)
    params = [SamplingParams(temperature=0), SamplingParams(seed=1), SamplingParams(temperature=0), SamplingParams(seed=2, top_k=5)]
    res = sample(mx.array(logits[None, :, :].transpose(1, 0, 2)), states_for(params))  # [B, 1, V] accepted
    toks = np.array(res.tokens)
    assert toks[0] == logits[0].argmax() and toks[2] == logits[2].argmax()
    assert toks[3] in np.argsort(-logits[3])[:5]


def run_steps(states, logits_steps, row):
    out = []
    for step in logits_steps:
        out.append(int(sample(mx.array(step), states).tokens[row]))
    return out


def test_same_seed_same_tokens_regardless_of_batch():
    vocab, steps = 50, 12
    seq_logits = random_logits(steps, vocab, seed=7, scale=1.0)
    p = SamplingParams(seed=1234, temperature=0.9, top_p=0.95)
    alone = run_steps(states_for([p]), [seq_logits[i : i + 1] for i in range(steps)], 0)
    again = run_steps(states_for([p]), [seq_logits[i : i + 1] for i in range(steps)], 0)
    others = random_logits(steps, vocab, seed=8, scale=1.0)
    batched_steps = [np.stack([others[i], seq_logits[i], others[i]]) for i in range(steps)]
    batch_params = [SamplingParams(seed=1), p, SamplingParams(temperature=0)]
    batched = run_steps(states_for(batch_params), batched_steps, 1)
    assert alone == again == batched


def test_different_seeds_differ():
    flat = np.zeros((1, 1000), dtype=np.float32)
    seqs = [run_steps(states_for([SamplingParams(seed=s)]), [flat] * 8, 0) for s in (1, 2, 3)]
    assert seqs[0] != seqs[1] and seqs[1] != seqs[2] and seqs[0] != seqs[2]


def test_unseeded_follows_global_mlx_seed():
    flat = np.zeros((1, 1000), dtype=np.float32)
    mx.random.seed(11)
    a = run_steps(states_for([SamplingParams()]), [flat] * 5, 0)
    mx.random.seed(11)
    b = run_steps(states_for([SamplingParams()]), [flat] * 5, 0)
    assert a == b


@pytest.mark.parametrize(
    "params, keep_fn",
    [
        (dict(top_k=3), lambda x: np_top_k_keep(x, [3])),
        (dict(top_p=0.6), lambda x: np_top_p_keep(x, [0.6])),
        (dict(min_p=0.3), lambda x: np_min_p_keep(x, [0.3])),
        (dict(top_k=4, top_p=0.9, temperature=0.7), None),
    ],
)
def test_filtered_tokens_never_drawn_and_distribution(params, keep_fn):
    vocab, draws = 12, 1500
    logits = random_logits(1, vocab, seed=9, scale=1.0)
    temp = params.get("temperature", 1.0)
    scaled = logits / temp
    if keep_fn is None:
        keep = np_top_k_keep(scaled, [4]) & np_top_p_keep(np.where(np_top_k_keep(scaled, [4]), scaled, -np.inf), [0.9])
    else:
        keep = keep_fn(scaled)
    states = states_for([SamplingParams(seed=i, **params) for i in range(draws)])
    toks = np.array(sample(mx.array(np.repeat(logits, draws, axis=0)), states).tokens)
    assert keep[0, toks].all()
    # empirical frequencies follow the renormalised kept distribution
    probs = np_softmax(np.where(keep, scaled, -np.inf))[0]
    freq = np.bincount(toks, minlength=vocab) / draws
    assert np.abs(freq - probs).max() < 4 * math.sqrt(0.25 / draws)


def test_logprobs_are_raw_log_softmax():
    logits = random_logits(3, 40, seed=10)
    params = [SamplingParams(temperature=0, logprobs=5), SamplingParams(seed=3, temperature=2.0, logprobs=2), SamplingParams(seed=4)]
    res = sample(mx.array(logits), states_for(params))
    logp = np.log(np_softmax(logits))
    toks = np.array(res.tokens)
    np.testing.assert_allclose(np.array(res.logprobs), logp[np.arange(3), toks], atol=1e-5)
    assert res.top_ids.shape == (3, 5) and res.top_logprobs.dtype == mx.float32
    np.testing.assert_array_equal(np.array(res.top_ids), np.argsort(-logp, axis=-1)[:, :5])
    np.testing.assert_allclose(np.array(res.top_logprobs), np.sort(logp, axis=-1)[:, ::-1][:, :5], atol=1e-5)
    assert sample(mx.array(logits), states_for([SamplingParams()] * 3)).logprobs is None


def test_batched_gumbel_noise_equals_per_row_draws():
    # The batched sampler splits every row's key and draws its uniforms in one vmapped
    # op; each row must still get exactly the stream its own key gives alone.
    from mlx_ferrum.engine.sampling import SamplerState, _gumbel, _gumbel_rows

    one_by_one = [SamplerState.create(SamplingParams(seed=s)) for s in (3, 11, 2**40)]
    batched = [SamplerState.create(SamplingParams(seed=s)) for s in (3, 11, 2**40)]
    for _ in range(3):
        expected = mx.stack([_gumbel(64, st.next_key()) for st in one_by_one])
        assert mx.array_equal(_gumbel_rows(64, batched), expected).item()
    for a, b in zip(one_by_one, batched):
        assert mx.array_equal(a.key, b.key).item()


def test_pending_tokens_count_in_every_penalty_as_if_they_were_in_the_history():
    """The pipelined step samples before the previous token reaches the host history; a
    pending id passed on the device must give exactly the result of the longer history."""
    from mlx_ferrum.engine.sampling import apply_presence_frequency_penalty

    logits = random_logits(3, 40, seed=5)
    history = [[1, 2, 2], [5], [7, 8]]
    pending = [2, 9, -1]  # row 2 has nothing pending
    full = [h + ([p] if p >= 0 else []) for h, p in zip(history, pending)]
    out = apply_repetition_penalty(mx.array(logits), history, [1.3, 2.0, 0.7], pending=mx.array(pending))
    np.testing.assert_allclose(np.array(out), np_repetition_penalty(logits, full, [1.3, 2.0, 0.7]), rtol=1e-6)
    expected = np.array(apply_presence_frequency_penalty(mx.array(logits), full, [0.5, -1.0, 1.5], [0.3, 0.8, -0.2]))
    got = apply_presence_frequency_penalty(mx.array(logits), history, [0.5, -1.0, 1.5], [0.3, 0.8, -0.2],
                                           pending=mx.array(pending))
    np.testing.assert_allclose(np.array(got), expected, rtol=1e-6)
    # through sample(): the same tokens as with the longer histories
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, presence_penalty=1.0, frequency_penalty=0.5)
    short = [SamplerState.create(params, h) for h in history]
    for state in short:
        state.num_prompt_tokens = 0
    longer = [SamplerState.create(params, h) for h in full]
    for state in longer:
        state.num_prompt_tokens = 0
    a = sample(mx.array(logits), short, record=False, pending=mx.array(pending)).tokens.tolist()
    b = sample(mx.array(logits), longer, record=False).tokens.tolist()
    assert a == b
