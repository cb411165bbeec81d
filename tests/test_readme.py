"""README.md: its Python snippet runs as written, and its install steps are the right ones."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()


def test_the_python_snippet_runs_as_written(stories_path, stories_expected):
    blocks = re.findall(r"```python\n(.*?)```", README, re.S)
    assert blocks, "README has no python snippet"
    env = dict(os.environ, PYTHONPATH=REPO)
    r = subprocess.run([sys.executable, "-c", blocks[0]], capture_output=True, text=True, cwd=REPO, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    greedy = stories_expected["once"]["completion_text"]
    assert r.stdout.startswith(greedy[:40])  # the greedy completion, checked against the recording
    assert r.stdout.rstrip().endswith("(1, 512)")  # decode logits [1, vocab]


def test_install_steps_use_a_venv_and_the_dev_extra_only_for_tests():
    setup = README.split("## Set up and chat", 1)[1].split("##", 1)[0]
    assert "python3 -m venv .venv" in setup and ". .venv/bin/activate" in setup
    assert 'pip install -e .\n' in setup and "[dev]" not in setup
    tests = README.split("## Tests", 1)[1].split("##", 1)[0]
    assert 'pip install -e ".[dev]"' in tests
