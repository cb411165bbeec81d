"""``/v1/responses``, ``/v1/messages`` (+ ``count_tokens``) and ``/v1/embeddings`` of
``mlx-ferrum serve``, driven by the vendors' own SDKs (``openai``, ``anthropic``).

Fast tests run on stories260K with the plain chat template (the prompt is BOS and the
messages' texts), so the expected texts come from the greedy recordings in
../shared/models/stories260K and prompt lengths from ``/tokenize`` of the same messages.
Forced tool calls use schemas a story model can complete (enums, integers). The heavier
SmolLM2 round trips are marked slow.
"""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

from support.server_helpers import PLAIN_TEMPLATE, running_server, wait_until_idle  # noqa: E402

MODEL = "stories"
KEY = "agent-key"
GREEDY = {"temperature": 0}
CITY = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"],
        "additionalProperties": False}
NUMBER = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agent")
    template = tmp / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    with running_server(stories_path, tmp, ["--served-model-name", MODEL, "--chat-template", str(template),
                                            "--api-key", KEY], {"FERRUM_PREFIX_CACHE": "0"}) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def once(stories_expected):
    return stories_expected["once"]


def prompt_tokens(server, messages: list[dict]) -> int:
    """The prompt length of ``messages`` by the server's /tokenize (the chat template)."""
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages},
                   headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text
    return r.json()["count"]


# ---------------------------------------------------------------- Responses


def test_responses_text_equals_recording_and_usage(oai, once):
    r = oai.responses.create(model=MODEL, input=once["prompt"], max_output_tokens=30, **GREEDY)
    assert once["completion_text"].startswith(r.output_text) and len(r.output_text) > 40
    assert r.id.startswith("resp_") and r.object == "response"
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in r.output] == ["message"] and r.output[0].status == "incomplete"
    assert r.usage.input_tokens == len(once["prompt_ids"]) and r.usage.output_tokens == 30
    assert r.usage.total_tokens == r.usage.input_tokens + 30
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0


def test_responses_stream_events(oai, once):
    events = list(oai.responses.create(model=MODEL, input=once["prompt"], max_output_tokens=30, stream=True, **GREEDY))
    types = [e.type for e in events]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    seq = [e.sequence_number for e in events]
    assert seq == sorted(seq) and len(set(seq)) == len(seq)
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert once["completion_text"].startswith(text) and len(text) > 40
    done = events[-1].response
    assert done.output_text == text == events[-4].text
    assert done.usage.output_tokens == 30 and done.usage.input_tokens == len(once["prompt_ids"])
    assert events[-2].item.content[0].text == text and events[-2].item.status == "incomplete"


def test_responses_multi_turn_with_previous_response_id(server, oai):
    first = oai.responses.create(model=MODEL, input="Once upon a time", instructions="Lily", max_output_tokens=8, **GREEDY)
    second = oai.responses.create(model=MODEL, input=[{"role": "user", "content": "Tom"}], instructions="Ben",
                                  previous_response_id=first.id, max_output_tokens=8, **GREEDY)
    # instructions are not carried over; the history and the first reply are
    expected = prompt_tokens(server, [{"role": "system", "content": "Ben"}, {"role": "user", "content": "Once upon a time"},
                                      {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "Tom"}])
    assert second.usage.input_tokens == expected
    # the same conversation sent whole gives the same reply
    whole = oai.responses.create(model=MODEL, instructions="Ben", max_output_tokens=8, input=[
        {"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": first.output_text},
        {"role": "developer", "content": ""}, {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Tom"}]}],
        **GREEDY)
    assert whole.output_text == second.output_text and whole.usage.input_tokens == expected


def test_responses_previous_response_id_unknown_or_not_stored(oai):
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(model=MODEL, input="Lily", previous_response_id="resp_nope", max_output_tokens=2)
    assert e.value.body["param"] == "previous_response_id" and e.value.body["code"] == "previous_response_not_found"
    unstored = oai.responses.create(model=MODEL, input="Lily", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        oai.responses.create(model=MODEL, input="Tom", previous_response_id=unstored.id, max_output_tokens=2)


def test_responses_forced_tool_round_trip(server, oai):
    tools = [{"type": "function", "name": "weather", "description": "the weather", "parameters": CITY},
             {"type": "web_search"}]  # a tool type the server does not run: skipped
    r = oai.responses.create(model=MODEL, input="Once upon a time", tools=tools, max_output_tokens=30,
                             tool_choice={"type": "function", "name": "weather"}, **GREEDY)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "weather" and r.status == "completed"
    jsonschema.validate(json.loads(calls[0].arguments), CITY)
    # the stream carries the same call
    events = list(oai.responses.create(model=MODEL, input="Once upon a time", tools=tools, max_output_tokens=30,
                                       tool_choice={"type": "function", "name": "weather"}, stream=True, **GREEDY))
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and done[0].arguments == calls[0].arguments
    assert events[-1].type == "response.completed" and events[-1].response.output[-1].type == "function_call"
    # the result goes back as function_call_output
    follow = oai.responses.create(model=MODEL, tools=tools, max_output_tokens=8, **GREEDY, input=[
        {"role": "user", "content": "Once upon a time"},
        {"type": "function_call", "call_id": calls[0].call_id, "name": "weather", "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": " it was sunny"}])
    assert follow.status == "incomplete" and follow.output_text
    assert follow.usage.input_tokens == prompt_tokens(server, [
        {"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": ""},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": " it was sunny"}])


def test_responses_required_tool_choice_and_none(oai):
    tools = [{"type": "function", "name": "pick", "parameters": NUMBER}]
    r = oai.responses.create(model=MODEL, input="Lily", tools=tools, tool_choice="required", parallel_tool_calls=False,
                             max_output_tokens=40, **GREEDY)
    calls = [item for item in r.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "pick"
    jsonschema.validate(json.loads(calls[0].arguments), NUMBER)
    plain = oai.responses.create(model=MODEL, input="Lily", tools=tools, tool_choice="none", max_output_tokens=6, **GREEDY)
    assert [item.type for item in plain.output] == ["message"]


def test_responses_structured_output_validates(oai):
    fmt = {"type": "json_schema", "name": "n", "schema": NUMBER, "strict": True}
    r = oai.responses.create(model=MODEL, input="Once upon a time", text={"format": fmt}, max_output_tokens=30, **GREEDY)
    jsonschema.validate(json.loads(r.output_text), NUMBER)
    events = list(oai.responses.create(model=MODEL, input="Once upon a time", text={"format": fmt}, max_output_tokens=30,
                                       stream=True, **GREEDY))
    assert events[-1].response.output_text == r.output_text


def test_responses_context_length_exceeded(server, oai):
    long = "Lily " * 600  # over stories260K's 512 positions
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(model=MODEL, input=long, max_output_tokens=2)
    assert e.value.body["code"] == "context_length_exceeded"
    events = list(oai.responses.create(model=MODEL, input=long, max_output_tokens=2, stream=True))
    assert events[-1].type == "response.failed" and events[-1].response.error.code == "context_length_exceeded"


# ---------------------------------------------------------------- Messages


def test_messages_text_equals_recording(claude, once):
    m = claude.messages.create(model=MODEL, max_tokens=30, messages=[{"role": "user", "content": once["prompt"]}],
                               extra_body=GREEDY)
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant"
    assert [b.type for b in m.content] == ["text"]
    assert once["completion_text"].startswith(m.content[0].text) and len(m.content[0].text) > 40
    assert m.stop_reason == "max_tokens" and m.stop_sequence is None
    assert m.usage.input_tokens == len(once["prompt_ids"]) and m.usage.output_tokens == 30
    assert m.usage.cache_read_input_tokens == 0


def test_messages_stream_and_count_tokens(server, claude, once):
    messages = [{"role": "user", "content": once["prompt"]}]
    with claude.messages.stream(model=MODEL, max_tokens=30, messages=messages, extra_body=GREEDY) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert once["completion_text"].startswith(text) and len(text) > 40
    assert final.content[0].text == text and final.stop_reason == "max_tokens" and final.usage.output_tokens == 30
    # the raw events, in Anthropic's order
    with httpx.stream("POST", server.url + "/v1/messages?beta=true", timeout=60,
                      headers={"x-api-key": KEY, "anthropic-beta": "some-future-feature-2099-01-01"},
                      json={"model": MODEL, "max_tokens": 5, "messages": messages, "stream": True}) as r:
        names = [line[len("event: "):] for line in r.iter_lines() if line.startswith("event: ")]
    assert names[0] == "message_start" and names[1] == "content_block_start"
    assert names[-4:] == ["content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    count = claude.messages.count_tokens(model=MODEL, messages=messages, system="Lily")
    assert count.input_tokens == prompt_tokens(server, [{"role": "system", "content": "Lily"}] + messages)
    m = claude.messages.create(model=MODEL, max_tokens=2, messages=messages, system="Lily", extra_body=GREEDY)
    assert m.usage.input_tokens == count.input_tokens


def test_messages_stop_sequence(claude, once):
    full = once["completion_text"]
    m = claude.messages.create(model=MODEL, max_tokens=60, messages=[{"role": "user", "content": once["prompt"]}],
                               stop_sequences=["zzz", " girl"], extra_body=GREEDY)
    assert m.content[0].text == full[: full.index(" girl")]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == " girl"


def test_messages_forced_tool_round_trip(server, claude):
    tools = [{"name": "weather", "description": "the weather", "input_schema": CITY}]
    m = claude.messages.create(model=MODEL, max_tokens=30, tools=tools, tool_choice={"type": "tool", "name": "weather"},
                               messages=[{"role": "user", "content": "Once upon a time"}], extra_body=GREEDY)
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "weather" and m.stop_reason == "tool_use"
    jsonschema.validate(uses[0].input, CITY)
    any_call = claude.messages.create(model=MODEL, max_tokens=80, tools=tools,
                                      tool_choice={"type": "any", "disable_parallel_tool_use": True},
                                      messages=[{"role": "user", "content": "Once upon a time"}], extra_body=GREEDY)
    assert [b.type for b in any_call.content] == ["tool_use"] and any_call.stop_reason == "tool_use"
    with claude.messages.stream(model=MODEL, max_tokens=30, tools=tools, tool_choice={"type": "tool", "name": "weather"},
                                messages=[{"role": "user", "content": "Once upon a time"}], extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert streamed.content[-1].type == "tool_use" and streamed.content[-1].input == uses[0].input
    history = [{"role": "user", "content": "Once upon a time"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": uses[0].id, "name": "weather", "input": uses[0].input}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": " it was sunny",
                                             "is_error": True}, {"type": "text", "text": " and"}]}]
    follow = claude.messages.create(model=MODEL, max_tokens=5, tools=tools, messages=history, extra_body=GREEDY)
    assert follow.content and follow.stop_reason == "max_tokens"
    assert follow.usage.input_tokens == prompt_tokens(server, [
        {"role": "user", "content": "Once upon a time"}, {"role": "assistant", "content": ""},
        {"role": "tool", "tool_call_id": uses[0].id, "content": "Error:  it was sunny"},
        {"role": "user", "content": " and"}])


def test_messages_structured_output(claude):
    m = claude.messages.create(model=MODEL, max_tokens=30, messages=[{"role": "user", "content": "Once upon a time"}],
                               extra_body={"output_config": {"format": {"type": "json_schema", "schema": NUMBER}}, **GREEDY})
    jsonschema.validate(json.loads(m.content[0].text), NUMBER)


def test_anthropic_error_shapes(server, claude):
    url = server.url + "/v1/messages"
    ok = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "Lily"}]}
    cases = [
        ({"x-api-key": KEY}, {k: v for k, v in ok.items() if k != "max_tokens"}, 400, "invalid_request_error"),
        ({"x-api-key": "wrong"}, ok, 401, "authentication_error"),
        ({}, ok, 401, "authentication_error"),
        ({"x-api-key": KEY}, dict(ok, model="nope"), 404, "not_found_error"),
        ({"x-api-key": KEY}, dict(ok, messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}]}]),
         400, "invalid_request_error"),
        ({"Authorization": f"Bearer {KEY}"}, dict(ok, messages=[{"role": "system", "content": "x"}]), 400, "invalid_request_error"),
    ]
    for headers, body, status, kind in cases:
        r = httpx.post(url, json=body, headers=headers, timeout=30)
        assert r.status_code == status, (body, r.text)
        assert r.json() == {"type": "error", "error": {"type": kind, "message": r.json()["error"]["message"]}}
    r = httpx.post(url, content=b'{"model": "' + b"x" * (1024 * 1024 + 10) + b'"}', timeout=30,
                   headers={"x-api-key": KEY, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.post(server.url + "/v1/messages/count_tokens", json={"model": MODEL, "messages": "x"},
                   headers={"x-api-key": KEY}, timeout=30)
    assert r.status_code == 400 and r.json()["type"] == "error"
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="nope", max_tokens=2, messages=[{"role": "user", "content": "Lily"}])
    # both header styles carry the key; an OpenAI route keeps OpenAI's shape
    assert httpx.post(url, json=ok, headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200
    r = httpx.post(server.url + "/v1/responses", json={"model": "nope", "input": "x"}, headers={"x-api-key": KEY})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"


# ---------------------------------------------------------------- cancellation


@pytest.mark.parametrize("path, body", [
    ("/v1/responses", {"model": MODEL, "input": "Once upon a time", "max_output_tokens": 450, "stream": True, **GREEDY}),
    ("/v1/messages", {"model": MODEL, "max_tokens": 450, "messages": [{"role": "user", "content": "Once upon a time"}],
                      "stream": True, **GREEDY}),
])
def test_closing_a_stream_frees_its_blocks(server, path, body):
    before = server.metrics()
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as h:
        with h.stream("POST", server.url + path, json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(24)]
            assert any("delta" in g for g in got)
            during = server.metrics()
            assert during["mlx_ferrum:num_requests_running"] == 1 and during["mlx_ferrum:kv_cache_used_blocks"] > 0
    wait_until_idle(server)
    after = server.metrics()
    assert after["mlx_ferrum:generation_tokens_total"] - before["mlx_ferrum:generation_tokens_total"] < 450


# ---------------------------------------------------------------- embeddings


def test_embeddings_shapes_and_errors(server, oai):
    texts = ["Once upon a time", "Lily"]
    floats = oai.embeddings.create(model=MODEL, input=texts, encoding_format="float")
    b64 = oai.embeddings.create(model=MODEL, input=texts)  # the client asks for base64 and decodes it
    assert len(floats.data) == 2 and [d.index for d in floats.data] == [0, 1]
    for a, b in zip(floats.data, b64.data):
        assert np.allclose(a.embedding, b.embedding, atol=0, rtol=0)
        assert abs(np.linalg.norm(a.embedding) - 1) < 1e-5
    raw = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, "input": texts, "encoding_format": "base64"},
                     headers={"Authorization": f"Bearer {KEY}"}).json()
    vector = np.frombuffer(base64.b64decode(raw["data"][1]["embedding"]), dtype="<f4")
    assert np.array_equal(vector, np.array(floats.data[1].embedding, dtype=np.float32))
    alone = oai.embeddings.create(model=MODEL, input="Lily", encoding_format="float")  # batched or not: the same vector
    assert np.allclose(alone.data[0].embedding, floats.data[1].embedding, atol=1e-5)
    ids = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": "Lily"},
                     headers={"Authorization": f"Bearer {KEY}"}).json()["tokens"]
    by_ids = oai.embeddings.create(model=MODEL, input=[ids], encoding_format="float")
    assert np.allclose(by_ids.data[0].embedding, floats.data[1].embedding, atol=1e-5)
    assert floats.usage.prompt_tokens == prompt_tokens(server, [{"role": "user", "content": "Once upon a time"}]) + len(ids)
    for body in ({"input": []}, {"input": "Lily", "dimensions": 8}, {"input": [[]]}, {"input": [1, "a"]},
                 {"input": "Lily", "encoding_format": "int8"}, {"input": [[99999]]}):
        r = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL, **body}, headers={"Authorization": f"Bearer {KEY}"})
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_embeddings_equal_transformers_hidden_states(stories_path, tmp_path):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModel.from_pretrained(str(stories_path), torch_dtype=torch.float32).eval()
    texts = ["Once upon a time", "Lily and Ben went to the park."]
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    for pooling in ("last", "mean"):
        with running_server(stories_path, tmp_path, ["--served-model-name", MODEL, "--chat-template", str(template),
                                                     "--pooling", pooling]) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
            got = client.embeddings.create(model=MODEL, input=texts, encoding_format="float").data
            for text, item in zip(texts, got):
                ids = httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["tokens"]
                with torch.no_grad():
                    hidden = hf(torch.tensor([ids])).last_hidden_state[0].numpy()
                ref = hidden[-1] if pooling == "last" else hidden.mean(axis=0)
                ref = ref / np.linalg.norm(ref)
                assert np.abs(np.array(item.embedding) - ref).max() < 1e-4, pooling


# ---------------------------------------------------------------- reasoning parser wiring


def test_reasoning_parser_in_all_three_apis(stories_path, tmp_path, once):
    """With ``--reasoning-parser deepseek_r1`` (reasoning opened by the prompt, closed by
    ``</think>``), a story that never writes ``</think>`` is all reasoning: each API must
    return the recorded text as its reasoning field and no answer text."""
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    with running_server(stories_path, tmp_path, ["--served-model-name", MODEL, "--chat-template", str(template),
                                                 "--reasoning-parser", "deepseek_r1"]) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        claude_client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        messages = [{"role": "user", "content": once["prompt"]}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
        thought = chat.choices[0].message.reasoning_content
        assert once["completion_text"].startswith(thought) and len(thought) > 20 and not chat.choices[0].message.content
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0, stream=True)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == thought
        assert not "".join(d.content or "" for d in deltas)
        r = client.responses.create(model=MODEL, input=once["prompt"], max_output_tokens=20, temperature=0)
        assert r.output[0].type == "reasoning" and r.output[0].content[0].text == thought
        assert r.usage.output_tokens_details.reasoning_tokens > 0
        events = list(client.responses.create(model=MODEL, input=once["prompt"], max_output_tokens=20, temperature=0,
                                              stream=True))
        assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == thought
        m = claude_client.messages.create(model=MODEL, max_tokens=20, messages=messages, extra_body=GREEDY)
        assert [b.type for b in m.content] == ["thinking"] and m.content[0].thinking == thought
        with claude_client.messages.stream(model=MODEL, max_tokens=20, messages=messages, extra_body=GREEDY) as stream:
            final = stream.get_final_message()
        assert final.content[0].type == "thinking" and final.content[0].thinking == thought


def test_reasoning_effort_and_thinking_reach_the_chat_template(stories_path, tmp_path):
    """``reasoning.effort`` (Responses), ``thinking`` (Messages) and ``chat_template_kwargs``
    (chat) become template variables; the ones the server sets itself cannot be replaced."""
    template = tmp_path / "vars.jinja"
    template.write_text("{{ bos_token }}{% if reasoning_effort is defined %}[{{ reasoning_effort }}]{% endif %}"
                        "{% if enable_thinking is defined %}<{{ enable_thinking }}>{% endif %}"
                        "{% for m in messages %}{{ m['content'] }}{% endfor %}")
    with running_server(stories_path, tmp_path, ["--served-model-name", MODEL, "--chat-template", str(template)]) as server:
        def count(text: str) -> int:
            return httpx.post(server.url + "/tokenize", json={"prompt": text}).json()["count"]

        client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
        r = client.responses.create(model=MODEL, input="Once", reasoning={"effort": "high"}, max_output_tokens=1)
        assert r.usage.input_tokens == count("[high]Once")
        claude_client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
        m = claude_client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Once"}],
                                                thinking={"type": "enabled", "budget_tokens": 1024})
        assert m.input_tokens == count("<True>Once")
        chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once"}], max_tokens=1,
                                              extra_body={"chat_template_kwargs": {"reasoning_effort": "low",
                                                                                   "messages": [], "bos_token": "x"}})
        assert chat.usage.prompt_tokens == count("[low]Once")
