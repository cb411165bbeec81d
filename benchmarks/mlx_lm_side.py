"""mlx-lm's side of the concurrent-serving benchmark: the same burst as
``mlx_ferrum.cli.bench.bench_engine`` (``mlx-ferrum bench``), served by mlx-lm's
``BatchGenerator``.

Method: see ``mlx_ferrum/cli/bench.py`` (identical prompts from the same seed, greedy,
EOS ignored, every request submitted at ``t0``). mlx-lm runs with
``prefill_batch_size = completion_batch_size = concurrency``, the engine's admission
(all requests prefilled and decoded together). ``kv_allocated_bytes`` is mlx-lm's
``prompt_cache_nbytes`` (buffer capacity) at its largest during the run.

This is development code: it lives outside the runtime package, which never needs mlx-lm.
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_ferrum.cli.bench import make_prompts, summarize, warm_up_shape  # noqa: E402
from mlx_ferrum.errors import ConfigurationError  # noqa: E402

RATIO_HEADERS = ["concurrency", "decode tok/s", "output tok/s", "TTFT p50", "ITL p50", "wall"]


def import_mlx_lm():
    """``mlx_lm`` (a dev dependency), imported on first use.

    Raises:
        ConfigurationError: mlx-lm is not installed (the message says how to install it).
    """
    try:
        import mlx_lm  # noqa: F401
        from mlx_lm.generate import BatchGenerator  # noqa: F401
    except ImportError as e:
        raise ConfigurationError(
            f"the mlx-lm comparison needs the mlx-lm package, which is not importable ({e}): "
            "install it with `pip install mlx-lm` (or `pip install -e .[dev]`)"
        ) from None
    return mlx_lm


def parameter_dtype(model):
    """The dtype of ``model``'s first floating-point parameter (None when it has none)."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    for _, value in tree_flatten(model.parameters()):
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return None


def load_mlx_lm_model(model_path, dtype=None):
    """mlx-lm's model for a checkpoint folder (``mlx_lm.utils.load_model``; the prompts are
    token ids, so no tokenizer is loaded), cast to ``dtype`` (an ``mx.Dtype`` or its name)
    when given, weights evaluated.

    Raises:
        ConfigurationError: mlx-lm is missing.
    """
    import mlx.core as mx

    import_mlx_lm()
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_path))
    if dtype is not None:
        dt = getattr(mx, dtype) if isinstance(dtype, str) else dtype
        model.set_dtype(dt)
    mx.eval(model.parameters())
    return model


def run_mlx_lm_batch(model, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    # the same admission as the engine's: every request prefilled and decoded at once
    gen = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=n, prefill_batch_size=n)
    kv_bytes = 0
    try:
        t0 = time.perf_counter()
        uids = gen.insert(prompts, [max_tokens] * n)
        times: dict[int, list[float]] = {u: [] for u in uids}
        tokens: dict[int, list[int]] = {u: [] for u in uids}
        left = n
        while left:
            _, resps = gen.next()
            now = time.perf_counter()
            kv_bytes = max(kv_bytes, gen.prompt_cache_nbytes)
            for r in resps:
                times[r.uid].append(now)
                tokens[r.uid].append(int(r.token))
                if r.finish_reason is not None:
                    left -= 1
        t_end = time.perf_counter()
    finally:
        gen.close()
    res = summarize([times[u] for u in uids], t0, t_end, len(prompts[0]), max_tokens)
    res["kv_allocated_bytes"] = kv_bytes
    return res, [tokens[u] for u in uids]


def bench_mlx_lm_batch(
    model_path,
    concurrency: int,
    prompt_tokens: int,
    max_tokens: int,
    seed: int = 0,
    warmup: bool = True,
    dtype=None,
    model=None,
) -> dict:
    """The same burst as ``mlx_ferrum.cli.bench.bench_engine``, served by mlx-lm's ``BatchGenerator``.

    Args:
        model_path: checkpoint folder, loaded with mlx-lm's own loader (ignored when
            ``model`` is given).
        concurrency, prompt_tokens, max_tokens, seed, warmup: as for
            ``bench_engine`` (same seed = same prompts).
        dtype: cast the loaded model (``mx.Dtype`` or name); None keeps the checkpoint's.
        model: an mlx-lm model already loaded (skips loading).

    Returns:
        The figures of :func:`summarize`, plus ``"engine": "mlx-lm"`` and ``"tokens"``
        (the generated ids of each request), as ``bench_engine`` returns them.

    Raises:
        ConfigurationError: mlx-lm is missing, or bad counts.
    """
    import_mlx_lm()
    if max_tokens < 1:
        raise ConfigurationError(f"max_tokens={max_tokens} must be >= 1")
    lm = model if model is not None else load_mlx_lm_model(model_path, dtype)
    vocab = lm.args.vocab_size
    prompts = make_prompts(vocab, concurrency, prompt_tokens, seed)
    if warmup:
        wp, wt = warm_up_shape(prompt_tokens, max_tokens)
        run_mlx_lm_batch(lm, make_prompts(vocab, concurrency, wp, seed + 1), wt)
    res, toks = run_mlx_lm_batch(lm, prompts, max_tokens)
    res["engine"] = "mlx-lm"
    res["tokens"] = toks
    return res


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of requests whose greedy tokens agree up to the shorter length: a sanity
    figure (bf16 rounding in different batch shapes may flip near-ties)."""
    if not a:
        return math.nan
    same = sum(1 for x, y in zip(a, b) if x[: min(len(x), len(y))] == y[: min(len(x), len(y))])
    return same / len(a)


def ratio_row(ferrum: dict, lm: dict) -> list[str]:
    """Row of :data:`RATIO_HEADERS`: ferrum / mlx-lm of each figure (above 1 is better
    for the rates, below 1 for the times)."""
    def q(k):
        a, b = ferrum[k], lm[k]
        return "nan" if not b or math.isnan(a) or math.isnan(b) else f"{a / b:.2f}x"

    return [str(ferrum["concurrency"]), q("decode_tps"), q("output_tps"), q("ttft_p50"), q("itl_p50"), q("wall_s")]
