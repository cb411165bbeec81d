"""The README's chat survives long conversations, errors and Ctrl-C; CLI niceties.

Runs the real stories260K checkpoint (512-token context, no chat template).
"""

import io
import os
import signal
import subprocess
import sys
import time

import pytest

import mlx_ferrum as mf
import mlx_ferrum.api as api
from mlx_ferrum import cli
from support.cli_helpers import feed  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def record_prompts(monkeypatch, fail_on_turn=None):
    seen = []
    real = api.stream_request

    def wrapper(engine, prompt, params, **kw):
        seen.append((prompt, params.seed))
        if fail_on_turn is not None and len(seen) == fail_on_turn:
            raise RuntimeError("injected failure in this turn")
        return real(engine, prompt, params, **kw)

    monkeypatch.setattr(api, "stream_request", wrapper)
    return seen


def test_chat_trims_history_keeps_the_system_prompt_and_never_exits(stories_path, monkeypatch, capsys):
    turns = ["Once upon a time there was a little girl", "She went to the park", "Then she saw a dog",
             "The dog was big and brown", "They played all day"]
    feed(monkeypatch, turns)
    seen = record_prompts(monkeypatch)
    rc = cli.main(["chat", "--model", str(stories_path), "--temp", "0", "--max-tokens", "256", "--ignore-eos",
                   "--system", "A story."])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert len(seen) == len(turns) and "Traceback" not in err and "error" not in err
    assert "dropped the" in err
    tok = mf.load(stories_path)[1]
    for (prompt, _), turn in zip(seen, turns):
        assert prompt.startswith("A story.\n") and prompt.endswith(turn)  # system kept, newest turn last
        assert len(tok.encode(prompt)) < 512


def test_a_failing_turn_prints_one_error_line_and_the_chat_goes_on(stories_path, monkeypatch, capsys):
    feed(monkeypatch, ["Once upon a time", "Lily", "Tim"])
    seen = record_prompts(monkeypatch, fail_on_turn=2)
    rc = cli.main(["chat", "--model", str(stories_path), "--temp", "0", "--max-tokens", "8"])
    out, err = capsys.readouterr()
    assert rc == 0 and len(seen) == 3
    assert "error: RuntimeError: injected failure in this turn" in err and "Traceback" not in err
    assert "Lily" not in seen[2][0]  # the failed message left the history


def test_a_message_too_long_for_the_context_is_refused_and_the_chat_goes_on(stories_path, monkeypatch, capsys):
    feed(monkeypatch, ["Once " * 600, "Once upon a time"])
    rc = cli.main(["chat", "--model", str(stories_path), "--temp", "0", "--max-tokens", "8"])
    out, err = capsys.readouterr()
    assert rc == 0 and "too long" in err and "Traceback" not in err
    assert out.strip()  # the second turn was answered


def test_the_seed_changes_per_turn(stories_path, monkeypatch, capsys):
    feed(monkeypatch, ["Once upon a time", "/reset", "Once upon a time"])
    seen = record_prompts(monkeypatch)
    assert cli.main(["chat", "--model", str(stories_path), "--max-tokens", "4", "--seed", "7"]) == 0
    assert [s for _, s in seen] == [7, 8]


def test_generate_prompt_dash_reads_stdin_and_stats_start_on_a_new_line(stories_path, stories_expected, monkeypatch,
                                                                        capsys):
    monkeypatch.setattr(sys, "stdin", io.StringIO("Once upon a time"))
    rc = cli.main(["generate", "--model", str(stories_path), "-p", "-", "--max-tokens", "200", "--temp", "0"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert out == stories_expected["once"]["completion_text"]
    assert err.startswith("\nprompt:")


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mlx-ferrum {mf.__version__}"


def test_an_unexpected_error_is_one_line_not_a_traceback(monkeypatch, capsys):
    def boom(*args, **kwargs):
        raise RuntimeError("surprise")

    monkeypatch.setattr(api, "load", boom)
    assert cli.main(["generate", "--model", "x", "-p", "hi"]) == 1
    err = capsys.readouterr().err
    assert err.strip() == "error: RuntimeError: surprise"


@pytest.mark.parametrize("script", [["examples/chat.py"], ["-m", "mlx_ferrum", "chat"]])
def test_ctrl_c_at_the_prompt_leaves_without_a_traceback(stories_path, script):
    env = dict(os.environ, PYTHONPATH=REPO, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, *script, "--model", str(stories_path)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, cwd=REPO)
    try:
        seen = b""
        deadline = time.time() + 120
        while b">> " not in seen and time.time() < deadline:
            chunk = p.stdout.read1(64) if hasattr(p.stdout, "read1") else p.stdout.read(1)
            if not chunk:
                break
            seen += chunk
        assert b">> " in seen, "the chat never showed its prompt"
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        # the CLI goes on after Ctrl-C at the prompt (EOF then ends it); the example leaves
        _, err = p.communicate(input=b"", timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0, err.decode()
    assert b"Traceback" not in err


def test_invalid_text_in_the_chat_prints_an_error_and_the_chat_goes_on(stories_path, monkeypatch, capsys):
    feed(monkeypatch, ["bad \udcff bytes", "Once upon a time"])
    rc = cli.main(["chat", "--model", str(stories_path), "--temp", "0", "--max-tokens", "8"])
    out, err = capsys.readouterr()
    assert rc == 0 and "not valid Unicode" in err and "Traceback" not in err
    assert out.strip()  # the second turn was answered


def record_max_tokens(monkeypatch):
    seen = []
    real = api.stream_request

    def wrapper(engine, prompt, params, **kw):
        seen.append(params.max_tokens)
        return real(engine, prompt, params, **kw)

    monkeypatch.setattr(api, "stream_request", wrapper)
    return seen


def test_a_reply_cut_by_max_tokens_ends_with_a_marker(stories_path, monkeypatch, capsys):
    feed(monkeypatch, ["Once upon a time"])
    rc = cli.main(["chat", "--model", str(stories_path), "--temp", "0", "--max-tokens", "8", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0 and out.strip()
    assert "[reply cut at 8 tokens; --max-tokens to change]" in err


def test_without_max_tokens_a_reply_may_use_the_rest_of_the_context(stories_path, monkeypatch, capsys):
    feed(monkeypatch, ["Once upon a time"])
    seen = record_max_tokens(monkeypatch)
    rc = cli.main(["chat", "--model", str(stories_path), "--temp", "0", "--ignore-eos"])
    out, err = capsys.readouterr()
    assert rc == 0
    assert seen == [512]  # stories260K's whole context: the engine ends the reply where the context ends
    assert "the context of 512 tokens is full" in err and "[reply cut at" in err
    cut = int(err.split("[reply cut at ")[1].split(" tokens")[0])
    assert cut > 256  # the old fixed limit stopped every reply at 256 tokens
