"""README's install and test commands, run as a new user would: a fresh venv, only
``pip install -e ".[dev]"``, no OpenBLAS preload, then a few representative test files
and ``mlx-ferrum generate`` on stories260K. Slow (the install downloads the
dependencies); ``.ci/run`` also runs the README's whole test command in such a venv."""

import os
import subprocess
import venv

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = open(os.path.join(REPO, "README.md"), encoding="utf-8").read()

# a BLAS-sensitive parity file, the CLI and the README's own snippets
REPRESENTATIVE = ["tests/test_executor.py", "tests/test_cli.py", "tests/test_readme.py"]


def clean_env() -> dict:
    """The environment of a new user's shell: none of this session's preloads or paths."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("LD_PRELOAD", "OPENBLAS_NUM_THREADS", "PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


@pytest.mark.slow
def test_readme_install_and_test_commands_in_a_clean_venv(tmp_path, stories_path, stories_expected):
    tests_section = README.split("## Tests", 1)[1].split("\n## ", 1)[0]
    assert 'pip install -e ".[dev]"' in tests_section and "python -m pytest -q" in tests_section
    venv_dir = tmp_path / "venv"
    venv.create(venv_dir, with_pip=True)
    python = str(venv_dir / "bin" / "python")
    env = clean_env()
    env["PATH"] = str(venv_dir / "bin") + os.pathsep + env.get("PATH", "")

    def run(*args, timeout=1800):
        r = subprocess.run(list(args), capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout)
        assert r.returncode == 0, f"{args}: {r.stdout[-3000:]}\n{r.stderr[-3000:]}"
        return r

    run(python, "-m", "pip", "install", "-q", "-e", ".[dev]")
    # the new venv has no torch (the [ref] extra) and no preload: what README promises
    probe = run(python, "-c", "import importlib.util, mlx_ferrum; print(mlx_ferrum.__file__); "
                              "print(importlib.util.find_spec('torch') is not None)")
    assert probe.stdout.split() == [os.path.join(REPO, "mlx_ferrum", "__init__.py"), "False"]
    run(python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *REPRESENTATIVE)
    r = run(str(venv_dir / "bin" / "mlx-ferrum"), "generate", "--model", str(stories_path), "--prompt",
            "Once upon a time", "--max-tokens", "200", "--temp", "0")
    assert r.stdout == stories_expected["once"]["completion_text"]
    assert "tok/s" in r.stderr


def test_ci_runs_the_readme_test_command_in_the_readme_environment():
    ci = open(os.path.join(REPO, ".ci", "run"), encoding="utf-8").read()
    preloaded = ci.index('export LD_PRELOAD="$OPENBLAS"')
    second = ci.index('.venv-readme/bin/python -m pip install -q -e ".[dev]"')
    assert preloaded < second  # after the preloaded run, a venv with only the [dev] extra
    readme_run = ci.index("env -u LD_PRELOAD -u OPENBLAS_NUM_THREADS .venv-readme/bin/python -m pytest -q\n")
    assert second < readme_run < ci.index("-m slow")
    # the default runs keep `set -e` (a pytest exit 5, no test collected, fails CI);
    # only the slow run accepts 5
    assert ci.index("set +e") > readme_run and '[ "$rc" -ne 5 ]' in ci


def test_readme_lists_every_environment_flag_and_the_serve_default():
    from mlx_ferrum.config import _ENV

    table = README.split("## Environment flags", 1)[1].split("\n## ", 1)[0]
    for var, _, _ in _ENV.values():
        if var in ("FERRUM_PROMPT_LOOKUP_MAX",):
            continue  # listed with _MIN as `FERRUM_PROMPT_LOOKUP_MIN` / `_MAX`
        assert f"| `{var}`" in table, f"{var} is missing from README's flag table"
    assert "`serve` defaults to paged" in table


def test_readme_says_to_install_openai_before_its_snippet():
    section = README.split("## OpenAI-compatible server", 1)[1].split("\n## ", 1)[0]
    before_snippet = section.split("from openai import OpenAI", 1)[0]
    assert "pip install openai" in before_snippet.rsplit("```bash", 1)[-1]
