"""LlmExecutor: the ``ModelExecutor`` over a real decoder-only MLX model.

One executor serves many sequences, each known by a ``cache_id``. The KV layout comes
from :class:`~mlx_ferrum.config.RuntimeConfig` (``FERRUM_METAL_PAGED_KV``):

- contiguous: each sequence has per-layer :class:`~mlx_ferrum.kv_cache.ContiguousKvCache`.
  Batched calls put sequences on separate rows; rows whose caches differ in length are
  right-padded and masked inside attention, and prompts of different lengths are run
  in groups of equal length (so no pad token is ever stored).
- paged: all sequences share one :class:`~mlx_ferrum.kv_cache.PagedKvPool`; a batched
  call packs every sequence's new tokens into ONE row (varlen, no padding), with
  per-token positions and a ``slot_mapping`` into the pool (ferrum's ``unified_decode``).

Every call evaluates its logits before returning, so timings in :meth:`status` are real.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass
from typing import Optional, Sequence

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from ..config import RuntimeConfig, resolve_kv_capacity
from ..errors import ExecutorError, KvCacheExhaustedError, PromptTooLongError, UnknownCacheError
from ..kv_cache import (
    ContiguousKvCache,
    LayerGroupKvManager,
    PagedKvCacheManager,
    PagedKvPool,
    bytes_per_block,
    default_num_blocks,
)
from ..layers.attention import AttentionMetadata, contiguous_pad_mask
from .types import (
    AttentionType,
    DecodeInput,
    DecodeOutput,
    ExecutorCapabilities,
    ExecutorMemoryUsage,
    ExecutorState,
    ExecutorStatus,
    KvCacheHandle,
    MemoryRequirements,
    ModelInfo,
    PrefillInput,
    PrefillOutput,
)

_ids = itertools.count()


@dataclass
class SeqWork:
    """New tokens of one sequence for one forward pass.

    Attributes:
        cache_id: the sequence's cache (created when absent).
        tokens: the new token ids.
        all_logits: return logits for every new token, else for the last one.
    """

    cache_id: str
    tokens: list[int]
    all_logits: bool = False


def model_dtype(model: nn.Module) -> mx.Dtype:
    """The activation dtype of ``model``: ``model.dtype`` if set, else its embedding's float dtype
    (the scales' dtype if quantized)."""
    if isinstance(getattr(model, "dtype", None), mx.Dtype):
        return model.dtype
    emb = model.model.embed_tokens
    w = getattr(emb, "scales", None)
    return (w if w is not None else emb.weight).dtype


def layer_windows(model: nn.Module) -> list[Optional[int]]:
    """The sliding window of each layer (None: full attention), from ``model.args.window``.

    One shared window (Mistral, Phi-3) lets the paged manager free blocks outside it;
    mixed layers (Gemma 3, gpt-oss) get a :class:`~mlx_ferrum.kv_cache.LayerGroupKvManager`.
    """
    args = model.args
    if not hasattr(args, "window"):
        return [None] * args.num_hidden_layers
    return [args.window(i) for i in range(args.num_hidden_layers)]


def _as_token_list(ids: mx.array, what: str) -> list[int]:
    if not isinstance(ids, mx.array):
        ids = mx.array(ids)
    if ids.ndim == 1:
        ids = ids[None]
    if ids.ndim != 2 or ids.shape[0] != 1:
        raise ExecutorError(
            f"{what}.input_ids must have shape [1, L], got {tuple(ids.shape)}: pass one sequence per input "
            "and use batch_prefill/batch_decode for several"
        )
    if ids.shape[1] == 0:
        raise ExecutorError(f"{what}.input_ids is empty: give at least one token")
    return [int(t) for t in ids[0].tolist()]


class LlmExecutor:
    """Executor over a Llama-family ``Model`` (see :mod:`mlx_ferrum.models.llama`).

    Args:
        model: the loaded model (``model.args`` a ``ModelArgs``).
        config: runtime settings; ``None`` reads them from the environment.
        model_id: a name for :attr:`info`.
        manager: an existing paged manager to use (paged layout only); its block size
            and block count size the pool.

    Raises (from its calls):
        PromptTooLongError: tokens beyond ``kv_capacity()``.
        KvCacheExhaustedError: the paged pool is full (the failed call's blocks are released).
        UnknownCacheError: a handle whose cache was released.
        ExecutorError: malformed input, or a call after ``shutdown``.
    """

    def __init__(
        self,
        model: nn.Module,
        config: Optional[RuntimeConfig] = None,
        model_id: str = "model",
        manager: Optional[PagedKvCacheManager] = None,
    ):
        self.model = model
        self.config = config if config is not None else RuntimeConfig()
        args = model.args
        self.args = args
        self.dtype = model_dtype(model)
        self.layout = self.config.kv_layout
        self.max_seq_len = resolve_kv_capacity(self.config, args.max_position_embeddings)
        self._lock = threading.RLock()
        self._weight_bytes = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
        n_params = sum(v.size for _, v in tree_flatten(model.parameters()))
        self.info = ModelInfo(
            model_id=model_id,
            model_type=args.model_type,
            vocab_size=args.vocab_size,
            hidden_size=args.hidden_size,
            num_layers=args.num_hidden_layers,
            num_heads=args.num_attention_heads,
            num_kv_heads=args.num_key_value_heads,
            head_dim=args.head_dim,
            max_sequence_length=self.max_seq_len,
            dtype=str(self.dtype).replace("mlx.core.", ""),
            num_parameters=n_params,
        )
        self._contiguous: dict[str, list[ContiguousKvCache]] = {}
        self.manager: Optional[PagedKvCacheManager] = None
        self.pool: Optional[PagedKvPool] = None
        if manager is not None and self.layout != "paged":
            raise ExecutorError("a PagedKvCacheManager needs the paged layout: pass RuntimeConfig(kv_layout='paged')")
        if self.layout == "paged" and manager is not None:
            self.manager = manager
            self.pool = PagedKvPool(
                args.num_hidden_layers, manager.num_blocks, args.num_key_value_heads, manager.block_size,
                args.head_dim, self.dtype,
            )
        elif self.layout == "paged":
            bs = self.config.block_size
            num_blocks = self.config.max_num_blocks or default_num_blocks(
                args.num_hidden_layers,
                args.num_key_value_heads,
                bs,
                args.head_dim,
                self.dtype,
                self._weight_bytes,
                self.config.kv_memory_fraction,
                max_num_seqs=self.config.max_num_seqs,
                max_seq_len=self.max_seq_len,
            )
            windows = layer_windows(model)
            if len(set(windows)) > 1:
                # full and sliding layers mixed (Gemma 3, gpt-oss): one block table per layer group
                self.manager = LayerGroupKvManager(
                    num_blocks, bs, -(-self.max_seq_len // bs), windows, prefix_cache=self.config.prefix_cache
                )
            else:
                self.manager = PagedKvCacheManager(
                    num_blocks, bs, max_blocks_per_seq=-(-self.max_seq_len // bs),
                    prefix_cache=self.config.prefix_cache, sliding_window=windows[0],
                )
            self.pool = PagedKvPool(
                args.num_hidden_layers, num_blocks, args.num_key_value_heads, bs, args.head_dim, self.dtype
            )
        self._state = ExecutorState.READY
        self._counts = {"prefill": 0, "decode": 0}
        self._times = {"prefill": 0.0, "decode": 0.0}
        self._last_batch = 0
        self._last_op: Optional[float] = None
        self._peak_kv_bytes = 0

    # ------------------------------------------------------------- handles
    def _handle(self, cache_id: str) -> KvCacheHandle:
        if self.layout == "paged":
            seq = self.manager._seq(cache_id)
            return KvCacheHandle(
                cache_id, seq.num_tokens, "paged", self.manager.block_size, tuple(seq.block_ids)
            )
        caches = self._contiguous.get(cache_id)
        if caches is None:
            raise UnknownCacheError(f"unknown KV cache {cache_id!r}: it was never created or was released")
        return KvCacheHandle(cache_id, caches[0].len, "contiguous")

    def has_cache(self, cache_id: str) -> bool:
        """True when ``cache_id`` holds a cache."""
        if self.layout == "paged":
            return self.manager.has(cache_id)
        return cache_id in self._contiguous

    def num_tokens(self, cache_id: str) -> int:
        """Tokens stored for ``cache_id``.

        Raises:
            UnknownCacheError: unknown ``cache_id``.
        """
        if self.layout == "paged":
            return self.manager.num_tokens(cache_id)
        caches = self._contiguous.get(cache_id)
        if caches is None:
            raise UnknownCacheError(f"unknown KV cache {cache_id!r}: it was never created or was released")
        return caches[0].len

    def kv_capacity(self) -> int:
        """Most tokens one sequence may hold (``FERRUM_KV_CAPACITY`` or ``max_position_embeddings``)."""
        return self.max_seq_len

    def _check_open(self) -> None:
        if self._state == ExecutorState.SHUTDOWN:
            raise ExecutorError("this executor was shut down: create a new one")

    # ------------------------------------------------------------- core
    def run(self, work: Sequence[SeqWork]) -> list[mx.array]:
        """One forward pass over new tokens of several sequences (ferrum's ``unified_decode``).

        Caches that do not exist are created. On any error every cache touched by this
        call is restored to its previous length (and new ones released), so a failed call
        leaves no blocks behind and other sequences untouched.

        Returns:
            One array per item: ``[n_i, vocab]`` if ``all_logits`` else ``[1, vocab]``,
            in the model dtype, evaluated.

        Raises:
            PromptTooLongError, KvCacheExhaustedError, ExecutorError.
        """
        self._check_open()
        if not work:
            return []
        ids = [w.cache_id for w in work]
        if len(set(ids)) != len(ids):
            raise ExecutorError("a cache_id appears twice in one batch: send one item per sequence")
        for w in work:
            if not w.tokens:
                raise ExecutorError(f"no tokens given for cache {w.cache_id!r}")
            bad = [t for t in w.tokens if not 0 <= t < self.args.vocab_size]
            if bad:
                raise ExecutorError(f"token id {bad[0]} is outside the vocabulary [0, {self.args.vocab_size})")
            have = self.num_tokens(w.cache_id) if self.has_cache(w.cache_id) else 0
            if have + len(w.tokens) > self.max_seq_len:
                raise PromptTooLongError(
                    f"sequence {w.cache_id!r} would hold {have + len(w.tokens)} tokens, more than the context of "
                    f"{self.max_seq_len}: shorten the prompt or max_tokens, or raise FERRUM_KV_CAPACITY "
                    "(at most the model's max_position_embeddings for sound results)"
                )
        with self._lock:
            self._state = ExecutorState.BUSY
            try:
                if self.layout == "paged":
                    return self._run_paged(work)
                return self._run_contiguous(work)
            finally:
                self._state = ExecutorState.READY

    def _run_paged(self, work: Sequence[SeqWork]) -> list[mx.array]:
        order = sorted(range(len(work)), key=lambda i: len(work[i].tokens) != 1)  # decodes first, stable
        items = [work[i] for i in order]
        mgr = self.manager
        before: list[tuple[str, Optional[int]]] = []
        slots: list[int] = []
        positions: list[int] = []
        copies: list[tuple[int, int]] = []
        grouped = isinstance(mgr, LayerGroupKvManager)
        group_slots: list[list[int]] = [[] for _ in mgr.groups] if grouped else []
        group_copies: list[list[tuple[int, int]]] = [[] for _ in mgr.groups] if grouped else []
        try:
            for w in items:
                existed = mgr.has(w.cache_id)
                if not existed:
                    mgr.create(w.cache_id)
                start = mgr.num_tokens(w.cache_id)
                before.append((w.cache_id, start if existed else None))
                res = mgr.append_slots(w.cache_id, len(w.tokens), w.tokens)
                slots.extend(res.slots)
                copies.extend(res.copies)
                if grouped:
                    for g, r in enumerate(res.group_results):
                        group_slots[g].extend(r.slots)
                        group_copies[g].extend(r.copies)
                positions.extend(range(start, start + len(w.tokens)))
        except BaseException:  # Ctrl-C too: never leave slots appended twice
            for cid, prev in before:
                if prev is None:
                    mgr.release(cid)
                else:
                    mgr.truncate(cid, prev)
            raise
        if grouped:
            for g, pairs in enumerate(group_copies):
                self.pool.copy_blocks(pairs, layers=[i for i, x in enumerate(mgr.layer_groups) if x == g])
        else:
            self.pool.copy_blocks(copies)

        def block_tables(seqs) -> mx.array:
            # blocks freed outside a sliding window (-1) point at block 0: attention never reads them
            tables = [[max(b, 0) for b in seqs[w.cache_id].block_ids] for w in items]
            max_blocks = max(len(t) for t in tables)
            return mx.array([t + [0] * (max_blocks - len(t)) for t in tables], dtype=mx.int32)

        table_arr = block_tables(mgr.seqs)
        ctx = [mgr.seqs[w.cache_id].num_tokens for w in items]
        qsl = [0]
        for w in items:
            qsl.append(qsl[-1] + len(w.tokens))
        nd = sum(1 for w in items if len(w.tokens) == 1)
        logit_rows: list[int] = []
        for i, w in enumerate(items):
            logit_rows.extend(range(qsl[i], qsl[i + 1]) if w.all_logits else [qsl[i + 1] - 1])
        meta = AttentionMetadata(
            layout="paged",
            positions=mx.array(positions, dtype=mx.int32),
            pool=self.pool,
            slot_mapping=mx.array(slots, dtype=mx.int32),
            block_tables=table_arr,
            context_lens=mx.array(ctx, dtype=mx.int32),
            query_start_loc=mx.array(qsl, dtype=mx.int32),
            num_decode_seqs=nd,
            host_context_lens=ctx,
            host_query_start_loc=qsl,
            logits_indices=None if len(logit_rows) == qsl[-1] else mx.array(logit_rows, dtype=mx.int32),
        )
        if grouped:
            meta.layer_groups = mgr.layer_groups
            meta.group_slot_mappings = [mx.array(gs, dtype=mx.int32) for gs in group_slots]
            meta.group_block_tables = [block_tables(g.seqs) for g in mgr.groups]
        tokens = mx.array([t for w in items for t in w.tokens], dtype=mx.int32)[None]
        try:
            logits = self.model(tokens, meta)[0]
            mx.eval(logits, self.pool.k, self.pool.v)
        except BaseException:  # Ctrl-C too: never leave slots appended twice
            for cid, prev in before:
                if prev is None:
                    mgr.release(cid)
                else:
                    mgr.truncate(cid, prev)
            raise
        for w in items:
            # keep only each sliding window between steps; a verify step (all logits)
            # keeps its blocks until the rejected draft tokens are truncated
            if not w.all_logits:
                mgr.trim_to_window(w.cache_id)
        out: list[Optional[mx.array]] = [None] * len(work)
        r = 0
        for i, w in zip(order, items):
            n = len(w.tokens) if w.all_logits else 1
            out[i] = logits[r : r + n]
            r += n
        return out  # type: ignore[return-value]

    def _new_contiguous(self) -> list[ContiguousKvCache]:
        a = self.args
        pre = self.config.kv_capacity is not None
        return [
            ContiguousKvCache(
                a.num_key_value_heads, a.head_dim, self.dtype, self.max_seq_len, self.config.kv_cache_step, pre
            )
            for _ in range(a.num_hidden_layers)
        ]

    def _run_contiguous(self, work: Sequence[SeqWork]) -> list[mx.array]:
        out: list[Optional[mx.array]] = [None] * len(work)
        groups: dict[int, list[int]] = {}
        for i, w in enumerate(work):
            groups.setdefault(len(w.tokens), []).append(i)
        done: list[tuple[list, list[int], list[str]]] = []  # groups already run, to undo on a later failure
        try:
            self._run_contiguous_groups(work, groups, out, done)
        except BaseException:
            for caches, prev, created in done:
                self._undo_contiguous(caches, prev, created)
            raise
        return out  # type: ignore[return-value]

    def _undo_contiguous(self, caches: list, prev: list[int], created: list[str]) -> None:
        for c, p in zip(caches, prev):
            for layer in c:
                if layer.len > p:
                    layer.truncate(p)
        for cid in created:
            self._contiguous.pop(cid, None)

    def _run_contiguous_groups(self, work, groups, out, done) -> None:
        for n, idxs in groups.items():
            rows = [work[i] for i in idxs]
            created = []
            for w in rows:
                if w.cache_id not in self._contiguous:
                    self._contiguous[w.cache_id] = self._new_contiguous()
                    created.append(w.cache_id)
            caches = [self._contiguous[w.cache_id] for w in rows]
            prev = [c[0].len for c in caches]
            done.append((caches, prev, created))
            rows_wanted = [
                r for j, w in enumerate(rows) for r in (range(j * n, (j + 1) * n) if w.all_logits else [(j + 1) * n - 1])
            ]
            meta = AttentionMetadata(
                layout="contiguous",
                offsets=mx.array(prev, dtype=mx.int32),
                caches=caches,
                pad_mask=contiguous_pad_mask([p + n for p in prev], n, self.dtype),
                # the LM head runs only on the rows whose logits are returned
                logits_indices=None if len(rows_wanted) == n * len(rows) else mx.array(rows_wanted, dtype=mx.int32),
            )
            tokens = mx.array([w.tokens for w in rows], dtype=mx.int32)
            logits = self.model(tokens, meta)
            mx.eval(logits)
            flat = logits.reshape(-1, logits.shape[-1])
            r = 0
            for i, w in zip(idxs, rows):
                k = n if w.all_logits else 1
                out[i] = flat[r : r + k]
                r += k

    # ---------------------------------------------------------- ferrum API
    def _timed(self, kind: str, batch: int, fn):
        t0 = time.perf_counter()
        res = fn()
        dt = time.perf_counter() - t0
        self._counts[kind] += 1
        self._times[kind] += dt
        self._last_batch = batch
        self._last_op = time.time()
        self._peak_kv_bytes = max(self._peak_kv_bytes, self._kv_used_bytes())
        return res

    def prefill(self, input: PrefillInput) -> PrefillOutput:
        """Run a prompt (or extend ``input.kv_cache`` by a chunk) in one forward pass.

        Returns:
            ``PrefillOutput`` with logits ``[1, L, vocab]`` when ``return_all_logits``
            else ``[1, 1, vocab]``.
        """
        return self.batch_prefill([input])[0]

    def batch_prefill(self, inputs: Sequence[PrefillInput]) -> list[PrefillOutput]:
        """Several prompts in one forward pass (paged: packed; contiguous: grouped by length)."""
        work = []
        for inp in inputs:
            toks = _as_token_list(inp.input_ids, "PrefillInput")
            if inp.attention_mask is not None and not bool(mx.all(inp.attention_mask != 0)):
                raise ExecutorError("attention_mask with zeros is not supported: send unpadded sequences")
            if inp.kv_cache is not None:
                cid = inp.kv_cache.cache_id
                if not self.has_cache(cid):
                    raise UnknownCacheError(f"unknown KV cache {cid!r}: it was never created or was released")
            else:
                cid = inp.cache_id or f"seq-{next(_ids)}"
                if self.has_cache(cid):
                    raise ExecutorError(f"cache_id {cid!r} is in use: release it or pass its handle as kv_cache")
            work.append(SeqWork(cid, toks, inp.return_all_logits))
        logits = self._timed("prefill", len(work), lambda: self.run(work))
        return [PrefillOutput(l[None], self._handle(w.cache_id)) for l, w in zip(logits, work)]

    def decode(self, input: DecodeInput) -> DecodeOutput:
        """One token of one sequence; logits ``[1, vocab]``."""
        return self.batch_decode([input])[0]

    def batch_decode(self, inputs: Sequence[DecodeInput]) -> list[DecodeOutput]:
        """One token for each of several sequences, in ONE forward pass.

        Paged: ragged context lengths, no padding. Contiguous: K/V rows padded to the
        longest cache and masked.
        """
        work = []
        for inp in inputs:
            toks = _as_token_list(inp.input_ids, "DecodeInput")
            if len(toks) != 1:
                raise ExecutorError("DecodeInput.input_ids must hold one token ([1, 1]); use forward_verify for more")
            if not self.has_cache(inp.kv_cache.cache_id):
                raise UnknownCacheError(
                    f"unknown KV cache {inp.kv_cache.cache_id!r}: it was never created or was released"
                )
            work.append(SeqWork(inp.kv_cache.cache_id, toks))
        logits = self._timed("decode", len(work), lambda: self.run(work))
        return [DecodeOutput(l, self._handle(w.cache_id)) for l, w in zip(logits, work)]

    def forward_verify(self, inputs: Sequence[DecodeInput]) -> list[DecodeOutput]:
        """N+1 tokens of ONE sequence in one forward pass, one logits row per token.

        For speculative decoding: pass the last accepted token followed by N draft
        tokens, all with the same ``kv_cache``; row ``i`` gives the logits after token
        ``i``. Every output carries the final handle; roll rejected tokens back with
        :meth:`truncate_kv`.
        """
        if not inputs:
            return []
        cid = inputs[0].kv_cache.cache_id
        if any(i.kv_cache.cache_id != cid for i in inputs):
            raise ExecutorError("forward_verify takes tokens of one sequence: all inputs must share kv_cache")
        if not self.has_cache(cid):
            raise UnknownCacheError(f"unknown KV cache {cid!r}: it was never created or was released")
        toks = [t for i in inputs for t in _as_token_list(i.input_ids, "DecodeInput")]
        logits = self._timed("decode", 1, lambda: self.run([SeqWork(cid, toks, True)]))[0]
        h = self._handle(cid)
        return [DecodeOutput(logits[i : i + 1], h) for i in range(len(toks))]

    def truncate_kv(self, kv_cache: KvCacheHandle, new_len: int) -> KvCacheHandle:
        """Keep the first ``new_len`` tokens of a cache; paged blocks past them are freed.

        Raises:
            UnknownCacheError: released cache. KvCacheError: ``new_len`` out of range.
        """
        cid = kv_cache.cache_id
        with self._lock:
            if self.layout == "paged":
                self.manager.truncate(cid, new_len)
            else:
                caches = self._contiguous.get(cid)
                if caches is None:
                    raise UnknownCacheError(f"unknown KV cache {cid!r}: it was never created or was released")
                for c in caches:
                    c.truncate(new_len)
        return self._handle(cid)

    def fork_cache(self, kv_cache: KvCacheHandle, new_cache_id: Optional[str] = None) -> KvCacheHandle:
        """A new sequence starting with ``kv_cache``'s tokens (paged: shared blocks, copy-on-write)."""
        new_id = new_cache_id or f"seq-{next(_ids)}"
        with self._lock:
            if self.layout == "paged":
                self.manager.fork(kv_cache.cache_id, new_id)
            else:
                src = self._contiguous.get(kv_cache.cache_id)
                if src is None:
                    raise UnknownCacheError(f"unknown KV cache {kv_cache.cache_id!r}")
                dst = self._new_contiguous()
                for s, d in zip(src, dst):
                    if s.len:
                        d.append(s.k[..., : s.len, :], s.v[..., : s.len, :])
                self._contiguous[new_id] = dst
        return self._handle(new_id)

    def release_cache(self, cache_id: str) -> None:
        """Free a sequence's cache; unknown ids are ignored (release is idempotent)."""
        with self._lock:
            if self.layout == "paged":
                if self.manager.has(cache_id):
                    self.manager.release(cache_id)
            else:
                self._contiguous.pop(cache_id, None)

    # ------------------------------------------------------------ reports
    def _kv_used_bytes(self) -> int:
        a = self.args
        per_tok = 2 * a.num_hidden_layers * a.num_key_value_heads * a.head_dim * self.dtype.size
        if self.layout == "paged":
            if isinstance(self.manager, LayerGroupKvManager):
                return self.manager.bytes_held(per_tok // a.num_hidden_layers)
            return self.manager.allocator.num_in_use * self.manager.block_size * per_tok
        return sum(c[0].capacity for c in self._contiguous.values()) * per_tok

    def kv_allocated_bytes(self) -> int:
        """Bytes of KV memory held: the whole pool (paged) or every buffer's capacity (contiguous)."""
        if self.layout == "paged":
            return self.pool.nbytes
        return self._kv_used_bytes()

    def cache_metrics_snapshot(self) -> dict:
        """Paged: the manager's block metrics; contiguous: sequences and bytes held."""
        if self.layout == "paged":
            return self.manager.cache_metrics_snapshot()
        return {"num_sequences": len(self._contiguous), "allocated_bytes": self._kv_used_bytes()}

    def capabilities(self) -> ExecutorCapabilities:
        """What this executor does (every flag is true of the implementation)."""
        a = self.args
        mechs = [AttentionType.MULTI_HEAD]
        if a.num_key_value_heads < a.num_attention_heads:
            mechs.append(AttentionType.MULTI_QUERY if a.num_key_value_heads == 1 else AttentionType.GROUPED_QUERY)
        if self.layout == "paged":
            mechs.append(AttentionType.PAGED)
        per_tok_layer = 2 * a.num_key_value_heads * a.head_dim * self.dtype.size
        return ExecutorCapabilities(
            max_batch_size=self.config.max_num_seqs if self.layout == "paged" else 256,
            max_sequence_length=self.max_seq_len,
            attention_mechanisms=mechs,
            supports_dynamic_batching=True,
            supports_continuous_batching=self.layout == "paged",
            supports_speculative_decoding=True,
            supports_tensor_parallelism=False,
            supports_pipeline_parallelism=False,
            supported_dtypes=["float32", "float16", "bfloat16"],
            supported_devices=["gpu" if mx.metal.is_available() else "cpu"],
            memory_requirements=MemoryRequirements(
                parameter_memory=self._weight_bytes,
                activation_memory_per_token=4 * a.hidden_size * self.dtype.size,
                kv_cache_memory_per_token=per_tok_layer,
            ),
            kv_layout=self.layout,
        )

    def status(self) -> ExecutorStatus:
        """Counts of prefill/decode calls and their average time in milliseconds."""
        avg = lambda k: 1000.0 * self._times[k] / self._counts[k] if self._counts[k] else 0.0  # noqa: E731
        alloc = self.kv_allocated_bytes()
        used = self._kv_used_bytes()
        return ExecutorStatus(
            state=self._state,
            is_ready=self._state == ExecutorState.READY,
            current_batch_size=self._last_batch,
            prefill_operations=self._counts["prefill"],
            decode_operations=self._counts["decode"],
            avg_prefill_time_ms=avg("prefill"),
            avg_decode_time_ms=avg("decode"),
            memory_usage=ExecutorMemoryUsage(
                allocated_bytes=alloc,
                used_bytes=used,
                peak_bytes=self._peak_kv_bytes,
                utilization_percent=100.0 * used / alloc if alloc else 0.0,
            ),
            last_operation=self._last_op,
        )

    def warmup(self) -> None:
        """Run a 2-token prefill and a decode on a scratch cache, then release it."""
        self._check_open()
        cid = f"warmup-{next(_ids)}"
        try:
            self.run([SeqWork(cid, [0, 0])])
            self.run([SeqWork(cid, [0])])
        finally:
            self.release_cache(cid)

    def shutdown(self) -> None:
        """Release every cache; later calls raise ``ExecutorError``."""
        with self._lock:
            if self.layout == "paged":
                for cid in list(self.manager.seqs):
                    self.manager.release(cid)
            self._contiguous.clear()
            self._state = ExecutorState.SHUTDOWN
