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

from support.server_helpers import PLAIN_TEMPLATE, running_server  # noqa: E402

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


# ------------------------------------------------------------------ response_format

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer", "minimum": 0, "maximum": 99},
                   "pet": {"enum": ["cat", "dog"]}},
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}


def test_response_format_json_schema_and_json_object_on_chat_and_completions(client):
    jsonschema = pytest.importorskip("jsonschema")
    msgs = [{"role": "user", "content": "Lily"}]
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=120, temperature=1.0, seed=seed,
                                           response_format=rf)
        assert r.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    r = client.completions.create(model=MODEL, prompt="Lily", max_tokens=120, temperature=1.0, seed=5,
                                  extra_body={"response_format": rf})
    jsonschema.validate(json.loads(r.choices[0].text), PERSON)
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=60, temperature=1.0, seed=1,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    text = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0,
                                          response_format={"type": "text"}).choices[0].message.content
    assert text == client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=8, temperature=0).choices[0].message.content
    # vLLM's guided fields
    r = client.completions.create(model=MODEL, prompt="Lily", max_tokens=20, temperature=1.0,
                                  extra_body={"guided_regex": "(yes|no)!"})
    assert r.choices[0].text in ("yes!", "no!")


def test_parse_with_a_pydantic_model(client):
    from typing import Literal

    from pydantic import BaseModel, Field

    class Pet(BaseModel):
        kind: Literal["cat", "dog", "fish"]
        legs: int = Field(ge=0, le=8)
        happy: bool

    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    r = parse(model=MODEL, messages=[{"role": "user", "content": "Lily"}], response_format=Pet, max_tokens=100,
              temperature=1.0, seed=2)
    pet = r.choices[0].message.parsed
    assert isinstance(pet, Pet) and pet.kind in ("cat", "dog", "fish") and 0 <= pet.legs <= 8


def test_a_schema_that_does_not_compile_is_a_400(server, client):
    for body in ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
                 {"response_format": {"type": "json_schema"}},
                 {"response_format": {"type": "yaml"}},
                 {"guided_regex": "[a-"}):
        r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Lily"}], "max_tokens": 4, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] in ("response_format", "guided_regex"), err
    # the server serves on
    assert client.completions.create(model=MODEL, prompt="Lily", max_tokens=2, temperature=0).choices[0].text


# ------------------------------------------------------------------ tools

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                                       "additionalProperties": False}}}
MSGS = [{"role": "user", "content": "Lily"}]


def test_tool_choice_required_and_named_always_parse(client):
    for seed in range(3):
        r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER, TIME], tool_choice="required",
                                           max_tokens=120, temperature=1.0, seed=seed, parallel_tool_calls=False)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.tool_calls, c
        for call in c.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            assert call.function.name in ("get_weather", "get_time")
            json.loads(call.function.arguments)
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER, TIME], max_tokens=60, temperature=1.0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    (call,) = r.choices[0].message.tool_calls
    args = json.loads(call.function.arguments)
    assert call.function.name == "get_weather" and args["city"] in ("Paris", "Rome") and 1 <= args["days"] <= 7


HERMES_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}\n</tool_call>'


def test_auto_tool_calls_are_parsed_from_the_model_output_streamed_and_not(client):
    # a scripted reply: the regex makes the model write a Hermes tool call after some text
    script = {"guided_regex": "Sure\\. " + HERMES_CALL.replace("{", "\\{").replace("}", "\\}")}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=100, temperature=0,
                                       extra_body=script)
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Sure."
    (call,) = c.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome", "days": 2}
    stream = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=100, temperature=0,
                                            extra_body=script, stream=True)
    content, calls, finish = "", [], None
    for chunk in stream:
        d = chunk.choices[0].delta
        content += d.content or ""
        calls.extend(d.tool_calls or [])
        finish = chunk.choices[0].finish_reason or finish
    assert content.strip() == "Sure." and finish == "tool_calls"
    assert [(k.index, k.function.name, json.loads(k.function.arguments)) for k in calls] == [(0, "get_weather", {"city": "Rome", "days": 2})]
    # no call in the reply: plain content, finish_reason stop/length
    plain = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=8, temperature=0)
    assert plain.choices[0].message.tool_calls is None and plain.choices[0].message.content


def test_required_tool_calls_stream_as_deltas(client):
    stream = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], tool_choice="required",
                                            max_tokens=120, temperature=1.0, seed=4, stream=True, parallel_tool_calls=False)
    calls, finish = [], None
    for chunk in stream:
        if chunk.choices:
            calls.extend(chunk.choices[0].delta.tool_calls or [])
            finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls and all(k.function.name == "get_weather" for k in calls)


def test_tool_messages_go_back_into_the_template(client):
    history = MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length")


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_malformed_tools_are_400s(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=30,
                   json={"model": MODEL, "messages": MSGS, "max_tokens": 4, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# a scripted reply per parser, in the syntax of the model family that parser serves
SCRIPTED = {
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Rome", "days": 2}}', None),
    "mistral": ('Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]', "Sure."),
}


@pytest.mark.parametrize("parser", sorted(SCRIPTED))
def test_llama3_and_mistral_tool_calls_parse_end_to_end_streamed_and_not(stories_path, tmp_path, parser):
    """``--tool-call-parser`` picks the syntax: a reply the regex scripts in that syntax
    comes back as ``tool_calls``, whole and as streamed deltas."""
    import re

    reply, content = SCRIPTED[parser]
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    args = ["--served-model-name", MODEL, "--chat-template", str(template), "--tool-call-parser", parser]
    with running_server(stories_path, tmp_path, args) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        script = {"guided_regex": re.escape(reply)}
        r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=120, temperature=0,
                                           extra_body=script)
        c = r.choices[0]
        assert c.finish_reason == "tool_calls" and c.message.content == content, c
        (call,) = c.message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Rome", "days": 2}
        stream = client.chat.completions.create(model=MODEL, messages=MSGS, tools=[WEATHER], max_tokens=120,
                                                temperature=0, extra_body=script, stream=True)
        text, calls, finish = "", [], None
        for chunk in stream:
            if chunk.choices:
                d = chunk.choices[0].delta
                text += d.content or ""
                calls.extend(d.tool_calls or [])
                finish = chunk.choices[0].finish_reason or finish
        assert finish == "tool_calls" and (text.strip() or None) == content
        assert [(k.function.name, json.loads(k.function.arguments)) for k in calls] == \
            [("get_weather", {"city": "Rome", "days": 2})]
