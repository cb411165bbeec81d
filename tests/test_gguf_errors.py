"""Damaged and unsupported GGUF files: each gets a named error from mlx_ferrum.errors,
the CLI prints one ``error:`` line (no traceback), and nothing is half-loaded."""

from __future__ import annotations

import struct

import pytest

pytest.importorskip("gguf")

from support.gguf_fixtures import write_llama_gguf  # noqa: E402
from mlx_ferrum.errors import (  # noqa: E402
    GGUFFormatError,
    TokenizerError,
    UnsupportedArchitectureError,
    UnsupportedTensorTypeError,
    WeightShapeError,
)
from mlx_ferrum.models import load_model  # noqa: E402
from mlx_ferrum.models.gguf.reader import read_gguf  # noqa: E402
from mlx_ferrum.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "model.gguf"
    write_llama_gguf(path, "Q4_0")
    return path


def _variant(good, tmp_path, edit) -> str:
    data = bytearray(good.read_bytes())
    data = edit(data)
    path = tmp_path / "bad.gguf"
    path.write_bytes(bytes(data))
    return path


def _tensor_table_entry(data: bytearray, name: str) -> int:
    """Offset of the type id (u32) that follows tensor ``name``'s dims in the header."""
    key = name.encode()
    at = bytes(data).index(struct.pack("<Q", len(key)) + key) + 8 + len(key)
    n_dims = struct.unpack_from("<I", data, at)[0]
    return at + 4 + 8 * n_dims


@pytest.mark.parametrize("edit, match", [
    (lambda d: d[: len(d) // 2], "truncated|beyond"),
    (lambda d: d[:40], "truncated|cannot be parsed"),
    (lambda d: b"GGML" + d[4:], "magic"),
    (lambda d: d[:4] + struct.pack("<I", 7) + d[8:], "version 7"),
])
def test_damaged_files_get_a_named_error(good, tmp_path, edit, match):
    path = _variant(good, tmp_path, edit)
    with pytest.raises(GGUFFormatError, match=match):
        load_model(path)


def test_tensor_data_out_of_range(good, tmp_path):
    def edit(data):
        at = _tensor_table_entry(data, "blk.1.ffn_down.weight") + 4
        struct.pack_into("<Q", data, at, 10 ** 9)
        return data

    with pytest.raises(GGUFFormatError, match="blk.1.ffn_down.weight.*beyond"):
        read_gguf(_variant(good, tmp_path, edit))


def test_shape_disagreeing_with_metadata(tmp_path):
    path = tmp_path / "model.gguf"
    write_llama_gguf(path, "F32")
    data = bytearray(path.read_bytes())
    key = b"llama.feed_forward_length"
    at = bytes(data).index(struct.pack("<Q", len(key)) + key) + 8 + len(key) + 4  # past the type id
    struct.pack_into("<I", data, at, 1024)
    path.write_bytes(bytes(data))
    with pytest.raises(WeightShapeError, match="ffn|mlp"):
        load_model(path)


def test_unsupported_tensor_type_lists_types_and_tensors(good, tmp_path):
    def edit(data):
        at = _tensor_table_entry(data, "blk.0.attn_v.weight")
        struct.pack_into("<I", data, at, 16)  # IQ2_XXS
        return data

    with pytest.raises(UnsupportedTensorTypeError, match=r"IQ2_XXS: blk.0.attn_v.weight.*supported: .*Q4_K"):
        load_model(_variant(good, tmp_path, edit))


def test_unknown_architecture_lists_the_supported(tmp_path):
    path = tmp_path / "model.gguf"
    write_llama_gguf(path, "F32", architecture="mamba")
    with pytest.raises(UnsupportedArchitectureError, match="'mamba'.*llama, qwen2, qwen3"):
        load_model(path)


def test_missing_tokenizer_metadata(tmp_path):
    path = tmp_path / "model.gguf"
    write_llama_gguf(path, "F32", tokenizer=False)
    load_model(path)  # the model itself loads
    with pytest.raises(TokenizerError, match="no tokenizer metadata"):
        Tokenizer.from_pretrained(path)


def test_unknown_pre_tokenizer_is_refused():
    from mlx_ferrum.models.gguf.tokenizer import build_backend

    metadata = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "made-up", "tokenizer.ggml.tokens": ["a"],
                "tokenizer.ggml.merges": []}
    with pytest.raises(TokenizerError, match="'made-up'.*smollm"):
        build_backend(metadata)


@pytest.mark.parametrize("edit", [lambda d: d[: len(d) // 2], lambda d: b"GGML" + d[4:]])
def test_cli_prints_one_error_line(good, tmp_path, capsys, edit):
    from mlx_ferrum.cli import main

    code = main(["generate", "--model", str(_variant(good, tmp_path, edit)), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("strings", [[], [b""], [b"", b"a", b""], [b"a\x00b", b"c"], [b"\xff", b"x"],
                                     [b"x" * 70000, b"y"], [b"\xc3\xa9", b"\n", b"a b"]])
def test_string_list_fast_path_equals_reading_each_string(strings):
    """The header's string lists are read in one decode when they can be (short, valid
    UTF-8, no NUL); NULs, invalid bytes and long strings must read as string by string."""
    import struct

    from mlx_ferrum.models.gguf.reader import _Cursor

    encoded = b"".join(struct.pack("<Q", len(s)) + s for s in strings) + b"tail"
    fast, slow = _Cursor(memoryview(encoded)), _Cursor(memoryview(encoded))
    assert fast.strings(len(strings)) == slow._each_string(len(strings))
    assert fast.pos == slow.pos == len(encoded) - 4
