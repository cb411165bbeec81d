"""The mlx-ferrum CLI on the real stories260K checkpoint: exact output, stats on stderr, chat REPL."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_cli(args, env_extra=None, stdin=None):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-m", "mlx_ferrum", *args], capture_output=True, text=True,
                          env=env, input=stdin, timeout=300, cwd=REPO)


@pytest.mark.parametrize("paged", ["0", "1"])
def test_generate_prints_exactly_the_recorded_completion(stories_path, stories_expected, paged):
    r = run_cli(["generate", "--model", str(stories_path), "--prompt", "Once upon a time", "--max-tokens", "200",
                 "--temp", "0"], {"FERRUM_METAL_PAGED_KV": paged})
    assert r.returncode == 0, r.stderr
    assert r.stdout == stories_expected["once"]["completion_text"]
    assert "tok/s" in r.stderr and "peak memory" in r.stderr


def test_generate_bad_config_and_missing_model(stories_path, tmp_path):
    r = run_cli(["generate", "--model", str(stories_path), "--prompt", "x"], {"FERRUM_PAGED_BLOCK_SIZE": "abc"})
    assert r.returncode == 2 and "FERRUM_PAGED_BLOCK_SIZE" in r.stderr and r.stdout == ""
    r = run_cli(["generate", "--model", str(tmp_path), "--prompt", "x"])
    assert r.returncode == 2 and "config.json" in r.stderr


def test_chat_repl_streams_resets_and_exits(stories_path, stories_expected):
    r = run_cli(["chat", "--model", str(stories_path), "--temp", "0", "--max-tokens", "20"],
                stdin="Once upon a time\n/reset\nOnce upon a time\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "conversation cleared" in r.stderr
    # the model has no chat template: plain-text continuation, same greedy reply twice
    first = stories_expected["once"]["completion_text"][:20]
    assert r.stdout.count(first[:15]) == 2


def test_python_m_and_help():
    r = run_cli(["--help"])
    assert r.returncode == 0 and "generate" in r.stdout and "chat" in r.stdout and "bench" in r.stdout
