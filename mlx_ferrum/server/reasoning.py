"""Reasoning parsers: keep a reasoning model's thinking apart from its answer.

Parsers (vLLM's ``--reasoning-parser`` names):

- ``qwen3``: ``<think>...</think>`` then the answer. Text without ``</think>`` is all
  answer; a ``</think>`` without ``<think>`` ends reasoning that the chat template opened
  in the prompt (Qwen3 "thinking" checkpoints put ``<think>`` there).
- ``deepseek_r1``: the same markers, but the template always opens ``<think>`` in the
  prompt, so everything before ``</think>`` is reasoning, and a reply without it is all
  reasoning (vLLM's parser reads it so).
- ``gpt_oss``: OpenAI's Harmony format. Each message is ``<|channel|>NAME[ to=RECIPIENT]
  [<|constrain|>json]<|message|>TEXT`` ended by ``<|end|>``, ``<|call|>`` or ``<|return|>``,
  and further messages start with ``<|start|>assistant``. ``analysis`` is reasoning,
  ``final`` the answer, ``commentary`` addressed ``to=functions.NAME`` a tool call
  (its text is the JSON arguments), other ``commentary`` is answer text. Reading it needs
  the special tokens in the text (``needs_special_tokens``).

Every parser reads the whole text generated so far, so a stream calls it again on each
step and sends what grew: ``finished=False`` holds back a trailing piece that may be the
start of a marker, so no marker ever leaks into a delta.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from ..engine.sequence import partial_stop_length
from .tool_parsers import ToolCall

__all__ = ["ReasoningSplit", "ReasoningParser", "REASONING_PARSERS", "get_reasoning_parser"]


@dataclass
class ReasoningSplit:
    """One reading of a reply: ``reasoning`` (None when the model wrote none), the
    ``content`` (answer text) and, for Harmony, the tool ``calls`` of its commentary channel."""

    reasoning: Optional[str]
    content: str
    calls: list[ToolCall] = field(default_factory=list)


class ReasoningParser:
    """Base: ``split(text, finished) -> ReasoningSplit`` of the text generated so far."""

    name = ""
    #: True when the parser reads special tokens, so the text must be decoded with them
    needs_special_tokens = False

    def split(self, text: str, finished: bool = True) -> ReasoningSplit:
        """The reasoning, answer and (Harmony) tool calls in ``text``; while unfinished, a
        possible marker at the end is held back from the answer."""
        raise NotImplementedError


def _hold(text: str, markers: tuple, finished: bool) -> str:
    """``text`` less a trailing piece that may begin one of ``markers`` (while streaming)."""
    if finished:
        return text
    n = partial_stop_length(text, markers)
    return text[: len(text) - n] if n else text


class ThinkParser(ReasoningParser):
    """``<think>reasoning</think>answer`` (Qwen3; DeepSeek-R1 with ``implicit_start``).

    Args as class attributes: ``implicit_start`` True means the prompt already opened
    ``<think>``, so text before ``</think>`` (or all of it, without one) is reasoning.
    """

    name = "qwen3"
    start, end = "<think>", "</think>"
    implicit_start = False

    def split(self, text, finished=True):
        i = text.find(self.start)
        if i >= 0:
            before, rest = text[:i], text[i + len(self.start):]
        elif self.end in text or self.implicit_start:
            before, rest = "", text
        else:  # no reasoning: all answer (less a piece that may begin "<think>")
            return ReasoningSplit(None, _hold(text, (self.start, self.end), finished))
        # templates write "<think>\n" and "</think>\n\n": those newlines are no part of either
        # text (only leading ones are dropped, so a stream's pieces stay prefixes of the whole)
        j = rest.find(self.end)
        if j < 0:  # still thinking
            return ReasoningSplit(_hold(rest, (self.end,), finished).lstrip("\n"), before)
        answer = rest[j + len(self.end):]
        return ReasoningSplit(rest[:j].lstrip("\n"), before + answer.lstrip("\n"))


class DeepSeekR1Parser(ThinkParser):
    """DeepSeek-R1: ``<think>`` is opened by the prompt; text up to ``</think>`` is reasoning."""

    name = "deepseek_r1"
    implicit_start = True


_HARMONY_MARKERS = ("<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|return|>", "<|start|>", "<|constrain|>")
_HARMONY_MESSAGE = re.compile(
    r"<\|channel\|>(?P<channel>[A-Za-z_]+)(?P<header>[^<]*)(?:<\|constrain\|>[^<]*)?<\|message\|>"
    r"(?P<body>.*?)(?P<stop><\|end\|>|<\|call\|>|<\|return\|>|$)", re.DOTALL)
_RECIPIENT = re.compile(r"to=(?:functions\.)?([^\s<]+)")


class GptOssParser(ReasoningParser):
    """gpt-oss's Harmony channels: ``analysis`` -> reasoning, ``final`` (and commentary
    without a recipient) -> answer, ``commentary to=functions.NAME`` -> a tool call.

    A reply without any ``<|channel|>`` is all answer. Format: OpenAI's Harmony response
    format (github.com/openai/harmony, "Receiving tool calls").
    """

    name = "gpt_oss"
    needs_special_tokens = True

    def split(self, text, finished=True):
        if "<|channel|>" not in text:
            return ReasoningSplit(None, _hold(text, _HARMONY_MARKERS, finished))
        reasoning, content, calls = [], [], []
        for m in _HARMONY_MESSAGE.finditer(text):
            open_end = m.group("stop") == ""
            body = _hold(m.group("body"), _HARMONY_MARKERS, finished) if open_end else m.group("body")
            channel, header = m.group("channel"), m.group("header")
            recipient = _RECIPIENT.search(header)
            if recipient is not None:
                if not open_end or finished:  # a call is taken whole, once its message ends
                    calls.append(ToolCall(recipient.group(1), body.strip() or "{}"))
            elif channel == "analysis":
                reasoning.append(body)
            else:  # final, or commentary the user reads
                content.append(body)
        return ReasoningSplit("".join(reasoning) if reasoning else None, "".join(content), calls)


REASONING_PARSERS = {p.name: p for p in (ThinkParser, DeepSeekR1Parser, GptOssParser)}


def get_reasoning_parser(name: Optional[str]) -> Optional[ReasoningParser]:
    """The parser called ``name`` (None: no parser, the text stays as the model wrote it).

    Raises:
        ValueError: an unknown name (the message lists the known ones).
    """
    if name is None:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: use one of {sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]()
