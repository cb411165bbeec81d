"""Structured output: grammar-constrained decoding with llguidance.

A request names its constraint with :class:`StructuredOutputsParams` (vLLM's
``SamplingParams.structured_outputs`` is the naming precedent): a JSON schema, any JSON
object, a regular expression, a Lark grammar (llguidance's dialect; GBNF is accepted too)
or a choice among strings. The engine keeps one llguidance ``LLMatcher`` per request (its
grammar state); before a step samples, the allowed-token bitmask of every constrained
row is computed on the host into one ``[B, ceil(V / 32)]`` int32 array (llguidance's
packed layout, bit ``t % 32`` of word ``t // 32``; unconstrained rows are all ones), by
llguidance's thread pool, while the device runs the forward pass; ``sample()`` applies it
to the whole batch in one ``mx.where`` (:func:`apply_token_bitmask`).

Why llguidance (over xgrammar and outlines-core): it ships a prebuilt wheel for Linux and
macOS with no torch dependency and an MLX helper, compiles a grammar lazily (no
per-schema ahead-of-time compile over the vocabulary, so a large schema cannot stall the
server), bounds the work of every mask with fuel limits (:class:`llguidance.LLParserLimits`),
covers JSON schema, regex and Lark/GBNF with one matcher, and computes masks in tens of
microseconds at 100K+ vocabularies. outlines-core compiles a schema's whole regex to a
token index up front (seconds for large schemas); xgrammar's wheel brings torch along.

Errors: a constraint the library cannot compile raises :class:`StructuredOutputError`
(a :class:`~mlx_ferrum.errors.SamplingParamsError`, so the server answers 400 naming it),
and so does one whose first mask leaves the grammar in its error state (no finite output,
a work limit spent): the first mask is computed at compile time, before the grammar is
cached. llguidance's "stopped" state covers both a complete output and an error; an error
met while generating ends the request with ``finish_reason="error"``, never ``"stop"``.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

import mlx.core as mx
import numpy as np

from ..errors import StructuredOutputError
from .json_number_bound import JsonLexState, TokenDigits

__all__ = [
    "StructuredOutputsParams",
    "GrammarBackend",
    "GrammarMatcher",
    "apply_token_bitmask",
    "bitmask_words",
]

#: The JSON grammar writes compact JSON (no free whitespace): a sampled run of spaces or
#: newlines can never keep a constrained request from closing its object.
JSON_OPTIONS = {"whitespace_flexible": False}


#: Bounds of a ``json_object`` reply (any JSON object), where the value could not mean
#: more: a string holds at most this many characters (an escape counts as one) ...
JSON_OBJECT_MAX_STRING = 1024
#: ... objects and arrays nest at most this deep (the reply's own object is depth 1) ...
JSON_OBJECT_MAX_DEPTH = 16
#: ... and a number has at most 17 digits before and 17 after its point and 3 in its
#: exponent: 17 significant digits are all a float64 carries, so a sampled run of digits
#: (0.0080000000000000000200000...) can never keep the reply from closing.
JSON_NUMBER_REGEX = r"-?(0|[1-9][0-9]{0,16})(\.[0-9]{1,17})?([eE][+-]?[0-9]{1,3})?"


def json_object_grammar(max_string: int = JSON_OBJECT_MAX_STRING, max_depth: int = JSON_OBJECT_MAX_DEPTH) -> str:
    """A Lark grammar (llguidance's dialect) of one compact JSON object (RFC 8259, no free
    whitespace) within the bounds above: each nesting level is its own rule, so depth is
    bounded by construction; strings and numbers are bounded lexemes.

    Raises:
        ValueError: a bound below 1.
    """
    if max_string < 1 or max_depth < 1:
        raise ValueError("json_object bounds must be positive")
    lines = ["start: object1",
             r'STRING: /"([^"\\\x00-\x1f]|\\["\\\/bfnrt]|\\u[0-9a-fA-F]{4}){0,%d}"/' % max_string,
             f"NUMBER: /{JSON_NUMBER_REGEX}/"]
    for k in range(1, max_depth + 1):
        deeper = f" | object{k + 1} | array{k + 1}" if k < max_depth else ""
        lines += [f'object{k}: "{{" (pair{k} ("," pair{k})*)? "}}"',
                  f'pair{k}: STRING ":" value{k}',
                  f'array{k}: "[" (value{k} ("," value{k})*)? "]"',
                  f'value{k}: STRING | NUMBER | "true" | "false" | "null"{deeper}']
    return "\n".join(lines)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """One request's output constraint; exactly one field is set.

    Fields:
        json: a JSON schema (a dict, or its JSON text): the output is one JSON value
            that validates against it.
        json_object: True: the output is any JSON object, within documented bounds:
            strings of at most ``JSON_OBJECT_MAX_STRING`` characters, nesting at most
            ``JSON_OBJECT_MAX_DEPTH`` deep, numbers of at most 17 digits each side of the
            point (:func:`json_object_grammar`).
        regex: the output matches this regular expression (Rust ``regex`` syntax).
        grammar: a Lark grammar in llguidance's dialect (or a GBNF grammar); its start
            rule is ``start`` (Lark) / ``root`` (GBNF).
        choice: the output is exactly one of these strings.

    Raises:
        StructuredOutputError: none or several fields set, or a field of the wrong type.
    """

    json: Optional[Union[dict, str]] = None
    json_object: bool = False
    regex: Optional[str] = None
    grammar: Optional[str] = None
    choice: Optional[tuple] = None

    def __post_init__(self):
        if self.choice is not None:
            if isinstance(self.choice, str) or not all(isinstance(c, str) for c in self.choice) or not self.choice:
                raise StructuredOutputError("structured_outputs.choice must be a non-empty list of strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        set_fields = [name for name in ("json", "regex", "grammar", "choice") if getattr(self, name) is not None]
        if self.json_object:
            set_fields.append("json_object")
        if len(set_fields) != 1:
            raise StructuredOutputError(
                "structured_outputs needs exactly one of json, json_object, regex, grammar, choice; "
                f"got {set_fields or 'none'}")
        if self.json is not None and not isinstance(self.json, (dict, str)):
            raise StructuredOutputError("structured_outputs.json must be a JSON schema (a dict or its JSON text)")
        for name in ("regex", "grammar"):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), str):
                raise StructuredOutputError(f"structured_outputs.{name} must be a string")

    def __hash__(self):
        return hash(self.key())

    @property
    def kind(self) -> str:
        """The constraint's kind as errors name it: json_schema, json_object, regex, grammar or choice."""
        if self.json is not None:
            return "json_schema"
        for name in ("json_object", "regex", "grammar", "choice"):
            if getattr(self, name):
                return name
        return "none"

    def key(self) -> str:
        """A string naming the constraint exactly (the compile cache's key)."""
        value = self.json if not isinstance(self.json, dict) else json.dumps(self.json, sort_keys=True)
        return json.dumps([value, self.json_object, self.regex, self.grammar, self.choice])

    def llguidance_grammar(self) -> str:
        """The constraint as an llguidance grammar (text).

        Raises:
            StructuredOutputError: the JSON schema text is not JSON, or not an object; the
                grammar is GBNF that llguidance cannot convert (a syntax error, no ``root`` rule).
        """
        import llguidance

        if self.json_object:
            return llguidance.grammar_from("lark", json_object_grammar())
        if self.json is not None:
            schema: Any = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise StructuredOutputError(f"the JSON schema is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise StructuredOutputError("a JSON schema must be a JSON object, e.g. {\"type\": \"object\"}")
            try:
                return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)
            except ValueError as e:
                raise StructuredOutputError(f"the JSON schema cannot be used: {e}") from None
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            import re

            return llguidance.LLMatcher.grammar_from_regex("|".join(re.escape(c) for c in self.choice))
        try:
            return llguidance.grammar_from("grammar", self.grammar)
        except ValueError as e:  # a GBNF grammar llguidance cannot convert (syntax error, no ``root`` rule)
            raise StructuredOutputError(f"the grammar cannot be used: {e}: write a Lark grammar with a 'start' rule "
                                        "or a GBNF grammar with a 'root' rule") from None


def _short(error: Optional[str]) -> str:
    """The library's error without its state dump (its first line)."""
    return (error or "").strip().splitlines()[0] if (error or "").strip() else ""


def _failed_message(kind: str, error: Optional[str]) -> str:
    reason = _short(error)
    if reason == "NoExtensionBias":  # llguidance: no token can extend the output to a complete one
        reason = "it allows no complete output (e.g. a schema that only refers to itself)"
    return f"the {kind} constraint cannot be used: {reason or 'the grammar library reported an error'}"


def bitmask_words(vocab_size: int) -> int:
    """32-bit words per row of a packed bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def apply_token_bitmask(logits: mx.array, bitmask: mx.array) -> mx.array:
    """Set every disallowed token's logit to ``-inf``, for the whole batch at once.

    Args:
        logits: ``[B, V]`` float.
        bitmask: ``[B, ceil(V / 32)]`` int32 (or uint32), llguidance's packed layout: token
            ``t`` of row ``b`` is allowed when bit ``t % 32`` of ``bitmask[b, t // 32]`` is
            set. A row of all ones (``-1``) leaves that row's logits unchanged, bit for bit.

    Returns:
        ``[B, V]``, the dtype of ``logits``.
    """
    batch, vocab = logits.shape
    words = bitmask.astype(mx.uint32)
    bits = mx.right_shift(words[:, :, None], mx.arange(32, dtype=mx.uint32)[None, None, :]) & 1
    allowed = bits.reshape(batch, -1)[:, :vocab].astype(mx.bool_)
    return mx.where(allowed, logits, mx.array(float("-inf"), dtype=logits.dtype))


class GrammarMatcher:
    """One request's grammar state (an llguidance ``LLMatcher``).

    Call :meth:`accept` with each generated token in order; the engine fills the row's
    mask with :meth:`GrammarBackend.fill_bitmask` before each sample. A JSON-schema
    constraint also carries the digit bound of :mod:`~mlx_ferrum.engine.json_number_bound`
    (``digits``), whose lexical state is kept per accepted token.
    """

    def __init__(self, matcher, kind: str = "grammar", digits: Optional[TokenDigits] = None):
        self.matcher = matcher
        self.kind = kind
        self.num_tokens = 0
        self.digits = digits
        self._lex = [JsonLexState()]  # the state after each accepted token (digit bound only)

    def limit_digits(self, row: np.ndarray) -> None:
        """Apply the digit bound to ``row``, this matcher's packed mask (in place)."""
        if self.digits is not None:
            self.digits.limit(self._lex[-1], row)

    def accept(self, token_id: int) -> None:
        """Advance the grammar by one generated token.

        Raises:
            StructuredOutputError: the grammar does not allow the token (the mask was not
                applied, or the grammar ran out of its work limits).
        """
        if not self.matcher.consume_token(int(token_id)):
            raise StructuredOutputError(
                f"the {self.kind} constraint rejected token {token_id}: {_short(self.matcher.get_error()) or 'not allowed here'}")
        self.num_tokens += 1
        if self.digits is not None:
            self._lex.append(self._lex[-1].advance(self.digits.token_bytes[int(token_id)]))

    def check(self) -> None:
        """Raise when the grammar is in its error state: an error is never a finished output.

        Raises:
            StructuredOutputError: naming the constraint and the library's reason (a work
                limit ran out, or the grammar allows no complete output from here).
        """
        if self.matcher.is_error():
            raise StructuredOutputError(_failed_message(self.kind, self.matcher.get_error()))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` accepted tokens (a rejected speculative draft)."""
        if num_tokens:
            self.matcher.rollback(num_tokens)
            self.num_tokens -= num_tokens
            if self.digits is not None:
                del self._lex[-num_tokens:]

    def allowed_prefix(self, token_ids: Sequence[int], stop_ids: Sequence[int] = ()) -> int:
        """How many leading tokens of a speculative draft the grammar allows, without
        changing its state (``LLMatcher.validate_tokens``: a rejected ``consume_token``
        would leave the matcher in an error state that ``rollback`` does not undo). The
        count ends after a stop id: nothing after one is emitted."""
        allowed = int(self.matcher.validate_tokens([int(t) for t in token_ids])) if token_ids else 0
        state = self._lex[-1]
        for i, tok in enumerate(token_ids[:allowed]):
            if self.digits is not None:
                if not self.digits.fits(state, int(tok)):
                    return i
                state = state.advance(self.digits.token_bytes[int(tok)])
            if tok in stop_ids:
                return i + 1
        return allowed

    def draft_bitmask(self, token_ids: Sequence[int], words: int) -> np.ndarray:
        """The masks of the ``m + 1`` positions a draft of ``m`` tokens is verified at.

        Row ``i`` is the mask after the accepted tokens and ``token_ids[:i]`` (llguidance's
        packed layout, ``[m + 1, words]`` int32), so verifying the draft against masked
        logits accepts and samples exactly what one token at a time would. Each draft
        token is consumed to reach the next position and all are rolled back at the end
        (``LLMatcher.rollback``): the state is unchanged. Call with a draft that
        :meth:`allowed_prefix` accepted in full.

        Raises:
            StructuredOutputError: a draft token is not allowed.
        """
        mask = np.full((len(token_ids) + 1, words), -1, dtype=np.int32)
        row_bytes = words * 4
        consumed = 0
        state = self._lex[-1]
        try:
            for i in range(len(token_ids) + 1):
                if self.matcher.is_stopped():
                    break  # nothing follows a complete output: the row stays unmasked, never emitted
                self.matcher.unsafe_compute_mask_ptr(mask.ctypes.data + i * row_bytes, row_bytes)
                if self.digits is not None:
                    self.digits.limit(state, mask[i])
                if i < len(token_ids):
                    if not self.matcher.consume_token(int(token_ids[i])):
                        raise StructuredOutputError(f"the grammar rejected draft token {token_ids[i]}")
                    consumed += 1
                    if self.digits is not None:
                        state = state.advance(self.digits.token_bytes[int(token_ids[i])])
        finally:
            if consumed:
                self.matcher.rollback(consumed)
        return mask

    @property
    def done(self) -> bool:
        """True when the grammar allows no further token because the output is complete
        (llguidance's stopped state is also its error state: an error is not done)."""
        return self.matcher.is_stopped() and not self.matcher.is_error()

    @property
    def error(self) -> Optional[str]:
        """The matcher's error (an exhausted work limit ...), or None."""
        return self.matcher.get_error() if self.matcher.is_error() else None


class GrammarBackend:
    """Compiles constraints for one tokenizer and computes the batch's masks.

    Args:
        tokenizer: a :class:`~mlx_ferrum.tokenizer.Tokenizer` (its ``backend`` is a
            Hugging Face ``tokenizers.Tokenizer``).
        vocab_size: the model's logits width ``V`` (ids at or above the tokenizer's own
            vocabulary are never allowed).
        cache_size: compiled grammars kept (a new request of a cached constraint gets a
            copy of its matcher, without compiling).
        parallel_min_rows: batches of at least this many constrained rows have their
            masks computed by llguidance's thread pool; smaller ones on the calling
            thread. None: 4 on a machine of more than 2 cores, never on 2 or fewer.

    Raises:
        StructuredOutputError: llguidance is not installed, or the tokenizer cannot be
            read by it.
    """

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = 256, parallel_min_rows: Optional[int] = None):
        try:
            import llguidance
        except ImportError:
            raise StructuredOutputError("structured output needs the llguidance package: pip install llguidance") from None
        self._llg = llguidance
        eos = sorted(getattr(tokenizer, "eos_token_ids", ()) or ())
        try:
            self.lltokenizer = llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=eos or None)
        except Exception as e:  # noqa: BLE001 - a tokenizer llguidance cannot read
            raise StructuredOutputError(f"llguidance cannot read this tokenizer ({type(e).__name__}: {e})") from None
        self.vocab_size = vocab_size
        self.words = bitmask_words(vocab_size)
        self._executor = llguidance.LLExecutor()
        # verbose errors would put the parser's internal state into a client's 400
        self._limits = llguidance.LLParserLimits(verbose_errors=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        # Waking the pool's threads costs more than it saves on few rows, and on a
        # machine of 2 cores, where MLX's own thread runs the forward pass beside them,
        # it never pays (measured: 8 rows of a 32K vocabulary, 82 µs pooled, 57 µs in turn)
        if parallel_min_rows is None:
            parallel_min_rows = 4 if (os.cpu_count() or 1) > 2 else 1 << 30
        self.parallel_min_rows = parallel_min_rows
        #: seconds per mask computation (one per constrained row and step), the latest ones
        self.mask_seconds: deque = deque(maxlen=100_000)
        self._token_digits: Optional[TokenDigits] = None  # built with the first JSON-schema constraint

    def token_digits(self) -> TokenDigits:
        """The vocabulary's tables for the JSON digit bound (built once, on first use:
        one ``decode_bytes`` per token id)."""
        with self._lock:
            if self._token_digits is None:
                token_bytes = []
                for token_id in range(self.vocab_size):
                    try:
                        token_bytes.append(self.lltokenizer.decode_bytes([token_id]))
                    except Exception:  # noqa: BLE001 - an id past the tokenizer's vocabulary has no text
                        token_bytes.append(b"")
                self._token_digits = TokenDigits(token_bytes, self.words)
            return self._token_digits

    def _wrap(self, matcher, spec: StructuredOutputsParams) -> GrammarMatcher:
        digits = self.token_digits() if spec.kind == "json_schema" else None
        return GrammarMatcher(matcher, spec.kind, digits)

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        """A fresh grammar state for ``spec`` (compiled once per distinct constraint).

        Raises:
            StructuredOutputError: the constraint does not compile (the message holds the
                library's reason: an unknown keyword, a bad regex, a grammar syntax error).
        """
        key = spec.key()
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                copy = cached.deep_copy()
        if cached is not None:
            return self._wrap(copy, spec)
        grammar = spec.llguidance_grammar()
        # compiling drops the GIL; the parser limits bound its work
        m = self._llg.LLMatcher(self.lltokenizer, grammar, log_level=0, limits=self._limits)
        if m.is_error():
            raise StructuredOutputError(_failed_message(spec.kind, m.get_error()))
        # The first mask is computed here, once per distinct constraint: llguidance builds
        # the lexer lazily, so a grammar with no finite output (a schema that is only
        # {"$ref": "#"}) or one over the work limits shows its error state only then; and a
        # copy taken before that first mask does not share the lexer work, so it may fail
        # where the original passed. Caching the state after the first mask makes every
        # request of a constraint, fresh or cached, start from the same state.
        probe = np.empty(self.words, dtype=np.int32)
        m.unsafe_compute_mask_ptr(probe.ctypes.data, self.words * 4)
        if m.is_error():
            raise StructuredOutputError(_failed_message(spec.kind, m.get_error()))
        with self._lock:
            self._cache[key] = m.deep_copy()
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return self._wrap(m, spec)

    def fill_bitmask(self, matchers: Sequence[Optional[GrammarMatcher]]) -> np.ndarray:
        """The packed ``[B, ceil(V / 32)]`` int32 mask of a batch: row ``b`` from
        ``matchers[b]``, all ones where it is None. From ``parallel_min_rows`` rows on, the
        rows are computed in parallel by llguidance's threads (the GIL is released
        meanwhile); fewer, one after the other on the calling thread."""
        mask = np.full((len(matchers), self.words), -1, dtype=np.int32)
        rows = [(m.matcher, b) for b, m in enumerate(matchers) if m is not None]
        if rows:
            start = time.perf_counter()
            if len(rows) >= self.parallel_min_rows:
                self._executor.unsafe_compute_mask_ptr(rows, mask.ctypes.data, self.words * 4, len(matchers))
            else:
                row_bytes = self.words * 4
                for matcher, b in rows:
                    matcher.unsafe_compute_mask_ptr(mask.ctypes.data + b * row_bytes, row_bytes)
            for b, m in enumerate(matchers):
                if m is not None and m.digits is not None:
                    m.limit_digits(mask[b])
            per_row = (time.perf_counter() - start) / len(rows)
            self.mask_seconds.extend([per_row] * len(rows))
        return mask
