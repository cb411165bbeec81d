"""Real GGUF files from ../shared/models: SmolLM2-135M-Instruct Q4_1 (the same bits as the
MLX folder beside it) and stories260K (F32, SentencePiece), and the entry points that
find a GGUF model (file path, folder with one .gguf, folder with several, hub repo +
file name, the CLI's --model / --gguf-file)."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

pytest.importorskip("gguf")

import mlx_ferrum as mf  # noqa: E402
from conftest import SHARED_MODELS  # noqa: E402
from mlx_ferrum.errors import AmbiguousCheckpointError  # noqa: E402
from mlx_ferrum.engine.sequence import encode_prompt  # noqa: E402
from mlx_ferrum.models import load_model  # noqa: E402
from mlx_ferrum.tokenizer import Tokenizer  # noqa: E402

SMOL = SHARED_MODELS / "SmolLM2-135M-Instruct"
SMOL_GGUF = SMOL / "source" / "SmolLM2-135M-Instruct.Q4_1.gguf"
STORIES_GGUF = SHARED_MODELS / "stories260K" / "source" / "stories260K.gguf"

needs_smol = pytest.mark.skipif(not SMOL_GGUF.is_file(), reason=f"{SMOL_GGUF} not found (set FERRUM_SHARED_MODELS)")
needs_stories = pytest.mark.skipif(not STORIES_GGUF.is_file(), reason=f"{STORIES_GGUF} not found")

TEXTS = [
    "Hello world! 12345 it's   fine\n\n  café 🤗 naïve — “quotes”",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n",
    "def f(x):\n\treturn x**2  # comment",
]


@pytest.fixture(scope="module")
def smol_pair():
    gguf_model, _, _ = load_model(SMOL_GGUF)
    folder_model, _, _ = load_model(SMOL)
    return gguf_model, folder_model


@needs_smol
def test_smollm2_gguf_is_the_mlx_folder_bit_for_bit(smol_pair):
    ours, folder = smol_pair
    a, b = dict(tree_flatten(ours.parameters())), dict(tree_flatten(folder.parameters()))
    assert set(a) == set(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and mx.array_equal(a[name], b[name]).item(), name
    ids = mx.array([[1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511]])
    assert mx.array_equal(ours(ids), folder(ids)).item()


@needs_smol
def test_smollm2_gguf_tokenizer_matches_the_folder_and_transformers():
    ours, folder = Tokenizer.from_pretrained(SMOL_GGUF), Tokenizer.from_pretrained(SMOL)
    for text in TEXTS:
        assert ours.encode(text) == folder.encode(text)
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == folder.decode(ids, skip_special_tokens=False)
    assert ours.chat_template == folder.chat_template
    assert (ours.bos_token_id, ours.eos_token_ids, ours.pad_token_id, ours.add_bos_token) == (
        folder.bos_token_id, folder.eos_token_ids, folder.pad_token_id, folder.add_bos_token)
    pytest.importorskip("torch", reason="transformers reads GGUF files only with torch installed (the ref extra)")
    transformers = pytest.importorskip("transformers")
    reference = transformers.AutoTokenizer.from_pretrained(str(SMOL_GGUF.parent), gguf_file=SMOL_GGUF.name)
    for text in TEXTS:
        assert ours.encode(text) == reference.encode(text)


@needs_smol
@pytest.mark.slow
def test_smollm2_gguf_reproduces_greedy_chat_recording():
    recording = json.loads((SMOL / "greedy_chat.json").read_text())
    model, tokenizer = mf.load(str(SMOL_GGUF), dtype="float32")  # the recording was made in float32
    for case in recording["cases"]:
        assert encode_prompt(tokenizer, case["messages"]) == case["prompt_ids"]
        text = mf.generate(model, tokenizer, case["messages"], max_tokens=recording["n_new"], temperature=0.0)
        assert text == case["text_transformers"]


@needs_stories
@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_stories260k_gguf_reproduces_recordings(stories_path, stories_expected, layout):
    model, tokenizer = mf.load(str(STORIES_GGUF), dtype="float32")
    once = stories_expected["once"]
    assert tokenizer.encode(once["prompt"]) == once["prompt_ids"]
    config = mf.RuntimeConfig(kv_layout=layout, block_size=16)
    out = mf.generate(model, tokenizer, once["prompt_ids"], max_tokens=once["max_new_tokens"], temperature=0.0,
                      ignore_eos=True, config=config)
    assert out == once["completion_text"]


@needs_stories
def test_stories260k_gguf_tokenizer_matches_the_folder(stories_path):
    ours, folder = Tokenizer.from_pretrained(STORIES_GGUF), Tokenizer.from_pretrained(stories_path)
    for text in TEXTS + ["Once upon a time, there was a little girl named Lily.", "  leading spaces\tand Ünïcode"]:
        assert ours.encode(text) == folder.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids) == folder.decode(ids)
    assert (ours.bos_token_id, ours.eos_token_ids, ours.add_bos_token) == (
        folder.bos_token_id, folder.eos_token_ids, folder.add_bos_token)


@needs_stories
def test_stories260k_gguf_logits_equal_the_folder(stories_path):
    ours, _, _ = load_model(STORIES_GGUF)
    folder, _, _ = load_model(stories_path)
    ids = mx.array([[1, 403, 407, 261, 378, 432, 383]])
    np.testing.assert_allclose(np.array(ours(ids)), np.array(folder(ids)), atol=1e-5, rtol=0)


@needs_stories
def test_entry_points_folder_ambiguity_and_hub(tmp_path, monkeypatch):
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(STORIES_GGUF, one / "stories.gguf")
    model, tokenizer = mf.load(str(one))
    assert model.path == one / "stories.gguf" and tokenizer.vocab_size == 512
    shutil.copy(STORIES_GGUF, one / "other.gguf")
    with pytest.raises(AmbiguousCheckpointError, match="other.gguf.*stories.gguf|--gguf-file"):
        mf.load(str(one))
    model, _ = mf.load(str(one), gguf_file="other.gguf")
    assert model.path == one / "other.gguf"

    calls = []

    def fake_download(repo_id, filename, revision=None, **_):
        calls.append((repo_id, filename))
        return str(one / filename)

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    model, _ = mf.load("someone/stories-GGUF", gguf_file="stories.gguf")
    assert calls == [("someone/stories-GGUF", "stories.gguf")] and model.path == one / "stories.gguf"


@needs_stories
def test_split_gguf_loads_as_one_model(tmp_path):
    from gguf import GGUFWriter

    from mlx_ferrum.models.gguf.reader import read_gguf

    source = read_gguf(STORIES_GGUF)
    names = list(source.tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    for index, part in enumerate(halves, start=1):
        writer = GGUFWriter(str(tmp_path / f"s-{index:05d}-of-00002.gguf"), "llama")
        if index == 1:
            for key, value in source.metadata.items():
                if key in ("general.architecture", "general.alignment"):
                    continue
                _add_value(writer, key, value)
        for name in part:
            writer.add_tensor(name, np.asarray(source.tensors[name].data))
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    split, _, _ = load_model(tmp_path / "s-00001-of-00002.gguf")
    whole, _, _ = load_model(STORIES_GGUF)
    ids = mx.array([[1, 403, 407]])
    assert mx.array_equal(split(ids), whole(ids)).item()


def _add_value(writer, key, value):
    from gguf import GGUFValueType

    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value) if value >= 0 else writer.add_int32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list):
        sub = GGUFValueType.get_type(value[0]) if value else GGUFValueType.INT32
        writer.add_array(key, value) if sub != GGUFValueType.FLOAT32 else writer.add_array(key, [float(v) for v in value])


@needs_stories
@pytest.mark.parametrize("command", ["generate", "chat", "bench", "serve"])
def test_every_cli_command_takes_a_gguf_model(command, tmp_path):
    from mlx_ferrum.cli import build_parser

    args = build_parser().parse_args([command, "--model", str(tmp_path), "--gguf-file", "x.gguf"] + (
        ["--prompt", "hi"] if command == "generate" else []))
    assert args.model == str(tmp_path) and args.gguf_file == "x.gguf"


@needs_stories
def test_cli_generate_with_a_gguf_file(capsys):
    from mlx_ferrum.cli import main

    code = main(["generate", "--model", str(STORIES_GGUF), "--prompt", "Once upon a time", "--max-tokens", "8",
                 "--temp", "0", "--dtype", "float32"])
    out = capsys.readouterr()
    assert code == 0, out.err
    assert "there was a little girl" in out.out
