"""The one place a KV store is built: layout, pool size and block manager are chosen here, once.

:func:`build_kv_store` turns a model's KV shape (:class:`KvSpec`) and a
:class:`~mlx_ferrum.config.RuntimeConfig` into a :class:`~mlx_ferrum.kv_cache.store.KvStore`:

- ``kv_layout="contiguous"``: a :class:`~mlx_ferrum.kv_cache.store.ContiguousKvStore`
  whose per-sequence caches are :class:`~mlx_ferrum.kv_cache.ContiguousKvCache` lists
  (grown in ``kv_cache_step`` steps, or preallocated to ``kv_capacity`` when it is set).
- ``kv_layout="paged"``: a :class:`~mlx_ferrum.kv_cache.store.PagedKvStore` over
  - a pool of :func:`pool_num_blocks` blocks (``max_num_blocks``, else sized from the
    memory budget and ``max_num_seqs`` sequences of ``max_seq_len`` tokens), checked
    against free memory before anything is allocated;
  - a :class:`~mlx_ferrum.kv_cache.block_tables.KvGeometry` from which the owner of the
    blocks (the scheduler, or the low-level executor adapter) builds the only paged block
    manager, a :class:`~mlx_ferrum.kv_cache.LayerGroupKvManager`:
    one block table per layer group, so layers with different attention windows
    (Gemma 3, gpt-oss) free blocks independently; a model whose layers share one window
    (or have none) has one group (with that window, so blocks outside it are freed);
  - a :class:`~mlx_ferrum.kv_cache.PagedKvPool` of one block more than the manager
    hands out: the scratch block (id ``manager.num_blocks``) that the pad rows of a
    compiled decode step write to.

The attention backend is chosen here too, once per store, by layout and
``kv_cache_dtype``: :class:`~mlx_ferrum.layers.attention.ContiguousAttentionBackend` /
:class:`~mlx_ferrum.layers.attention.PagedAttentionBackend` over the model dtype ("auto"),
:class:`~mlx_ferrum.layers.quantized_backends.QuantizedContiguousAttentionBackend` /
:class:`~mlx_ferrum.layers.quantized_backends.QuantizedPagedAttentionBackend` over the
int8 / int4 storage of :mod:`mlx_ferrum.kv_cache.quantized` (int4 rotates keys); a
paged backend picks its kernels (Metal or the pure-MLX reference) as it is built, from
``config.metal_kernels``; the runner's pass builder puts ``store.backend`` in every
pass's metadata. Nothing above this module tests the layout string to decide how KV is
stored or attended: the runner asks the store it was given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx

from ..config import RuntimeConfig
from ..errors import ExecutorError
from ..kernels.quantized_reference import check_kv_cache_dtype
from ..layers.attention import ContiguousAttentionBackend, PagedAttentionBackend
from ..layers.quantized_backends import (
    QuantizedContiguousAttentionBackend,
    QuantizedPagedAttentionBackend,
)
from .block_tables import KvGeometry, LayerGroupKvManager
from .contiguous import ContiguousKvCache
from .quantized import (
    QuantizedContiguousKvCache,
    QuantizedPagedKvPool,
    check_quantized_pool_fits,
)
from .quantized import bytes_per_token as quantized_bytes_per_token
from .store import (
    ContiguousKvStore,
    KvStore,
    PagedKvPool,
    PagedKvStore,
    check_pool_fits,
    default_num_blocks,
)


@dataclass(frozen=True)
class KvSpec:
    """The shape of a model's KV cache, all a store needs to know about the model.

    Attributes:
        num_layers: attention layers (one K and one V per layer).
        num_kv_heads: key/value heads per layer.
        head_dim: features per head.
        dtype: the KV dtype (the model's activation dtype).
        max_seq_len: most tokens one sequence may hold (``resolve_kv_capacity``).
        layer_windows: each layer's sliding window in tokens (None: full attention),
            ``num_layers`` entries.
        kv_cache_dtype: how K and V are stored: "auto" (``dtype``), "int8" or "int4"
            (:mod:`mlx_ferrum.kv_cache.quantized`).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    max_seq_len: int
    layer_windows: tuple[Optional[int], ...]
    kv_cache_dtype: str = "auto"

    @property
    def bytes_per_token(self) -> int:
        """K+V bytes of one token over all layers, scales and biases included."""
        return self.num_layers * quantized_bytes_per_token(self.num_kv_heads, self.head_dim, self.kv_cache_dtype,
                                                           self.dtype)

    @property
    def quantized(self) -> bool:
        """True for an int8 / int4 cache."""
        return self.kv_cache_dtype != "auto"


def pool_num_blocks(spec: KvSpec, config: RuntimeConfig, weight_bytes: int) -> int:
    """Blocks the paged manager hands out: ``config.max_num_blocks`` when set, else
    :func:`~mlx_ferrum.kv_cache.store.default_num_blocks` (``kv_memory_fraction`` of the
    memory left beside ``weight_bytes``, at most what ``max_num_seqs`` sequences of
    ``max_seq_len`` tokens use, at least 16).

    Args:
        spec: the model's KV shape.
        config: ``block_size``, ``max_num_blocks``, ``kv_memory_fraction``, ``max_num_seqs``.
        weight_bytes: bytes of the model's parameters.

    Returns:
        The block count (not counting the scratch block).
    """
    if config.max_num_blocks:
        return config.max_num_blocks
    return default_num_blocks(
        spec.num_layers,
        spec.num_kv_heads,
        config.block_size,
        spec.head_dim,
        spec.dtype,
        weight_bytes,
        config.kv_memory_fraction,
        max_num_seqs=config.max_num_seqs,
        max_seq_len=spec.max_seq_len,
        block_bytes=spec.bytes_per_token * config.block_size,
    )


def paged_geometry(spec: KvSpec, config: RuntimeConfig, num_blocks: int) -> KvGeometry:
    """The paged pool's :class:`~mlx_ferrum.kv_cache.block_tables.KvGeometry` for ``spec``:
    ``num_blocks`` blocks of ``config.block_size`` tokens, ``ceil(max_seq_len / block_size)``
    blocks per table, the model's layer windows, ``config.prefix_cache``."""
    bs = config.block_size
    return KvGeometry(num_blocks, bs, -(-spec.max_seq_len // bs), tuple(spec.layer_windows) or (None,),
                      bool(config.prefix_cache), float_window_slots(spec, config), float_window(spec, config),
                      float_window_lookahead(config) if float_window(spec, config) else 0)


def float_window(spec: KvSpec, config: RuntimeConfig) -> int:
    """Tokens of the float window the store keeps: ``config.kv_float_window`` for int4 KV,
    else 0 (int8 codes lose too little to need one)."""
    return int(config.kv_float_window or 0) if spec.kv_cache_dtype == "int4" else 0


def float_window_slots(spec: KvSpec, config: RuntimeConfig) -> int:
    """Float-window slots: one per sequence an engine step may run (``max_num_seqs``) and
    one for a finished sequence whose blocks the pipelined step releases a step late. A
    sequence that finds none free runs on codes alone (slower to none: every slot costs
    about 1.6 MiB on SmolLM2, the budget of a 4,096-token sequence's share)."""
    return int(config.max_num_seqs) + 1 if float_window(spec, config) else 0


def float_window_lookahead(config: RuntimeConfig) -> int:
    """Tokens past its first that one sequence may write in a pass whose decode rows read
    the float window after the write: a speculative draft of ``num_speculative_tokens``."""
    return int(config.num_speculative_tokens) if config.speculative else 0


def build_kv_store(
    spec: KvSpec,
    config: RuntimeConfig,
    weight_bytes: int,
    manager: Optional[LayerGroupKvManager] = None,
) -> KvStore:
    """The KV store ``config.kv_layout`` names, sized for ``spec``, with the attention
    backend of its layout and ``spec.kv_cache_dtype``.

    Args:
        spec: the model's KV shape and KV storage format.
        config: ``kv_layout``, ``block_size``, ``max_num_blocks``, ``kv_memory_fraction``,
            ``max_num_seqs``, ``prefix_cache``, ``kv_capacity``, ``kv_cache_step``.
        weight_bytes: bytes of the model's parameters (the pool's memory budget is what
            is left beside them).
        manager: an existing :class:`LayerGroupKvManager` whose geometry sizes the pool
            (paged layout only; its owner keeps driving it, the store never holds it). One
            group serves every layer; several must match the model's layer windows.

    Returns:
        A :class:`PagedKvStore` (``.geometry``, ``.pool`` with ``geometry.num_blocks + 1``
        blocks: the last is the scratch block) or a :class:`ContiguousKvStore`.

    Raises:
        ExecutorError: ``manager`` given for the contiguous layout, or not a
            :class:`LayerGroupKvManager`.
        InsufficientMemoryError: the pool (``max_num_blocks`` blocks) does not fit in free
            memory; raised before the manager's host bookkeeping or the pool is allocated.
        ConfigurationError: an unknown ``kv_cache_dtype``, or int4 with an odd head_dim.
    """
    check_kv_cache_dtype(spec.kv_cache_dtype, spec.head_dim)
    # keys rotated in both formats: it spreads outlier channels over the group (see the
    # format's module); int8 halved its KL on stories260K with it
    rotate_keys = spec.quantized
    if config.kv_layout != "paged":
        if manager is not None:
            raise ExecutorError("a block manager needs the paged layout: pass RuntimeConfig(kv_layout='paged')")
        backend = (QuantizedContiguousAttentionBackend(spec.kv_cache_dtype, rotate_keys) if spec.quantized
                   else ContiguousAttentionBackend())
        return ContiguousKvStore(contiguous_cache_maker(spec, config), spec.bytes_per_token, backend)
    if manager is not None and not isinstance(manager, LayerGroupKvManager):
        raise ExecutorError(f"the paged store takes a LayerGroupKvManager, not {type(manager).__name__}: "
                            "build it as LayerGroupKvManager(num_blocks, block_size, max_blocks_per_seq)")
    if manager is None:
        num_blocks = pool_num_blocks(spec, config, weight_bytes)
        # before the manager builds its per-block lists: a huge FERRUM_KV_MAX_BLOCKS
        # must be a named error, not a MemoryError from the host bookkeeping
        if spec.quantized:
            check_quantized_pool_fits(spec.num_layers, num_blocks, spec.num_kv_heads, config.block_size,
                                      spec.head_dim, spec.kv_cache_dtype, extra_blocks=1)
        else:
            check_pool_fits(spec.num_layers, num_blocks, spec.num_kv_heads, config.block_size, spec.head_dim,
                            spec.dtype, extra_blocks=1)
        geometry = paged_geometry(spec, config, num_blocks)
    else:
        # an existing manager only sizes the pool: its owner keeps driving it
        geometry = KvGeometry.of(manager, spec.num_layers)
    # one block past the manager's: the scratch block that the pad rows of a compiled
    # decode step write to (the manager never hands it out)
    if spec.quantized:
        pool = QuantizedPagedKvPool(spec.num_layers, geometry.num_blocks + 1, spec.num_kv_heads, geometry.block_size,
                                    spec.head_dim, spec.kv_cache_dtype, rotate_keys=rotate_keys,
                                    float_window=geometry.float_window, window_slots=geometry.window_slots,
                                    lookahead=geometry.window_lookahead)
        backend = QuantizedPagedAttentionBackend(spec.kv_cache_dtype, pool.rotate_keys,
                                                 metal_kernels=bool(config.metal_kernels))
    else:
        pool = PagedKvPool(spec.num_layers, geometry.num_blocks + 1, spec.num_kv_heads, geometry.block_size,
                           spec.head_dim, spec.dtype)
        backend = PagedAttentionBackend(metal_kernels=bool(config.metal_kernels))
    return PagedKvStore(geometry, pool, spec.bytes_per_token, backend)


def contiguous_cache_maker(spec: KvSpec, config: RuntimeConfig):
    """A function building one new sequence's per-layer :class:`ContiguousKvCache` list
    (:class:`~mlx_ferrum.kv_cache.quantized.QuantizedContiguousKvCache` for int8 / int4):
    ``[1, num_kv_heads, capacity, head_dim]`` per layer, grown in ``config.kv_cache_step``
    tokens up to ``spec.max_seq_len``, or preallocated to it when ``config.kv_capacity`` is set."""
    preallocate = config.kv_capacity is not None

    def new_caches() -> list:
        if spec.quantized:
            return [
                QuantizedContiguousKvCache(spec.num_kv_heads, spec.head_dim, spec.dtype, spec.max_seq_len,
                                           spec.kv_cache_dtype, config.kv_cache_step, preallocate,
                                           float_window=float_window(spec, config),
                                           lookahead=float_window_lookahead(config))
                for _ in range(spec.num_layers)
            ]
        return [
            ContiguousKvCache(spec.num_kv_heads, spec.head_dim, spec.dtype, spec.max_seq_len, config.kv_cache_step,
                              preallocate)
            for _ in range(spec.num_layers)
        ]

    return new_caches


__all__: Sequence[str] = ["KvSpec", "build_kv_store", "contiguous_cache_maker",
                          "paged_geometry", "pool_num_blocks"]
