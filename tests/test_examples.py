"""The examples run end to end on the real stories260K checkpoint."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, args, stdin=None, env_extra=None):
    env = dict(os.environ, PYTHONPATH=REPO, **(env_extra or {}))
    return subprocess.run([sys.executable, os.path.join(REPO, "examples", script), *args], capture_output=True,
                          text=True, input=stdin, env=env, timeout=300)


def test_generate_example(stories_path, stories_expected):
    r = run("generate.py", ["--model", str(stories_path), "--max-tokens", "40"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(stories_expected["once"]["completion_text"][:60])


def test_chat_example_paged(stories_path):
    r = run("chat.py", ["--model", str(stories_path), "--max-tokens", "10"], stdin="Once upon a time\n/exit\n",
            env_extra={"FERRUM_METAL_PAGED_KV": "1"})
    assert r.returncode == 0, r.stderr
    assert len(r.stdout.strip()) > 10


def test_batch_generate_example(stories_path):
    r = run("batch_generate.py", ["--model", str(stories_path), "--max-tokens", "16"])
    assert r.returncode == 0, r.stderr
    assert "8 requests" in r.stdout and "tok/s" in r.stdout
