"""benchmarks/request_trace.py keeps working: it serves a tiny random checkpoint in-process,
traces a non-streamed and a streamed chat request, and reports real files of every layer a
request crosses (docs/architecture.md prints its output at the top)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

pytest.importorskip("httpx")
import request_trace  # noqa: E402


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    model = request_trace.tiny_checkpoint(tmp_path_factory.mktemp("trace") / "tiny")
    before = sys.gettrace()
    out = request_trace.trace_chat_requests(model, max_tokens=8)
    assert sys.gettrace() is before, "the tracer must give the thread's trace function back"
    return out


@pytest.mark.parametrize("name", ["non-streamed", "streamed"])
def test_the_trace_names_real_files_of_every_layer_the_request_crosses(traces, name):
    trace = traces[name]
    assert trace.files, "nothing recorded"
    assert len(set(trace.files)) == len(trace.files)
    for f in trace.files:
        assert f.startswith("mlx_ferrum/") and (REPO / f).is_file(), f
    layers = {f.split("/")[1] for f in trace.files}
    assert {"server", "engine", "runner", "models"} <= layers, sorted(layers)
    assert "kernels" in layers or "layers/attention.py" in {f.removeprefix("mlx_ferrum/") for f in trace.files}
    assert "mlx_ferrum/server/chat_completions.py" in trace.files
    # the stepping thread was traced (the model runs there, not on the event loop)
    assert trace.threads["mlx_ferrum/runner/llm_runner.py"] != trace.threads["mlx_ferrum/server/chat_completions.py"]


@pytest.mark.parametrize("name", ["non-streamed", "streamed"])
def test_path_helpers_and_hops_are_consistent(traces, name):
    trace = traces[name]
    assert sorted(trace.path_files + trace.helper_files) == sorted(trace.files)
    assert not set(trace.path_files) & set(trace.helper_files)
    # the path reaches from the route handler down to the model
    assert {"mlx_ferrum/server/chat_completions.py", "mlx_ferrum/engine/engine.py",
            "mlx_ferrum/runner/llm_runner.py"} <= set(trace.path_files)
    assert any(f.startswith("mlx_ferrum/models/") for f in trace.path_files)
    for (caller, callee), calls in trace.edges.items():
        assert caller != callee and calls > 0
        assert caller in trace.files and callee in trace.files
    assert ("mlx_ferrum/engine/engine.py", "mlx_ferrum/runner/llm_runner.py") in trace.edges
    text = request_trace.report(trace, functions=True)
    assert f"{len(trace.files)} files" in text and f"{len(trace.edges)} distinct" in text


def test_loop_erasure_drops_only_the_detour_of_a_callback():
    erase = request_trace.loop_erased
    assert erase(("a", "b", "c")) == ("a", "b", "c")
    # the launch stage calls back into the engine, which then enters the runner
    assert erase(("async", "engine", "launch", "engine", "runner")) == ("async", "engine", "runner")
    assert erase(("a", "b", "c", "b", "d", "a", "e")) == ("a", "e")


@pytest.mark.parametrize("name", ["non-streamed", "streamed"])
def test_the_path_with_detours_kept_contains_the_loop_erased_path(traces, name):
    trace = traces[name]
    assert set(trace.path_files) <= set(trace.path_files_with_detours) <= set(trace.files)
