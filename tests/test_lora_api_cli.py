"""LoRA through the conveniences: ``mf.generate(..., lora=...)`` and the CLI's ``--adapter-path``."""

from __future__ import annotations

import pytest

import mlx_ferrum as mf
from mlx_ferrum import cli
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.errors import LoraError
from support.lora_fixtures import random_peft_adapter

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def stories(stories_path, tmp_path_factory):
    model, tokenizer = mf.load(str(stories_path))
    adapter = random_peft_adapter(model, tmp_path_factory.mktemp("ad") / "story-lora", seed=3, std=0.5)
    return model, tokenizer, str(adapter)


def test_generate_with_an_adapter_path_equals_the_engine(stories):
    model, tokenizer, adapter = stories
    base = mf.generate(model, tokenizer, PROMPT, max_tokens=16, temperature=0.0)
    text = mf.generate(model, tokenizer, PROMPT, max_tokens=16, temperature=0.0, lora=adapter)
    eng = Engine(model, tokenizer, RuntimeConfig(enable_lora=True))
    eng.add_lora("story", adapter)
    outs = eng.generate([PROMPT, PROMPT], SamplingParams(max_tokens=16, temperature=0.0), lora=["story", None])
    assert text == outs[0].text and base == outs[1].text
    assert text != base, "the adapter changes nothing"
    with pytest.raises(LoraError, match="no LoRA adapter folder"):
        mf.generate(model, tokenizer, PROMPT, max_tokens=2, lora="./missing-adapter")


def test_cli_adapter_path(stories, stories_path, capsys):
    model, tokenizer, adapter = stories
    expected = mf.generate(model, tokenizer, PROMPT, max_tokens=12, temperature=0.0, lora=adapter)
    assert cli.main(["generate", "--model", str(stories_path), "-p", PROMPT, "-m", "12", "--temp", "0",
                     "--adapter-path", adapter]) == 0
    assert capsys.readouterr().out.rstrip("\n") == expected.rstrip("\n")
    assert cli.main(["generate", "--model", str(stories_path), "-p", PROMPT, "-m", "2",
                     "--adapter-path", "./no/such/adapter"]) == 2  # a FerrumError: one line, exit 2
    assert "no LoRA adapter folder" in capsys.readouterr().err


def test_chat_adapter_path(stories, stories_path, capsys, monkeypatch):
    """``chat --adapter-path`` answers with the adapter (the same streamer as generate)."""
    model, tokenizer, adapter = stories
    lines = [PROMPT]

    def fake_input(prompt=""):
        if not lines:
            raise EOFError
        return lines.pop()

    monkeypatch.setattr("builtins.input", fake_input)
    assert cli.main(["chat", "--model", str(stories_path), "-m", "8", "--temp", "0", "--adapter-path", adapter]) == 0
    with_adapter = capsys.readouterr().out
    lines.append(PROMPT)
    assert cli.main(["chat", "--model", str(stories_path), "-m", "8", "--temp", "0"]) == 0
    assert capsys.readouterr().out != with_adapter
