"""Which files of ``mlx_ferrum`` one chat request passes through, measured.

The server is built as ``mlx-ferrum serve`` builds it (its own argument parser,
``serve_config``, ``load_model``, then ``Engine`` -> ``AsyncEngine`` -> ``OpenAIServing``
-> ``build_app``, as ``run_server`` does), minus uvicorn: the requests go to the ASGI app
in-process (``httpx.ASGITransport``) on the main thread's event loop, as uvicorn would
run it. ``sys.settrace`` and ``threading.settrace`` are installed before the engine's
stepping thread starts, so every thread the request touches is traced: the event loop,
the stepping thread and the worker threads that tokenize prompts and parse bodies.

One warm-up request of each kind runs first, unrecorded, so files entered only at import
or on a first call (compiling the decode step, building caches) are excluded. Then one
non-streamed and one streamed ``/v1/chat/completions`` request are recorded: every file
under ``mlx_ferrum/`` in which a function is entered (a Python ``call`` event, including a
generator or coroutine resuming), in first-entered order. What the engine's thread
does with no request at all (it polls ``has_unfinished_requests``) is sampled between the
warm-up and the recording, and those calls (same functions, same callers) are left out.

Each file is then classed:

* **path**: control passes through it on the way down to the kernels. The seed is the
  kernels layer (``mlx_ferrum/kernels/``, or the attention layer when no kernel file is
  entered); a file is added when it is on a thread's call stack at the moment a path file
  is entered (so the event loop's route handler joins through ``async_engine.py``, which
  the stepping thread's stack links to the kernels). A stack is read as the route control
  took through files with its detours erased: when a file appears on it twice (a callback
  into a file already passed, such as the launch stage ending a request through the
  engine), the files between the two are a detour, not a way down, and are dropped (the
  loop-erased route; the report also prints the count with the detours kept). The results come back up through
  the returns of these same files.
* **helper**: everything else the request entered: services the path calls (tokenizing,
  sampling, stops, detokenizing, the reply's translation, config, errors ...).

A *hop* is a call from one ``mlx_ferrum`` file into another: the callee's nearest
``mlx_ferrum`` caller frame on the same thread (library frames in between, such as
FastAPI's or ``mx.compile``'s, are skipped). The edges are counted distinct.

Usage (from the repository root)::

    PYTHONPATH=$PWD python benchmarks/request_trace.py                 # stories260K if found, else a tiny random model
    PYTHONPATH=$PWD python benchmarks/request_trace.py --model PATH -- --kv-layout contiguous

Arguments after ``--`` go to ``mlx-ferrum serve``'s parser (``--model`` is given already).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

REPO = Path(__file__).resolve().parents[1]

#: A chat template for checkpoints without one (stories260K): BOS, then the message texts.
PLAIN_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"

#: The tiny model used when stories260K is not found (Qwen2 shapes, random weights,
#: word-level tokens t0 .. t255): only the code path matters here, not the text.
TINY_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"], "hidden_act": "silu", "hidden_size": 32, "intermediate_size": 64,
    "max_position_embeddings": 256, "model_type": "qwen2", "num_attention_heads": 4, "num_hidden_layers": 2,
    "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": True,
    "vocab_size": 256, "bos_token_id": None, "eos_token_id": 1, "initializer_range": 0.02,
}

#: How long the idle engine's thread is watched for the calls it makes without a request.
IDLE_SAMPLE_S = 0.5

#: The files of the deepest layers, where the path's seed is looked for (kernels first).
KERNEL_PREFIXES = ("mlx_ferrum/kernels/",)
ATTENTION_FILES = ("mlx_ferrum/layers/attention.py", "mlx_ferrum/layers/quantized_backends.py")


@dataclass
class RequestTrace:
    """What one recorded request entered.

    Attributes:
        name: ``"non-streamed"`` or ``"streamed"``.
        files: repository-relative paths (``mlx_ferrum/...``), in first-entered order.
        threads: for each file, the name of the thread that entered it first.
        edges: ``{(caller file, callee file): number of calls}``, in first-seen order.
        functions: for each file, the qualified names of the functions entered, in first-entered order.
        path_files: the files on the way to the kernels (see the module's docstring), in ``files`` order.
        path_files_with_detours: the same with every stack read whole (callbacks' detours kept).
        helper_files: the other files, in ``files`` order.
    """

    name: str
    files: list[str] = field(default_factory=list)
    threads: dict[str, str] = field(default_factory=dict)
    edges: dict[tuple[str, str], int] = field(default_factory=dict)
    functions: dict[str, list[str]] = field(default_factory=dict)
    path_files: list[str] = field(default_factory=list)
    path_files_with_detours: list[str] = field(default_factory=list)
    helper_files: list[str] = field(default_factory=list)
    #: entries skipped because the idle engine makes them too (its stepping thread's polling)
    idle_entries: int = 0
    # distinct tuples of the mlx_ferrum files on a stack when a file was entered (outermost first)
    stacks: set = field(default_factory=set, repr=False)


class FileTracer:
    """A ``sys.settrace`` function that records mlx_ferrum file entries while a phase is set."""

    def __init__(self, package_dir: Path):
        self.package_dir = str(package_dir.resolve()) + os.sep
        self.root = str(package_dir.resolve().parent) + os.sep
        self.phase: Optional[RequestTrace] = None
        #: while set, the function-level stacks seen are collected here (the idle engine's polling)
        self.idle: Optional[set] = None
        #: function-level stacks of the idle engine: entries with one of these are not the request's
        self.idle_stacks: set = set()
        #: threads of this script (waiting for the engine to go idle): never recorded
        self.ignored_threads: set = set()
        #: after remove(): a thread that still calls this function drops it
        self.retired = False
        self._names: dict[str, Optional[str]] = {}
        self._lock = threading.Lock()

    def _rel(self, filename: str) -> Optional[str]:
        rel = self._names.get(filename, 0)
        if rel == 0:
            path = os.path.realpath(filename) if filename and not filename.startswith("<") else ""
            rel = path[len(self.root):] if path.startswith(self.package_dir) else None
            self._names[filename] = rel
        return rel

    def __call__(self, frame, event, arg):
        trace, idle = self.phase, self.idle
        if self.retired:
            sys.settrace(None)  # a worker thread started while tracing: stop paying for the call
            return None
        if (trace is None and idle is None) or event != "call" or threading.get_ident() in self.ignored_threads:
            return None
        rel = self._rel(frame.f_code.co_filename)
        if rel is None:
            return None
        stack = [rel]
        functions = [(rel, frame.f_code.co_name)]
        caller = None
        f = frame.f_back
        while f is not None:
            up = self._rel(f.f_code.co_filename)
            if up is not None:
                functions.append((up, f.f_code.co_name))
                if caller is None:
                    caller = up
                if up != stack[-1]:
                    stack.append(up)
            f = f.f_back
        functions = tuple(functions)
        if idle is not None:
            with self._lock:
                idle.add(functions)
            return None
        if functions in self.idle_stacks:
            trace.idle_entries += 1
            return None
        with self._lock:
            if rel not in trace.threads:
                trace.files.append(rel)
                trace.threads[rel] = threading.current_thread().name
                trace.functions[rel] = []
            name = frame.f_code.co_qualname
            if name not in trace.functions[rel]:
                trace.functions[rel].append(name)
            if caller is not None and caller != rel:
                trace.edges[(caller, rel)] = trace.edges.get((caller, rel), 0) + 1
            trace.stacks.add(tuple(reversed(stack)))
        return None

    def install(self) -> None:
        """Trace this thread and every thread started from now on."""
        threading.settrace(self)
        sys.settrace(self)

    def remove(self, previous=None) -> None:
        """Stop recording; restore ``previous`` as this thread's trace function."""
        self.phase = None
        self.retired = True
        threading.settrace(None)
        sys.settrace(previous)


def loop_erased(stack: tuple) -> tuple:
    """``stack`` (files, outermost first) with every detour removed: when a file appears
    again, the files since its first appearance are dropped, e.g.
    ``(engine, launch, engine, runner) -> (engine, runner)``."""
    route: list = []
    for f in stack:
        if f in route:
            del route[route.index(f) + 1:]
        else:
            route.append(f)
    return tuple(route)


def classify(trace: RequestTrace) -> None:
    """Fill ``trace.path_files`` / ``helper_files`` (see the module's docstring), and
    ``path_files_with_detours``: the path when every stack is read whole."""
    trace.path_files = path_files(trace, erase_loops=True)
    trace.path_files_with_detours = path_files(trace, erase_loops=False)
    trace.helper_files = [f for f in trace.files if f not in trace.path_files]


def path_files(trace: RequestTrace, erase_loops: bool) -> list[str]:
    """The path's files, in ``trace.files`` order, over loop-erased stacks or whole ones."""
    seed = {f for f in trace.files if f.startswith(KERNEL_PREFIXES)} or {f for f in trace.files if f in ATTENTION_FILES}
    path = set(seed)
    stacks = {loop_erased(s) for s in trace.stacks} if erase_loops else trace.stacks
    grown = True
    while grown:
        grown = False
        for stack in stacks:
            if stack[-1] in path and not path.issuperset(stack):
                path.update(stack)
                grown = True
    return [f for f in trace.files if f in path]


def find_stories() -> Optional[Path]:
    """stories260K from ``FERRUM_SHARED_MODELS``, ``../shared/models`` or ``/work/shared/models`` (None: absent)."""
    roots = [os.environ.get("FERRUM_SHARED_MODELS"), REPO.parent / "shared" / "models", "/work/shared/models"]
    for root in roots:
        if root and (Path(root) / "stories260K" / "config.json").is_file():
            return Path(root) / "stories260K"
    return None


def tiny_checkpoint(folder: Path) -> Path:
    """A random-weight two-layer Qwen2 checkpoint in ``folder`` (see :data:`TINY_CONFIG`)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from common import build_random_checkpoint

    return build_random_checkpoint(Path(folder), TINY_CONFIG, dtype="float32")


def _has_chat_template(model_path: Path) -> bool:
    config = model_path / "tokenizer_config.json"
    if (model_path / "chat_template.jinja").is_file():
        return True
    return config.is_file() and bool(json.loads(config.read_text()).get("chat_template"))


def _wait_idle(engine, tracer: FileTracer, timeout_s: float = 30.0) -> None:
    """Until the engine holds no request, plus a moment for its stepping thread to park
    (this thread's own calls into the engine are not recorded)."""
    tracer.ignored_threads.add(threading.get_ident())
    try:
        end = time.monotonic() + timeout_s
        while engine.has_unfinished_requests() and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.2)
    finally:  # the executor reuses its threads: one may tokenize a prompt next
        tracer.ignored_threads.discard(threading.get_ident())


async def _chat(app, body: dict) -> str:
    import httpx

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://trace") as client:
        r = await client.post("/v1/chat/completions", json=body, timeout=120)
        if r.status_code != 200:
            raise RuntimeError(f"/v1/chat/completions answered {r.status_code}: {r.text[:500]}")
        return r.text


def trace_chat_requests(model_path: Path, serve_args: Sequence[str] = (), prompt: Optional[str] = None,
                        max_tokens: int = 16) -> dict[str, RequestTrace]:
    """Serve ``model_path`` in-process as ``mlx-ferrum serve`` does and trace one non-streamed
    and one streamed chat request (after one unrecorded warm-up of each).

    Args:
        model_path: a checkpoint folder (or anything ``serve --model`` takes).
        serve_args: more ``mlx-ferrum serve`` flags (``--kv-layout contiguous`` ...).
        prompt: the user message (None: "Once upon a time", or word-level tokens for the tiny model).
        max_tokens: tokens generated per request (greedy).

    Returns:
        ``{"non-streamed": RequestTrace, "streamed": RequestTrace}``, classified.

    Raises:
        RuntimeError: a request was not answered with 200.
    """
    from dataclasses import fields

    from mlx_ferrum.cli import build_parser
    from mlx_ferrum.cli.args import load_model
    from mlx_ferrum.cli.serve import _serve_sampling_defaults, serve_config
    from mlx_ferrum.engine import AsyncEngine, Engine
    from mlx_ferrum.server.app import build_app
    from mlx_ferrum.server.limits import ServerLimits
    from mlx_ferrum.server.metrics import ServerMetrics
    from mlx_ferrum.server.serving import OpenAIServing

    model_path = Path(model_path)
    argv = ["serve", "--model", str(model_path), "--served-model-name", "m", *serve_args]
    args = build_parser().parse_args(argv)
    config = serve_config(args)
    limits = ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})
    template = PLAIN_TEMPLATE if args.chat_template is None and not _has_chat_template(model_path) else None
    if args.chat_template is not None:
        template = Path(args.chat_template).read_text()
    model, tokenizer = load_model(args)
    if prompt is None:
        prompt = "Once upon a time" if tokenizer.encode("Once upon a time") else "t5 t6 t7 t8"

    import mlx_ferrum

    tracer = FileTracer(Path(mlx_ferrum.__file__).parent)
    previous = sys.gettrace()
    tracer.install()  # before the stepping thread starts: threading.settrace reaches only new threads
    engine = Engine(model, tokenizer, config)
    async_engine = AsyncEngine(engine)
    traces: dict[str, RequestTrace] = {}
    try:
        metrics = ServerMetrics(engine)
        serving = OpenAIServing(async_engine, ["m"], template, metrics, limits,
                                sampling_defaults=_serve_sampling_defaults(args, model))
        app = build_app(serving, metrics, None, limits, web_ui=args.web_ui, pooling=args.pooling)
        body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0}

        async def run_all() -> None:
            for stream in (False, True):  # warm-up: imports, first calls, the compiled step's traces
                await _chat(app, dict(body, stream=stream))
            await asyncio.to_thread(_wait_idle, engine, tracer)
            # what the engine's thread does with no request (it polls): not the request's
            tracer.idle = set()
            await asyncio.sleep(IDLE_SAMPLE_S)
            tracer.idle_stacks, tracer.idle = tracer.idle, None
            for name, stream in (("non-streamed", False), ("streamed", True)):
                tracer.phase = traces[name] = RequestTrace(name)
                await _chat(app, dict(body, stream=stream))
                await asyncio.to_thread(_wait_idle, engine, tracer)
                tracer.phase = None

        asyncio.run(run_all())
    finally:
        tracer.remove(previous)
        async_engine.shutdown()
    for trace in traces.values():
        classify(trace)
    return traces


def _layer(rel: str) -> str:
    parts = rel.split("/")
    return parts[1] if len(parts) > 2 else parts[1].removesuffix(".py")


def report(trace: RequestTrace, functions: bool = False) -> str:
    """A printable account of ``trace``: files in order (with ``functions``, the functions
    entered in each), counts, hops."""
    head = (f"== {trace.name} /v1/chat/completions: {len(trace.files)} files "
            f"({len(trace.path_files)} on the path to the kernels, {len(trace.helper_files)} helpers)")
    lines = [head]
    for i, f in enumerate(trace.files, 1):
        kind = "path  " if f in trace.path_files else "helper"
        lines.append(f"{i:3d}. {kind} {f:48s} [{trace.threads[f]}]")
        if functions:
            lines.append("       " + ", ".join(trace.functions[f]))
    lines.append(f"-- with the detours of callbacks kept (stacks read whole): "
                 f"{len(trace.path_files_with_detours)} on the path")
    lines.append(f"-- {trace.idle_entries} entries skipped: the idle engine's thread makes them too")
    lines.append(f"-- hops: {len(trace.edges)} distinct (caller file -> callee file) edges "
                 f"between {len({f for e in trace.edges for f in e})} files; "
                 f"{sum(1 for a, b in trace.edges if _layer(a) != _layer(b))} cross a package boundary")
    for (a, b), n in trace.edges.items():
        lines.append(f"     {a} -> {b}  ({n} calls)")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    serve_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, serve_args = argv[:i], argv[i + 1:]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint folder (default: stories260K, else a tiny random one)")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--functions", action="store_true", help="list the functions entered in each file")
    parser.add_argument("--json", default=None, help="also write the traces to this JSON file")
    opts = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(opts.model) if opts.model else (find_stories() or tiny_checkpoint(Path(tmp) / "tiny"))
        print(f"model: {model}; serve flags: {' '.join(serve_args) or '(defaults)'}")
        traces = trace_chat_requests(model, serve_args, max_tokens=opts.max_tokens)
    for trace in traces.values():
        print(report(trace, opts.functions))
    union = [f for t in traces.values() for f in t.files]
    union = list(dict.fromkeys(union))
    path = {f for t in traces.values() for f in t.path_files}
    edges = {e for t in traces.values() for e in t.edges}
    print(f"== both requests: {len(union)} files ({sum(f in path for f in union)} path, "
          f"{sum(f not in path for f in union)} helpers), {len(edges)} distinct hops")
    if opts.json:
        Path(opts.json).write_text(json.dumps({name: {"files": t.files, "threads": t.threads, "path": t.path_files,
                                                      "helpers": t.helper_files, "functions": t.functions,
                                                      "edges": [[a, b, n] for (a, b), n in t.edges.items()]}
                                               for name, t in traces.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
