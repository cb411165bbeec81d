"""Tokenizer, chat templates and the streaming detokenizer.

References: the recorded stories260K outputs, ``tokenizers``' own ``decode`` of the
whole id list, and transformers' ``AutoTokenizer`` (encode and ``apply_chat_template``)
on the same files.
"""

from __future__ import annotations

import json
import random
from datetime import datetime
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, processors, trainers

from mlx_ferrum.errors import ChatTemplateError, TokenizerError
from mlx_ferrum.tokenizer import StreamingDetokenizer, Tokenizer

MULTIBYTE = "héllo → 日本語 🎉 難しい naïve"


def _transformers_tokenizer(path: Path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _stream(tok: Tokenizer, ids) -> list[str]:
    det = tok.detokenizer()
    pieces = [det.add_token(i) for i in ids]
    pieces.append(det.finalize())
    assert det.text == "".join(pieces)
    return pieces


# ---------------------------------------------------------------------------
# tiny tokenizers built in the test
# ---------------------------------------------------------------------------

CORPUS = [
    "hello world, the cat sat on the mat.",
    "日本語 は 難しい 日本 日本語",
    "héllo café naïve",
    "emoji 🎉 party 🎉🎉",
] * 20
CHATML_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def _byte_level_bpe(specials) -> HFTokenizer:
    """GPT-2 / Qwen style: byte-level pre-tokenizer and decoder, trained on CORPUS."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=list(specials),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def _sentencepiece_like(metaspace: bool = False) -> HFTokenizer:
    """Llama-2 style BPE over characters with ``<0xXX>`` byte fallback and a BOS post-processor."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    for ch in "▁abcdefghijklmnopqrstuvwxyz.,!é":
        vocab.setdefault(ch, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "c"), ("a", "t"), ("▁c", "at"), ("l", "l"), ("e", "ll")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if metaspace:  # transformers' Llama conversion with legacy=False
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    else:  # legacy conversion, as in stories260K
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    return tok


def _write_folder(folder: Path, backend: HFTokenizer, config: dict, generation_config: dict | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", **config}))
    if generation_config is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


@pytest.fixture(scope="module")
def byte_bpe_backend():
    return _byte_level_bpe(CHATML_SPECIALS + LLAMA3_SPECIALS)


@pytest.fixture
def chatml_folder(tmp_path, byte_bpe_backend):
    return _write_folder(
        tmp_path / "chatml",
        byte_bpe_backend,
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None, "chat_template": CHATML_TEMPLATE},
        {"eos_token_id": [byte_bpe_backend.token_to_id("<|im_end|>"), byte_bpe_backend.token_to_id("<|endoftext|>")]},
    )


# ---------------------------------------------------------------------------
# templates written for these tests (in the style of Qwen2 / Llama 3)
# ---------------------------------------------------------------------------

CHATML_TEMPLATE = (
    "{%- for message in messages %}\n"
    "  {%- if loop.first and message['role'] != 'system' %}\n"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "  {%- endif %}\n"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}\n"
    "{%- if add_generation_prompt %}\n<|im_start|>assistant\n{% endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}\n"
    "{%- if tools is not none %}{{- 'Tools: ' + tools | tojson(indent=2) + '\\n' }}{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n"
    "{%- endif %}\n"
)

ALTERNATING_TEMPLATE = (
    "{%- for message in messages %}"
    "{%- if message['role'] == 'system' %}{% continue %}{% endif %}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == (1 if messages[0]['role'] == 'system' else 0)) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif %}"
    "{%- if message['content'] == 'STOP' %}{% break %}{% endif %}"
    "[{{ message['role'] }}] {{ message['content'] }}\n"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}[assistant]{% endif %}"
)

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "日本語で話せますか? 🎉"},
        {"role": "assistant", "content": "  はい.  "},
        {"role": "user", "content": "naïve café"},
    ],
]


# ---------------------------------------------------------------------------
# stories260K (real checkpoint)
# ---------------------------------------------------------------------------


def test_stories_encode_matches_recording(stories_path, stories_expected):
    tok = Tokenizer.from_pretrained(stories_path)
    once = stories_expected["once"]
    assert tok.encode(once["prompt"]) == once["prompt_ids"]
    # the tokenizer.json post-processor adds BOS and add_bos_token is true: still only one
    assert tok.encode(once["prompt"]).count(tok.bos_token_id) == 1
    assert tok.encode(once["prompt"], add_special_tokens=False) == once["prompt_ids"][1:]


def test_stories_special_tokens_from_files(stories_path):
    tok = Tokenizer.from_pretrained(stories_path)
    cfg = json.loads((stories_path / "tokenizer_config.json").read_text())
    gen = json.loads((stories_path / "generation_config.json").read_text())
    vocab = json.loads((stories_path / "tokenizer.json").read_text())["model"]["vocab"]
    assert tok.bos_token_id == vocab[cfg["bos_token"]]
    gen_eos = gen["eos_token_id"] if isinstance(gen["eos_token_id"], list) else [gen["eos_token_id"]]
    assert tok.eos_token_ids == set(gen_eos) | {vocab[cfg["eos_token"]]}
    assert tok.add_bos_token == cfg["add_bos_token"]
    assert tok.pad_token_id is None
    assert tok.vocab_size == len(vocab)


def test_stories_encode_matches_transformers(stories_path):
    ref = _transformers_tokenizer(stories_path)
    tok = Tokenizer.from_pretrained(stories_path)
    for text in ["Once upon a time", "  two spaces", "", MULTIBYTE, "Lily said, \"Hi!\"\nBye."]:
        assert tok.encode(text) == ref.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == ref.encode(text, add_special_tokens=False), text


def test_stories_decode_recorded_ids(stories_path, stories_expected):
    tok = Tokenizer.from_pretrained(stories_path)
    for rec in stories_expected.values():
        ids = rec["prompt_ids"] + rec["generated_ids"]
        assert tok.decode(ids) == rec["full_text"]


def test_stories_streaming_equals_decode(stories_path, stories_expected):
    tok = Tokenizer.from_pretrained(stories_path)
    for rec in stories_expected.values():
        ids = rec["prompt_ids"] + rec["generated_ids"]
        assert "".join(_stream(tok, ids)) == rec["full_text"]
        # the completion alone, as an engine streams it after the prompt
        gen = rec["generated_ids"]
        assert "".join(_stream(tok, gen)) == tok.decode(gen)


def test_stories_streaming_multibyte(stories_path):
    tok = Tokenizer.from_pretrained(stories_path)
    ids = tok.encode(MULTIBYTE)
    assert tok.decode(ids) == MULTIBYTE
    pieces = _stream(tok, ids)
    assert "".join(pieces) == MULTIBYTE
    assert not any("\ufffd" in p for p in pieces)
    # byte-fallback tokens were held back, not emitted one byte at a time
    assert pieces.count("") >= 3


def test_stories_streaming_bos_mid_stream(stories_path):
    # the model ends a story with BOS: the space after it must survive
    tok = Tokenizer.from_pretrained(stories_path)
    ids = tok.encode("The end.") + tok.encode("Once upon a time") + tok.encode(" two", add_special_tokens=False)
    assert "".join(_stream(tok, ids)) == tok.decode(ids)
    det = StreamingDetokenizer(tok, skip_special_tokens=False)
    text = "".join(det.add_token(i) for i in ids) + det.finalize()
    assert text == tok.decode(ids, skip_special_tokens=False)


def test_stories_has_no_chat_template(stories_path):
    tok = Tokenizer.from_pretrained(stories_path)
    assert tok.chat_template is None
    with pytest.raises(ChatTemplateError, match="chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])
    # a caller-supplied template works
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}], chat_template="{{ bos_token }}{{ messages[0].content }}", tokenize=True)
    assert out == tok.encode("hi")


# ---------------------------------------------------------------------------
# streaming on built tokenizers
# ---------------------------------------------------------------------------


def test_byte_level_streaming_never_splits_characters(tmp_path, byte_bpe_backend):
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path / "bl", byte_bpe_backend, {}))
    ids = tok.encode(MULTIBYTE)
    # the test is only meaningful if some token holds part of a character
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces = _stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids) == MULTIBYTE
    assert not any("\ufffd" in p for p in pieces)


def test_byte_level_streaming_random_ids(tmp_path, byte_bpe_backend):
    # arbitrary ids, invalid UTF-8 included: the stream still equals the full decode
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path / "bl", byte_bpe_backend, {}))
    rng = random.Random(0)
    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        assert "".join(_stream(tok, ids)) == tok.decode(ids)


@pytest.mark.parametrize("metaspace", [False, True])
def test_sentencepiece_byte_fallback_streaming(tmp_path, metaspace):
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path / "sp", _sentencepiece_like(metaspace), {"bos_token": "<s>", "eos_token": "</s>"}))
    for text in [MULTIBYTE, "  the cat", "the cat sat, hello!", "é日", "🎉 the"]:
        ids = tok.encode(text)
        assert ids.count(tok.bos_token_id) == 1
        if not text.startswith(" "):  # Metaspace "first" does not round-trip a leading space
            assert tok.decode(ids) == text
        pieces = _stream(tok, ids)
        assert "".join(pieces) == tok.decode(ids)
        assert not any("\ufffd" in p for p in pieces)
        # special tokens in the middle of the stream
        doubled = ids + ids[1:] + [tok.bos_token_id] + ids[1:]
        assert "".join(_stream(tok, doubled)) == tok.decode(doubled)


def test_streaming_finalize_flushes_incomplete_character(tmp_path):
    tok = Tokenizer.from_pretrained(_write_folder(tmp_path / "sp", _sentencepiece_like(), {"bos_token": "<s>"}))
    ids = tok.encode("a日", add_special_tokens=False)[:-1]  # drop the last byte of 日
    det = tok.detokenizer()
    held = "".join(det.add_token(i) for i in ids)
    assert "\ufffd" not in held
    assert held + det.finalize() == tok.decode(ids)
    assert det.finalize() == ""


# ---------------------------------------------------------------------------
# chat templates, cross-checked with transformers
# ---------------------------------------------------------------------------


def _check_against_transformers(folder: Path, conversations, **kwargs):
    ours = Tokenizer.from_pretrained(folder)
    ref = _transformers_tokenizer(folder)
    for messages in conversations:
        for agp in (True, False):
            text = ours.apply_chat_template(messages, add_generation_prompt=agp, **kwargs)
            ref_text = ref.apply_chat_template(messages, add_generation_prompt=agp, tokenize=False, **kwargs)
            assert text == ref_text
            ids = ours.apply_chat_template(messages, add_generation_prompt=agp, tokenize=True, **kwargs)
            ref_ids = ref.apply_chat_template(messages, add_generation_prompt=agp, tokenize=True, return_dict=False, **kwargs)
            assert ids == list(ref_ids)
    return ours


def test_chatml_template_matches_transformers(chatml_folder, byte_bpe_backend):
    tok = _check_against_transformers(chatml_folder, CONVERSATIONS)
    assert tok.eos_token_ids == {byte_bpe_backend.token_to_id("<|im_end|>"), byte_bpe_backend.token_to_id("<|endoftext|>")}
    assert tok.bos_token_id is None and not tok.add_bos_token
    assert tok.pad_token_id == byte_bpe_backend.token_to_id("<|endoftext|>")
    text = tok.apply_chat_template(CONVERSATIONS[0])
    assert text.endswith("<|im_start|>assistant\n")
    assert not tok.apply_chat_template(CONVERSATIONS[0], add_generation_prompt=False).endswith("assistant\n")
    ids = tok.apply_chat_template(CONVERSATIONS[0], tokenize=True)
    assert ids.count(byte_bpe_backend.token_to_id("<|im_start|>")) == 3


def test_llama3_template_bos_not_doubled(tmp_path):
    # a SentencePiece-like tokenizer whose post-processor adds BOS; the template writes it too
    folder = _write_folder(
        tmp_path / "l3",
        _sentencepiece_like(),
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": LLAMA3_TEMPLATE},
    )
    tok = _check_against_transformers(folder, [[{"role": "user", "content": "the cat"}]])
    ids = tok.apply_chat_template([{"role": "user", "content": "the cat"}], tokenize=True)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1


def test_llama3_template_with_tools_and_tojson(tmp_path, byte_bpe_backend):
    folder = _write_folder(
        tmp_path / "l3b",
        byte_bpe_backend,
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>", "chat_template": LLAMA3_TEMPLATE},
    )
    tools = [{"type": "function", "function": {"name": "météo", "description": "天気", "parameters": {"type": "object"}}}]
    _check_against_transformers(folder, CONVERSATIONS, tools=tools)
    text = Tokenizer.from_pretrained(folder).apply_chat_template(CONVERSATIONS[0], tools=tools)
    assert json.dumps(tools, ensure_ascii=False, indent=2) in text  # non-ASCII kept, indent honoured
    assert text.startswith("<|begin_of_text|>")


def test_named_template_list(tmp_path, byte_bpe_backend):
    templates = [{"name": "default", "template": CHATML_TEMPLATE}, {"name": "plain", "template": ALTERNATING_TEMPLATE}]
    folder = _write_folder(tmp_path / "named", byte_bpe_backend, {"eos_token": "<|im_end|>", "chat_template": templates})
    tok = _check_against_transformers(folder, CONVERSATIONS)
    assert tok.chat_template == CHATML_TEMPLATE
    assert set(tok.chat_templates) == {"default", "plain"}
    _check_against_transformers(folder, CONVERSATIONS, chat_template="plain")


def test_chat_template_jinja_file(tmp_path, byte_bpe_backend):
    folder = _write_folder(tmp_path / "jinja", byte_bpe_backend, {"eos_token": "<|im_end|>"})
    (folder / "chat_template.jinja").write_text(ALTERNATING_TEMPLATE)
    tok = _check_against_transformers(folder, CONVERSATIONS)
    assert tok.chat_template == ALTERNATING_TEMPLATE


def test_loop_controls_and_raise_exception(chatml_folder):
    tok = Tokenizer.from_pretrained(chatml_folder)
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "STOP"},
        {"role": "user", "content": "never shown"},
    ]
    text = tok.apply_chat_template(messages, chat_template=ALTERNATING_TEMPLATE)
    ref = _transformers_tokenizer(chatml_folder).apply_chat_template(messages, chat_template=ALTERNATING_TEMPLATE, tokenize=False, add_generation_prompt=True)
    assert text == ref
    assert "sys" not in text and "never shown" not in text  # continue, then break
    with pytest.raises(ChatTemplateError, match="must alternate"):
        tok.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}], chat_template=ALTERNATING_TEMPLATE)


def test_template_helpers_and_kwargs(chatml_folder):
    tok = Tokenizer.from_pretrained(chatml_folder)
    msgs = [{"role": "user", "content": "x"}]
    year = tok.apply_chat_template(msgs, chat_template="{{ strftime_now('%Y') }}")
    assert year == datetime.now().strftime("%Y")
    out = tok.apply_chat_template(msgs, chat_template="{{ eos_token }}|{{ add_generation_prompt }}|{{ custom }}|{{ documents is none }}", custom="v")
    assert out == "<|im_end|>|True|v|True"
    gen = tok.apply_chat_template(msgs, chat_template="{% generation %}{{ messages[0].content }}{% endgeneration %}")
    assert gen == "x"


def test_template_errors(chatml_folder):
    tok = Tokenizer.from_pretrained(chatml_folder)
    with pytest.raises(ChatTemplateError, match="syntax error"):
        tok.apply_chat_template([], chat_template="{% for %}")
    with pytest.raises(ChatTemplateError, match="failed to render"):
        tok.apply_chat_template([], chat_template="{{ messages[0]['content'] + 1 }}")
    with pytest.raises(ChatTemplateError, match="list of dicts"):
        tok.apply_chat_template("hello")


# ---------------------------------------------------------------------------
# loading errors
# ---------------------------------------------------------------------------


def test_missing_and_malformed_files(tmp_path, byte_bpe_backend):
    with pytest.raises(TokenizerError, match="does not exist"):
        Tokenizer.from_pretrained(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(TokenizerError, match=str(empty / "tokenizer.json")):
        Tokenizer.from_pretrained(empty)
    (empty / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_pretrained(empty)
    folder = _write_folder(tmp_path / "badcfg", byte_bpe_backend, {})
    (folder / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json"):
        Tokenizer.from_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": 3}))
    with pytest.raises(TokenizerError, match="chat_template"):
        Tokenizer.from_pretrained(folder)


def test_template_bos_token_comes_from_the_tokenizer_config_only(tmp_path, byte_bpe_backend):
    """Qwen2-style files: ``bos_token: null`` in tokenizer_config.json but a ``bos_token_id``
    in generation_config.json. transformers renders ``{{ bos_token }}`` as empty there."""
    folder = _write_folder(
        tmp_path / "null_bos",
        byte_bpe_backend,
        {"eos_token": "<|im_end|>", "bos_token": None,
         "chat_template": "{{ bos_token or '' }}{% for m in messages %}{{ m['content'] }}{% endfor %}"},
        {"bos_token_id": byte_bpe_backend.token_to_id("<|endoftext|>")},
    )
    _check_against_transformers(folder, CONVERSATIONS)


@pytest.mark.parametrize("model", ["stories260K", "SmolLM2-135M-Instruct"])
def test_a_detokenizer_after_a_prompt_continues_it_as_decode_does(stories_path, model):
    """Seeded with the prompt, the stream's text is decode(prompt + ids) past decode(prompt)
    (OpenAI's and vLLM's completion text): SentencePiece's leading space on the first
    generated token is kept; byte-level BPE reads the same either way."""
    path = stories_path.parent / model
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"{model} not found")
    tok = Tokenizer.from_pretrained(path)
    hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
    rng = random.Random(0)
    prompt = tok.encode("Once upon")
    for text in (" a time, there was a", " a café 🙂 and", "\nLily"):
        for ids in (tok.encode(text, add_special_tokens=False),
                    [rng.randrange(3, min(tok.vocab_size, 500)) for _ in range(12)]):
            detok = tok.detokenizer(prompt_ids=prompt)
            streamed = "".join(detok.add_token(t) for t in ids) + detok.finalize()
            head = hf.decode(prompt)
            assert streamed == hf.decode(prompt + ids)[len(head):] == detok.text, (model, ids)
            detok.reset()
            assert detok.text == ""  # after the same prompt again
            assert "".join(detok.add_token(t) for t in ids) + detok.finalize() == streamed
