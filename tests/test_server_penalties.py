"""Presence and frequency penalties (added for the server's OpenAI fields) against numpy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.engine.sampling import apply_presence_frequency_penalty
from mlx_ferrum.engine.sampling import SamplerState, SamplingParams, sample
from mlx_ferrum.errors import SamplingParamsError


def _numpy_reference(logits, generated, presence, frequency):
    out = logits.astype(np.float64).copy()
    for b, ids in enumerate(generated):
        counts = np.bincount(np.asarray(ids, dtype=np.int64), minlength=logits.shape[1]) if ids else np.zeros(logits.shape[1])
        out[b] -= presence[b] * (counts > 0) + frequency[b] * counts
    return out


def test_matches_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 11)).astype(np.float32)
    generated = [[1, 1, 4, 10], [], [0, 0, 0, 3]]
    presence, frequency = [0.5, 1.0, -0.7], [0.25, 2.0, 1.5]
    got = apply_presence_frequency_penalty(mx.array(logits), generated, presence, frequency)
    np.testing.assert_allclose(np.array(got), _numpy_reference(logits, generated, presence, frequency), rtol=1e-6, atol=1e-6)


def test_sample_penalises_generated_tokens_only():
    # token 2 is best; it is in the prompt (no penalty) and, for row 1, generated (penalised below token 3)
    logits = mx.array([[0.0, 0.0, 3.0, 2.0]] * 2)
    params = SamplingParams(temperature=0, frequency_penalty=1.5)
    fresh = SamplerState.create(params, prompt_ids=[2, 2])
    used = SamplerState.create(params, prompt_ids=[2, 2])
    used.append(2)
    assert sample(logits, [fresh, used]).tokens.tolist() == [2, 3]


@pytest.mark.parametrize("field", ["presence_penalty", "frequency_penalty"])
@pytest.mark.parametrize("value", [2.5, -3, float("nan")])
def test_validation_names_the_field(field, value):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: value})
