"""RuntimeConfig: every runtime knob, each readable from its ``FERRUM_*`` variable.

Precedence: an explicit constructor argument beats the environment, and the
environment beats the default. A field left as ``None`` is resolved in
``__post_init__``; after construction every field holds a concrete, validated value
(``max_num_blocks`` and ``kv_capacity`` may stay ``None``: they are then sized from
the memory budget and the model, by the model runner).

Names follow ferrum (``FERRUM_METAL_PAGED_KV``) and vLLM (``block_size``,
``max_num_seqs``, ``max_num_batched_tokens``).

Why this module is one file of over 500 lines: every runtime knob with its FERRUM_*
variable, default, parsing and validation in one place: it is the reference users and
the CLI read.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

from .errors import ConfigurationError, InsufficientMemoryError

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _parse_bool(var: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ConfigurationError(f"{var}={raw!r} is not a boolean: use 1 or 0")


def _parse_int(var: str, raw: str) -> int:
    try:
        return int(raw.strip())
    except ValueError:
        raise ConfigurationError(f"{var}={raw!r} is not an integer: set it to a whole number") from None


def _parse_float(var: str, raw: str) -> float:
    try:
        return float(raw.strip())
    except ValueError:
        raise ConfigurationError(f"{var}={raw!r} is not a number: set it to e.g. 0.7") from None


def _parse_layout(var: str, raw: str) -> str:
    v = raw.strip().lower()
    if v in ("paged",) or v in _TRUE:
        return "paged"
    if v in ("contiguous",) or v in _FALSE:
        return "contiguous"
    raise ConfigurationError(f"{var}={raw!r} is not valid: use 1 (paged) or 0 (contiguous)")


#: The accepted ``kv_cache_dtype`` values (vLLM's ``--kv-cache-dtype`` names): "auto" stores
#: K and V in the model dtype; "int8" / "int4" store group-wise quantized codes with float16
#: scales (see ``kernels/quantized_reference.py`` for the format).
KV_CACHE_DTYPES = ("auto", "int8", "int4")


def _parse_kv_cache_dtype(var: str, raw: str) -> str:
    return raw.strip().lower()


def _parse_speculative(var: str, raw: str) -> Optional[str]:
    v = raw.strip()
    if v.lower() in ("", "0", "off", "none", "false", "no"):
        return None
    return "ngram" if v.lower() == "ngram" else v


#: ``mx.distributed.init`` backends (``any``: the first one that is up)
DISTRIBUTED_BACKENDS = ("any", "ring", "jaccl", "mpi", "nccl")


def _parse_backend(var: str, raw: str) -> str:
    v = raw.strip().lower()
    if v not in DISTRIBUTED_BACKENDS:
        raise ConfigurationError(f"{var}={raw!r} is not valid: use one of {', '.join(DISTRIBUTED_BACKENDS)}")
    return v


def _parse_split(var: str, raw: str) -> Optional[str]:
    v = raw.strip().replace(" ", "")
    if not v:
        return None
    parts = v.split(",")
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigurationError(f"{var}={raw!r} is not valid: give layers per pipeline rank, e.g. 3,2")
    return v


#: the compact spelling of both parallel sizes, read when neither size is given explicitly
PARALLEL_VARIABLE = "FERRUM_PARALLEL"

_PARALLEL_KEYS = {"tensor": "tensor_parallel_size", "pipeline": "pipeline_parallel_size"}


def parse_parallel(var: str, raw: str) -> dict[str, int]:
    """Parse the compact parallel spelling: ``none``, ``tensor=N``, ``pipeline=N`` or
    ``tensor=N,pipeline=M`` (either order, spaces ignored) into the two size fields.

    Returns:
        ``{"tensor_parallel_size": N, "pipeline_parallel_size": M}`` (a mode left out is 1).

    Raises:
        ConfigurationError: anything else (an unknown mode, a mode given twice, a size
            that is not a positive integer, ``none`` mixed with a size); the message names
            ``var`` and the accepted forms.
    """
    usage = (f"{var}={raw!r} is not valid: use none, tensor=N, pipeline=N or tensor=N,pipeline=M "
             "(N, M positive integers)")
    text = raw.strip().lower().replace(" ", "")
    sizes = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}
    if text in ("none", "1"):
        return sizes
    seen = set()
    for part in text.split(","):
        mode, equals, size = part.partition("=")
        if mode not in _PARALLEL_KEYS or not equals or mode in seen or not size.isdigit() or int(size) < 1:
            raise ConfigurationError(usage)
        seen.add(mode)
        sizes[_PARALLEL_KEYS[mode]] = int(size)
    return sizes


# field -> (environment variable, parser, default)
_ENV: dict[str, tuple[str, Callable[[str, str], Any], Any]] = {
    "kv_layout": ("FERRUM_METAL_PAGED_KV", _parse_layout, "contiguous"),
    "block_size": ("FERRUM_PAGED_BLOCK_SIZE", _parse_int, 16),
    "max_num_blocks": ("FERRUM_KV_MAX_BLOCKS", _parse_int, None),
    "kv_capacity": ("FERRUM_KV_CAPACITY", _parse_int, None),
    "max_num_seqs": ("FERRUM_PAGED_MAX_SEQS", _parse_int, 32),
    "prefill_chunk_size": ("FERRUM_CHUNKED_PREFILL", _parse_int, 512),
    "max_num_batched_tokens": ("FERRUM_MAX_BATCHED_TOKENS", _parse_int, 2048),
    "max_num_prefill_seqs": ("FERRUM_MAX_NUM_PREFILL_SEQS", _parse_int, None),
    "prefix_cache": ("FERRUM_PREFIX_CACHE", _parse_bool, True),
    "metal_kernels": ("FERRUM_METAL_KERNELS", _parse_bool, True),
    "kv_memory_fraction": ("FERRUM_KV_MEMORY_FRACTION", _parse_float, 0.5),
    "kv_cache_step": ("FERRUM_KV_CACHE_STEP", _parse_int, 256),
    "async_scheduling": ("FERRUM_ASYNC_SCHEDULING", _parse_bool, True),
    "enforce_eager": ("FERRUM_ENFORCE_EAGER", _parse_bool, False),
    "speculative": ("FERRUM_SPECULATIVE", _parse_speculative, None),
    "num_speculative_tokens": ("FERRUM_NUM_SPECULATIVE_TOKENS", _parse_int, 4),
    "prompt_lookup_min": ("FERRUM_PROMPT_LOOKUP_MIN", _parse_int, 2),
    "prompt_lookup_max": ("FERRUM_PROMPT_LOOKUP_MAX", _parse_int, 4),
    "speculative_disable_by_batch_size": ("FERRUM_SPECULATIVE_DISABLE_BY_BATCH_SIZE", _parse_int, 2),
    "speculative_min_acceptance": ("FERRUM_SPECULATIVE_MIN_ACCEPTANCE", _parse_float, 0.2),
    "enable_lora": ("FERRUM_ENABLE_LORA", _parse_bool, False),
    "max_loras": ("FERRUM_MAX_LORAS", _parse_int, 8),
    "max_lora_rank": ("FERRUM_MAX_LORA_RANK", _parse_int, 64),
    "max_cpu_loras": ("FERRUM_MAX_CPU_LORAS", _parse_int, None),
    "kv_cache_dtype": ("FERRUM_KV_CACHE_DTYPE", _parse_kv_cache_dtype, "auto"),
    "kv_float_window": ("FERRUM_KV_FLOAT_WINDOW", _parse_int, 64),
    "tensor_parallel_size": ("FERRUM_TENSOR_PARALLEL_SIZE", _parse_int, 1),
    "pipeline_parallel_size": ("FERRUM_PIPELINE_PARALLEL_SIZE", _parse_int, 1),
    "distributed_backend": ("FERRUM_DISTRIBUTED_BACKEND", _parse_backend, "any"),
    "distributed_timeout": ("FERRUM_DISTRIBUTED_TIMEOUT", _parse_int, 60),
    "pipeline_split": ("FERRUM_PIPELINE_SPLIT", _parse_split, None),
    "pipeline_micro_batches": ("FERRUM_PIPELINE_MICRO_BATCHES", _parse_int, 2),
}

#: One line per field, for ``mlx-ferrum serve --help`` (the README's flag table says the same).
FIELD_HELP: dict[str, str] = {
    "kv_layout": "KV cache layout: 'paged' (a block pool shared by all sequences) or 'contiguous'",
    "block_size": "tokens per KV block of the paged layout",
    "max_num_blocks": "blocks in the paged pool (refused when larger than free memory)",
    "kv_capacity": "most tokens per sequence (at most the model's max_position_embeddings)",
    "max_num_seqs": "most sequences per engine step",
    "prefill_chunk_size": "most prompt tokens per sequence per engine step",
    "max_num_batched_tokens": "token budget of one engine step",
    "max_num_prefill_seqs": "most sequences that prefill in one engine step (a burst of prompts is prefilled a few "
                            "at a time, so the first of them start sooner)",
    "prefix_cache": "share full prompt blocks across requests",
    "metal_kernels": "0 forces the pure-MLX attention path",
    "kv_memory_fraction": "share of free memory (minus weights) the paged pool may take when --max-num-blocks is unset",
    "kv_cache_step": "growth step, in tokens, of the contiguous cache",
    "async_scheduling": "queue engine step t+1 before reading step t's tokens",
    "enforce_eager": "1 builds every forward pass op by op instead of compiling paged decode steps",
    "speculative": "speculative decoding: 'ngram' (prompt lookup) or a draft checkpoint sharing the tokenizer",
    "num_speculative_tokens": "tokens proposed per decode step and request",
    "prompt_lookup_min": "shortest n-gram the 'ngram' proposer matches",
    "prompt_lookup_max": "longest n-gram the 'ngram' proposer matches",
    "speculative_disable_by_batch_size": "no speculation in a step while at least this many requests run "
    "(2: only a request running alone speculates; beside others, verifying drafts cost more than they saved)",
    "speculative_min_acceptance": "a request whose recent drafts were accepted less than this fraction of the time, "
    "or that found nothing to propose while others run, stops proposing for a growing number of steps "
    "(0 never backs off)",
    "enable_lora": "serve LoRA adapters (several per batch, one per request)",
    "max_loras": "adapters resident at once (slots in every batch)",
    "max_lora_rank": "largest adapter rank accepted (smaller ranks are zero-padded to it)",
    "max_cpu_loras": "adapters kept loaded in memory, least recently used evicted",
    "kv_cache_dtype": "KV cache storage: 'auto' (the model dtype), 'int8' or 'int4' (group-wise quantized, "
    "float16 scales; int4 rotates keys by a Walsh-Hadamard transform)",
    "kv_float_window": "with --kv-cache-dtype int4, each query's last N keys and values (and its sequence's "
    "first 4) are attended in float16 beside the codes (KIVI's full-precision residual; 0: codes only)",
    "tensor_parallel_size": "ranks each layer is split across (tensor parallelism; run under mlx.launch)",
    "pipeline_parallel_size": "ranks the layers are split across (pipeline parallelism; run under mlx.launch)",
    "distributed_backend": "mx.distributed backend: any, ring, jaccl, mpi or nccl",
    "distributed_timeout": "seconds an engine step may wait on the other ranks before this rank exits",
    "pipeline_split": "layers per pipeline rank, e.g. 3,2 (the sum is the model's layers)",
    "pipeline_micro_batches": "micro-batches each engine step is split into under pipeline parallelism, so the "
                              "stages overlap (1: one pass at a time)",
}

#: Upper bound, in bytes, of the paged pool's memory budget where no Metal device reports
#: a working-set size (Linux CPU, CUDA); the pool is normally far smaller, being sized
#: from ``max_num_seqs`` and the capacity (see ``kv_cache.default_num_blocks``).
DEFAULT_KV_POOL_BYTES = 1 << 30


def device_info() -> dict:
    """MLX's description of the default device (``architecture``, and on a Mac
    ``max_recommended_working_set_size`` in bytes, ...).

    MLX 0.32 moved this from ``mx.metal.device_info`` to ``mx.device_info`` and warns
    on every call of the old name, so the new one is used wherever it exists.

    Raises:
        RuntimeError: whatever MLX raises when it cannot describe the device.
    """
    import mlx.core as mx

    query = getattr(mx, "device_info", None) or mx.metal.device_info
    return dict(query())


def available_memory_bytes() -> int:
    """Bytes this process may still allocate for KV: the Metal recommended working set
    on a Mac, else the OS's available memory (``MemAvailable`` of ``/proc/meminfo``, or
    free pages); a very large number when neither can be read."""
    try:
        import mlx.core as mx

        if mx.metal.is_available():
            return int(device_info()["max_recommended_working_set_size"])
    except Exception:  # noqa: BLE001 - best effort
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def check_memory(nbytes: int, what: str, fix: str) -> None:
    """Refuse an allocation of ``nbytes`` that the machine cannot hold, before it is tried.

    Raises:
        InsufficientMemoryError: names ``what``, both sizes (GiB and bytes) and ``fix``.
    """
    avail = available_memory_bytes()
    if nbytes > avail:
        raise InsufficientMemoryError(
            f"{what} needs {nbytes / 2**30:.2f} GiB ({nbytes} bytes) but only {avail / 2**30:.2f} GiB "
            f"({avail} bytes) is available: {fix}"
        )


def resolve_kv_capacity(config: "RuntimeConfig", max_position_embeddings: int) -> int:
    """Most tokens per sequence: ``config.kv_capacity``, or the model's ``max_position_embeddings``.

    Raises:
        ConfigurationError: ``kv_capacity`` exceeds ``max_position_embeddings`` (positions
            past it are untrained, and the caches would be sized for nothing).
    """
    cap = config.kv_capacity
    if cap is None:
        return max_position_embeddings
    if cap > max_position_embeddings:
        raise ConfigurationError(
            f"FERRUM_KV_CAPACITY (RuntimeConfig.kv_capacity) = {cap} exceeds the model's max_position_embeddings = "
            f"{max_position_embeddings}: set it to at most {max_position_embeddings}, or leave it unset"
        )
    return cap


@dataclass
class RuntimeConfig:
    """Runtime settings of the engine and its model runner (and of the ``LlmExecutor``
    adapter over a runner).

    Fields (environment variable, default):

    - ``kv_layout`` (``FERRUM_METAL_PAGED_KV``: 1 = ``"paged"``, 0/unset = ``"contiguous"``).
    - ``block_size`` (``FERRUM_PAGED_BLOCK_SIZE``, 16): tokens per KV block; a power of two in [8, 128].
    - ``max_num_blocks`` (``FERRUM_KV_MAX_BLOCKS``, None = sized from the memory budget):
      blocks in the paged pool (each layer has a pool of this many blocks).
    - ``kv_capacity`` (``FERRUM_KV_CAPACITY``, None = the model's ``max_position_embeddings``):
      max tokens per sequence; the contiguous cache preallocates up to it when set.
    - ``max_num_seqs`` (``FERRUM_PAGED_MAX_SEQS``, 32): max sequences per engine step.
    - ``prefill_chunk_size`` (``FERRUM_CHUNKED_PREFILL``, 512): max prompt tokens per sequence per step.
    - ``max_num_batched_tokens`` (``FERRUM_MAX_BATCHED_TOKENS``, 2048): token budget of one engine step.
    - ``max_num_prefill_seqs`` (``FERRUM_MAX_NUM_PREFILL_SEQS``, None = no cap; ``mlx-ferrum
      serve``: 4): most sequences with prompt tokens in one engine step. A burst of prompts
      is then prefilled a few at a time between decode steps, so the first of them start
      sooner (time to first token); mlx-lm's server caps prompts per prefill batch the
      same way (``--prompt-concurrency``, 8).
    - ``prefix_cache`` (``FERRUM_PREFIX_CACHE``, 1): share full prompt blocks by hash (paged
      layout; on by default, as in vLLM V1; outputs are identical with it off).
    - ``metal_kernels`` (``FERRUM_METAL_KERNELS``, 1): 0 forces the pure-MLX reference attention.
    - ``kv_memory_fraction`` (``FERRUM_KV_MEMORY_FRACTION``, 0.5): share of the Metal
      working set (minus weights) given to the paged pool when ``max_num_blocks`` is unset.
    - ``kv_cache_step`` (``FERRUM_KV_CACHE_STEP``, 256): growth step, in tokens, of the contiguous cache.
    - ``async_scheduling`` (``FERRUM_ASYNC_SCHEDULING``, 1): the engine queues step t+1 before it
      reads step t's tokens (vLLM's name); 0 runs every step synchronously.
    - ``enforce_eager`` (``FERRUM_ENFORCE_EAGER``, 0): 1 builds every forward pass op by op;
      0 lets the paged model runner run decode passes through ``mx.compile`` (vLLM's name for
      turning its compiled graphs off).
    - ``speculative`` (``FERRUM_SPECULATIVE``, None = off): ``"ngram"`` for prompt-lookup
      speculative decoding, or a draft checkpoint (folder or hub id) sharing the tokenizer.
    - ``num_speculative_tokens`` (``FERRUM_NUM_SPECULATIVE_TOKENS``, 4): tokens proposed per
      decode step and request (k).
    - ``prompt_lookup_min`` / ``prompt_lookup_max`` (``FERRUM_PROMPT_LOOKUP_MIN`` / ``_MAX``,
      2 / 4): shortest and longest n-gram the prompt-lookup proposer matches.
    - ``speculative_disable_by_batch_size`` (``FERRUM_SPECULATIVE_DISABLE_BY_BATCH_SIZE``, 2):
      no request speculates in a step while at least this many requests run (vLLM's
      ``speculative_disable_by_batch_size``). The default speculates only for a request
      running alone: measured on MLX's CPU backend, from 2 requests on ordinary text and
      from 4 on text that repeats its context, the synchronous drafting steps and their
      verification rows cost more than the tokens they saved (docs/benchmarks.md); 3
      suits traffic that mostly repeats its context.
    - ``speculative_min_acceptance`` (``FERRUM_SPECULATIVE_MIN_ACCEPTANCE``, 0.2): a request
      whose drafts are accepted less often than this (a moving average of accepted /
      proposed), or whose proposer finds nothing while other requests run, stops
      proposing for 1, 2, 4 ... up to 64 steps, so text that does not repeat itself runs
      on the pipelined plain step.
    - ``enable_lora`` (``FERRUM_ENABLE_LORA``, 0): serve LoRA adapters (vLLM's name).
    - ``max_loras`` (``FERRUM_MAX_LORAS``, 8): adapter slots resident at once; a batch mixes
      at most this many adapters.
    - ``max_lora_rank`` (``FERRUM_MAX_LORA_RANK``, 64): the largest rank accepted; every slot
      is this wide (smaller adapters are zero-padded, which adds exact zeros).
    - ``max_cpu_loras`` (``FERRUM_MAX_CPU_LORAS``, None = ``max_loras``): adapters kept loaded
      in memory; the least recently used beyond it are dropped and re-read from disk on use.
    - ``kv_cache_dtype`` (``FERRUM_KV_CACHE_DTYPE``, ``"auto"``): how K and V are stored: ``"auto"``
      (the model dtype), ``"int8"`` or ``"int4"`` (group-wise quantized along ``head_dim``, float16
      scales; keys are Walsh-Hadamard rotated). vLLM's name.
    - ``kv_float_window`` (``FERRUM_KV_FLOAT_WINDOW``, 64): with int4 KV, each query reads
      its last this-many positions and its sequence's first 4 from a float16 copy kept per
      running sequence, in one softmax with the codes of all other positions
      (:mod:`mlx_ferrum.kernels.float_window`); 0 reads codes only. int8 keeps none.
    - ``tensor_parallel_size`` (``FERRUM_TENSOR_PARALLEL_SIZE``, 1): ranks each layer's heads
      and MLP columns are split across (vLLM's name). Above 1 the process must be one rank
      of an ``mlx.launch`` group (see :mod:`mlx_ferrum.distributed`).
    - ``pipeline_parallel_size`` (``FERRUM_PIPELINE_PARALLEL_SIZE``, 1): ranks the decoder
      layers are split across (vLLM's name). The group's size must equal
      ``tensor_parallel_size * pipeline_parallel_size``; :attr:`parallel` names the mode.
    - ``distributed_backend`` (``FERRUM_DISTRIBUTED_BACKEND``, ``any``): the
      ``mx.distributed`` backend (``ring``, ``jaccl``, ``mpi``, ``nccl``; ``any`` takes the
      first that is up). Initialised strictly: a backend that is not up is an error,
      never a silent group of one.
    - ``distributed_timeout`` (``FERRUM_DISTRIBUTED_TIMEOUT``, 60): seconds one engine step
      may wait on the other ranks; past it the rank exits with
      :class:`~mlx_ferrum.errors.DistributedTimeoutError` (a dead or hung peer).
    - ``pipeline_split`` (``FERRUM_PIPELINE_SPLIT``, None = even): layers per pipeline rank,
      ``"3,2"``; checked against the model's layer count at load.
    - ``pipeline_micro_batches`` (``FERRUM_PIPELINE_MICRO_BATCHES``, 2): under pipeline
      parallelism each engine step's sequences are split into this many micro-batches
      (about equal token counts), so stage ``r`` computes one while stage ``r + 1``
      computes the one before; 1 runs one pass at a time. Ignored otherwise (and by the
      combined tensor + pipeline mode, whose sums take every rank).
    - ``FERRUM_PARALLEL`` (no field of its own): both sizes in one variable, ``none``,
      ``tensor=2``, ``pipeline=2`` or ``tensor=2,pipeline=2`` (:func:`parse_parallel`); a
      mode it leaves out is 1. An explicit size field still wins; a size variable set to a
      different value is refused. :attr:`parallel` reads the resulting mode back.

    Raises:
        ConfigurationError: a value is malformed; the message names the variable or field.
    """

    kv_layout: Optional[str] = None
    block_size: Optional[int] = None
    max_num_blocks: Optional[int] = None
    kv_capacity: Optional[int] = None
    max_num_seqs: Optional[int] = None
    prefill_chunk_size: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    max_num_prefill_seqs: Optional[int] = None
    prefix_cache: Optional[bool] = None
    metal_kernels: Optional[bool] = None
    kv_memory_fraction: Optional[float] = None
    kv_cache_step: Optional[int] = None
    async_scheduling: Optional[bool] = None
    enforce_eager: Optional[bool] = None
    speculative: Optional[str] = None
    num_speculative_tokens: Optional[int] = None
    prompt_lookup_min: Optional[int] = None
    prompt_lookup_max: Optional[int] = None
    speculative_disable_by_batch_size: Optional[int] = None
    speculative_min_acceptance: Optional[float] = None
    enable_lora: Optional[bool] = None
    max_loras: Optional[int] = None
    max_lora_rank: Optional[int] = None
    max_cpu_loras: Optional[int] = None
    kv_cache_dtype: Optional[str] = None
    kv_float_window: Optional[int] = None
    tensor_parallel_size: Optional[int] = None
    pipeline_parallel_size: Optional[int] = None
    distributed_backend: Optional[str] = None
    distributed_timeout: Optional[int] = None
    pipeline_split: Optional[str] = None
    pipeline_micro_batches: Optional[int] = None

    def __post_init__(self) -> None:
        explicit = set()
        spelled = self._parallel_from_environment()
        for f in fields(self):
            if getattr(self, f.name) is not None:
                explicit.add(f.name)
                continue
            if f.name in spelled:
                setattr(self, f.name, spelled[f.name])
                continue
            var, parse, default = _ENV[f.name]
            raw = os.environ.get(var)
            setattr(self, f.name, parse(var, raw) if raw is not None else default)
        self._validate(explicit)

    def _parallel_from_environment(self) -> dict[str, int]:
        """The sizes ``FERRUM_PARALLEL`` spells, for the size fields not given explicitly.

        Raises:
            ConfigurationError: ``FERRUM_PARALLEL`` is malformed, or a size variable
                (``FERRUM_TENSOR_PARALLEL_SIZE`` / ``FERRUM_PIPELINE_PARALLEL_SIZE``) is set to
                another value than the one ``FERRUM_PARALLEL`` implies (a mode it leaves out
                is 1): two spellings that disagree are refused rather than one silently winning.
        """
        raw = os.environ.get(PARALLEL_VARIABLE)
        if raw is None:
            return {}
        spelled = parse_parallel(PARALLEL_VARIABLE, raw)
        for name, size in spelled.items():
            var, parse, _ = _ENV[name]
            other = os.environ.get(var)
            if getattr(self, name) is None and other is not None and parse(var, other) != size:
                raise ConfigurationError(
                    f"{PARALLEL_VARIABLE}={raw!r} sets {name}={size} but {var}={other!r} disagrees: "
                    f"unset one of them (or make them agree)"
                )
        return {name: size for name, size in spelled.items() if getattr(self, name) is None}

    @classmethod
    def from_env(cls, **overrides: Any) -> "RuntimeConfig":
        """Build a config from the environment, with explicit ``overrides`` winning.

        Raises:
            ConfigurationError: a variable or override is malformed.
        """
        return cls(**overrides)

    def _name(self, field_name: str, explicit: set) -> str:
        var = _ENV[field_name][0]
        return f"RuntimeConfig.{field_name}" if field_name in explicit else var

    def _validate(self, explicit: set) -> None:
        n = lambda f: self._name(f, explicit)  # noqa: E731
        if self.kv_layout not in ("contiguous", "paged"):
            raise ConfigurationError(
                f"{n('kv_layout')}={self.kv_layout!r} is not valid: use 'contiguous' or 'paged'"
            )
        bs = self.block_size
        if not isinstance(bs, int) or bs < 8 or bs > 128 or bs & (bs - 1):
            raise ConfigurationError(
                f"{n('block_size')}={bs!r} is not valid: use a power of two from 8 to 128 (e.g. 16)"
            )
        for name in ("max_num_blocks", "kv_capacity", "max_num_prefill_seqs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ConfigurationError(f"{n(name)}={v!r} is not valid: use a positive integer or leave it unset")
        for name in ("max_num_seqs", "prefill_chunk_size", "max_num_batched_tokens", "kv_cache_step"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigurationError(f"{n(name)}={v!r} is not valid: use a positive integer")
        f = self.kv_memory_fraction
        if not isinstance(f, (int, float)) or not 0.0 < f <= 1.0:
            raise ConfigurationError(f"{n('kv_memory_fraction')}={f!r} is not valid: use a number in (0, 1]")
        if self.speculative is not None and (not isinstance(self.speculative, str) or not self.speculative.strip()):
            raise ConfigurationError(
                f"{n('speculative')}={self.speculative!r} is not valid: use 'ngram', a draft checkpoint path or "
                "hub id, or leave it unset"
            )
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigurationError(f"{n(name)}={v!r} is not valid: use a positive integer")
        v = self.speculative_disable_by_batch_size
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigurationError(
                f"{n('speculative_disable_by_batch_size')}={v!r} is not valid: use a positive integer "
                "(a large value never disables speculation)"
            )
        v = self.speculative_min_acceptance
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0.0 <= v <= 1.0:
            raise ConfigurationError(
                f"{n('speculative_min_acceptance')}={v!r} is not valid: use a number in [0, 1] (0 never backs off)"
            )
        for name in ("max_loras", "max_lora_rank"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigurationError(f"{n(name)}={v!r} is not valid: use a positive integer")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        v = self.max_cpu_loras
        if not isinstance(v, int) or isinstance(v, bool) or v < self.max_loras:
            raise ConfigurationError(
                f"{n('max_cpu_loras')}={v!r} is not valid: use an integer of at least max_loras={self.max_loras} "
                "(every resident adapter is also loaded), or leave it unset"
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigurationError(
                f"{n('kv_cache_dtype')}={self.kv_cache_dtype!r} is not valid: use one of {', '.join(KV_CACHE_DTYPES)}"
            )
        v = self.kv_float_window
        if not isinstance(v, int) or isinstance(v, bool) or v < 0:
            raise ConfigurationError(f"{n('kv_float_window')}={v!r} is not valid: use 0 or a positive number of tokens")
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "distributed_timeout", "pipeline_micro_batches"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigurationError(f"{n(name)}={v!r} is not valid: use a positive integer")
        if self.pipeline_split is not None:
            self.pipeline_split = _parse_split(n("pipeline_split"), str(self.pipeline_split))
        if self.distributed_backend not in DISTRIBUTED_BACKENDS:
            raise ConfigurationError(
                f"{n('distributed_backend')}={self.distributed_backend!r} is not valid: use one of "
                f"{', '.join(DISTRIBUTED_BACKENDS)}"
            )
        self._check_parallel_only(explicit)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigurationError(
                f"{n('prompt_lookup_min')}={self.prompt_lookup_min} is above "
                f"{n('prompt_lookup_max')}={self.prompt_lookup_max}: make min <= max"
            )

    def _check_parallel_only(self, explicit: set) -> None:
        """Settings that act only under model parallelism are refused without it, rather
        than accepted and never used (a pipeline split checked against no pipeline).

        Raises:
            ConfigurationError: ``pipeline_split`` or ``pipeline_micro_batches`` set to
                other than its default (by argument or variable) with
                ``pipeline_parallel_size`` 1, or ``distributed_backend`` other than
                ``"any"`` with both parallel sizes 1.
        """
        # a value other than the default (dataclasses.replace passes every field again)
        given = lambda name: getattr(self, name) != _ENV[name][2]  # noqa: E731
        size_hint = "RuntimeConfig.pipeline_parallel_size" if "pipeline_parallel_size" in explicit else \
            "pipeline_parallel_size (FERRUM_PIPELINE_PARALLEL_SIZE)"
        for name in ("pipeline_split", "pipeline_micro_batches"):
            if given(name) and self.pipeline_parallel_size == 1:
                raise ConfigurationError(
                    f"{self._name(name, explicit)} needs pipeline parallelism, and {size_hint} is 1: set it to the "
                    f"number of pipeline stages (ranks), or leave {self._name(name, explicit)} unset")
        if given("distributed_backend") and self.world_size == 1:
            raise ConfigurationError(
                f"{self._name('distributed_backend', explicit)} needs tensor or pipeline parallelism, and "
                "tensor_parallel_size and pipeline_parallel_size are both 1: set one of them above 1 (and start "
                f"the ranks with mlx.launch), or leave {self._name('distributed_backend', explicit)} unset")

    @property
    def parallel(self) -> str:
        """The parallelism asked for: ``"none"``, ``"tensor"``, ``"pipeline"`` or
        ``"tensor+pipeline"`` (from the two sizes)."""
        modes = [m for m, size in (("tensor", self.tensor_parallel_size), ("pipeline", self.pipeline_parallel_size))
                 if size > 1]
        return "+".join(modes) or "none"

    @property
    def world_size(self) -> int:
        """Ranks the parallel sizes need: ``tensor_parallel_size * pipeline_parallel_size``."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def paged(self) -> bool:
        """True when the paged block-pool layout is selected."""
        return self.kv_layout == "paged"
