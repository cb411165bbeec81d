"""The digit bound of JSON-schema replies: a number cannot run on past what a float64 means.

References: Python's own reading of the bytes (a hand-written scan of quotes, escapes and
digit runs is checked against a regex over the text), numpy's bit packing of masks, and
``json`` / ``jsonschema`` on the engine's replies.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.engine.json_number_bound import MAX_NUMBER_DIGITS, JsonLexState, TokenDigits
from mlx_ferrum.engine.structured import StructuredOutputsParams

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

NUMBER_SCHEMA = {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "integer"}},
                 "required": ["x", "y"], "additionalProperties": False}


def _longest_run_outside_strings(text: str) -> int:
    outside = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    return max((len(m) for m in re.findall(r"[0-9]+", outside)), default=0)


def _reference_state(text: str) -> tuple[bool, int]:
    """(inside a string, digits ending the text outside a string), from regexes: strip
    every complete string, then an unterminated one at the end."""
    closed = re.sub(r'"(?:[^"\\]|\\.)*"', '""', text)
    in_string = re.search(r'"(?:[^"\\]|\\.)*\\?$', closed) is not None and closed.count('"') % 2 == 1
    trailing = "" if in_string else re.search(r"[0-9]*$", closed).group(0)
    return in_string, len(trailing)


@pytest.mark.parametrize("text", ['{"a":12345,"b":"99999999999999999999","c":[1.25e10]}',
                                  '{"k\\"12":0.0080000000000000000200000', '"\\\\"123', '123"456', '"ab\\',
                                  '{"a":"x"}7'])
def test_the_lexical_state_follows_strings_escapes_and_digit_runs(text):
    data = text.encode()
    state = JsonLexState()
    for i in range(len(data)):  # one byte at a time, as tokens of any split would arrive
        state = state.advance(data[i:i + 1])
    assert state == JsonLexState().advance(data)
    assert (state.in_string, state.digits) == _reference_state(text)


def test_fitting_masks_pack_like_llguidance():
    token_bytes = [b"", b"1", b"12", b"x1", b"123", b'"', b"1234"] + [b"a"] * 25
    digits = TokenDigits(token_bytes, words=1)
    for room in range(5):
        packed = digits.fitting(room).view(np.uint32)[0]
        allowed = [t for t in range(32) if (packed >> t) & 1]
        want = [t for t, data in enumerate(token_bytes) if len(re.match(rb"[0-9]*", data).group(0)) <= room]
        assert allowed == want


def test_a_mask_the_bound_would_empty_is_kept():
    digits = TokenDigits([b"1", b"2"] + [b""] * 30, words=1)
    row = np.array([0b11], dtype=np.int32)  # the grammar allows only digits here
    digits.limit(JsonLexState(digits=MAX_NUMBER_DIGITS), row)
    assert row[0] == 0b11


@pytest.mark.parametrize("mode", [dict(kv_layout="paged"), dict(kv_layout="contiguous"),
                                  dict(kv_layout="paged", speculative="ngram", speculative_disable_by_batch_size=1 << 20)],
                         ids=["paged", "contiguous", "speculative-ngram"])
def test_a_reply_pushed_towards_endless_digits_still_closes_and_validates(stories_path, mode):
    """Every digit token gets +100 logit bias: without the bound the number never ends
    (the reply runs to ``max_tokens`` inside it); with it the reply closes, parses and
    validates, and no run of digits outside a string is longer than a float64 means."""
    from mlx_ferrum import load

    model, tok = load(str(stories_path))
    engine = Engine(model, tok, RuntimeConfig(block_size=8, max_num_blocks=256, **mode))
    table = engine.grammar_backend().token_digits()
    bias = {t: 100.0 for t, data in enumerate(table.token_bytes) if data and data.isdigit()}
    assert bias, "the tokenizer has digit tokens"
    params = SamplingParams(temperature=0.0, max_tokens=120, logit_bias=bias,
                            structured_outputs=StructuredOutputsParams(json=NUMBER_SCHEMA))
    out = engine.generate(["Once upon a time"], params)[0]
    assert out.finish_reason == "stop", (out.finish_reason, out.text)
    value = json.loads(out.text)
    jsonschema.validate(value, NUMBER_SCHEMA)
    assert _longest_run_outside_strings(out.text) <= MAX_NUMBER_DIGITS, out.text
