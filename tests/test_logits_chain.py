"""One logits chain for sampling, speculative verification and draft proposals.

The references are the sampler itself (the chain must give verification the same
distribution that ``sample`` draws from) and numpy's argmax.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.engine.rejection_sampler import Proposal, distributions, verify
from mlx_ferrum.engine.sampling import SamplerState, SamplingParams, process_logits, sample

VOCAB = 64


def _logits(rows: int, seed: int = 0, scale: float = 30.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, VOCAB)) * scale).astype(np.float32)


@pytest.mark.parametrize("temperature", [1e-30, 1e-37])
def test_verify_with_a_tiny_temperature_acts_greedy(temperature):
    """A temperature so small that logits / temperature overflows float32 is as sharp as
    greedy: ``sample`` takes the argmax there, so verification must accept exactly the
    argmax tokens and add the argmax as its own token."""
    params = SamplingParams(temperature=temperature, max_tokens=8)
    logits = _logits(4, seed=1)
    argmax = logits.argmax(-1).tolist()
    for _ in range(5):  # sampled rows draw uniforms: repeat so luck cannot pass
        state = SamplerState.create(params, [1, 2, 3])
        result = verify([mx.array(logits)], [Proposal(argmax[:3])], [state])[0]
        assert result.token_ids == argmax and result.num_accepted == 3
        state = SamplerState.create(params, [1, 2, 3])
        wrong = [(argmax[0] + 1) % VOCAB, argmax[1], argmax[2]]
        result = verify([mx.array(logits)], [Proposal(wrong)], [state])[0]
        assert result.token_ids == [argmax[0]] and result.num_accepted == 0


def test_sample_with_a_tiny_temperature_takes_the_argmax():
    logits = _logits(3, seed=2)
    states = [SamplerState.create(SamplingParams(temperature=1e-30, max_tokens=4), [5]) for _ in range(3)]
    assert sample(mx.array(logits), states).tokens.tolist() == logits.argmax(-1).tolist()


def test_draft_distributions_are_the_samplers():
    """The distribution a proposer draws from is softmax of the chain's filtered logits,
    the one ``sample`` draws from by Gumbel-max: compare the draw frequencies."""
    params = SamplingParams(temperature=0.7, top_k=8, top_p=0.9, repetition_penalty=1.3, max_tokens=4)
    logits = _logits(1, seed=3, scale=2.0)
    history = [int(np.argmax(logits[0]))]
    _, probs = distributions(process_logits(mx.array(logits), [params], [history]))
    probs = np.array(probs)[0]
    draws = 4000
    state = SamplerState.create(SamplingParams(temperature=0.7, top_k=8, top_p=0.9, repetition_penalty=1.3,
                                               max_tokens=4, seed=0), history)
    counts = np.zeros(VOCAB)
    batch = mx.array(np.repeat(logits, 1, axis=0))
    for _ in range(draws):
        counts[sample(batch, [state], record=False).tokens.item()] += 1
    assert np.all(counts[probs == 0] == 0)
    # a binomial's standard deviation at most sqrt(0.25 / draws) ~ 0.008: allow 5 of them
    assert np.max(np.abs(counts / draws - probs)) < 0.04


def test_top_k_above_the_vocabulary_keeps_everything_in_every_path():
    params = SamplingParams(temperature=1.0, top_k=10 * VOCAB, max_tokens=4)
    chain = process_logits(mx.array(_logits(2, seed=4, scale=1.0)), [params, params], [[], []])
    assert bool(mx.all(mx.isfinite(chain.filtered)))
