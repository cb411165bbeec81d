"""The agent APIs on a real chat model: ``mlx-ferrum serve`` on SmolLM2-135M-Instruct
(ChatML template, 4-bit), driven by the ``openai`` and ``anthropic`` SDKs as Codex CLI
and Claude Code would: multi-turn conversations, a forced tool round trip, structured
output. Slow on CPU (about 5 tokens/s for this 4-bit checkpoint), so short replies and
``@pytest.mark.slow``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")
anthropic = pytest.importorskip("anthropic")
jsonschema = pytest.importorskip("jsonschema")

from conftest import SHARED_MODELS  # noqa: E402
from support.server_helpers import running_server  # noqa: E402

pytestmark = pytest.mark.slow

SMOLLM = Path(os.environ.get("FERRUM_SMOLLM", SHARED_MODELS / "SmolLM2-135M-Instruct"))
MODEL = "smollm"
CITY = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]}},
        "required": ["city"], "additionalProperties": False}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not (SMOLLM / "config.json").exists():
        pytest.skip(f"SmolLM2-135M-Instruct not found at {SMOLLM}")
    with running_server(SMOLLM, tmp_path_factory.mktemp("smol"), ["--served-model-name", MODEL],
                        {"FERRUM_PREFIX_CACHE": "1"}) as s:
        yield s


def prompt_tokens(server, messages) -> int:
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "messages": messages})
    assert r.status_code == 200, r.text
    return r.json()["count"]


def test_codex_like_responses_session(server):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    tools = [{"type": "function", "name": "get_weather", "description": "Current weather in a city",
              "parameters": CITY, "strict": True}, {"type": "web_search"}]
    first = client.responses.create(model=MODEL, instructions="You are a helpful assistant.",
                                    input="What is the weather in Paris?", tools=tools, tool_choice="required",
                                    parallel_tool_calls=False, max_output_tokens=40, temperature=0)
    calls = [o for o in first.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    jsonschema.validate(json.loads(calls[0].arguments), CITY)
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, instructions="You are a helpful assistant.",  # sent each turn, as Codex does
        tools=tools, max_output_tokens=12, temperature=0, stream=True,
        input=[{"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 24 C"}])
    events = list(second)
    assert events[-1].type == "response.completed"
    seq = [e.sequence_number for e in events]
    assert seq == sorted(seq)
    reply = events[-1].response
    assert reply.output_text.strip()
    # the follow-up prompt is the stored conversation plus the tool output
    expected = prompt_tokens(server, [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": calls[0].call_id, "type": "function", "function": {
            "name": "get_weather", "arguments": calls[0].arguments}}]},
        {"role": "tool", "tool_call_id": calls[0].call_id, "content": "sunny, 24 C"}])
    assert reply.usage.input_tokens == expected
    assert reply.usage.input_tokens_details.cached_tokens > 0  # the first turn's prompt, from the prefix cache
    fmt = {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}
    structured = client.responses.create(model=MODEL, input="Name a city in Japan.", text={"format": fmt},
                                         max_output_tokens=20, temperature=0)
    jsonschema.validate(json.loads(structured.output_text), CITY)


def test_claude_code_like_messages_session(server):
    client = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=300)
    tools = [{"name": "get_weather", "description": "Current weather in a city", "input_schema": CITY}]
    history = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    first = client.messages.create(model=MODEL, max_tokens=40, system="You are a helpful assistant.", tools=tools,
                                   tool_choice={"type": "tool", "name": "get_weather"}, messages=history,
                                   extra_body={"temperature": 0})
    use = first.content[-1]
    assert use.type == "tool_use" and first.stop_reason == "tool_use"
    jsonschema.validate(use.input, CITY)
    history += [{"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "rainy, 18 C"}]}]
    count = client.messages.count_tokens(model=MODEL, system="You are a helpful assistant.", tools=tools, messages=history)
    with client.messages.stream(model=MODEL, max_tokens=12, system="You are a helpful assistant.", tools=tools,
                                messages=history, extra_body={"temperature": 0}) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() and final.content[0].text == text
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == count.input_tokens
    assert final.usage.cache_read_input_tokens > 0
    history += [{"role": "assistant", "content": text}, {"role": "user", "content": "Thanks!"}]
    third = client.messages.create(model=MODEL, max_tokens=8, system="You are a helpful assistant.", messages=history,
                                   extra_body={"temperature": 0})
    assert third.content[0].type == "text" and third.stop_reason in ("end_turn", "max_tokens")
