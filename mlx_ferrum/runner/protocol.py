"""The runner contract: :class:`ModelRunner`, the batch item :class:`SeqWork` and :class:`ModelInfo`.

:class:`ModelRunner` is exactly what the layers above call: the engine's step
(:mod:`mlx_ferrum.engine.engine`), the speculative draft proposer
(:mod:`mlx_ferrum.engine.speculative`) and the readers of ``engine.runner`` (the
server, ``mlx-ferrum bench``). The ferrum-compatible ``ModelExecutor`` surface
(prefill / decode / handles) is an adapter over it in :mod:`mlx_ferrum.executor`.

Units: token counts and positions are tokens; byte counts are bytes. Cache ids are
any hashable (the engine uses request ids, strings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Optional, Protocol, Sequence, runtime_checkable

import mlx.core as mx

from ..config import RuntimeConfig


@dataclass
class SeqWork:
    """New tokens of one sequence for one forward pass.

    Attributes:
        cache_id: the sequence's cache (created when absent).
        tokens: the new token ids (Python ints in ``[0, vocab_size)``).
        all_logits: return logits for every new token, else for the last one.
        return_logits: False for a prefill chunk that does not reach the end of its
            prompt: no logits row at all (ignored when ``all_logits``).
        prev_row: ``>= 0``: the last token is not known on the host yet; it is row
            ``prev_row`` of the ``prev_tokens`` device array given to
            :meth:`ModelRunner.forward` (``tokens[-1]`` is a placeholder then).
        as_decode: lay the tokens out as one decode row each (the same results as a
            prefill segment; see ``PagedPassBuilder.passes``): the engine sets it for a
            speculative draft, whose few tokens then keep a batch of drafts on the
            compiled decode step. Honoured by the paged layout for rows of at most
            ``MAX_DECODE_EXPANSION`` tokens with ``all_logits`` on an existing cache.
        lora_slot: the resident LoRA slot these tokens run with
            (:meth:`ModelRunner.acquire_lora`), or -1 for the base model; the engine copies
            it from the scheduler's row (``ScheduledItem.lora_slot``). A row laid out
            ``as_decode`` runs every one of its decode rows with it.
    """

    cache_id: str
    tokens: list[int]
    all_logits: bool = False
    return_logits: bool = True
    prev_row: int = -1
    as_decode: bool = False
    lora_slot: int = -1

    @property
    def num_logit_rows(self) -> int:
        """Logits rows this item gets back: ``len(tokens)``, 1, or 0."""
        if self.all_logits:
            return len(self.tokens)
        return 1 if self.return_logits else 0


@dataclass
class ModelInfo:
    """Static facts about the model a runner (or executor) serves."""

    model_id: str
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_sequence_length: int
    dtype: str
    num_parameters: int = 0


@runtime_checkable
class ModelRunner(Protocol):
    """One model and its KV store, driven by batches of :class:`SeqWork`.

    Implementation: :class:`~mlx_ferrum.runner.LlmRunner`. Every method may be called
    from any thread; calls are serialised by the runner's lock.

    The runner never allocates KV blocks: the scheduler owns the block manager (built from
    :attr:`kv_geometry`) and hands each paged pass its rows' slots and block tables
    (``blocks``, the ``SchedulerOutput.kv`` of the step), which the runner only reads. The
    storage methods below (``release_cache``, ``trim_cache``) concern the contiguous
    layout's per-sequence buffers and do nothing for the paged pool.

    Attributes:
        config: the runtime settings the runner was built with.
        info: static facts (``vocab_size``, ``max_sequence_length``, ...).
        args: the model's ``ModelArgs`` (read by the server for its limits).
        kv_geometry: the paged pool's :class:`~mlx_ferrum.kv_cache.block_tables.KvGeometry`
            (blocks, block size, layer groups and windows, prefix caching), or None for
            the contiguous layout.
    """

    config: RuntimeConfig
    info: ModelInfo
    args: Any
    kv_geometry: Optional[Any]

    def forward(
        self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array] = None, blocks: Optional[Any] = None,
    ) -> tuple[mx.array, list[mx.array]]:
        """Build one forward pass over ``work`` (each ``cache_id`` once) and return it
        UNEVALUATED: ``(logits [R, vocab] model dtype, the rows of every item in work
        order, num_logit_rows each; the KV arrays to evaluate with them)``.
        ``prev_tokens`` ``[N]`` int32 (device): an item with ``prev_row >= 0`` takes its
        last token from it. ``blocks``: paged layout, the step's
        :class:`~mlx_ferrum.kv_cache.block_tables.BatchBlocks` (one row per item, as
        many slots as it has tokens), read only.

        Raises:
            PromptTooLongError, InvalidInputIdsError, ExecutorError (``blocks`` missing or
            not matching): nothing changes then.
        """

    def run(self, work: Sequence[SeqWork], prev_tokens: Optional[mx.array] = None,
            blocks: Optional[Any] = None) -> list[mx.array]:
        """:meth:`forward`, evaluated: one array per item, ``[n_i, vocab]`` if
        ``all_logits`` else ``[1, vocab]`` (``[0, vocab]`` without logits).

        Raises:
            as :meth:`forward`; an evaluation failure restores every touched cache too.
        """

    def schedule_kv_state(self) -> None:
        """Queue the evaluation of every KV array without waiting (after a failed pass)."""

    def trim_cache(self, cache_id: Hashable, num_tokens: int) -> None:
        """Keep the first ``num_tokens`` tokens of a contiguous cache's buffers (paged:
        nothing to do; the scheduler frees the blocks).

        Raises:
            UnknownCacheError: unknown contiguous cache. KvCacheError: ``num_tokens`` out of range.
        """

    def release_cache(self, cache_id: Hashable) -> None:
        """Free a sequence's contiguous buffers (paged: nothing to do); unknown ids are ignored."""

    def kv_capacity(self) -> int:
        """Most tokens one sequence may hold."""

    def kv_allocated_bytes(self) -> int:
        """Bytes of KV memory held (the whole pool, or every contiguous buffer)."""

    def cache_metrics_snapshot(self, block_manager: Optional[Any] = None) -> dict:
        """Paged: ``block_manager``'s block metrics and the pool's bytes; contiguous:
        sequences and bytes held."""

    # ------------------------------------------------------------------ LoRA
    # ``config.enable_lora`` says whether these serve adapters; when it is off the
    # methods that need the registry raise ExecutorError.
    def add_lora(self, name: str, path: str) -> Any:
        """Register the PEFT or mlx-lm adapter at ``path`` (folder or hub id) as ``name``,
        read and checked against the model now.

        Raises:
            ExecutorError: LoRA is off. LoraError: the adapter is refused.
        """

    def remove_lora(self, name: str) -> None:
        """Unregister ``name``.

        Raises:
            ExecutorError: LoRA is off. UnknownLoraError: unknown ``name``. LoraError: in use.
        """

    def list_loras(self) -> list[str]:
        """Registered adapter names (empty when LoRA is off)."""

    def lora_path(self, name: str) -> str:
        """Where adapter ``name`` was registered from.

        Raises:
            ExecutorError: LoRA is off. UnknownLoraError: unknown ``name``.
        """

    def acquire_lora(self, name: str, owner: Hashable) -> Optional[int]:
        """Pin adapter ``name``'s resident slot for ``owner`` (loading it into a free or
        least recently used unpinned slot); None when every slot is pinned by other
        adapters. The slot goes into ``SeqWork.lora_slot``.

        Raises:
            ExecutorError: LoRA is off. UnknownLoraError: unknown ``name``. LoraError: unreadable.
        """

    def release_lora(self, owner: Hashable) -> None:
        """Unpin ``owner``'s slot (a no-op when it holds none)."""

    def lora_metrics_snapshot(self) -> dict:
        """Adapter metrics (registered, loaded, resident slots, requests, loads,
        evictions); ``{}`` when LoRA is off."""
