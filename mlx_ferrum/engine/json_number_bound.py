"""A bound on the digits a JSON-schema-constrained reply writes in a row.

A JSON schema's ``"type": "number"`` admits any count of digits, and llguidance's JSON
compiler has no option that bounds them (``multipleOf: 1e-17`` is refused as "too many
digits", and a ``minimum`` / ``maximum`` of +-1e308 does not compile), so a sampled reply
could run on inside one number (``0.0080000000000000000200000...``) until ``max_tokens``
cut it. No float64 means more than 17 significant decimal digits (IEEE 754 binary64: 17
digits round-trip every value), so beside the grammar's mask a reply may write at most
:data:`MAX_NUMBER_DIGITS` digits in a row outside a JSON string: the integer part, the
fraction and the exponent each count on their own, as in ``json_object``'s grammar.

How: a token may start where the reply is not inside a string only when its leading
digits fit the room left in the current run. The run is tracked by a three-field lexical
state over the reply's bytes (inside a string, after a backslash, digits in a row),
advanced token by token, and kept per accepted token so that a rejected speculative draft
rolls back with the grammar. A token that closes a string and then starts a number is
allowed by its leading bytes (a quote), so its few digits count from when it is accepted.
Where the grammar itself demands more digits (a ``minimum`` of 1e20 written out), the
bound yields: a mask it would leave empty is not changed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["MAX_NUMBER_DIGITS", "JsonLexState", "TokenDigits"]

#: Digits in a row a constrained JSON reply may write outside a string.
MAX_NUMBER_DIGITS = 17

_DIGITS = frozenset(b"0123456789")


@dataclass(frozen=True)
class JsonLexState:
    """Where a JSON text stands, as far as the digit bound needs: inside a string, just
    after a backslash in one, and how many digits end the text outside a string."""

    in_string: bool = False
    escaped: bool = False
    digits: int = 0

    def advance(self, data: bytes) -> "JsonLexState":
        """The state after ``data`` (a token's bytes; UTF-8 continuation bytes are never
        quotes, backslashes or digits, so bytes are read one by one)."""
        in_string, escaped, digits = self.in_string, self.escaped, self.digits
        for byte in data:
            if in_string:
                if escaped:
                    escaped = False
                elif byte == 0x5C:  # backslash
                    escaped = True
                elif byte == 0x22:  # closing quote
                    in_string = False
            elif byte == 0x22:
                in_string, digits = True, 0
            elif byte in _DIGITS:
                digits += 1
            else:
                digits = 0
        return JsonLexState(in_string, escaped, digits)


class TokenDigits:
    """Per-vocabulary tables of the bound: each token's bytes and leading digits, and the
    packed masks (llguidance's layout) of the tokens whose leading digits fit a room.

    Args:
        token_bytes: one ``bytes`` per token id (``b""`` for ids without text).
        words: ``ceil(V / 32)``, the packed mask's width in int32 words.
    """

    def __init__(self, token_bytes: Sequence[bytes], words: int):
        self.token_bytes = list(token_bytes)
        lead = np.zeros(words * 32, dtype=np.int32)
        for token_id, data in enumerate(self.token_bytes):
            count = 0
            for byte in data:
                if byte not in _DIGITS:
                    break
                count += 1
            lead[token_id] = count
        self.lead = lead
        self.max_lead = int(lead.max()) if len(lead) else 0
        self.words = words
        self._masks: dict[int, np.ndarray] = {}

    def fitting(self, room: int) -> np.ndarray:
        """``[words]`` int32: bit ``t`` set when token ``t`` has at most ``room`` leading digits."""
        mask = self._masks.get(room)
        if mask is None:
            bits = (self.lead <= room).astype(np.uint32).reshape(self.words, 32)
            mask = (bits << np.arange(32, dtype=np.uint32)).sum(axis=1, dtype=np.uint64).astype(np.uint32).view(np.int32)
            self._masks[room] = mask
        return mask

    def limit(self, state: JsonLexState, row: np.ndarray) -> None:
        """AND ``row`` (one packed mask, changed in place) with the tokens that fit the room
        ``state`` leaves; unchanged inside a string, when every token fits, or when the
        limited mask would allow nothing (the grammar demands more digits)."""
        if state.in_string:
            return
        room = MAX_NUMBER_DIGITS - state.digits
        if room >= self.max_lead:
            return
        limited = row & self.fitting(max(room, 0))
        if limited.any():
            row[:] = limited

    def fits(self, state: JsonLexState, token_id: int) -> bool:
        """True when ``token_id`` may follow ``state`` under the bound."""
        return state.in_string or self.lead[token_id] <= MAX_NUMBER_DIGITS - state.digits
