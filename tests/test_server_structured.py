"""The OpenAI features evaluations and agents need, through the official ``openai`` client
against ``mlx-ferrum serve`` on stories260K: ``echo`` + ``logprobs`` (prompt logprobs).
"""

from __future__ import annotations

import json

import httpx
import mlx.core as mx
import pytest

openai = pytest.importorskip("openai")
mlx_lm_utils = pytest.importorskip("mlx_lm.utils")

from server_helpers import PLAIN_TEMPLATE, running_server  # noqa: E402

MODEL = "stories"


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-structured")
    template = tmp / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    with running_server(stories_path, tmp, ["--served-model-name", MODEL, "--chat-template", str(template)]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(stories_path):
    model, _ = mlx_lm_utils.load_model(stories_path)
    return model


def _tokenize(server, text):
    return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]


def _teacher_forced(ref, ids):
    logits = ref(mx.array([ids]))[0].astype(mx.float32)
    return (logits - mx.logsumexp(logits, axis=-1, keepdims=True)).tolist()


# ------------------------------------------------------------------ echo + logprobs


def test_echo_with_max_tokens_0_returns_the_prompt_and_its_logprobs(server, client, reference):
    prompt = "Once upon a time, there was a little girl named Lily."
    ids = _tokenize(server, prompt)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=2, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and c.finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.usage.prompt_tokens == len(ids)
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = _teacher_forced(reference, ids)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - want[p - 1][ids[p]]) <= 1e-4
        assert lp.tokens[p] in lp.top_logprobs[p] and 2 <= len(lp.top_logprobs[p]) <= 3
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_with_generation_prepends_the_prompt(server, client):
    prompt = "Lily went to the park"
    plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=1)
    echoed = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, logprobs=1, echo=True)
    ids = _tokenize(server, prompt)
    c = echoed.choices[0]
    assert c.text == prompt + plain.choices[0].text
    assert c.logprobs.tokens[len(ids):] == plain.choices[0].logprobs.tokens
    assert c.logprobs.token_logprobs[len(ids):] == pytest.approx(plain.choices[0].logprobs.token_logprobs, abs=1e-5)
    assert c.logprobs.text_offset[len(ids)] == len(prompt)
    # echo without logprobs: text only
    bare = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0, echo=True)
    assert bare.choices[0].text == c.text and bare.choices[0].logprobs is None


def test_echo_streams_the_prompt_first(server, client):
    prompt = "The cat sat on the mat"
    ids = _tokenize(server, prompt)
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=0, stream=True))
    texts = [ch.choices[0].text for ch in chunks if ch.choices]
    assert "".join(texts) == prompt
    first = chunks[0].choices[0]
    assert first.logprobs.token_logprobs[0] is None and len(first.logprobs.tokens) == len(ids)
    assert chunks[-1].choices[0].finish_reason == "length"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, temperature=0, stream=True)
    assert "".join(ch.choices[0].text for ch in full if ch.choices).startswith(prompt)


def test_loglikelihood_multiple_choice_through_the_server_matches_mlx_lm(server, client, reference):
    items = [
        ("Once upon a time, there was a", [" little girl", " big dog", " red car"]),
        ("Lily went to the park to", [" play", " sleep in the sky", " eat a rock"]),
        ("The sun was", [" shining", " green", " very hot and bright"]),
    ]
    for context, endings in items:
        n_ctx = len(_tokenize(server, context))
        ours, theirs = [], []
        for e in endings:
            ids = _tokenize(server, context + e)
            r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=0)
            ours.append(sum(r.choices[0].logprobs.token_logprobs[n_ctx:]))
            want = _teacher_forced(reference, ids)
            theirs.append(sum(want[p - 1][ids[p]] for p in range(n_ctx, len(ids))))
        assert ours == pytest.approx(theirs, abs=1e-3)
        assert max(range(len(endings)), key=ours.__getitem__) == max(range(len(endings)), key=theirs.__getitem__)
