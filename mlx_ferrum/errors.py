"""Exception types that users of mlx_ferrum catch.

Every error message names the problem and the fix. All errors derive from
:class:`FerrumError`, so ``except mf.errors.FerrumError`` catches everything
this package raises on purpose.
"""

from __future__ import annotations


class FerrumError(Exception):
    """Base class of every error raised on purpose by mlx_ferrum."""


class ConfigurationError(FerrumError, ValueError):
    """A runtime setting (a ``FERRUM_*`` variable or a ``RuntimeConfig`` field) is malformed.

    The message names the variable or field, the value found and the values accepted.
    """


class ModelLoadError(FerrumError):
    """A checkpoint cannot be loaded: base class of the loader's errors."""


class ConfigNotFoundError(ModelLoadError, FileNotFoundError):
    """``config.json`` is missing from a checkpoint folder (the message names the path)."""


class MalformedConfigError(ModelLoadError, ValueError):
    """``config.json`` (or another checkpoint json) cannot be parsed or lacks a required key."""


class MissingShardError(ModelLoadError, FileNotFoundError):
    """A safetensors shard listed in ``model.safetensors.index.json`` is absent, or no weights exist."""


class UnsupportedArchitectureError(ModelLoadError, ValueError):
    """``model_type`` is not one this package implements (the message lists the supported ones)."""


class WeightShapeError(ModelLoadError, ValueError):
    """A stored tensor's shape disagrees with the config (names tensor, expected and found shapes)."""


class MissingWeightError(ModelLoadError, KeyError):
    """A parameter the model needs is absent from the checkpoint, or an unexpected one is present."""


class VocabularyMismatchError(ModelLoadError, ValueError):
    """The tokenizer cannot decode ids the model emits: its vocabulary (added tokens
    included) is smaller than the model's ``vocab_size`` by more than padding (the
    message names both sizes; pair the model with its own tokenizer)."""


class TokenizerError(FerrumError):
    """The tokenizer files are missing or malformed, or a chat template cannot be rendered."""


class ChatTemplateError(TokenizerError):
    """A chat template is missing, or raised (``raise_exception``) while rendering."""


class SamplingParamsError(FerrumError, ValueError):
    """A ``SamplingParams`` field is out of range (the message names the field and the range)."""


class StructuredOutputError(SamplingParamsError):
    """A structured-output constraint (JSON schema, regex, grammar) cannot be compiled or
    used, or a token broke it (the message holds the constraint library's reason)."""


class PromptTooLongError(FerrumError, ValueError):
    """A prompt (plus ``max_tokens`` where it must fit) exceeds the context the model or cache allows."""


class KvCacheError(FerrumError):
    """Base class of KV-cache bookkeeping errors."""


class KvCacheExhaustedError(KvCacheError, MemoryError):
    """The paged block pool (or a contiguous cache's capacity) cannot hold the requested tokens.

    Nothing was allocated when this is raised: allocation is all-or-nothing.
    """


class DoubleFreeError(KvCacheError):
    """A block was freed whose reference count is already zero."""


class UnknownBlockError(KvCacheError, IndexError):
    """A block id outside ``[0, num_blocks)`` was freed or acquired."""


class UnknownCacheError(KvCacheError, KeyError):
    """A ``cache_id`` is not (or no longer) held by the KV store (of a model runner or an
    ``LlmExecutor``); it may have been released."""


class ExecutorError(FerrumError):
    """A model runner, or the ``LlmExecutor`` adapter over it, was called in a way it cannot
    serve (shut down, bad input shape, ...)."""


class InvalidInputIdsError(ExecutorError, ValueError):
    """Executor ``input_ids`` that are not token ids: not an integer dtype (floats would be
    truncated), not the ``[1, L]`` shape of one sequence, empty, or an id outside
    ``[0, vocab_size)`` (the message names what was found and the fix)."""


class KernelError(FerrumError):
    """A Metal kernel cannot be built or launched for the given shapes or dtypes."""


class RequestError(FerrumError):
    """An engine request cannot be served (unknown request id, or it alone cannot fit the pool)."""


class EngineShutdownError(FerrumError, RuntimeError):
    """An :class:`~mlx_ferrum.engine.AsyncEngine` was shut down: it takes no new request,
    and a request still running at ``shutdown()`` ends with this error (create a new
    engine to go on)."""


class InvalidWeightError(ModelLoadError, ValueError):
    """A stored tensor cannot be used: an integer or bool dtype where floats belong, or
    NaN/Inf values (the message names the tensor and the fix)."""


class UnsupportedQuantizationError(ModelLoadError, ValueError):
    """A checkpoint's quantization method or mode is not one this loader reads (the
    message names it, lists what is supported, and gives the ``mlx_lm.convert``
    command that produces a supported checkpoint)."""


class NonFiniteLogitsError(FerrumError, FloatingPointError):
    """The model produced NaN or Inf logits for a request at run time; the request ends
    with ``finish_reason="error"`` and this error's message (check the checkpoint's
    weights and ``rope_theta``, or use float32)."""


class InsufficientMemoryError(ConfigurationError, MemoryError):
    """A setting asks for more memory than the machine has free (a paged KV pool from
    ``FERRUM_KV_MAX_BLOCKS``, ...); refused before anything is allocated. The message
    names the setting, the bytes asked for, the bytes free and the largest value that fits."""


class LoraError(FerrumError, ValueError):
    """A LoRA adapter cannot be loaded or served: unknown adapter name, a format or PEFT
    type this package does not read (DoRA, IA3 ...), a module or shape that does not
    match the base model, a rank above ``max_lora_rank``, or LoRA not enabled (the
    message names the adapter, the module and the fix)."""


class UnknownLoraError(LoraError, KeyError):
    """A request or call names an adapter that is not registered (the message lists the known ones)."""

    def __str__(self) -> str:  # KeyError would print the message quoted
        return str(self.args[0]) if self.args else ""


class DistributedError(FerrumError):
    """Base class of the errors of multi-process (tensor or pipeline parallel) runs."""


class DistributedConfigurationError(DistributedError, ConfigurationError):
    """A parallel setting cannot be honoured: no distributed backend is up (the process
    was not started by ``mlx.launch``), the group's size differs from
    ``tensor_parallel_size * pipeline_parallel_size``, or a feature that cannot run in
    lockstep (LoRA, draft-model speculation, structured output) was asked for (the
    message names the setting, the sizes found and the launch command)."""


class ShardingError(DistributedError, ModelLoadError):
    """A model cannot be split across the group: a head count, the MLP width, the number
    of experts or of layers is not divisible by the parallel size, or the family has no
    sharding plan (the message names the count, the size and the sizes that work)."""


class DistributedTimeoutError(DistributedError, RuntimeError):
    """A collective (an engine step's broadcast or a forward pass's ``all_sum``) did not
    finish within ``RuntimeConfig.distributed_timeout`` seconds: another rank died or
    hangs. The rank that sees it exits (every rank does, so nothing hangs forever)."""


class DistributedPeerLostError(DistributedError, RuntimeError):
    """The connection to another rank of the group broke (the backend reported it, e.g.
    the ring's "connection to a peer was lost"): that rank died. The group cannot go on
    without it, so the rank that sees this exits; restart every rank with ``mlx.launch``."""


class GGUFFormatError(ModelLoadError, ValueError):
    """A GGUF file is damaged or inconsistent: bad magic, an unsupported version, a
    truncated file, tensor data past the end, or tensor shapes that disagree with its
    metadata (the message names the file, the tensor and what was expected)."""


class UnsupportedTensorTypeError(UnsupportedQuantizationError):
    """A GGUF file stores tensors in a type this loader does not read (IQ*, TQ*, Q8_K,
    an unknown id): the message lists the types found, the tensors using them and the
    supported types."""


class AmbiguousCheckpointError(ModelLoadError, ValueError):
    """A folder holds several GGUF models and none was named: the message lists them
    and the flag (``--gguf-file``) or argument (``gguf_file=``) that picks one."""
