"""Turning the prompt forms users pass (text, chat messages, token ids) into token ids.

Every form is checked before it reaches the tokenizer or the engine, so a malformed
prompt fails its own request with a :class:`~mlx_ferrum.errors.RequestError` that
names the problem, and never reaches a batch shared with other requests.
"""

from __future__ import annotations

import numbers
from typing import Optional, Sequence, Union

import mlx.core as mx

Prompt = Union[str, Sequence[dict], Sequence[int], mx.array]

_FORMS = "give a str, a list of {'role', 'content'} messages, or a list of int token ids"


def _check_ids(ids: list, vocab_size: Optional[int]) -> list[int]:
    from ..errors import RequestError

    out = []
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise RequestError(f"prompt item {i} is {type(t).__name__} {t!r}, not a token id: {_FORMS}")
        t = int(t)
        if t < 0 or (vocab_size is not None and t >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise RequestError(
                f"token id {t} (prompt item {i}) is outside the vocabulary {bound}: "
                "check the ids come from this model's tokenizer"
            )
        out.append(t)
    return out


def encode_prompt(tokenizer, prompt: Prompt, vocab_size: Optional[int] = None) -> list[int]:
    """Token ids of a prompt, validated.

    Args:
        tokenizer: a :class:`~mlx_ferrum.tokenizer.Tokenizer` (unused for token ids).
        prompt: text (encoded; BOS as ``tokenizer_config.json`` says), OpenAI-style
            messages ``[{"role", "content"}]`` (rendered with the chat template, with the
            generation prompt), or token ids (a list of ints or an integer ``mx.array``),
            kept as they are.
        vocab_size: when given, every token id must lie in ``[0, vocab_size)``.

    Returns:
        The prompt's token ids, a non-empty ``list[int]``.

    Raises:
        ChatTemplateError: messages given and the checkpoint has no chat template.
        TokenizerError: the text is not valid Unicode (lone surrogates), too long, or the
            template cannot be rendered within its limits.
        RequestError: an empty prompt, a prompt of another type (``None``, ``bytes``, an
            int, nested lists ...), text without a tokenizer, or a token id out of range.
    """
    from ..errors import RequestError

    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("a text prompt needs a tokenizer: pass one to the engine, or give token ids")
        ids = tokenizer.encode(prompt)
    elif isinstance(prompt, (bytes, bytearray)):
        raise RequestError(f"the prompt is {type(prompt).__name__}: decode it to str first ({_FORMS})")
    elif isinstance(prompt, mx.array):
        if not mx.issubdtype(prompt.dtype, mx.integer):
            raise RequestError(f"a token-id array must have an integer dtype, not {prompt.dtype}: {_FORMS}")
        ids = prompt.reshape(-1).tolist()
    elif isinstance(prompt, (list, tuple)):
        items = list(prompt)
        if items and all(isinstance(m, dict) for m in items):
            if tokenizer is None:
                raise RequestError("chat messages need a tokenizer: pass one to the engine, or give token ids")
            for i, m in enumerate(items):
                if not isinstance(m.get("role"), str) or not isinstance(m.get("content", ""), (str, list)):
                    raise RequestError(f"message {i} needs a str 'role' and a str 'content': {_FORMS}")
            ids = list(tokenizer.apply_chat_template(items, add_generation_prompt=True, tokenize=True))
        else:
            ids = items
    else:
        raise RequestError(f"the prompt is {type(prompt).__name__} {prompt!r:.40}: {_FORMS}")
    ids = _check_ids(ids, vocab_size)
    if not ids:
        raise RequestError("the prompt is empty: give at least one token (or a tokenizer that adds BOS)")
    return ids
