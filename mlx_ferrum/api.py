"""load(), generate(), stream_generate(): thin conveniences over an executor.

One stream at a time: a prompt is prefilled, then decoded token by token through the
model's cached :class:`~mlx_ferrum.executor.LlmExecutor`, sampled with
:func:`~mlx_ferrum.engine.sampling.sample`, and detokenized as it streams. For many
concurrent requests use :class:`~mlx_ferrum.engine.Engine`.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, fields
from typing import Any, Iterator, Optional

import mlx.core as mx

from .config import RuntimeConfig
from .engine.engine import context_full_message
from .engine.prompt import Prompt, encode_prompt
from .engine.sampling import SamplerState, SamplingParams, sample
from .engine.stop import StopStringMatcher, emit_token
from .errors import NonFiniteLogitsError, PromptTooLongError
from .executor import DecodeInput, LlmExecutor, PrefillInput
from .models.loader import load_model
from .tokenizer import Tokenizer

_stream_ids = itertools.count()

def load(path_or_repo_id: str, dtype: Any = None) -> tuple[Any, Tokenizer]:
    """Load a model and its tokenizer from a local folder or a Hugging Face hub id.

    Args:
        path_or_repo_id: a checkpoint folder (never touches the network) or a hub repo
            id (downloaded with ``huggingface_hub.snapshot_download``, needed files only).
        dtype: ``mx.float32`` / ``"bfloat16"`` ... to cast float weights; default keeps
            the checkpoint's dtype.

    Returns:
        ``(model, tokenizer)``; ``model.path`` is the resolved folder.

    Raises:
        ConfigNotFoundError, MissingShardError, UnsupportedArchitectureError,
        WeightShapeError, MissingWeightError, TokenizerError: see :mod:`mlx_ferrum.errors`.
    """
    model, _config, path = load_model(path_or_repo_id, dtype=dtype)
    tokenizer = Tokenizer.from_pretrained(path)
    model.path = path
    return model, tokenizer


def executor_for(model, config: Optional[RuntimeConfig] = None) -> LlmExecutor:
    """The executor cached on ``model`` for this configuration (built on first use).

    For single-stream use, a paged pool without ``FERRUM_KV_MAX_BLOCKS`` is sized for
    one sequence at full capacity rather than from the memory budget.
    """
    cfg = config if config is not None else RuntimeConfig()
    if cfg.kv_layout == "paged" and cfg.max_num_blocks is None:
        capacity = cfg.kv_capacity or model.args.max_position_embeddings
        cfg = RuntimeConfig(**{f.name: getattr(cfg, f.name) for f in fields(cfg)})
        cfg.max_num_blocks = -(-capacity // cfg.block_size)
    key = tuple(getattr(cfg, f.name) for f in fields(cfg))
    cache = model.__dict__.setdefault("_mf_executors", {})
    ex = cache.get(key)
    if ex is None:
        ex = cache[key] = LlmExecutor(model, cfg, model_id=str(getattr(model, "path", "model")))
    return ex


@dataclass
class GenerationChunk:
    """One step of :func:`stream_generate`.

    Attributes:
        text: new text (may be empty while a multi-byte character or a possible stop
            string is held back).
        token: the token id generated at this step (None for the final flush chunk).
        finish_reason: ``None`` while running, then ``"stop"`` or ``"length"``.
        prompt_tokens, generation_tokens: counts so far.
        prompt_tps, generation_tps: tokens per second of prefill and of decode.
        peak_memory: peak bytes MLX has allocated in this process.
        logprob: log-probability of ``token`` when ``logprobs`` was asked for.
    """

    text: str
    token: Optional[int]
    finish_reason: Optional[str] = None
    prompt_tokens: int = 0
    generation_tokens: int = 0
    prompt_tps: float = 0.0
    generation_tps: float = 0.0
    peak_memory: int = 0
    logprob: Optional[float] = None


def _peak_memory() -> int:
    try:
        return int(mx.get_peak_memory())
    except AttributeError:  # older MLX
        return int(mx.metal.get_peak_memory())


def stream_generate(
    model,
    tokenizer: Tokenizer,
    prompt: Prompt,
    *,
    config: Optional[RuntimeConfig] = None,
    sampling_params: Optional[SamplingParams] = None,
    **sampling: Any,
) -> Iterator[GenerationChunk]:
    """Generate text for one prompt, yielding it as it is produced.

    Args:
        model, tokenizer: from :func:`load`.
        prompt: text, messages (``[{"role", "content"}]``) or token ids.
        config: runtime settings (KV layout ...); default from the environment.
        sampling_params: a :class:`SamplingParams`, or give its fields as keywords
            (``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``min_p``,
            ``repetition_penalty``, ``seed``, ``stop``, ``stop_token_ids``, ...).

    Yields:
        :class:`GenerationChunk`; the last has ``finish_reason`` ``"stop"`` (EOS, a stop
        token id or a stop string, which is trimmed) or ``"length"`` (``max_tokens`` or
        the context is full).

    Raises:
        PromptTooLongError: the prompt fills the whole context.
        SamplingParamsError: a sampling field is out of range.
        RequestError: a prompt of the wrong type, or a token id outside the vocabulary.
        NonFiniteLogitsError: the model produced NaN or Inf logits (the cache is released).
    """
    params = sampling_params if sampling_params is not None else SamplingParams(**sampling)
    ex = executor_for(model, config)
    ids = encode_prompt(tokenizer, prompt, vocab_size=model.args.vocab_size)
    if len(ids) >= ex.kv_capacity():
        raise PromptTooLongError(context_full_message(len(ids), ex.kv_capacity(), model.args.max_position_embeddings))
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos:
        stop_ids |= set(tokenizer.eos_token_ids)
    state = SamplerState.create(params, ids)
    detok = tokenizer.detokenizer()
    matcher = StopStringMatcher(params.stop)
    want_logprobs = params.logprobs is not None

    # the id is fixed before the prefill so the finally below frees the cache even when
    # Ctrl-C lands inside the prefill
    cache_id = f"stream-{next(_stream_ids)}"
    try:
        t0 = time.perf_counter()
        out = ex.prefill(PrefillInput(input_ids=mx.array([ids], dtype=mx.int32), cache_id=cache_id))
        handle = out.kv_cache
        logits = out.logits[:, -1, :]
        prompt_time = time.perf_counter() - t0
        prompt_tps = len(ids) / prompt_time if prompt_time > 0 else 0.0
        t_dec = time.perf_counter()
        n = 0
        while True:
            res = sample(logits, [state], record=False)
            finite = mx.all(mx.isfinite(logits))
            mx.eval(res.tokens, finite)
            if not finite.item():
                raise NonFiniteLogitsError(
                    "the model produced NaN or Inf logits: check the checkpoint's weights and rope_theta, "
                    "or load it in float32"
                )
            token = int(res.tokens[0])
            state.append(token)
            n += 1
            lp = float(res.logprobs[0]) if want_logprobs and res.logprobs is not None else None
            elapsed = time.perf_counter() - t_dec
            stats = dict(
                prompt_tokens=len(ids),
                generation_tokens=n,
                prompt_tps=prompt_tps,
                generation_tps=(n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
                peak_memory=_peak_memory(),
            )
            out_of_room = n >= params.max_tokens or handle.num_tokens + 1 >= ex.kv_capacity()
            text, reason = emit_token(detok, matcher, token, stop_ids, out_of_room)
            yield GenerationChunk(text, token, reason, logprob=lp, **stats)
            if reason is not None:
                return
            step = ex.decode(DecodeInput(input_ids=mx.array([[token]], dtype=mx.int32), kv_cache=handle))
            handle = step.kv_cache
            logits = step.logits
    finally:
        ex.release_cache(cache_id)


def generate(model, tokenizer: Tokenizer, prompt: Prompt, **kwargs: Any) -> str:
    """The whole completion of :func:`stream_generate` as one string (stop strings trimmed)."""
    return "".join(chunk.text for chunk in stream_generate(model, tokenizer, prompt, **kwargs))
