"""Tool calling: parse a model's tool-call syntax into OpenAI ``tool_calls``, and the
grammars that enforce ``tool_choice: "required"`` or a named function.

Parsers (vLLM's ``--tool-call-parser`` names):

- ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3): ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  one block per call, text around them is content.
- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3): the whole reply is ``{"name": ..., "parameters": {...}}``
  (optionally after ``<|python_tag|>``, several separated by ``;``).
- ``mistral``: ``[TOOL_CALLS]`` then a JSON list ``[{"name": ..., "arguments": {...}}]``, or
  (tokenizer v11+) ``[TOOL_CALLS]name[ARGS]{...}`` per call.

The parser is chosen by the server's ``--tool-call-parser`` flag, else from the chat
template's text (:func:`detect_parser`), else ``hermes``.

``tool_choice: "required"`` / a named function do not rely on the model's syntax: as in
vLLM, the output is constrained by a JSON schema (a named function: its ``parameters``;
required: a non-empty array of ``{"name", "parameters"}`` over the given tools) and read
back as JSON (:func:`forced_calls`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Optional

__all__ = ["ToolCall", "ToolParser", "PARSERS", "detect_parser", "get_parser", "required_schema", "forced_calls"]


@dataclass
class ToolCall:
    """One parsed call: ``arguments`` is a JSON text (OpenAI's ``function.arguments``)."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self):
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"

    def openai(self, index: Optional[int] = None) -> dict:
        """OpenAI's ``tool_calls`` entry (with ``index`` for a streamed delta)."""
        out = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def _arguments_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value if value is not None else {}, ensure_ascii=False)


def _call_from(obj, args_keys=("arguments", "parameters")) -> Optional[ToolCall]:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    for key in args_keys:
        if key in obj:
            return ToolCall(obj["name"], _arguments_text(obj[key]))
    return ToolCall(obj["name"], "{}")


class ToolParser:
    """Base: ``markers`` start a call in the text (content before them is streamed)."""

    name = ""
    markers: tuple = ()

    def parse(self, text: str) -> tuple[Optional[str], list[ToolCall]]:
        """``(content, calls)`` of a whole reply; content is None when only calls were made.
        A reply without a well-formed call is all content (no calls)."""
        raise NotImplementedError

    def content_end(self, text: str) -> int:
        """How much of a partial reply is surely content: up to the first marker, or
        before a trailing piece that may be the start of one."""
        cut = len(text)
        for m in self.markers:
            i = text.find(m)
            if i >= 0:
                cut = min(cut, i)
        for m in self.markers:
            for k in range(min(len(m) - 1, len(text)), 0, -1):
                if text.endswith(m[:k]):
                    cut = min(cut, len(text) - k)
                    break
        return cut


class HermesParser(ToolParser):
    """Hermes / Qwen2.5 / Qwen3 tool calls: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (the format of those checkpoints' chat templates; vLLM's ``hermes`` parser reads the same).

    ``parse(text) -> (content or None, [ToolCall])``: the text before the first ``<tool_call>``
    is the content; a block that is not a JSON call makes the whole reply plain text (no call).
    """

    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text):
        if "<tool_call>" not in text:
            return text, []
        calls = []
        for body in self._block.findall(text):
            try:
                call = _call_from(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []
            calls.append(call)
        content = text[: text.find("<tool_call>")].strip()
        return (content or None), calls


class Llama3JsonParser(ToolParser):
    """Llama 3.1+ JSON tool calls: the reply is one or more ``{"name": ..., "parameters": {...}}``
    objects (separated by ``;`` or whitespace), optionally after ``<|python_tag|>`` (Meta's
    Llama 3.1 prompt format; vLLM's ``llama3_json``).

    ``parse(text) -> (None, [ToolCall])`` for a reply made only of calls, else ``(text, [])``.
    A reply that opens with ``{`` is held back from streaming until it is known not to be a call.
    """

    name = "llama3_json"
    markers = ("<|python_tag|>",)

    def parse(self, text):
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>"):].strip()
        if not body.startswith("{"):
            return text, []
        calls = []
        decoder = json.JSONDecoder()
        i = 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call_from(obj, ("parameters", "arguments"))
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \n\t;":
                i += 1
        return None, calls

    def content_end(self, text):
        # a reply that opens with "{" may be a call: hold it back until it ends
        return 0 if text.lstrip().startswith(("{", "<|python_tag|>")) or not text.strip() else super().content_end(text)


class MistralParser(ToolParser):
    """Mistral tool calls after ``[TOOL_CALLS]``: a JSON list of ``{"name", "arguments"}`` (v3
    tokenizers) or ``name[ARGS]{...}`` per call (v11+), as Mistral's templates write them
    (vLLM's ``mistral`` parser).

    ``parse(text) -> (content before the marker or None, [ToolCall])``; malformed calls leave
    the reply as plain text.
    """

    name = "mistral"
    markers = ("[TOOL_CALLS]",)

    def parse(self, text):
        i = text.find("[TOOL_CALLS]")
        if i < 0:
            return text, []
        content = text[:i].strip() or None
        rest = text[i + len("[TOOL_CALLS]"):].strip()
        calls = []
        if rest.startswith("["):
            try:
                items = json.loads(rest)
            except ValueError:
                return text, []
            for obj in items if isinstance(items, list) else [items]:
                call = _call_from(obj)
                if call is None:
                    return text, []
                calls.append(call)
            return content, calls
        for piece in rest.split("[TOOL_CALLS]"):  # v11+: name[ARGS]{...}
            name, sep, args = piece.partition("[ARGS]")
            if not sep:
                return text, []
            try:
                json.loads(args)
            except ValueError:
                return text, []
            calls.append(ToolCall(name.strip(), args.strip()))
        return content, calls


PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def detect_parser(template_text: Optional[str]) -> str:
    """The parser name a chat template's tool syntax implies (``hermes`` when unknown)."""
    t = template_text or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "<|python_tag|>" in t or "ipython" in t:
        return "llama3_json"
    return "hermes"


def get_parser(name: str) -> ToolParser:
    """The parser called ``name``.

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}: use one of {sorted(PARSERS)}")
    return PARSERS[name]()


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """The JSON schema of ``tool_choice: "required"``: a non-empty array of calls, each
    ``{"name": <one tool>, "parameters": <its parameters>}``; one call only when not ``parallel``."""
    variants = []
    for t in tools:
        f = t["function"]
        variants.append({
            "type": "object",
            "properties": {"name": {"const": f["name"]}, "parameters": f.get("parameters") or {"type": "object"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })
    schema = {"type": "array", "minItems": 1, "items": {"anyOf": variants}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def forced_calls(text: str, named: Optional[str]) -> list[ToolCall]:
    """The calls of a reply constrained by :func:`required_schema` (``named`` None) or by
    one function's parameters (``named`` = its name). Empty when the reply is not
    complete JSON (it ran out of ``max_tokens``)."""
    try:
        value = json.loads(text)
    except ValueError:
        return []
    if named is not None:
        return [ToolCall(named, json.dumps(value, ensure_ascii=False))]
    return [ToolCall(v["name"], json.dumps(v.get("parameters", {}), ensure_ascii=False)) for v in value]
