"""The serving benchmark's byte-level BPE checkpoint tokenizer must read the same in
transformers (what mlx_lm.server loads) and in mlx-ferrum, or the two servers compute
different prompts (the word-level tokenizer it replaces did not: transformers loaded it
as a Qwen2 BPE tokenizer)."""

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

from common import BPE_SPECIAL_TOKENS, write_bpe_tokenizer  # noqa: E402

from mlx_ferrum.tokenizer import Tokenizer  # noqa: E402

transformers = pytest.importorskip("transformers")

VOCAB = 2048


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("bpe")
    write_bpe_tokenizer(path, VOCAB)
    return path


def _texts(ferrum: Tokenizer) -> list[str]:
    rng = random.Random(1)
    # decoded random merges, as bench_serving builds its prompts, plus text outside the training set
    texts = [ferrum.decode([rng.randrange(259, VOCAB) for _ in range(rng.randint(1, 80))]) for _ in range(20)]
    return texts + ["Hello, world!  Tabs\tand\nnewlines", "ünïcödé 漢字 emoji 🙂", " leading space", ""]


def test_vocab_size_and_special_tokens(folder):
    ferrum = Tokenizer.from_pretrained(folder)
    assert ferrum.backend.get_vocab_size() == VOCAB
    assert [ferrum.backend.token_to_id(t) for t in BPE_SPECIAL_TOKENS] == [0, 1, 2]
    assert ferrum.eos_token_id == 0


def test_transformers_and_ferrum_give_the_same_ids(folder):
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ferrum = Tokenizer.from_pretrained(folder)
    assert len(hf) == VOCAB
    assert hf.eos_token_id == ferrum.eos_token_id
    for text in _texts(ferrum):
        ids = list(hf.encode(text))
        assert ids == ferrum.encode(text), text
        assert hf.decode(ids) == ferrum.decode(ids)


def test_chat_template_renders_alike(folder):
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    ferrum = Tokenizer.from_pretrained(folder)
    texts = _texts(ferrum)
    messages = [{"role": "system", "content": texts[0]}, {"role": "user", "content": texts[1]},
                {"role": "assistant", "content": texts[2]}, {"role": "user", "content": texts[3]}]
    hf_text = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert hf_text == ferrum.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert hf_text.startswith("<|im_start|>system\n")
