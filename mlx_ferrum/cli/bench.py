"""``mlx-ferrum bench``: concurrent-serving throughput of the
:class:`~mlx_ferrum.engine.Engine` on token-id prompts, as a table on stdout.

Method (the closed-loop "burst" setting of vLLM's ``benchmark_throughput`` /
``benchmark_serving``, with every request arriving at once):

- ``concurrency`` prompts of ``prompt_tokens`` random token ids (seeded, so every run
  sees the same prompts), greedy decoding, ``max_tokens`` tokens each, EOS ignored;
- every request is submitted at ``t0``; the clock stops when the last one finishes;
- a token's time is when the driver loop has it as a Python int (after
  ``Engine.step()`` returns it);
- one short untimed warm-up burst at the same concurrency first (see
  :func:`warm_up_shape`).

Figures (times in seconds, rates in tokens per second):

- ``ttft_p50`` / ``ttft_p90`` / ``ttft_p99``: time from ``t0`` to a request's first token;
- ``itl_p50`` / ``itl_p90`` / ``itl_p99``: gaps between consecutive tokens of a request;
- ``decode_tps``: steady-state aggregate decode rate: tokens produced after the last
  request received its first token, divided by the time from then to the end (all
  requests decoding together, no prefill in the window);
- ``output_tps``: all generated tokens / wall time; ``total_tps``: (prompt + generated
  tokens) / wall time; ``wall_s``.

The engine always uses the paged KV layout (continuous batching needs it), with
``max_num_seqs = concurrency`` and a pool just large enough (all requests prefilled
and decoded together). ``kv_allocated_bytes`` is the KV memory the engine holds: its
whole pool. numpy is imported where it is used, so ``mlx-ferrum --help`` stays quick.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any, Optional, Sequence

from ..config import RuntimeConfig
from ..errors import ConfigurationError, FerrumError
from .args import HelpFormatter, add_model_args, load_model, positive_int


def add_parser(sub) -> None:
    """Add ``bench`` and its flags to the subcommands ``sub``."""
    b = sub.add_parser("bench", help="engine throughput at several concurrency levels", formatter_class=HelpFormatter)
    add_model_args(b)
    b.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts")
    b.add_argument("--prompt-tokens", type=positive_int, default=64, help="prompt length (tokens)")
    b.add_argument("--max-tokens", type=positive_int, default=64, help="tokens generated per request")
    b.set_defaults(func=cmd_bench)


# --------------------------------------------------------------------------- inputs
def make_prompts(vocab_size: int, concurrency: int, prompt_tokens: int, seed: int = 0) -> list[list[int]]:
    """``concurrency`` lists of ``prompt_tokens`` random token ids in ``[0, vocab_size)``.

    Seeded (numpy ``default_rng(seed)``), so every run sees the same prompts. Outputs of
    a random prompt are meaningless; only the shapes matter.

    Raises:
        ConfigurationError: a count is below 1.
    """
    if concurrency < 1 or prompt_tokens < 1 or vocab_size < 1:
        raise ConfigurationError(
            f"concurrency={concurrency}, prompt_tokens={prompt_tokens}, vocab_size={vocab_size}: each must be >= 1"
        )
    import numpy as np

    rng = np.random.default_rng(seed)
    return rng.integers(0, vocab_size, size=(concurrency, prompt_tokens)).tolist()


def bench_config(concurrency: int, prompt_tokens: int, max_tokens: int, block_size: Optional[int] = None,
                 kv_cache_dtype: Optional[str] = None, kv_float_window: Optional[int] = None) -> RuntimeConfig:
    """The engine configuration of a benchmark run: paged layout, ``max_num_seqs =
    concurrency``, and (unless ``FERRUM_KV_MAX_BLOCKS`` is set) a pool with exactly the
    blocks every request needs at its longest plus 8, so no request is preempted and
    no time goes into zeroing an oversized pool. Other fields come from the environment.

    Raises:
        ConfigurationError: a ``FERRUM_*`` variable is malformed.
    """
    cfg = RuntimeConfig(kv_layout="paged", max_num_seqs=concurrency, block_size=block_size,
                        kv_cache_dtype=kv_cache_dtype, kv_float_window=kv_float_window)
    if cfg.max_num_blocks is None:
        per_seq = -(-(prompt_tokens + max_tokens) // cfg.block_size)
        cfg.max_num_blocks = concurrency * per_seq + 8
    return cfg


def warm_up_shape(prompt_tokens: int, max_tokens: int) -> tuple[int, int]:
    """``(prompt_tokens, max_tokens)`` of each request of the untimed warm-up burst: short
    prompts (at most 16 tokens) and at most 4 generated tokens, enough to run prefill,
    mixed and pure decode steps at the benchmark's concurrency without paying for a
    second full prefill."""
    return max(1, min(prompt_tokens, 16)), max(1, min(max_tokens, 4))


# --------------------------------------------------------------------------- figures
def _pct(xs: Sequence[float], q: float) -> float:
    """Percentile ``q`` (0-100) with linear interpolation (numpy's default); nan when empty."""
    import numpy as np

    return float(np.percentile(np.asarray(xs, dtype=np.float64), q)) if len(xs) else math.nan


def summarize(
    token_times: Sequence[Sequence[float]], t0: float, t_end: float, prompt_tokens: int, max_tokens: int
) -> dict:
    """The figures of one run from each request's token arrival times.

    Args:
        token_times: per request, the ``time.perf_counter()`` of each generated token.
        t0: when the requests were submitted; t_end: when the last one finished.
        prompt_tokens, max_tokens: per request.

    Returns:
        ``concurrency``, ``prompt_tokens``, ``max_tokens``, ``generated_tokens`` and
        the figures of the module docstring (seconds and tokens per second; ``decode_tps`` is
        nan when no token came after the last first token, e.g. ``max_tokens == 1``).
    """
    n = len(token_times)
    firsts = [ts[0] for ts in token_times if ts]
    gen = sum(len(ts) for ts in token_times)
    wall = t_end - t0
    steady = max(firsts) if firsts else t_end
    after = sum(1 for ts in token_times for t in ts if t > steady)
    itl = [b - a for ts in token_times for a, b in zip(ts, ts[1:])]
    ttft = [f - t0 for f in firsts]
    return {
        "concurrency": n,
        "prompt_tokens": prompt_tokens,
        "max_tokens": max_tokens,
        "generated_tokens": gen,
        "wall_s": wall,
        "decode_tps": after / (t_end - steady) if after and t_end > steady else math.nan,
        "output_tps": gen / wall if wall > 0 else math.nan,
        "total_tps": (gen + n * prompt_tokens) / wall if wall > 0 else math.nan,
        "ttft_p50": _pct(ttft, 50),
        "ttft_p90": _pct(ttft, 90),
        "ttft_p99": _pct(ttft, 99),
        "itl_p50": _pct(itl, 50),
        "itl_p90": _pct(itl, 90),
        "itl_p99": _pct(itl, 99),
    }


# --------------------------------------------------------------------------- runs
def run_burst(engine, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    """Submit every prompt to ``engine`` at once (greedy, ``max_tokens`` each, EOS ignored)
    and step it until all finish.

    Returns:
        ``(figures, tokens)``: :func:`summarize`'s figures plus ``kv_allocated_bytes``,
        and the generated ids of each request.

    Raises:
        The exception that failed a request (see ``RequestOutput.exception``), or
        FerrumError for a request that failed without one (e.g. the pool cannot hold it).
    """
    from ..engine.sampling import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t0 = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    times: dict[str, list[float]] = {r: [] for r in ids}
    tokens: dict[str, list[int]] = {r: [] for r in ids}
    left = len(ids)
    while left:
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.request_id not in times:
                continue
            if o.exception is not None:
                raise o.exception
            if o.error is not None:
                raise FerrumError(f"benchmark request {o.request_id} failed: {o.error}")
            for t in o.new_token_ids:
                times[o.request_id].append(now)
                tokens[o.request_id].append(t)
            if o.finished:
                left -= 1
    t_end = time.perf_counter()
    res = summarize([times[r] for r in ids], t0, t_end, len(prompts[0]), max_tokens)
    res["kv_allocated_bytes"] = engine.runner.kv_allocated_bytes()
    return res, [tokens[r] for r in ids]


def bench_engine(
    model,
    tokenizer,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    config: Optional[RuntimeConfig] = None,
    seed: int = 0,
    warmup: bool = True,
    parallel=None,
) -> dict:
    """Serve ``concurrency`` simultaneous greedy requests through a fresh :class:`Engine`.

    Args:
        model, tokenizer: from :func:`mlx_ferrum.load` (tokenizer may be None: the
            prompts are token ids; with a tokenizer the engine also detokenizes, as it
            does when serving).
        concurrency: requests submitted at once (>= 1).
        prompt_tokens: prompt length of each, in tokens; max_tokens: tokens each generates.
        config: engine settings; None = :func:`bench_config` (paged layout).
        seed: prompt seed (:func:`make_prompts`).
        warmup: run one short request burst of the same shape first (not timed).
        parallel: rank 0's :class:`~mlx_ferrum.distributed.ParallelGroup` when the model
            is split across an ``mlx.launch`` group: the engine is then a lockstep engine
            (the other ranks run :func:`follow_bench_engine` with the same arguments).

    Returns:
        The figures of :func:`summarize` (seconds, tokens per second), plus
        ``"engine": "mlx_ferrum"`` (the table's engine column) and ``"tokens"``: the
        generated ids of each request.

    Raises:
        ConfigurationError: bad counts. FerrumError, or the request's own exception: a
        request failed (e.g. the pool in ``config`` cannot hold one request).
    """
    from ..engine import Engine

    if max_tokens < 1:
        raise ConfigurationError(f"max_tokens={max_tokens} must be >= 1")
    prompts = make_prompts(model.args.vocab_size, concurrency, prompt_tokens, seed)
    cfg = config if config is not None else bench_config(concurrency, prompt_tokens, max_tokens)
    if parallel is not None:
        from ..distributed import lockstep_engine

        engine = lockstep_engine(model, tokenizer, cfg, parallel)
    else:
        engine = Engine(model, tokenizer, cfg)
    try:
        if warmup:
            wp, wt = warm_up_shape(prompt_tokens, max_tokens)
            run_burst(engine, make_prompts(model.args.vocab_size, concurrency, wp, seed + 1), wt)
        res, tokens = run_burst(engine, prompts, max_tokens)
    finally:
        if parallel is not None:
            engine.close()
    res["engine"] = "mlx_ferrum"
    res["tokens"] = tokens
    return res


def follow_bench_engine(model, tokenizer, concurrency: int, prompt_tokens: int, max_tokens: int, parallel,
                        config: Optional[RuntimeConfig] = None) -> None:
    """A rank other than 0 of a parallel :func:`bench_engine`: the same engine, running
    the steps rank 0 broadcasts until rank 0 closes it."""
    from ..distributed import lockstep_engine

    cfg = config if config is not None else bench_config(concurrency, prompt_tokens, max_tokens)
    lockstep_engine(model, tokenizer, cfg, parallel).follow()


# --------------------------------------------------------------------------- report
def _ms(x: float) -> str:
    return "nan" if math.isnan(x) else f"{1000 * x:.1f}"


def _secs(x: float) -> str:
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _tps(x: float) -> str:
    return "nan" if math.isnan(x) else f"{x:.1f}"


TABLE_HEADERS = [
    "concurrency", "engine", "decode tok/s", "output tok/s", "total tok/s",
    "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms", "wall s",
]


def table_rows(results: Sequence[dict]) -> list[list[str]]:
    """Rows of :data:`TABLE_HEADERS` for results of :func:`bench_engine` (or of the same shape)."""
    return [
        [
            str(r["concurrency"]), r["engine"], _tps(r["decode_tps"]), _tps(r["output_tps"]), _tps(r["total_tps"]),
            _ms(r["ttft_p50"]), _ms(r["ttft_p90"]), _ms(r["itl_p50"]), _ms(r["itl_p90"]), _ms(r["itl_p99"]),
            _secs(r["wall_s"]),
        ]
        for r in results
    ]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A Markdown table (pastes into ``docs/benchmarks.md``)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = lambda r: "| " + " | ".join(str(c).ljust(w) for c, w in zip(r, widths)) + " |"  # noqa: E731
    out = [line(headers), "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    out.extend(line(r) for r in rows)
    return "\n".join(out)


def parse_concurrency(text: str) -> list[int]:
    """``"1,8,32"`` -> ``[1, 8, 32]``.

    Raises:
        ConfigurationError: an entry is not a positive integer.
    """
    out = []
    for part in str(text).split(","):
        part = part.strip()
        if not part:
            continue
        try:
            v = int(part)
        except ValueError:
            v = 0
        if v < 1:
            raise ConfigurationError(f"--concurrency {text!r}: {part!r} is not a positive integer; use e.g. 1,8,32")
        out.append(v)
    if not out:
        raise ConfigurationError(f"--concurrency {text!r} names no request count; use e.g. 1,8,32")
    return out


def cmd_bench(args: Any) -> int:
    """``mlx-ferrum bench``: the table of :data:`TABLE_HEADERS` for each concurrency level
    on stdout; progress and settings on stderr. The paged layout is always used.

    Args:
        args: the parsed ``bench`` arguments (``model``, ``dtype``, ``gguf_file``,
            ``concurrency``, ``prompt_tokens``, ``max_tokens``, ``kv_cache_dtype`` and the
            parallel sizes).

    Returns:
        0.

    Raises:
        ConfigurationError: malformed ``--concurrency`` / counts. ModelLoadError: the
        checkpoint cannot be loaded.
    """
    import mlx.core as mx

    from ..runner import model_dtype

    levels = parse_concurrency(args.concurrency)
    if args.prompt_tokens < 1 or args.max_tokens < 1:
        raise ConfigurationError(
            f"--prompt-tokens {args.prompt_tokens} / --max-tokens {args.max_tokens}: both must be >= 1"
        )
    err = sys.stderr
    kv_cache_dtype = getattr(args, "kv_cache_dtype", None)
    kv_float_window = getattr(args, "kv_float_window", None)
    # fails before the model loads
    bench_config(1, args.prompt_tokens, args.max_tokens, kv_cache_dtype=kv_cache_dtype, kv_float_window=kv_float_window)
    from ..distributed import init_group

    sizes = {name: getattr(args, name) for name in ("tensor_parallel_size", "pipeline_parallel_size",
                                                     "distributed_backend", "pipeline_split")
             if getattr(args, name, None) is not None}
    group = init_group(RuntimeConfig(**sizes))
    model, tokenizer = load_model(args, group)
    if group is not None and not group.is_driver:
        for c in levels:
            follow_bench_engine(model, tokenizer, c, args.prompt_tokens, args.max_tokens, group,
                                config=bench_config(c, args.prompt_tokens, args.max_tokens,
                                                    kv_cache_dtype=kv_cache_dtype, kv_float_window=kv_float_window))
        return 0
    a = model.args
    print(
        f"bench: {args.model} ({a.model_type}, {a.num_hidden_layers} layers, hidden {a.hidden_size}, "
        f"dtype {str(model_dtype(model)).replace('mlx.core.', '')}) | prompt {args.prompt_tokens} tokens, "
        f"{args.max_tokens} generated per request, greedy, EOS ignored | backend "
        f"{'gpu' if mx.metal.is_available() else 'cpu'}"
        + (f" | {group.mode} parallel over {group.size} ranks" if group is not None else ""),
        file=err,
    )
    results = []
    for c in levels:
        print(f"  concurrency {c}: mlx_ferrum ...", file=err, flush=True)
        config = bench_config(c, args.prompt_tokens, args.max_tokens, kv_cache_dtype=kv_cache_dtype,
                              kv_float_window=kv_float_window)
        results.append(bench_engine(model, tokenizer, c, args.prompt_tokens, args.max_tokens, config=config,
                                    parallel=group))
    print(format_table(TABLE_HEADERS, table_rows(results)))
    return 0

