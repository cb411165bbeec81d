"""The pre-tokenizers tokenizer.ggml.pre names split text as their models' regular
expressions say (Llama 3: digits in runs of up to three; Qwen2 and SmolLM: one digit at
a time; GPT-2: letters, digits and punctuation runs), and SentencePiece merges come out
ranked by the merged piece's score."""

from __future__ import annotations

import pytest

from mlx_ferrum.models.gguf.tokenizer import PRE_TOKENIZERS, _sentencepiece_merges


def _pieces(pre: str, text: str) -> list[str]:
    return [piece for piece, _ in PRE_TOKENIZERS[pre]().pre_tokenize_str(text)]


@pytest.mark.parametrize("pre, expected", [
    ("llama-bpe", ["Year", "Ġ", "123", "45", "!"]),
    ("qwen2", ["Year", "Ġ", "1", "2", "3", "4", "5", "!"]),
    ("smollm", ["Year", "Ġ", "1", "2", "3", "4", "5", "!"]),
    ("gpt-2", ["Year", "Ġ12345", "!"]),
])
def test_pre_tokenizers_split_digits_as_their_models_do(pre, expected):
    assert _pieces(pre, "Year 12345!") == expected


def test_llama3_pre_tokenizer_keeps_contractions_and_newlines_apart():
    assert _pieces("llama-bpe", "I'll go\n\nnow") == ["I", "'ll", "Ġgo", "ĊĊ", "now"]


def test_sentencepiece_merges_follow_scores():
    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    scores = [0.0, 0.0, 0.0, -2.0, -1.0, -3.0]
    merges = _sentencepiece_merges(tokens, scores)
    assert merges[:2] == [("b", "c"), ("a", "b")]  # "bc" scores higher than "ab"
    assert set(merges[2:]) == {("a", "bc"), ("ab", "c")}


def test_end_of_turn_ids_end_replies():
    from mlx_ferrum.models.gguf.tokenizer import end_token_ids

    metadata = {"tokenizer.ggml.tokens": ["a"] * 10, "tokenizer.ggml.eos_token_id": 2,
                "tokenizer.ggml.eot_token_id": 7, "tokenizer.ggml.eom_token_id": 4294967295}
    assert end_token_ids(metadata) == [2, 7]
