"""Tool-call parsers (scripted model outputs for each supported syntax), parser detection
from chat templates, and tool messages rendered back through a chat template."""

import json

import pytest

from mlx_ferrum.server import protocol as p
from mlx_ferrum.server.serving import template_message
from mlx_ferrum.server.tool_parsers import detect_parser, forced_calls, get_parser, required_schema


def _calls(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def test_hermes_qwen_syntax():
    parser = get_parser("hermes")
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>')
    content, calls = parser.parse(text)
    assert content == "Let me check."
    assert _calls(calls) == [("get_weather", {"city": "Rome"}), ("get_time", {"zone": "CET"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert parser.parse("no call here") == ("no call here", [])
    assert parser.parse("<tool_call>{not json</tool_call>")[1] == []  # malformed: stays content
    # streaming: content stops before a marker and before a partial one
    assert parser.content_end("Hello <tool") == len("Hello ")
    assert parser.content_end("Hello <tool_call>{") == len("Hello ")
    assert parser.content_end("Hello there") == len("Hello there")


def test_llama3_json_syntax():
    parser = get_parser("llama3_json")
    content, calls = parser.parse('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}')
    assert content is None and _calls(calls) == [("get_weather", {"city": "Paris", "days": 3})]
    _, calls = parser.parse('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}')
    assert _calls(calls) == [("a", {}), ("b", {"x": 1})]
    assert parser.parse("Once upon a time") == ("Once upon a time", [])
    assert parser.content_end('{"name"') == 0


def test_mistral_syntax_both_versions():
    parser = get_parser("mistral")
    content, calls = parser.parse('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Rome"}}]')
    assert content is None and _calls(calls) == [("get_weather", {"city": "Rome"})]
    content, calls = parser.parse('ok [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}')
    assert content == "ok" and _calls(calls) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert parser.parse("[TOOL_CALLS] [oops")[1] == []


def test_parser_detection_and_unknown_names():
    assert detect_parser("{% if tools %}<tool_call>{{ x }}</tool_call>{% endif %}") == "hermes"
    assert detect_parser("[AVAILABLE_TOOLS]...[TOOL_CALLS]") == "mistral"
    assert detect_parser("<|start_header_id|>ipython<|end_header_id|>") == "llama3_json"
    assert detect_parser(None) == "hermes"
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")


def test_forced_calls_read_the_constrained_json():
    assert _calls(forced_calls('{"city": "Rome"}', "get_weather")) == [("get_weather", {"city": "Rome"})]
    assert _calls(forced_calls('[{"name": "a", "parameters": {"x": 1}}]', None)) == [("a", {"x": 1})]
    assert forced_calls('[{"name": "a", "param', None) == []
    schema = required_schema([{"type": "function", "function": {"name": "a"}}], parallel=False)
    assert schema["minItems"] == schema["maxItems"] == 1


TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
    "{% for m in messages %}{{ m.role }}:"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }} {{ c.function.arguments | tojson }}{% endfor %}"
    "{% elif m.role == 'tool' %}RESULT[{{ m.tool_call_id }}] {{ m.content }}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
)


def test_tool_calls_and_results_render_back_through_the_template(stories_path):
    from mlx_ferrum import load

    _, tok = load(str(stories_path))
    messages = [
        p.ChatMessage(role="user", content="weather?"),
        p.ChatMessage(role="assistant", content=None, tool_calls=[
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]),
        p.ChatMessage(role="tool", content="sunny", tool_call_id="call_1"),
    ]
    msgs = [template_message(m, i) for i, m in enumerate(messages)]
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=False, chat_template=TEMPLATE, tools=tools)
    # (the template environment trims the newline after a block tag, as Hugging Face's does)
    assert text == 'TOOLS:get_weather;user:weather?assistant:CALL get_weather {"city": "Rome"}tool:RESULT[call_1] sunny'
