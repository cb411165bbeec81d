"""README.md: its Python snippet runs as written, and its install steps are the right ones."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()


def test_the_python_snippet_runs_as_written(stories_path, stories_expected):
    api_section = README.split("## Python API", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```python\n(.*?)```", api_section, re.S)
    assert blocks, "README's Python API section has no python snippet"
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


def test_the_server_commands_run_as_written(stories_path, stories_expected, tmp_path):
    """README's `mlx-ferrum serve` command (on a free port) answers README's openai
    client snippet, chat part included."""
    import shlex

    from support.server_helpers import running_server

    section = README.split("## OpenAI-compatible server", 1)[1].split("\n## ", 1)[0]
    command = re.findall(r"```bash\n(.*?)```", section, re.S)[0].replace("\\\n", " ")
    args = shlex.split(command)
    assert args[:2] == ["mlx-ferrum", "serve"]
    args = args[2:]
    model = args[args.index("--model") + 1]
    args[args.index("--model") + 1] = str(stories_path) if model.endswith("stories260K") else model
    port_at = args.index("--port") + 1
    extra = [a for i, a in enumerate(args) if i not in (port_at - 1, port_at, args.index("--model"),
                                                         args.index("--model") + 1)]
    snippet = re.findall(r"```python\n(.*?)```", section, re.S)[0]
    with running_server(stories_path, tmp_path, extra, {}) as server:
        code = snippet.replace("http://127.0.0.1:8000", server.url)
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.startswith(stories_expected["once"]["completion_text"][:40])  # greedy, as recorded
    assert "completion_tokens=40" in r.stdout
