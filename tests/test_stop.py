"""Stop strings over streamed text, checked against a search over the whole text."""

from __future__ import annotations

import random

import pytest

from mlx_ferrum.engine.sequence import StopStringMatcher, find_stop, partial_stop_length
from mlx_ferrum.errors import SamplingParamsError
from mlx_ferrum.tokenizer import Tokenizer


def expected_output(full_text: str, stops) -> tuple[str, str | None]:
    """Whole-text reference: cut at the earliest occurrence of any stop string."""
    hits = [(full_text.find(s), s) for s in stops if s in full_text]
    if not hits:
        return full_text, None
    start = min(i for i, _ in hits)
    return full_text[:start], next(s for i, s in hits if i == start)


def run_matcher(pieces, stops):
    """Feed pieces; check invariants after every step; return (emitted text, matched stop)."""
    m = StopStringMatcher(stops)
    seen, emitted = "", ""
    final, _ = expected_output("".join(pieces), stops)
    for piece in pieces:
        seen += piece
        check = m.feed(piece)
        emitted += check.text
        assert final.startswith(emitted)  # nothing emitted is ever retracted
        if check.stopped:
            return emitted, check.stop
        # what is held back is the start of some stop string, and nothing more
        assert seen == emitted + m.held
        assert not m.held or any(s.startswith(m.held) and len(m.held) < len(s) for s in stops)
    return emitted + m.flush(), None


def test_helpers():
    assert find_stop("abcabc", ["ca", "bc"]) == (1, "bc")
    assert find_stop("abc", ["x"]) is None
    assert partial_stop_length("hello wor", ["world", "or"]) == 3
    assert partial_stop_length("hello", ["world"]) == 0
    assert partial_stop_length("aa", ["aab"]) == 2


def test_stop_spanning_pieces():
    pieces = ["The", " end", "of", " st", "ory.", " More"]
    assert run_matcher(pieces, ["ofst", "story"]) == ("The endof ", "story")
    m = StopStringMatcher("<|im_end|>")
    assert m.feed("Hi <|im").text == "Hi "
    assert m.held == "<|im"
    check = m.feed("_end|> tail")
    assert check.stopped and check.text == "" and check.stop == "<|im_end|>"
    assert m.feed("more").stopped and m.feed("more").text == ""
    assert m.flush() == ""


def test_false_start_is_released():
    m = StopStringMatcher(["STOP"])
    assert m.feed("ST").text == ""
    assert m.feed("ART").text == "START"
    assert m.feed("S").text == ""
    assert m.flush() == "S"


def test_no_stops_and_stop_at_start():
    assert run_matcher(["a", "b"], []) == ("ab", None)
    assert run_matcher(["xy", "z"], ["x"]) == ("", "x")


def test_earliest_stop_wins():
    assert run_matcher(["a", "bcd", "e"], ["de", "bc"]) == ("a", "bc")
    assert run_matcher(["aaab"], ["aab", "ab"]) == ("a", "aab")


def test_invalid_stop_strings():
    with pytest.raises(SamplingParamsError):
        StopStringMatcher([""])


def test_random_against_whole_text_search():
    rng = random.Random(0)
    for _ in range(400):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), min(len(text) + 1, rng.randrange(1, 8))))
        pieces = [text[i:j] for i, j in zip([0] + cuts, cuts + [len(text)])]
        out, matched = run_matcher(pieces, stops)
        ref_out, ref_matched = expected_output(text, stops)
        assert out == ref_out
        # on a tie at one start the stop that completed first in the stream is reported
        assert (matched is None) == (ref_matched is None)
        assert matched is None or text[len(out):].startswith(matched)


def test_stories_stops_across_token_boundaries(stories_path, stories_expected):
    tok = Tokenizer.from_pretrained(stories_path)
    ids = stories_expected["once"]["generated_ids"]
    det = tok.detokenizer()
    pieces = [det.add_token(i) for i in ids] + [det.finalize()]
    text = "".join(pieces)
    assert text == stories_expected["once"]["completion_text"]
    # stop strings cut out of the text around token boundaries, so each spans 2+ tokens
    bounds, pos = [], 0
    for p in pieces[:-1]:
        pos += len(p)
        bounds.append(pos)
    rng = random.Random(1)
    for b in rng.sample([b for b in bounds if 4 < b < len(text) - 4], 20):
        stop = text[b - rng.randrange(1, 4) : b + rng.randrange(1, 4)]
        out, matched = run_matcher(pieces, [stop])
        assert (out, matched) == expected_output(text, [stop])
        assert matched == stop and len(out) <= b
    # a stop string that never occurs lets everything through
    assert run_matcher(pieces, ["dragon"]) == (text, None)
    # several stop strings at once: the earliest occurrence wins
    stops = ["ball", "park", "Lily"]
    assert run_matcher(pieces, stops) == expected_output(text, stops)


def test_emit_token_orders_stop_ids_stop_strings_and_length(stories_path, stories_expected):
    from mlx_ferrum.engine.sequence import StopStringMatcher, emit_token
    from mlx_ferrum.tokenizer import Tokenizer

    tok = Tokenizer.from_pretrained(stories_path)
    ids = stories_expected["once"]["generated_ids"]
    text = tok.decode(ids[:12])

    def run(stop_ids=(), stops=(), max_tokens=12):
        d, m, out = tok.detokenizer(), StopStringMatcher(list(stops)), ""
        for n, t in enumerate(ids[:12], 1):
            piece, reason = emit_token(d, m, t, set(stop_ids), n >= max_tokens)
            out += piece
            if reason:
                return out, reason, n
        return out, None, 12

    assert run() == (text, "length", 12)
    assert run(stop_ids=[ids[4]]) == (tok.decode(ids[:4]), "stop", 5)  # the stop id's text is not emitted
    out, reason, _ = run(stops=["little"])
    assert reason == "stop" and out == text[: text.index("little")]
    assert run(max_tokens=3)[1:] == ("length", 3)
