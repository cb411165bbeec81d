"""The load check of the tokenizer's vocabulary against the model's ``vocab_size``.

A tokenizer smaller than the model's vocabulary by more than padding is refused at
``mf.load`` (naming both sizes); a checkpoint whose embedding is padded past its
tokenizer (Qwen) loads, and the engine never samples a padding id.
"""

from __future__ import annotations


import mlx.core as mx
import pytest

import mlx_ferrum as mf
from support.checkpoints import _SPECS, _dump, _tokenizer_files, build_tokenizer, cached_checkpoint, make_checkpoint, vocab_size_of
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.errors import ModelLoadError, VocabularyMismatchError
from mlx_ferrum.models.loader import check_tokenizer_vocabulary


def _with_tokenizer_of(folder, family):
    """Replace the tokenizer files in ``folder`` with those of ``family``'s tiny tokenizer."""
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model"):
        (folder / name).unlink(missing_ok=True)
    tok = build_tokenizer(_SPECS[family].tokenizer)
    tok.save(str(folder / "tokenizer.json"))
    for name, obj in _tokenizer_files(family, tok).items():
        _dump(folder / name, obj)
    return tok.get_vocab_size(with_added_tokens=True)


def test_load_refuses_a_tokenizer_smaller_than_the_model_vocabulary(tmp_path):
    folder = make_checkpoint(tmp_path / "mismatched", "llama2")
    model_vocab = vocab_size_of("llama2")
    tok_vocab = _with_tokenizer_of(folder, "llama3")
    assert tok_vocab < model_vocab and model_vocab % 64  # not padding
    with pytest.raises(VocabularyMismatchError, match=rf"below {tok_vocab}.*vocab_size is {model_vocab}") as info:
        mf.load(str(folder))
    assert isinstance(info.value, ModelLoadError)


def test_cli_load_refuses_the_pair_with_one_line(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    folder = make_checkpoint(tmp_path / "mismatched", "llama2")
    tok_vocab = _with_tokenizer_of(folder, "llama3")
    repo = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, "-m", "mlx_ferrum", "generate", "--model", str(folder), "--prompt", "hi",
                        "--max-tokens", "2"], capture_output=True, text=True, timeout=120, cwd=str(repo))
    assert r.returncode != 0
    assert "VocabularyMismatchError" in r.stderr or "vocab_size" in r.stderr
    assert str(tok_vocab) in r.stderr and "Traceback" not in r.stderr


def test_padded_checkpoint_loads_and_never_emits_padding_ids():
    folder = cached_checkpoint("qwen2")
    model, tok = mf.load(str(folder))
    limit = tok.vocab_size
    assert limit < model.args.vocab_size  # Qwen pads the embedding past the tokenizer
    assert check_tokenizer_vocabulary(model.args.vocab_size, tok) == limit

    class PaddingFavoured:
        """The model, with its padding ids' logits raised far above every real id."""

        def __init__(self, inner):
            self._inner = inner

        def __getattr__(self, name):
            return getattr(self._inner, name)

        def __call__(self, input_ids, meta=None):
            logits = self._inner(input_ids, meta)
            boost = (mx.arange(logits.shape[-1]) >= limit).astype(logits.dtype) * 1e4
            return logits + boost

    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1),
              SamplingParams(max_tokens=12, temperature=1.5, seed=4, ignore_eos=True, logprobs=1)]
    for pipelined in (True, False):
        cfg = RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64, async_scheduling=pipelined)
        plain = Engine(model, tok, cfg).generate(["hello world", "the cat"], params)
        boosted = Engine(PaddingFavoured(model), tok, cfg).generate(["hello world", "the cat"], params)
        for a, b in zip(plain, boosted):
            assert all(t < limit for t in b.token_ids), b.token_ids
            assert b.token_ids == a.token_ids
            assert b.text == tok.decode(b.token_ids)
            assert all(lp > -1e30 for lp in b.logprobs)


def test_equal_or_larger_tokenizers_pass(stories_path):
    model, tok = mf.load(str(stories_path))
    assert check_tokenizer_vocabulary(model.args.vocab_size, tok) is None
    assert check_tokenizer_vocabulary(model.args.vocab_size - 1, tok) is None
    assert check_tokenizer_vocabulary(model.args.vocab_size, None) is None
