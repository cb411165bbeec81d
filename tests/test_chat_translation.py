"""Reasoning parsers (``--reasoning-parser``) and the shared output processing that all
three chat APIs use: the reasoning is kept apart, tool calls come from the answer only,
and what a stream sends adds up to the final reading, whatever the token boundaries.

The texts are written here in each format's documented syntax (Qwen3's and DeepSeek-R1's
``<think>`` blocks, OpenAI's Harmony channels), not produced by this code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from mlx_ferrum.server.reasoning import get_reasoning_parser
from mlx_ferrum.server.tool_parsers import get_parser
from mlx_ferrum.server.serving import ToolMode, TurnProcessor, merge_system

HARMONY = ("<|channel|>analysis<|message|>The user wants the weather.<|end|>"
           "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
           '{"city": "Paris"}<|call|>')
HARMONY_FINAL = ("<|channel|>analysis<|message|>Think briefly.<|end|>"
                 "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>")


def test_qwen3_think_block():
    p = get_reasoning_parser("qwen3")
    s = p.split("<think>\nI should greet.\n</think>\n\nHello!")
    assert (s.reasoning, s.content) == ("I should greet.\n", "Hello!")
    plain = p.split("Hello, no thinking")
    assert (plain.reasoning, plain.content) == (None, "Hello, no thinking")
    opened_by_prompt = p.split("step one</think>The answer")
    assert (opened_by_prompt.reasoning, opened_by_prompt.content) == ("step one", "The answer")
    unfinished = p.split("<think>still going", finished=True)
    assert (unfinished.reasoning, unfinished.content) == ("still going", "")


def test_deepseek_r1_reasoning_until_end_marker():
    p = get_reasoning_parser("deepseek_r1")
    assert (p.split("hmm</think>Answer").reasoning, p.split("hmm</think>Answer").content) == ("hmm", "Answer")
    s = p.split("no end marker yet")
    assert (s.reasoning, s.content) == ("no end marker yet", "")


def test_gpt_oss_harmony_channels_and_tool_call():
    p = get_reasoning_parser("gpt_oss")
    assert p.needs_special_tokens
    s = p.split(HARMONY)
    assert s.reasoning == "The user wants the weather." and s.content == ""
    assert [(c.name, json.loads(c.arguments)) for c in s.calls] == [("get_weather", {"city": "Paris"})]
    f = p.split(HARMONY_FINAL)
    assert (f.reasoning, f.content, f.calls) == ("Think briefly.", "It is sunny.", [])
    assert p.split("plain text").content == "plain text"


def test_unknown_parser_is_refused():
    assert get_reasoning_parser(None) is None
    with pytest.raises(ValueError, match="qwen3"):
        get_reasoning_parser("nope")


@dataclass
class FakeOutput:
    text: str
    token_ids: list = field(default_factory=list)
    finished: bool = False
    finish_reason: str = None


class CharTokenizer:
    """One 'token' per character: decode joins them (special tokens are plain text here)."""

    eos_token_ids = set()

    def decode(self, ids, skip_special_tokens=True):
        return "".join(ids)


def stream_through(processor: TurnProcessor, text: str, piece: int):
    """Feed ``text`` in ``piece``-character steps; returns (streamed reasoning, streamed content, final reading)."""
    reasoning, content = [], []
    for end in range(piece, len(text), piece):
        r, c = processor.step(FakeOutput(text[:end], list(text[:end])))
        reasoning.append(r)
        content.append(c)
    final = processor.finish(FakeOutput(text, list(text), True, "stop"))
    r, c = processor.rest(final)
    return "".join(reasoning) + r, "".join(content) + c, final


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_streamed_deltas_add_up_to_the_final_reading(piece):
    text = "<think>\nweigh it</think>\n\nThe answer is 4."
    processor = TurnProcessor(CharTokenizer(), ToolMode(), get_parser("hermes"), get_reasoning_parser("qwen3"))
    reasoning, content, final = stream_through(processor, text, piece)
    assert (final.reasoning, final.content) == ("weigh it", "The answer is 4.")
    assert content == final.content and "<" not in content
    assert reasoning == final.reasoning


@pytest.mark.parametrize("piece", [1, 5, 1000])
def test_tool_calls_come_from_the_answer_not_the_reasoning(piece):
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    text = ('<think>maybe <tool_call>{"name": "fake", "arguments": {}}</tool_call></think>'
            'Sure.<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>')
    processor = TurnProcessor(CharTokenizer(), ToolMode("auto", tools=tools), get_parser("hermes"),
                              get_reasoning_parser("qwen3"))
    reasoning, content, final = stream_through(processor, text, piece)
    assert [c.name for c in final.calls] == ["add"] and final.finish_reason == "tool_calls"
    assert final.content == "Sure." and content == "Sure." and "fake" in final.reasoning
    # without a reasoning parser the text stays as written: the think block is content
    plain = TurnProcessor(CharTokenizer(), ToolMode(), get_parser("hermes"), None)
    assert plain.finish(FakeOutput(text, list(text), True, "stop")).content == text


def test_harmony_stream_and_calls():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    processor = TurnProcessor(CharTokenizer(), ToolMode("auto", tools=tools), get_parser("hermes"),
                              get_reasoning_parser("gpt_oss"))
    reasoning, content, final = stream_through(processor, HARMONY, 3)
    assert reasoning == final.reasoning == "The user wants the weather."
    assert content == "" and [c.name for c in final.calls] == ["get_weather"]


def test_forced_tools_and_grammars_skip_the_reasoning_parser():
    processor = TurnProcessor(CharTokenizer(), ToolMode("named", name="add", tools=[]), get_parser("hermes"),
                              get_reasoning_parser("deepseek_r1"))
    final = processor.finish(FakeOutput('{"a": 1}', list('{"a": 1}'), True, "stop"))
    assert final.reasoning is None and [(c.name, c.arguments) for c in final.calls] == [("add", '{"a": 1}')]


def test_merge_system_makes_one_leading_system_message():
    merged = merge_system([{"role": "user", "content": "hi"}, {"role": "developer", "content": "be brief"},
                           {"role": "system", "content": "be kind"}, {"role": "assistant", "content": "ok"}])
    assert merged == [{"role": "system", "content": "be brief\n\nbe kind"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "ok"}]


def test_response_store_is_bounded_by_count_and_size():
    from mlx_ferrum.server.responses import ResponseStore

    store = ResponseStore(max_responses=2, max_chars=100)
    for i in range(3):
        store.put(f"r{i}", [{"role": "user", "content": "x" * 10}])
    assert store.get("r0") is None and store.get("r1") and store.get("r2")
    store.put("big", [{"role": "user", "content": "y" * 95}])
    assert store.get("r1") is None and store.get("r2") is None and store.get("big")


def test_openapi_description_covers_the_agent_endpoints():
    """The app's OpenAPI description (what a schema-driven fuzzer reads) lists the new
    endpoints with their request schemas."""
    pytest.importorskip("fastapi")
    from mlx_ferrum.server.app import build_app
    from mlx_ferrum.server.limits import ServerLimits
    from mlx_ferrum.server.metrics import ServerMetrics

    class StubServing:  # build_app only wires the serving objects together
        metrics, limits, engine = None, ServerLimits(), None

    spec = build_app(StubServing(), metrics=ServerMetrics(None)).openapi()
    for path, field_name in (("/v1/responses", "input"), ("/v1/messages", "max_tokens"),
                             ("/v1/messages/count_tokens", "messages"), ("/v1/embeddings", "input")):
        schema = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert field_name in schema["properties"], path
    assert "max_tokens" in spec["paths"]["/v1/messages"]["post"]["requestBody"]["content"]["application/json"]["schema"]["required"]


def test_messages_stream_pings_while_waiting_and_reports_a_refusal_as_an_error_event(monkeypatch):
    """While the first token is awaited (a long prefill), a Messages stream sends ``ping``
    events after ``message_start``; a refusal at admission then comes as an ``error``
    event in Anthropic's shape (the HTTP status is already sent)."""
    import asyncio

    from mlx_ferrum.server import anthropic_messages as am
    from mlx_ferrum.server.serving import ChatPlan, ServingError

    class SlowServing:
        async def _submit(self, items, lora):
            await asyncio.sleep(0.35)
            raise ServingError(429, "the server is busy", type="rate_limit_error")

    monkeypatch.setattr(am, "PING_INTERVAL_S", 0.1)
    plan = ChatPlan([(0, [1, 2, 3], None)], ToolMode(), None, False, "m")
    req = am.MessagesRequest(max_tokens=4, messages=[{"role": "user", "content": "hi"}], stream=True)

    async def collect():
        return [event async for event in am.MessagesServing(SlowServing())._stream("msg_1", req, plan)]

    events = asyncio.run(collect())
    kinds = [e.split("\n")[0] for e in events]
    assert kinds[0] == "event: message_start" and kinds[-1] == "event: error"
    assert 2 <= kinds.count("event: ping") <= 4
    error = json.loads(events[-1].split("data: ", 1)[1])
    assert error == {"type": "error", "error": {"type": "rate_limit_error", "message": "the server is busy"}}
    start = json.loads(events[0].split("data: ", 1)[1])
    assert start["message"]["usage"]["input_tokens"] == 3


def test_anthropic_error_types_follow_anthropics_table():
    from mlx_ferrum.server.anthropic_messages import error_body

    expected = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                413: "request_too_large", 429: "rate_limit_error", 500: "api_error"}
    for status, kind in expected.items():
        assert error_body(status, "m") == (status, {"type": "error", "error": {"type": kind, "message": "m"}})
    assert error_body(503, "m") == (529, {"type": "error", "error": {"type": "overloaded_error", "message": "m"}})
