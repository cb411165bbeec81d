"""Turning the prompt forms users pass (text, chat messages, token ids) into token ids."""

from __future__ import annotations

from typing import Sequence, Union

import mlx.core as mx

Prompt = Union[str, Sequence[dict], Sequence[int], mx.array]


def encode_prompt(tokenizer, prompt: Prompt) -> list[int]:
    """Token ids of a prompt.

    Args:
        tokenizer: a :class:`~mlx_ferrum.tokenizer.Tokenizer` (unused for token ids).
        prompt: text (encoded; BOS as ``tokenizer_config.json`` says), OpenAI-style
            messages ``[{"role", "content"}]`` (rendered with the chat template, with the
            generation prompt), or token ids (a list or an ``mx.array``), kept as they are.

    Raises:
        ChatTemplateError: messages given and the checkpoint has no chat template.
        RequestError: an empty prompt.
    """
    from ..errors import RequestError

    if isinstance(prompt, str):
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, mx.array):
        ids = [int(t) for t in prompt.reshape(-1).tolist()]
    else:
        items = list(prompt)
        if items and isinstance(items[0], dict):
            ids = list(tokenizer.apply_chat_template(items, add_generation_prompt=True, tokenize=True))
        else:
            ids = [int(t) for t in items]
    if not ids:
        raise RequestError("the prompt is empty: give at least one token (or a tokenizer that adds BOS)")
    return ids
