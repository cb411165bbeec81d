"""Tokenizer: ``tokenizer.json`` through the ``tokenizers`` library, chat templates through jinja2.

A checkpoint folder provides:

- ``tokenizer.json`` (required): the fast-tokenizer file (model, normalizer,
  pre-tokenizer, post-processor, decoder, added tokens).
- ``tokenizer_config.json`` (optional): special-token strings (``bos_token``,
  ``eos_token``, ``pad_token``, ``unk_token``; a string or an ``AddedToken`` dict),
  ``add_bos_token`` / ``add_eos_token``, and ``chat_template`` (a string, or a list of
  ``{"name", "template"}``).
- ``special_tokens_map.json`` (optional): fallback for the special-token strings.
- ``chat_template.jinja`` (optional): the chat template; it wins over
  ``tokenizer_config.json``, as in Hugging Face transformers >= 4.43.
- ``generation_config.json`` (optional): ``eos_token_id`` (int or list), merged into
  :attr:`Tokenizer.eos_token_ids`.

Template rendering follows the conventions of transformers'
``utils/chat_template_utils.py``: a sandboxed jinja2 environment with
``trim_blocks``/``lstrip_blocks`` and loop controls, helpers ``raise_exception`` and
``strftime_now``, a ``tojson`` filter that keeps non-ASCII text, and ``tools`` /
``documents`` defined as ``None`` unless given.

Text decoding does not apply transformers' ``clean_up_tokenization_spaces`` (it
rewrites ``" ."`` to ``"."`` and depends on the next token, which streaming cannot
know); :meth:`Tokenizer.decode` is exactly ``tokenizers``' decode.

Why this module is one file of over 500 lines: encoding, chat-template rendering (with
its checks) and the streaming detokenizer share the loaded tokenizer's special-token
state.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer as _HFTokenizer

from .errors import ChatTemplateError, PromptTooLongError, TokenizerError

__all__ = ["Tokenizer", "StreamingDetokenizer"]

_REPLACEMENT_CHAR = "\ufffd"

#: Longest text (characters) :meth:`Tokenizer.encode` accepts; checked before tokenizing,
#: so a huge prompt costs nothing. About 4x the longest context of current models.
MAX_INPUT_CHARS = 2_000_000
#: Limits of one chat-template rendering: wall time (seconds) and output characters.
TEMPLATE_TIMEOUT_S = 2.0
TEMPLATE_MAX_OUTPUT_CHARS = MAX_INPUT_CHARS


# ---------------------------------------------------------------------------
# file reading
# ---------------------------------------------------------------------------


def _read_json(path: Path, required: bool) -> Optional[dict]:
    """Parse a json object file; ``None`` when absent and not required.

    Raises:
        TokenizerError: the file is required and absent, or is not a json object.
    """
    if not path.is_file():
        if required:
            raise TokenizerError(f"{path} not found: the tokenizer folder must contain it")
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise TokenizerError(f"{path} is not valid json ({exc}); re-download or re-save the tokenizer") from exc
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} must hold a json object, found {type(data).__name__}")
    return data


def _token_content(value: Any) -> Optional[str]:
    """A special-token entry as a string: ``"<s>"`` or ``{"content": "<s>", ...}`` (AddedToken)."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_id_list(value: Any) -> list[int]:
    """``eos_token_id`` from generation_config.json: an int, a list of ints, or absent."""
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _select_template(raw: Any, source: Path) -> Union[str, dict[str, str], None]:
    """Normalise a ``chat_template`` entry: a string, or a list of named templates as a dict.

    Raises:
        TokenizerError: the entry is neither a string nor a list of ``{"name","template"}``.
    """
    if raw is None or isinstance(raw, str):
        return raw
    if isinstance(raw, list):
        named = {}
        for item in raw:
            if not (isinstance(item, dict) and isinstance(item.get("name"), str) and isinstance(item.get("template"), str)):
                raise TokenizerError(
                    f"chat_template in {source} is a list, but an entry is not {{'name': str, 'template': str}}: {item!r}"
                )
            named[item["name"]] = item["template"]
        return named
    raise TokenizerError(f"chat_template in {source} must be a string or a list of named templates, found {type(raw).__name__}")


# ---------------------------------------------------------------------------
# chat templates
# ---------------------------------------------------------------------------


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` as a plain block.

    transformers uses this tag to mark assistant tokens for training masks; some
    templates contain it, and rendering must not fail on it. The body is rendered
    unchanged.
    """

    tags = {"generation"}

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str):
    """Template helper: abort rendering with :class:`ChatTemplateError`."""
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators=None, sort_keys: bool = False) -> str:
    """Template filter ``tojson``: ``json.dumps`` without jinja's HTML escaping, non-ASCII kept."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    """Template helper: the local time formatted with ``datetime.strftime``."""
    return datetime.now().strftime(fmt)


_render = threading.local()  # deadline and output limit of the rendering on this thread


def _check_render(size: int = 0) -> None:
    """Raise when the rendering on this thread ran past its deadline or its output limit."""
    deadline = getattr(_render, "deadline", None)
    if deadline is not None and time.monotonic() > deadline:
        raise ChatTemplateError(
            f"the chat template ran longer than {_render.timeout:g} s: it loops too much; fix the template"
        )
    if size > getattr(_render, "max_chars", TEMPLATE_MAX_OUTPUT_CHARS):
        raise ChatTemplateError(
            f"the chat template built a value of {size} characters, more than the limit of {_render.max_chars}: "
            "fix the template or shorten the messages"
        )


class _BoundedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The sandbox, plus a time limit checked at every call and loop step over ``range``,
    and a size limit on strings and lists built by ``*`` or by calls (``'x' * 10**8``)."""

    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        _check_render()
        if operator == "**":
            if isinstance(right, int) and abs(right) > 4096:
                raise ChatTemplateError(f"the chat template raises a number to the power {right}: fix the template")
            return left**right
        if isinstance(left, int) and isinstance(right, (str, list, tuple)):
            left, right = right, left
        if isinstance(left, (str, list, tuple)) and isinstance(right, int):
            _check_render(len(left) * max(right, 0))
        return left * right

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
        _check_render()
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, (str, list, tuple)):
            _check_render(len(result))
        return result


def _bounded_range(*args):
    """``range`` for templates: jinja's sandbox limit, and the render deadline checked as it runs."""
    for i, value in enumerate(jinja2.sandbox.safe_range(*args)):
        if i % 1024 == 0:
            _check_render()
        yield value


@functools.lru_cache(maxsize=32)
def _compile_template(source: str) -> jinja2.Template:
    """Compile a chat template in the bounded sandbox (cached by its source text).

    Raises:
        ChatTemplateError: the template has a jinja syntax error.
    """
    env = _BoundedSandbox(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols, _GenerationTag]
    )
    env.globals["range"] = _bounded_range
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(f"the chat template has a syntax error at line {exc.lineno}: {exc.message}") from exc


# ---------------------------------------------------------------------------
# the tokenizer
# ---------------------------------------------------------------------------


class Tokenizer:
    """Text <-> token ids for one checkpoint, plus its chat template.

    Build it with :meth:`from_pretrained`. Attributes:

    - ``bos_token_id``, ``pad_token_id``, ``unk_token_id``: ``int`` or ``None``.
    - ``eos_token_ids``: ``set[int]``, every id that ends generation
      (``generation_config.json`` ``eos_token_id`` merged with ``eos_token``).
    - ``eos_token_id``: the id of ``eos_token`` (or the first generation-config id).
    - ``vocab_size``: ``int``, tokens in ``tokenizer.json`` including added tokens (the
      model's embedding may be larger).
    - ``chat_template``: the default template source, or ``None``.
    - ``add_bos_token``: whether :meth:`encode` with ``add_special_tokens=True`` starts
      the ids with BOS.
    """

    def __init__(
        self,
        backend: _HFTokenizer,
        config: Optional[dict] = None,
        generation_config: Optional[dict] = None,
        chat_template: Union[str, dict[str, str], None] = None,
        path: Optional[Path] = None,
    ):
        """Wrap a ``tokenizers.Tokenizer``.

        Args:
            backend: the loaded ``tokenizer.json``.
            config: ``tokenizer_config.json`` contents (special tokens, ``add_bos_token``).
            generation_config: ``generation_config.json`` contents (``eos_token_id``).
            chat_template: one template string, or ``{name: template}`` (``"default"`` used).
            path: the folder, for error messages.
        """
        config = dict(config or {})
        generation_config = dict(generation_config or {})
        self._backend = backend
        self.path = path
        self._templates: dict[str, str] = {}
        if isinstance(chat_template, dict):
            self._templates = dict(chat_template)
        elif isinstance(chat_template, str):
            self._templates = {"default": chat_template}

        self.bos_token = _token_content(config.get("bos_token"))
        # templates see the tokenizer config's own bos_token, as transformers renders them,
        # even when the id falls back to generation_config.json below
        self._template_bos_token = self.bos_token
        self.eos_token = _token_content(config.get("eos_token"))
        self.unk_token = _token_content(config.get("unk_token"))
        self.pad_token = _token_content(config.get("pad_token"))
        self.bos_token_id = self._id_of(self.bos_token)
        if self.bos_token_id is None and isinstance(generation_config.get("bos_token_id"), int):
            self.bos_token_id = generation_config["bos_token_id"]
            self.bos_token = backend.id_to_token(self.bos_token_id)
        self.unk_token_id = self._id_of(self.unk_token)
        self.pad_token_id = self._id_of(self.pad_token)
        if self.pad_token_id is None and _as_id_list(generation_config.get("pad_token_id")):
            self.pad_token_id = _as_id_list(generation_config["pad_token_id"])[0]

        gen_eos = _as_id_list(generation_config.get("eos_token_id"))
        tok_eos = self._id_of(self.eos_token)
        self.eos_token_id: Optional[int] = tok_eos if tok_eos is not None else (gen_eos[0] if gen_eos else None)
        self.eos_token_ids: set[int] = set(gen_eos) | ({tok_eos} if tok_eos is not None else set())
        if self.eos_token is None and self.eos_token_id is not None:
            self.eos_token = backend.id_to_token(self.eos_token_id)

        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)

        # Does the tokenizer.json post-processor already add BOS/EOS? Probe once with a
        # text that is not itself a special token.
        probe_plain = backend.encode("a", add_special_tokens=False).ids
        probe_full = backend.encode("a", add_special_tokens=True).ids
        self._post_adds_bos = (
            self.bos_token_id is not None
            and len(probe_full) > len(probe_plain)
            and probe_full[0] == self.bos_token_id
            and (not probe_plain or probe_plain[0] != self.bos_token_id)
        )
        self._post_adds_eos = (
            self.eos_token_id is not None
            and len(probe_full) > len(probe_plain)
            and probe_full[-1] == self.eos_token_id
            and (not probe_plain or probe_plain[-1] != self.eos_token_id)
        )
        add_bos = config.get("add_bos_token")
        add_eos = config.get("add_eos_token")
        self.add_bos_token: bool = self._post_adds_bos if add_bos is None else bool(add_bos) and self.bos_token_id is not None
        self.add_eos_token: bool = self._post_adds_eos if add_eos is None else bool(add_eos) and self.eos_token_id is not None

    # -- construction -------------------------------------------------------

    @classmethod
    def from_pretrained(cls, path: Union[str, Path]) -> "Tokenizer":
        """Load the tokenizer of a local checkpoint folder.

        Args:
            path: a folder holding ``tokenizer.json`` (see the module docstring for the
                other files read).

        Raises:
            TokenizerError: the folder or ``tokenizer.json`` is missing, or a json file is
                malformed (the message names the path).
        """
        folder = Path(path)
        if folder.is_file() and folder.name.endswith(".gguf"):
            return cls.from_gguf(folder)
        if not folder.is_dir():
            raise TokenizerError(f"tokenizer folder {folder} does not exist or is not a directory")
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerError(
                f"{tok_file} not found: mlx_ferrum needs the fast-tokenizer file; create it with "
                "transformers: AutoTokenizer.from_pretrained(folder).save_pretrained(folder)"
            )
        try:
            backend = _HFTokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception on parse errors
            raise TokenizerError(f"{tok_file} cannot be parsed by the tokenizers library: {exc}") from exc

        config_file = folder / "tokenizer_config.json"
        config = _read_json(config_file, required=False) or {}
        special_map = _read_json(folder / "special_tokens_map.json", required=False) or {}
        for key in ("bos_token", "eos_token", "unk_token", "pad_token"):
            if config.get(key) is None and special_map.get(key) is not None:
                config[key] = special_map[key]
        generation_config = _read_json(folder / "generation_config.json", required=False) or {}

        template: Union[str, dict[str, str], None] = _select_template(config.get("chat_template"), config_file)
        jinja_file = folder / "chat_template.jinja"
        legacy_file = folder / "chat_template.json"
        if jinja_file.is_file():
            try:
                source = jinja_file.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as exc:
                raise TokenizerError(f"{jinja_file} cannot be read: {exc}") from exc
            template = {**template, "default": source} if isinstance(template, dict) else source
        elif template is None and legacy_file.is_file():
            template = _select_template((_read_json(legacy_file, required=True) or {}).get("chat_template"), legacy_file)
        return cls(backend, config, generation_config, template, folder)

    @classmethod
    def from_gguf(cls, path: Union[str, Path]) -> "Tokenizer":
        """The tokenizer stored in a GGUF file's metadata (see
        :mod:`mlx_ferrum.models.gguf.tokenizer`), with its chat template.

        Raises:
            TokenizerError: the file has no tokenizer metadata, or a tokenizer model /
                pre-tokenizer that is not supported (named).
            GGUFFormatError: the file is damaged.
        """
        from .models.gguf.reader import read_gguf
        from .models.gguf.tokenizer import build_backend, tokenizer_config

        from .models.gguf.tokenizer import end_token_ids

        metadata = read_gguf(path).metadata
        config = tokenizer_config(metadata)
        generation_config = {"eos_token_id": end_token_ids(metadata)}
        return cls(build_backend(metadata), config, generation_config, config.get("chat_template"), Path(path))

    def _id_of(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._backend.token_to_id(token)

    # -- encode / decode -----------------------------------------------------

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``.

        With ``add_special_tokens``, the ``tokenizer.json`` post-processor runs, then BOS
        is prepended when ``add_bos_token`` holds and the ids do not already start with
        it (never twice), or removed when ``tokenizer_config.json`` sets
        ``add_bos_token: false`` but the post-processor added it (likewise EOS at the end).

        Returns:
            ``list[int]`` token ids.

        Raises:
            TokenizerError: ``text`` is not a string, or is not valid Unicode (a lone
                surrogate, e.g. from bytes decoded with ``surrogateescape``).
            PromptTooLongError: ``text`` has more than ``MAX_INPUT_CHARS`` characters
                (checked before tokenizing).
        """
        if not isinstance(text, str):
            raise TokenizerError(f"encode() takes a str, got {type(text).__name__}")
        if len(text) > MAX_INPUT_CHARS:
            raise PromptTooLongError(
                f"the text has {len(text)} characters, more than the limit of {MAX_INPUT_CHARS}: shorten it"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise TokenizerError(
                f"the text is not valid Unicode: {exc.reason} at character {exc.start}; "
                "decode input bytes as UTF-8 (errors='replace') before passing them"
            ) from None
        # encode_batch releases the GIL while it tokenizes (encode holds it throughout), so
        # a long text tokenized in a worker thread does not stall the other threads
        ids = list(self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)
        if not add_special_tokens:
            return ids
        if self._post_adds_bos and not self.add_bos_token and ids and ids[0] == self.bos_token_id:
            ids = ids[1:]
        elif self.add_bos_token and not self._post_adds_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        if self._post_adds_eos and not self.add_eos_token and ids and ids[-1] == self.eos_token_id:
            ids = ids[:-1]
        elif self.add_eos_token and not self._post_adds_eos and (not ids or ids[-1] != self.eos_token_id):
            ids = ids + [self.eos_token_id]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (``tokenizers``' decoder chain; special tokens dropped by default).

        Raises:
            TokenizerError: an id is not an int (ids past the vocabulary decode to nothing).
        """
        try:
            return self._backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
        except (TypeError, ValueError, OverflowError) as exc:
            raise TokenizerError(f"decode() needs a sequence of non-negative ints: {exc}") from exc

    def detokenizer(self, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()) -> "StreamingDetokenizer":
        """A fresh :class:`StreamingDetokenizer` over this tokenizer, its first tokens read
        after the last of ``prompt_ids`` (see the class)."""
        return StreamingDetokenizer(self, skip_special_tokens=skip_special_tokens, prompt_ids=prompt_ids)

    # -- chat templates ------------------------------------------------------

    @property
    def chat_template(self) -> Optional[str]:
        """The default chat template source, or ``None`` when the checkpoint has none."""
        return self._templates.get("default")

    @property
    def chat_templates(self) -> dict[str, str]:
        """Every named template (``{"default": ...}`` for a single one)."""
        return dict(self._templates)

    def _template_source(self, chat_template: Optional[str]) -> str:
        if chat_template is not None:
            # A name from the checkpoint's list, else a template string of the caller's.
            return self._templates.get(chat_template, chat_template)
        if "default" in self._templates:
            return self._templates["default"]
        where = self.path if self.path is not None else "this tokenizer"
        if self._templates:
            raise ChatTemplateError(
                f"{where} has several chat templates ({sorted(self._templates)}) and none named 'default': "
                "pass chat_template=<name>"
            )
        raise ChatTemplateError(
            f"{where} has no chat template: add 'chat_template' to tokenizer_config.json or a "
            "chat_template.jinja file to the folder, pass chat_template=<jinja string>, or encode a plain prompt instead"
        )

    def apply_chat_template(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        *,
        chat_template: Optional[str] = None,
        **template_kwargs: Any,
    ) -> Union[str, list[int]]:
        """Render OpenAI-style ``messages`` with the checkpoint's chat template.

        The template sees ``messages``, ``add_generation_prompt``, ``bos_token``,
        ``eos_token``, ``unk_token``, ``pad_token``, ``tools=None``, ``documents=None``
        and every ``template_kwargs`` entry (which override those).

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]``.
            add_generation_prompt: append the header that starts an assistant turn.
            tokenize: return ids instead of text; the text is encoded without adding
                special tokens, because templates write BOS themselves.
            chat_template: a template name from the checkpoint's list, or a template string.

        Returns:
            The rendered ``str``, or ``list[int]`` when ``tokenize``.

        Raises:
            ChatTemplateError: no template, a syntax error, a rendering error, the
                template called ``raise_exception``, or it ran past ``TEMPLATE_TIMEOUT_S``
                seconds or built more than ``TEMPLATE_MAX_OUTPUT_CHARS`` characters.
        """
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise ChatTemplateError("messages must be a list of dicts like {'role': 'user', 'content': '...'}")
        template = _compile_template(self._template_source(chat_template))
        variables: dict[str, Any] = {
            "messages": list(messages),
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self._template_bos_token or "",
            "eos_token": self.eos_token or "",
            "tools": None,
            "documents": None,
        }
        for key in ("unk_token", "pad_token"):
            if getattr(self, key) is not None:
                variables[key] = getattr(self, key)
        variables.update(template_kwargs)
        _render.timeout, _render.max_chars = TEMPLATE_TIMEOUT_S, TEMPLATE_MAX_OUTPUT_CHARS
        _render.deadline = time.monotonic() + TEMPLATE_TIMEOUT_S
        try:
            parts, size = [], 0
            for part in template.generate(**variables):
                size += len(part)
                _check_render(size)
                parts.append(part)
            text = "".join(parts)
        except ChatTemplateError:
            raise
        except Exception as exc:  # any failure inside user-supplied template code
            raise ChatTemplateError(f"the chat template failed to render: {type(exc).__name__}: {exc}") from exc
        finally:
            _render.deadline = None
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    def __repr__(self) -> str:
        return f"Tokenizer(path={str(self.path)!r}, vocab_size={self.vocab_size}, bos={self.bos_token_id}, eos={sorted(self.eos_token_ids)})"


# ---------------------------------------------------------------------------
# streaming detokenization
# ---------------------------------------------------------------------------


#: prompt tokens a completion's detokenizer starts after (vLLM's initial offset)
_PROMPT_CONTEXT_TOKENS = 5


class StreamingDetokenizer:
    """Turns a stream of token ids into text, emitting only text that is final.

    Algorithm (the prefix/read-offset scheme of Hugging Face text-generation-inference
    and vLLM's ``detokenize_incrementally``): keep two offsets into the ids. The window
    ``ids[prefix_offset:read_offset]`` holds the tokens behind the text emitted last;
    each new token decodes ``ids[prefix_offset:]`` and emits the part past the window's
    own text, unless that ends in U+FFFD (an incomplete UTF-8 character from
    byte-fallback or byte-level tokens), in which case it waits for more tokens.
    Decoding with at least one earlier token in the window keeps SentencePiece's
    leading space (which the decoder strips only from the first token of a text).
    Each step decodes a few tokens, not the whole sequence.

    Invariant: ``"".join(add_token(i) for i in ids) + finalize() == tokenizer.decode(ids)``
    (with the same ``skip_special_tokens``). Given ``prompt_ids``, the stream continues the
    prompt: its last few tokens (vLLM's offset of 5) are the first window and are never
    emitted, so the text is ``decode(prompt + ids)`` past ``decode(prompt)``, as OpenAI
    and vLLM return a completion (a SentencePiece token's leading space is kept on the
    first generated token). One exception, for invalid UTF-8 only: the
    ``ByteFallback`` decoder turns a whole run of ``<0xXX>`` tokens into U+FFFD when any
    byte of the run is invalid, so a valid character already emitted from the start of
    such a run stays as it was, where ``decode`` of the whole ids would show U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, prompt_ids: Sequence[int] = ()):
        """Start an empty stream over ``tokenizer`` (continuing ``prompt_ids``)."""
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._context = [int(t) for t in list(prompt_ids)[-_PROMPT_CONTEXT_TOKENS:]]
        self.reset()

    def reset(self) -> None:
        """Forget every generated token: start a new stream (after the same prompt)."""
        self.token_ids: list[int] = list(self._context)
        self._prefix_offset = 0
        self._read_offset = len(self._context)
        self._chunks: list[str] = []

    def _decode(self, start: int, stop: Optional[int] = None) -> str:
        return self._tokenizer.decode(self.token_ids[start:stop], skip_special_tokens=self._skip)

    def add_token(self, token_id: int) -> str:
        """Append one id; return the text that became final (possibly ``""``)."""
        self.token_ids.append(int(token_id))
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._chunks.append(delta)
        return delta

    def finalize(self) -> str:
        """Flush text held back (e.g. an unfinished UTF-8 sequence, decoded with U+FFFD)."""
        if self._read_offset == len(self.token_ids):
            return ""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        delta = new_text[len(prefix_text):]
        if delta:
            self._prefix_offset = self._read_offset
            self._read_offset = len(self.token_ids)
            self._chunks.append(delta)
        return delta

    @property
    def text(self) -> str:
        """All text emitted so far (held-back bytes excluded until :meth:`finalize`)."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""
