"""load(), generate(), stream_generate(): thin conveniences over the engine.

One stream at a time: the prompt runs as one request of the
:class:`~mlx_ferrum.engine.Engine` cached on the model for its configuration
(:func:`engine_for`), so it goes through the same scheduler, pipelined step, sampler
and stop handling as batched serving, and repeated calls build nothing twice. For many concurrent
requests use the :class:`~mlx_ferrum.engine.Engine` directly.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, fields
from typing import Any, Iterator, Optional

import mlx.core as mx

from .config import RuntimeConfig
from .engine.engine import Engine
from .engine.sampling import SamplingParams
from .engine.sequence import Prompt
from .errors import ConfigurationError, FerrumError, LoraError
from .executor import LlmExecutor
from .models.loader import check_tokenizer_vocabulary, load_model
from .tokenizer import Tokenizer


def load(path_or_repo_id: str, dtype: Any = None, parallel: Any = None,
         gguf_file: Optional[str] = None) -> tuple[Any, Tokenizer]:
    """Load a model and its tokenizer from a local folder or a Hugging Face hub id.

    Args:
        path_or_repo_id: a checkpoint folder (never touches the network) or a hub repo
            id (downloaded with ``huggingface_hub.snapshot_download``, needed files only).
        dtype: ``mx.float32`` / ``"bfloat16"`` ... to cast float weights; default keeps
            the checkpoint's dtype.
        parallel: a :class:`~mlx_ferrum.distributed.ParallelGroup` (from
            :func:`~mlx_ferrum.distributed.init_group`): the model is split across it
            (tensor or pipeline parallel) and this rank keeps only its part; None loads
            the whole model.
        gguf_file: a GGUF file name inside the folder or hub repo ``path_or_repo_id``
            (a ``.gguf`` path, or a folder with exactly one, needs none). GGUF models
            keep their quantized tensors quantized (see the README's GGUF section).

    Returns:
        ``(model, tokenizer)``; ``model.path`` is the resolved folder.

    Raises:
        ConfigNotFoundError, MissingShardError, UnsupportedArchitectureError,
        WeightShapeError, MissingWeightError, TokenizerError: see :mod:`mlx_ferrum.errors`.
        VocabularyMismatchError: the tokenizer cannot decode ids the model emits (its
            vocabulary is smaller than the model's ``vocab_size`` by more than padding; see
            :func:`~mlx_ferrum.models.loader.check_tokenizer_vocabulary`).
    """
    if parallel is not None:
        from .distributed import load_sharded

        if gguf_file is not None:
            raise ConfigurationError("gguf_file cannot be combined with a parallel load yet: load the GGUF file on one process")
        model, path = load_sharded(path_or_repo_id, parallel, dtype=dtype)
    else:
        model, _config, path = load_model(path_or_repo_id, dtype=dtype, gguf_file=gguf_file)
    tokenizer = Tokenizer.from_pretrained(path)
    check_tokenizer_vocabulary(model.args.vocab_size, tokenizer)
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


def engine_for(model, tokenizer: Optional[Tokenizer], config: Optional[RuntimeConfig] = None) -> Engine:
    """The engine cached on ``model`` for this tokenizer and configuration (built on first use).

    Repeated :func:`generate` / :func:`stream_generate` calls reuse it, so its KV pool,
    compiled decode steps and speculative proposer (a draft checkpoint is loaded once)
    are built once per configuration. The engine is safe to share between threads.

    Args:
        model: from :func:`load`.
        tokenizer: its tokenizer (or None for token-id prompts).
        config: runtime settings; None reads the environment.

    Returns:
        The cached :class:`~mlx_ferrum.engine.Engine`.
    """
    ex = executor_for(model, config)
    key = (id(ex), id(tokenizer))
    cache = model.__dict__.setdefault("_mf_engines", {})
    engine = cache.get(key)
    if engine is None or engine.tokenizer is not tokenizer:
        engine = cache[key] = Engine(model, tokenizer, ex.config, executor=ex)
    return engine


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


def _lora_config(model, config: Optional[RuntimeConfig], lora: str) -> tuple[RuntimeConfig, str]:
    """``config`` with LoRA on, and the adapter name ``lora`` resolves to on its executor
    (a path is registered under itself on first use).

    Raises:
        LoraError: ``lora`` is not a string, or the adapter is refused.
    """
    if not isinstance(lora, str) or not lora:
        raise LoraError(f"lora must be an adapter name or folder (a non-empty string), got {lora!r}")
    cfg = config if config is not None else RuntimeConfig()
    if not cfg.enable_lora:
        cfg = RuntimeConfig(**{**{f.name: getattr(cfg, f.name) for f in fields(cfg)}, "enable_lora": True})
    ex = executor_for(model, cfg)
    if lora not in ex.list_loras():
        ex.add_lora(lora, lora)
    return cfg, lora


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
    lora: Optional[str] = None,
    **sampling: Any,
) -> Iterator[GenerationChunk]:
    """Generate text for one prompt, yielding it as it is produced.

    Args:
        model, tokenizer: from :func:`load`.
        prompt: text, messages (``[{"role", "content"}]``) or token ids.
        config: runtime settings (KV layout ...); default from the environment.
        lora: a LoRA adapter: the name of one registered on this model's executor, or a
            PEFT / mlx-lm adapter folder (or hub id), registered under that string on
            first use. LoRA is switched on in the config when it is off.
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
        LoraError: the adapter cannot be read or does not fit the model.
        Any other exception that fails the request in the engine keeps its own type
        (see :func:`stream_request`).
    """
    params = sampling_params if sampling_params is not None else SamplingParams(**sampling)
    if lora is not None:
        config, lora = _lora_config(model, config, lora)
    yield from stream_request(engine_for(model, tokenizer, config), prompt, params, lora=lora)


def stream_request(engine: Engine, prompt: Prompt, params: SamplingParams,
                   lora: Optional[str] = None) -> Iterator[GenerationChunk]:
    """Run one request through ``engine`` and yield its tokens as :class:`GenerationChunk`.

    The request goes through the engine's own loop (scheduler, pipelined step, sampler,
    stops), so single-stream and batched generation share every line of request logic.
    The engine's stream aborts the request when this iterator is closed early, so its
    cache is freed even when Ctrl-C lands inside the prefill. ``prompt_tps`` is prompt
    tokens over the time to the first token; ``generation_tps`` is tokens after the
    first over the time since it (seconds of ``time.perf_counter``).

    Args:
        engine: an :class:`~mlx_ferrum.engine.Engine` (e.g. :func:`engine_for`'s, or a
            parallel run's lockstep engine on rank 0).
        prompt: text, messages or token ids; params: its sampling settings.
        lora: a registered adapter name, or None for the base model.

    Raises:
        PromptTooLongError, RequestError, SamplingParamsError, UnknownLoraError: refused
            at admission (see :meth:`Engine.add_request`).
        The exception that failed the request in the engine, re-raised as it was
        (:class:`~mlx_ferrum.errors.NonFiniteLogitsError`, a ``StructuredOutputError``,
        a ``LoraError`` ...). FerrumError: the request ended with no exception behind it
        (aborted by another caller, or more than the KV pool can hold).
    """
    want_logprobs = params.logprobs is not None
    t0 = time.perf_counter()
    t_first = None
    n = 0
    for out in engine.stream(prompt, params, lora=lora):
        now = time.perf_counter()
        num_prompt = len(out.prompt_token_ids)
        for k, token in enumerate(out.new_token_ids):
            n += 1
            if t_first is None:
                t_first = now
            last = k == len(out.new_token_ids) - 1
            elapsed = now - t_first
            prompt_time = t_first - t0
            lp = out.logprobs[n - 1] if want_logprobs and out.logprobs else None
            yield GenerationChunk(
                out.delta if last else "",
                token,
                out.finish_reason if last else None,
                prompt_tokens=num_prompt,
                generation_tokens=n,
                prompt_tps=num_prompt / prompt_time if prompt_time > 0 else 0.0,
                generation_tps=(n - 1) / elapsed if n > 1 and elapsed > 0 else 0.0,
                peak_memory=_peak_memory(),
                logprob=lp,
            )
        if out.finished and out.finish_reason in ("error", "abort"):
            if isinstance(out.exception, Exception):
                raise out.exception
            # a request failed by a KeyboardInterrupt or the like (the engine re-raises it
            # where it happened), or ended without an exception
            raise FerrumError(f"generation failed: {out.error or out.finish_reason}") from out.exception


def generate(model, tokenizer: Tokenizer, prompt: Prompt, **kwargs: Any) -> str:
    """The whole completion of :func:`stream_generate` as one string (stop strings trimmed)."""
    return "".join(chunk.text for chunk in stream_generate(model, tokenizer, prompt, **kwargs))
