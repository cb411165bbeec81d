"""A real chat model end to end: SmolLM2-135M-Instruct's 4-bit folder computing in float32
gives the recorded greedy replies (``greedy_chat.json``, transformers float32) token for
token through the Python API with messages, ``generate``, ``chat`` in a pseudo-terminal and
``/v1/chat/completions``; with n-gram speculation on; with the prefix cache reusing the
shared system prompt; in both KV layouts.

The default suite runs one or two conversations per path; the full matrix is ``slow``.
"""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

import mlx.core as mx
import pytest

import mlx_ferrum as mf
from mlx_ferrum import cli
from mlx_ferrum.config import RuntimeConfig
from support.smollm_support import load_float32, recorded_cases, smollm_path

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def smollm():
    return load_float32()


@pytest.fixture(scope="module")
def cases():
    return recorded_cases()


def _api_tokens(model, tokenizer, messages, config):
    return [c.token for c in mf.stream_generate(model, tokenizer, messages, config=config, max_tokens=48,
                                                temperature=0) if c.token is not None]


# ------------------------------------------------------------------ float32 everywhere


def test_dtype_float32_casts_the_quantization_scales_and_biases(smollm):
    model, _ = smollm
    from mlx.utils import tree_flatten

    quantized = [(k, v.dtype) for k, v in tree_flatten(model.parameters()) if k.endswith((".scales", ".biases"))]
    assert quantized, "the 4-bit folder should load as quantized modules"
    assert {dtype for _, dtype in quantized} == {mx.float32}
    floats = [v.dtype for _, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    assert set(floats) == {mx.float32}
    from mlx_ferrum.runner.llm_runner import model_dtype

    assert model_dtype(model) == mx.float32  # activations and the KV cache follow it


def test_the_prompt_ids_are_the_recorded_ones(smollm, cases):
    from mlx_ferrum.engine.sequence import encode_prompt

    _, tok = smollm
    for case in cases:
        assert encode_prompt(tok, case["messages"]) == case["prompt_ids"]


# ------------------------------------------------------------------ Python API


@pytest.mark.parametrize("layout", ["paged", pytest.param("contiguous", marks=pytest.mark.slow)])
def test_api_messages_give_the_recorded_replies(smollm, cases, layout):
    model, tok = smollm
    config = RuntimeConfig(kv_layout=layout)
    for case in cases:
        assert _api_tokens(model, tok, case["messages"], config) == case["greedy_transformers"], case["messages"]


def test_api_generate_text_in_the_contiguous_layout(smollm, cases):
    model, tok = smollm
    case = cases[0]
    text = mf.generate(model, tok, case["messages"], config=RuntimeConfig(kv_layout="contiguous"), max_tokens=48,
                       temperature=0)
    assert text == case["text_transformers"]


@pytest.mark.parametrize("layout", ["paged", pytest.param("contiguous", marks=pytest.mark.slow)])
def test_ngram_speculation_gives_the_recorded_reply(smollm, cases, layout):
    """The haiku repeats "A reminder of the", so prompt lookup drafts and some drafts are accepted."""
    from mlx_ferrum.api import engine_for

    model, tok = smollm
    config = RuntimeConfig(kv_layout=layout, speculative="ngram")
    chosen = cases[1:2] if layout == "paged" else cases
    for case in chosen:
        assert _api_tokens(model, tok, case["messages"], config) == case["greedy_transformers"], case["messages"]
    stats = engine_for(model, tok, config).stats()
    assert stats["spec_num_drafts"] > 0 and stats["spec_accepted_tokens"] > 0


@pytest.mark.slow
def test_prefix_cache_reuses_the_shared_system_prompt_and_changes_no_reply(smollm, cases):
    """Cases 0 and 1 share the template's default system message: the second request
    reads its blocks from the cache and still gives the recorded reply."""
    from mlx_ferrum.engine import Engine, SamplingParams

    model, tok = smollm
    engine = Engine(model, tok, RuntimeConfig(kv_layout="paged", prefix_cache=True, block_size=8))
    params = SamplingParams(temperature=0, max_tokens=48)
    outs = [engine.generate([case["messages"]], params)[0] for case in cases[:2]]
    for out, case in zip(outs, cases):
        assert out.token_ids == case["greedy_transformers"]
    assert outs[0].metrics.num_cached_tokens == 0
    assert outs[1].metrics.num_cached_tokens >= 16


# ------------------------------------------------------------------ generate (CLI)


def _generate_args(case):
    messages = case["messages"]
    system = [m["content"] for m in messages if m["role"] == "system"]
    user = [m["content"] for m in messages if m["role"] == "user"]
    assert len(user) == 1
    return ["-p", user[0], *(["--system", system[0]] if system else [])]


def test_generate_applies_the_chat_template_and_prints_the_recorded_reply(cases, capsys):
    """The issue's first command: without the template SmolLM2 ends its reply at once."""
    case = cases[0]
    assert case["messages"] == [{"role": "user", "content": "What is the capital of France?"}]
    rc = cli.main(["generate", "--model", str(smollm_path()), "--prompt", "What is the capital of France?",
                   "--temp", "0", "--dtype", "float32"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert out == case["text_transformers"] and out.strip()
    assert "finish: stop" in err


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--paged"], [], ["--paged", "--speculative", "ngram"],
                                   ["--speculative", "ngram"]], ids=["paged", "contiguous", "paged-ngram",
                                                                     "contiguous-ngram"])
def test_generate_gives_every_recorded_reply(cases, capsys, extra):
    for case in cases:
        rc = cli.main(["generate", "--model", str(smollm_path()), *_generate_args(case), "--temp", "0",
                       "--dtype", "float32", "--max-tokens", "48", *extra])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert out == case["text_transformers"]


def test_generate_ignore_chat_template_sends_the_raw_prompt(monkeypatch, capsys):
    import dataclasses

    seen = []
    real = mf.api.stream_request

    def spy(engine, prompt, params, **kw):
        seen.append(prompt)
        return real(engine, prompt, dataclasses.replace(params, max_tokens=1), **kw)

    monkeypatch.setattr(mf.api, "stream_request", spy)
    rc = cli.main(["generate", "--model", str(smollm_path()), "-p", "Paris is", "--ignore-chat-template",
                   "--temp", "0", "-m", "1"])
    assert rc == 0, capsys.readouterr().err
    assert seen == ["Paris is"]


@pytest.mark.parametrize("model, flags, needs", [("smollm", ["--ignore-chat-template"], "--ignore-chat-template"),
                                                  ("stories", [], "chat template")])
def test_generate_system_with_a_raw_prompt_is_refused(request, capsys, model, flags, needs):
    """A system message has no place in a raw prompt: exit 2, one line naming --system
    (it used to be dropped silently)."""
    path = smollm_path() if model == "smollm" else request.getfixturevalue("stories_path")
    rc = cli.main(["generate", "--model", str(path), "-p", "hi", "--system", "Be brief.", *flags])
    err = capsys.readouterr().err
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--system" in lines[0] and needs in lines[0]


# ------------------------------------------------------------------ chat in a pseudo-terminal


class PtyChat:
    """``mlx-ferrum chat`` on a pseudo-terminal (stdin, stdout and stderr), as a user runs
    it: Python's ``input()`` on a terminal writes its ``>> `` prompt to stderr, and the
    terminal echoes what is typed."""

    def __init__(self, args):
        self.master, slave = pty.openpty()
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.process = subprocess.Popen([sys.executable, "-m", "mlx_ferrum", "chat", *args], stdin=slave,
                                        stdout=slave, stderr=slave, env=env, cwd=REPO, close_fds=True)
        os.close(slave)
        self.seen = ""
        self.transcript = ""

    def read_until_prompt(self, timeout=180.0) -> str:
        """Terminal output up to the next ``>> `` prompt (not included), CRLF as LF."""
        deadline = time.monotonic() + timeout
        while ">> " not in self.seen:
            if time.monotonic() > deadline or self.process.poll() is not None:
                raise AssertionError(f"no prompt; terminal: {self.transcript + self.seen!r}")
            ready, _, _ = select.select([self.master], [], [], 0.5)
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode("utf-8", errors="replace")
                except OSError:
                    pass
        out, self.seen = self.seen.split(">> ", 1)
        self.transcript += out + ">> "
        return out.replace("\r\n", "\n")

    def say(self, line: str) -> str:
        """Type ``line`` and Enter; returns the reply as shown (the echo of the line removed)."""
        os.write(self.master, (line + "\n").encode())
        shown = self.read_until_prompt()
        echo = line + "\n"
        assert shown.startswith(echo), shown
        return shown[len(echo):]

    def close(self) -> int:
        try:
            os.write(self.master, b"/exit\n")
            return self.process.wait(timeout=60)
        finally:
            if self.process.poll() is None:
                self.process.kill()
            os.close(self.master)


def _chat_session(extra, conversations):
    """Each conversation (a list of user lines) after a /reset; returns the replies shown."""
    chat = PtyChat(["--model", str(smollm_path()), "--dtype", "float32", "--temp", "0", *extra])
    try:
        chat.read_until_prompt()
        replies = []
        for i, lines in enumerate(conversations):
            if i:
                assert chat.say("/reset") == "[conversation cleared]\n"
            replies.append([chat.say(line) for line in lines])
        assert chat.close() == 0
    finally:
        if chat.process.poll() is None:
            chat.process.kill()
    assert "Traceback" not in chat.transcript and "error" not in chat.transcript, chat.transcript
    return replies


def test_chat_in_a_terminal_gives_the_recorded_reply(cases):
    [[reply]] = _chat_session(["--paged"], [[cases[0]["messages"][0]["content"]]])
    assert reply == cases[0]["text_transformers"] + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--paged"], [], ["--paged", "--speculative", "ngram"]],
                         ids=["paged", "contiguous", "paged-ngram"])
def test_chat_in_a_terminal_gives_every_recorded_reply(cases, extra):
    plain = [c for c in cases if all(m["role"] == "user" for m in c["messages"])]
    replies = _chat_session(extra, [[c["messages"][0]["content"]] for c in plain])
    for [reply], case in zip(replies, plain):
        assert reply == case["text_transformers"] + "\n"
    for case in cases:
        if case in plain:
            continue
        system, user = case["messages"]
        [[reply]] = _chat_session([*extra, "--system", system["content"]], [[user["content"]]])
        assert reply == case["text_transformers"] + "\n"


# ------------------------------------------------------------------ /v1/chat/completions


def _serve_and_check(tmp_path, cases, extra):
    import httpx

    from support.server_helpers import running_server

    with running_server(smollm_path(), tmp_path, ["--dtype", "float32", "--block-size", "8", *extra]) as server:
        usages = []
        for case in cases:
            r = httpx.post(server.url + "/v1/chat/completions", timeout=300, json={
                "messages": case["messages"], "temperature": 0, "max_tokens": 48, "logprobs": True})
            assert r.status_code == 200, r.text
            body = r.json()
            choice = body["choices"][0]
            assert choice["message"]["content"] == case["text_transformers"]
            assert choice["finish_reason"] == ("stop" if case["greedy_transformers"][-1] == 2 else "length")
            assert body["usage"]["prompt_tokens"] == len(case["prompt_ids"])
            assert body["usage"]["completion_tokens"] == len(case["greedy_transformers"])
            usages.append(body["usage"])
    return usages


def test_chat_completions_give_the_recorded_replies_and_reuse_the_system_prompt(tmp_path, cases):
    """Two requests sharing the template's default system message: the second reads it
    from the prefix cache (``cached_tokens``) and still gives the recorded reply."""
    usages = _serve_and_check(tmp_path, cases[:2], [])
    cached = [(u.get("prompt_tokens_details") or {}).get("cached_tokens", 0) for u in usages]
    assert cached[0] == 0 and cached[1] >= 16, usages


@pytest.mark.slow
@pytest.mark.parametrize("extra", [["--kv-layout", "contiguous"], ["--speculative", "ngram"],
                                   ["--kv-layout", "contiguous", "--speculative", "ngram"]],
                         ids=["contiguous", "paged-ngram", "contiguous-ngram"])
def test_chat_completions_give_every_recorded_reply(tmp_path, cases, extra):
    _serve_and_check(tmp_path, cases, extra)


# ------------------------------------------------------------------ README


def test_the_readmes_first_chat_command_works_offline_on_the_shared_folder():
    """README's first chat command names the shared SmolLM2 folder (the hub example comes
    second) and answers a question with nothing downloaded."""
    import re
    import shlex

    readme = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()
    setup = readme.split("## Set up and chat", 1)[1].split("\n## ", 1)[0]
    commands = [line for block in re.findall(r"```bash\n(.*?)```", setup, re.S) for line in block.splitlines()
                if line.startswith("mlx-ferrum chat")]
    assert len(commands) >= 2 and "/" in commands[1].split("--model", 1)[1] and "shared" not in commands[1]
    args = shlex.split(commands[0])[2:]
    folder = args[args.index("--model") + 1]
    assert folder == "../shared/models/SmolLM2-135M-Instruct"
    args[args.index("--model") + 1] = str(smollm_path())  # where ../shared is for this run
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "mlx_ferrum", "chat", *args, "--max-tokens", "8", "--seed", "0"],
                       input="What is the capital of France?\n", capture_output=True, text=True, env=env, cwd=REPO,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "error" not in r.stderr and "Traceback" not in r.stderr
