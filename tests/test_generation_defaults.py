"""A model's generation_config.json gives ``generate``, ``chat`` and ``serve`` their sampling
defaults (vLLM's ``--generation-config auto``); flags and request fields win; ``none``
keeps the commands' own defaults.

Runs on a copy of stories260K (its files linked) whose generation_config.json is rewritten.
"""

from __future__ import annotations

import json
import os

import httpx
import pytest

import mlx_ferrum.api as api
from mlx_ferrum import cli
from mlx_ferrum.errors import ConfigurationError
from mlx_ferrum.generation_defaults import generation_defaults
from support.cli_helpers import feed  # noqa: E402

FILE = {"bos_token_id": 1, "eos_token_id": 2, "do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": 20,
        "min_p": 0.05, "repetition_penalty": 1.05, "max_new_tokens": 12}
#: FILE in SamplingParams' names (``max_new_tokens`` is ``max_tokens``, as in vLLM)
EXPECTED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.05, "max_tokens": 12}


def model_copy(stories_path, folder, generation_config):
    """stories260K's files linked into ``folder``, with this generation_config.json."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in os.listdir(stories_path):
        if name != "generation_config.json":
            os.symlink(stories_path / name, folder / name)
    (folder / "generation_config.json").write_text(json.dumps(generation_config))
    return folder


def test_the_keys_vllm_reads_become_sampling_defaults(tmp_path):
    (tmp_path / "generation_config.json").write_text(json.dumps(FILE))
    assert generation_defaults(tmp_path) == EXPECTED
    assert generation_defaults(tmp_path, "none") == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_p": None}))
    assert generation_defaults(tmp_path, str(other)) == {"temperature": 0.3}  # a null value sets nothing


def test_the_shared_models_set_no_sampling_defaults(stories_path):
    from support.smollm_support import SMOLLM

    assert generation_defaults(stories_path) == {}  # do_sample and max_length only
    if (SMOLLM / "generation_config.json").exists():
        assert generation_defaults(SMOLLM) == {}  # token ids only
    assert generation_defaults(stories_path.parent / "no-such-model") == {}


@pytest.mark.parametrize("content, named", [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
                                            ("[1, 2]", "not a JSON object"), ("{oops", "cannot be read")])
def test_a_bad_file_is_refused_with_the_fix(tmp_path, content, named):
    (tmp_path / "generation_config.json").write_text(content if isinstance(content, str) else json.dumps(content))
    with pytest.raises(ConfigurationError, match=named) as e:
        generation_defaults(tmp_path)
    assert "--generation-config none" in str(e.value)
    with pytest.raises(ConfigurationError, match="does not exist"):
        generation_defaults(tmp_path, str(tmp_path / "missing"))


def _spy(monkeypatch):
    import dataclasses

    seen = []
    real = api.stream_request

    def wrapper(engine, prompt, params, **kw):
        seen.append({k: getattr(params, k) for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                                                     "max_tokens")})
        return real(engine, prompt, dataclasses.replace(params, max_tokens=2), **kw)

    monkeypatch.setattr(api, "stream_request", wrapper)
    return seen


OWN_CHAT = {"temperature": 0.7, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0}
OWN_GENERATE = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
                "max_tokens": 256}


@pytest.mark.parametrize("flags, want", [
    ([], EXPECTED),
    (["--temp", "0.2", "--top-k", "5", "-m", "3"], {**EXPECTED, "temperature": 0.2, "top_k": 5, "max_tokens": 3}),
    (["--generation-config", "none"], OWN_GENERATE),
], ids=["from-the-model", "flags-win", "none"])
def test_generate_takes_the_models_defaults(stories_path, tmp_path, monkeypatch, capsys, flags, want):
    model = model_copy(stories_path, tmp_path / "m", FILE)
    seen = _spy(monkeypatch)
    assert cli.main(["generate", "--model", str(model), "-p", "Once upon a time", *flags]) == 0
    assert seen == [want]


@pytest.mark.parametrize("flags, want", [
    ([], EXPECTED),
    (["--temp", "0", "--repetition-penalty", "1.2"], {**EXPECTED, "temperature": 0.0, "repetition_penalty": 1.2}),
    (["--generation-config", "none"], {**OWN_CHAT, "max_tokens": 512}),  # no limit: the rest of the context
], ids=["from-the-model", "flags-win", "none"])
def test_chat_takes_the_models_defaults_and_says_so(stories_path, tmp_path, monkeypatch, capsys, flags, want):
    model = model_copy(stories_path, tmp_path / "m", FILE)
    seen = _spy(monkeypatch)
    feed(monkeypatch, ["Once upon a time"])
    assert cli.main(["chat", "--model", str(model), *flags]) == 0
    err = capsys.readouterr().err
    assert seen == [want]
    assert ("generation_config.json" in err) == ("none" not in flags)


def test_help_says_where_the_defaults_come_from(capsys):
    for command in ("generate", "chat", "serve"):
        with pytest.raises(SystemExit):
            cli.main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert "generation_config.json" in text and "--generation-config" in text, command


def test_serve_takes_the_models_defaults_and_request_fields_win(stories_path, stories_expected, tmp_path):
    """The model's file says greedy and 5 tokens: a request that sets neither gets the
    recorded greedy completion's first 5 tokens; its own fields win; ``none`` restores
    OpenAI's defaults (temperature 1, the rest of the context)."""
    from support.server_helpers import running_server

    model = model_copy(stories_path, tmp_path / "m", {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.0,
                                                      "max_new_tokens": 5})
    with running_server(model, tmp_path) as server:
        def complete(**fields):
            r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", **fields}, timeout=120)
            assert r.status_code == 200, r.text
            return r.json()

        default = complete()
        assert default["usage"]["completion_tokens"] == 5
        assert stories_expected["once"]["completion_text"].startswith(default["choices"][0]["text"])
        own = complete(max_tokens=9, temperature=0)
        assert own["usage"]["completion_tokens"] == 9
        sampled = complete(max_tokens=40, temperature=1.0, seed=3)
        assert not stories_expected["once"]["completion_text"].startswith(sampled["choices"][0]["text"])
    with running_server(model, tmp_path, ["--generation-config", "none"]) as server:
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Once upon a time", "seed": 3, "max_tokens": 40},
                       timeout=120)
        assert r.json()["choices"][0]["text"] == sampled["choices"][0]["text"]  # temperature 1 by default
