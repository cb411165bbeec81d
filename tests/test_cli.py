"""The mlx-ferrum CLI on the real stories260K checkpoint: exact output, stats on stderr, chat REPL."""

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


# --------------------------------------------------------------- one clean line, never a traceback


def one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("argv,expected", [
    (["serve", "--model", "m", "--port", "99999"], ["--port", "99999", "65535"]),
    (["serve", "--model", "m", "--port", "http"], ["--port", "'http'", "65535"]),
    (["serve", "--model", "m", "--kv-layout", "foo"], ["--kv-layout", "'foo'", "contiguous", "paged"]),
    (["serve", "--model", "m", "--prefix-cache", "maybe"], ["--prefix-cache", "'maybe'", "1, 0"]),
    (["serve", "--model", "m", "--block-size", "12"], ["--block-size", "12", "8, 16, 32, 64, 128"]),
    (["serve", "--model", "m", "--max-num-seqs", "0"], ["--max-num-seqs", "'0'", ">= 1"]),
    (["serve", "--model", "m", "--kv-memory-fraction", "2"], ["--kv-memory-fraction", "(0, 1]"]),
    (["serve", "--model", "m", "--api-key", ""], ["--api-key", "empty"]),
    (["serve", "--model", "m", "--api-key", "  "], ["--api-key", "empty"]),
    (["serve", "--model", "m", "--dtype", "int8"], ["--dtype", "float32", "bfloat16"]),
    (["generate", "--model", "m", "-p", "x", "--max-tokens", "0"], ["--max-tokens", ">= 1"]),
])
def test_bad_flag_values_are_one_line_that_lists_what_is_accepted(argv, expected, capsys):
    from mlx_ferrum import cli

    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    line = one_error_line(capsys.readouterr().err)
    assert "invalid <lambda>" not in line
    for piece in expected:
        assert piece in line, line


def test_a_taken_port_is_one_line_before_the_model_loads_and_before_the_banner(stories_path):
    import socket
    import time

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.perf_counter()
        r = run_cli(["serve", "--model", str(stories_path), "--port", str(port)])
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert f"127.0.0.1:{port}" in line and "already in use" in line and "--port" in line
    assert "mlx-ferrum serve:" not in r.stderr  # no banner for a server that never served
    assert time.perf_counter() - t0 < 60


def test_serve_on_port_0_announces_the_port_it_bound_and_answers(stories_path):
    import signal
    import time

    import httpx

    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "mlx_ferrum", "serve", "--model", str(stories_path), "--port", "0",
                          "--log-level", "warning"], stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    try:
        banner = p.stderr.readline()
        assert banner.startswith("mlx-ferrum serve:"), banner
        port = int(banner.split("http://127.0.0.1:")[1].split("/")[0])
        assert port != 0
        deadline = time.time() + 60
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
                break
            except httpx.TransportError:
                assert time.time() < deadline, "the announced port never answered"
                time.sleep(0.2)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == 0 and "Traceback" not in err


def test_a_kv_pool_larger_than_memory_is_refused_by_name_before_allocating(stories_path):
    r = run_cli(["generate", "--model", str(stories_path), "-p", "x", "-m", "2"],
                {"FERRUM_KV_MAX_BLOCKS": "1000000000", "FERRUM_METAL_PAGED_KV": "1"})
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert "FERRUM_KV_MAX_BLOCKS" in line and "--max-num-blocks" in line and "1000000000 blocks" in line
    fits = int(line.split("at most ")[1].split(" blocks")[0])
    assert 0 < fits < 1_000_000_000
    assert "bytes" in line and "MemoryError" not in line


def test_the_executor_raises_a_named_memory_error_that_names_the_largest_pool():
    from support.tiny_models import tiny_model

    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.errors import ConfigurationError, InsufficientMemoryError
    from mlx_ferrum.executor import LlmExecutor

    with pytest.raises(InsufficientMemoryError) as e:
        LlmExecutor(tiny_model("llama"), RuntimeConfig(kv_layout="paged", max_num_blocks=10**12))
    assert isinstance(e.value, ConfigurationError) and isinstance(e.value, MemoryError)
    message = str(e.value)
    assert "FERRUM_KV_MAX_BLOCKS" in message and f"{10**12} blocks" in message
    assert 0 < int(message.split("at most ")[1].split(" blocks")[0]) < 10**12


def test_a_bare_memory_error_says_out_of_memory_and_what_to_lower(monkeypatch, capsys):
    import mlx_ferrum.api
    from mlx_ferrum import cli

    def boom(*args, **kwargs):
        raise MemoryError()

    monkeypatch.setattr(mlx_ferrum.api, "load", boom)
    assert cli.main(["generate", "--model", "x", "-p", "hi"]) == 1
    line = one_error_line(capsys.readouterr().err)
    assert "out of memory" in line and "FERRUM_KV_MAX_BLOCKS" in line


def test_ctrl_c_during_model_load_exits_130_quietly(monkeypatch, capsys):
    import mlx_ferrum.api
    from mlx_ferrum import cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(mlx_ferrum.api, "load", interrupted)
    for argv in (["generate", "--model", "x", "-p", "hi"], ["serve", "--model", "x", "--port", "0"]):
        assert cli.main(argv) == 130
        assert capsys.readouterr().err.strip() == ""


# --------------------------------------------------------------- --help


def _subparsers(parser):
    import argparse

    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return action.choices


def test_every_option_of_every_subcommand_has_help_and_states_its_default():
    from mlx_ferrum import cli

    parser = cli.build_parser()
    commands = _subparsers(parser)
    assert set(commands) == {"generate", "chat", "serve", "bench"}
    for name, sub in commands.items():
        formatter = sub._get_formatter()
        for action in sub._actions:
            if not action.option_strings or action.dest == "help":
                continue
            text = formatter._get_help_string(action)
            assert action.help and action.help.strip(), f"{name} {action.option_strings} has no help"
            assert action.required or "default" in text, f"{name} {action.option_strings}: the help states no default: {text!r}"


def test_help_lists_the_kv_layout_values_and_shows_defaults():
    r = run_cli(["serve", "--help"])
    assert r.returncode == 0
    text = " ".join(r.stdout.split())
    assert "--kv-layout {contiguous,paged}" in text and "(default: 8000)" in text
    assert "$FERRUM_METAL_PAGED_KV, else paged" in text
    r = run_cli(["chat", "--help"])
    text = " ".join(r.stdout.split())
    assert "--presence-penalty" in text and "--frequency-penalty" in text and "the rest of the context" in text


# --------------------------------------------------------------- generate / chat flags


def test_generate_and_chat_pass_the_presence_and_frequency_penalties(stories_path, monkeypatch, capsys):
    import mlx_ferrum.api as api
    from mlx_ferrum import cli

    seen = []
    real = api.stream_request

    def wrapper(engine, prompt, params, **kw):
        seen.append(params)
        return real(engine, prompt, params, **kw)

    monkeypatch.setattr(api, "stream_request", wrapper)
    assert cli.main(["generate", "--model", str(stories_path), "-p", "Once upon a time", "-m", "4",
                     "--presence-penalty", "0.5", "--frequency-penalty", "-0.25"]) == 0
    lines = ["Once upon a time"]

    def fake_input(prompt=""):
        if not lines:
            raise EOFError
        return lines.pop()

    monkeypatch.setattr("builtins.input", fake_input)
    assert cli.main(["chat", "--model", str(stories_path), "-m", "4", "--presence-penalty", "1.5",
                     "--frequency-penalty", "2"]) == 0
    assert [(p.presence_penalty, p.frequency_penalty) for p in seen[:2]] == [(0.5, -0.25), (1.5, 2.0)]


def test_penalties_change_the_greedy_text(stories_path, stories_expected):
    r = run_cli(["generate", "--model", str(stories_path), "--prompt", "Once upon a time", "--max-tokens", "200",
                 "--temp", "0", "--frequency-penalty", "2"])
    assert r.returncode == 0, r.stderr
    assert r.stdout and r.stdout != stories_expected["once"]["completion_text"]


def test_generate_speculative_prints_acceptance_statistics(stories_path, stories_expected):
    r = run_cli(["generate", "--model", str(stories_path), "--prompt", "Once upon a time", "--max-tokens", "60",
                 "--temp", "0", "--speculative", "ngram"])
    assert r.returncode == 0, r.stderr
    assert r.stdout == stories_expected["once"]["completion_text"][:len(r.stdout)]
    line = next(x for x in r.stderr.splitlines() if x.startswith("speculative:"))
    accepted, proposed = (int(w) for w in line.split()[1:4:2])
    assert 0 <= accepted <= proposed and proposed > 0 and "%" in line and "mean accepted length" in line


# --------------------------------------------------------------- a hub id that cannot be fetched


def test_offline_hub_error_is_one_line_that_names_the_repo_and_the_fix(tmp_path):
    r = run_cli(["generate", "--model", "someone/not-cached-model", "-p", "x"],
                {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"),
                 "HF_HUB_CACHE": str(tmp_path / "hf-home" / "hub")})
    assert r.returncode == 2
    line = one_error_line(r.stderr)
    assert "'someone/not-cached-model' is not a local folder" in line
    assert "not in the local cache" in line and "HF_HUB_OFFLINE" in line
    assert "`hf download someone/not-cached-model`" in line and "local checkpoint folder" in line
    assert "huggingface-cli" not in line and "LocalEntryNotFoundError" not in line


def test_no_network_hub_error_says_so(monkeypatch, tmp_path):
    import socket

    import huggingface_hub.constants as const

    from mlx_ferrum.errors import ModelLoadError
    from mlx_ferrum.models import resolve_model_path

    def no_network(*args, **kwargs):
        raise OSError(101, "Network is unreachable")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr(const, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(const, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "1")
    with pytest.raises(ModelLoadError) as e:
        resolve_model_path("someone/not-cached-model")
    message = str(e.value)
    assert "\n" not in message and "'someone/not-cached-model' is not a local folder" in message
    assert "cannot be reached" in message and "`hf download someone/not-cached-model`" in message
    assert "huggingface-cli" not in message


def test_the_cli_module_starts_without_importing_mlx():
    """The CLI's heavy imports happen inside main's Ctrl-C handler, not before it: a
    Ctrl-C while MLX and the model code load exits 130 without a traceback."""
    code = "import sys, mlx_ferrum.cli; print(sorted(m for m in ('mlx', 'mlx.core', 'numpy') if m in sys.modules))"
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO, timeout=60)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr


def test_ctrl_c_while_the_model_loads_exits_130_without_a_traceback():
    import signal

    # a load that announces itself and then takes long, so the signal lands mid-load
    # SIGINT's handler is set as a terminal gives it: a test run started in the background
    # of a non-interactive shell inherits SIGINT ignored, which the child would keep
    code = ("import signal, sys, time, mlx_ferrum.api as api\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "def slow_load(*args, **kwargs):\n"
            "    print('loading', flush=True)\n"
            "    time.sleep(120)\n"
            "api.load = slow_load\n"
            "from mlx_ferrum.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for argv in (["serve", "--model", "m", "--port", "0"], ["generate", "--model", "m", "-p", "x"]):
        p = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env, cwd=REPO)
        try:
            assert p.stdout.readline() == b"loading\n"
            p.send_signal(signal.SIGINT)
            _, err = p.communicate(timeout=60)
        finally:
            if p.poll() is None:
                p.kill()
        assert p.returncode == 130, err
        assert b"Traceback" not in err and b"KeyboardInterrupt" not in err


def test_serve_turns_prefix_caching_on_by_default_and_off_by_flag(monkeypatch):
    """vLLM V1 and mlx_lm.server cache prompts by default; so does serve, and
    --no-enable-prefix-caching / FERRUM_PREFIX_CACHE=0 turn it off."""
    from mlx_ferrum.cli import build_parser
    from mlx_ferrum.cli.serve import serve_config

    monkeypatch.delenv("FERRUM_PREFIX_CACHE", raising=False)
    monkeypatch.delenv("FERRUM_METAL_PAGED_KV", raising=False)
    parse = build_parser().parse_args
    on = serve_config(parse(["serve", "--model", "m"]))
    assert on.prefix_cache is True and on.kv_layout == "paged"
    assert serve_config(parse(["serve", "--model", "m", "--no-enable-prefix-caching"])).prefix_cache is False
    assert serve_config(parse(["serve", "--model", "m", "--prefix-cache", "0"])).prefix_cache is False
    monkeypatch.setenv("FERRUM_PREFIX_CACHE", "0")
    assert serve_config(parse(["serve", "--model", "m"])).prefix_cache is False
    assert serve_config(parse(["serve", "--model", "m", "--enable-prefix-caching"])).prefix_cache is True


def test_speculation_policy_flags_reach_the_config(monkeypatch):
    from mlx_ferrum.cli import build_parser
    from mlx_ferrum.cli.generation import command_config
    from mlx_ferrum.cli.serve import serve_config

    args = build_parser().parse_args(["generate", "--model", "m", "--prompt", "x", "--speculative", "ngram",
                                      "--speculative-disable-by-batch-size", "3", "--speculative-min-acceptance", "0"])
    cfg = command_config(args)
    assert (cfg.speculative_disable_by_batch_size, cfg.speculative_min_acceptance) == (3, 0.0)
    served = serve_config(build_parser().parse_args(["serve", "--model", "m", "--speculative-min-acceptance", "0.5"]))
    assert served.speculative_min_acceptance == 0.5


@pytest.mark.parametrize("flags,named,needs", [
    (["--pipeline-split", "9,9"], "--pipeline-split", "--pipeline-parallel-size"),
    (["--pipeline-micro-batches", "4"], "--pipeline-micro-batches", "--pipeline-parallel-size"),
    (["--distributed-backend", "ring"], "--distributed-backend", "tensor or pipeline parallelism"),
    (["--tensor-parallel-size", "1", "--pipeline-split", "3,2"], "--pipeline-split", "--pipeline-parallel-size"),
])
def test_serve_refuses_parallel_flags_without_the_parallelism_they_need(stories_path, flags, named, needs):
    """A flag that acts only under model parallelism is refused before the model loads, not
    accepted and never used."""
    r = run_cli(["serve", "--model", str(stories_path), "--port", "0", *flags])
    assert r.returncode == 2, r.stderr
    line = one_error_line(r.stderr)
    assert named in line and needs in line, line


def test_a_parallel_only_variable_without_parallelism_is_refused_by_name(stories_path):
    r = run_cli(["generate", "--model", str(stories_path), "-p", "x", "-m", "2"], {"FERRUM_PIPELINE_SPLIT": "3,2"})
    assert r.returncode == 2
    assert "FERRUM_PIPELINE_SPLIT" in one_error_line(r.stderr)


@pytest.mark.parametrize("flags", [[], ["--speculative", "ngram"]], ids=["plain", "speculative"])
def test_generate_reports_a_request_that_failed_in_the_engine(stories_path, monkeypatch, capsys, flags):
    """A request the engine fails is an error (one line, exit 1), with or without
    speculation; the speculative path used to print its text and exit 0."""
    from mlx_ferrum import cli
    from mlx_ferrum.engine.launch import StepLauncher

    def broken_emit(self, *args, **kwargs):
        raise RuntimeError("injected emission failure")

    monkeypatch.setattr(StepLauncher, "_emit", broken_emit)
    rc = cli.main(["generate", "--model", str(stories_path), "-p", "Once upon a time", "-m", "4", "--temp", "0",
                   *flags])
    assert rc == 1
    assert one_error_line(capsys.readouterr().err) == "error: RuntimeError: injected emission failure"
