"""Scheduler: which sequences run in the next step, how many tokens each brings, and
where their K/V go. It owns the KV block manager.

First come, first served, in the style of vLLM's unified scheduler (and nano-vllm):

- Running sequences go first, in admission order. A decoding sequence brings one token;
  one still prefilling brings its next chunk (at most ``prefill_chunk_size`` tokens).
  Chunks and decode tokens of all sequences go into ONE forward pass.
- Then waiting sequences are admitted while there are sequence slots
  (``max_num_seqs``), token budget (``max_num_batched_tokens``) and free blocks. With
  prefix caching, an admitted sequence first shares the cached blocks of its prompt,
  and one whose prompt shares blocks that a running sequence computes in this step
  waits for them (``Scheduler._prefix_in_flight``).
- Preemption by recompute: when the pool cannot grow a running sequence, the most
  recently admitted running sequence is preempted: its blocks are freed at once
  (``SchedulerOutput.preempted``) and it returns to the front of the waiting queue, to
  be recomputed (prompt + outputs so far) later.

Block ownership follows vLLM's block manager (Kwon et al., SOSP 2023) and nano-vllm:
the scheduler holds the :class:`~mlx_ferrum.kv_cache.LayerGroupKvManager` (block
tables, reference counts, prefix hashes; built by the engine from the runner's
``kv_geometry``) and is the only one that changes it while the engine runs. Within
:meth:`Scheduler.schedule` it frees preempted sequences, shares cached prefixes, counts
the blocks each decision takes (so later decisions see earlier ones), and at the end
appends every row's slots, the lookahead slots of speculation included. The step's
:class:`SchedulerOutput` carries them (``SchedulerOutput.kv``: per row, its slots and
block tables per layer group); the runner only reads it. The engine reports back what
the step learned (:meth:`Scheduler.release_lookahead`, :meth:`Scheduler.commit_draft`,
:meth:`Scheduler.set_token_ids`, :meth:`Scheduler.free`, :meth:`Scheduler.rollback`).

The contiguous layout has no block manager (``block_manager=None``): admission is then
bounded by ``max_num_seqs`` only, and ``SchedulerOutput.kv`` is None.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Hashable, Optional, Sequence as Seq

from ..config import RuntimeConfig
from ..errors import KvCacheError
from ..kv_cache import LayerGroupKvManager
from ..kv_cache.block_tables import BatchBlocks, RowBlocks, append_row, shrink_row, undo_rows
from ..kv_cache.manager import UNKNOWN_TOKEN
from ..lora.registry import salt_token_ids
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledItem:
    """``num_tokens`` new tokens of ``seq`` (from ``seq.num_computed`` on) for this step.

    ``num_lookahead``: speculative tokens this decode row may add after its one token
    (vLLM's ``num_lookahead_slots``): the step's token budget counts them and their
    slots are appended with the row's (``SchedulerOutput.kv``), so the engine may
    append up to that many proposed tokens; it gives back the slots a draft does not
    use (:meth:`Scheduler.release_lookahead`).

    ``lora_slot``: the runner's adapter slot the request pinned at admission
    (:meth:`Scheduler.add`), -1 for the base model; the row's work carries it to the
    runner (``SeqWork.lora_slot``).
    """

    seq: Sequence
    num_tokens: int
    num_lookahead: int = 0
    lora_slot: int = -1

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so its logits are sampled."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class SchedulerOutput:
    """One step's plan: the rows to run with their KV slots, and sequences preempted,
    refused or failed.

    Attributes:
        items: what runs this step, running sequences first, then admitted ones: per row
            the sequence (its request id, sampling parameters and adapter), its token
            count (``num_tokens``), its speculative lookahead and its adapter slot
            (``lora_slot``, -1: the base model).
        preempted: sequences preempted this step, in order (their blocks are freed).
        rejected: sequences that can never run (the engine fails them).
        failed: ``(sequence, error)`` for rows whose slots could not be appended (the
            engine fails them; other rows are untouched).
        kv: the rows' blocks (:class:`~mlx_ferrum.kv_cache.block_tables.BatchBlocks`):
            per request id, its first position (``start``), one slot per token
            (``num_tokens + num_lookahead`` of them; ``block_id * block_size + offset``)
            and its block table, per layer group; plus copy-on-write copies. None for
            the contiguous layout.
    """

    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)
    failed: list = field(default_factory=list)
    kv: Optional[BatchBlocks] = None

    @property
    def num_tokens(self) -> int:
        """Tokens in the step's forward pass (lookahead slots not counted)."""
        return sum(i.num_tokens for i in self.items)

    @property
    def request_ids(self) -> list[str]:
        """The rows' request ids, in row order."""
        return [i.seq.request_id for i in self.items]

    def row_blocks(self, request_id: Hashable) -> Optional[RowBlocks]:
        """The row's :class:`~mlx_ferrum.kv_cache.block_tables.RowBlocks` (None: contiguous or no row)."""
        return self.kv.rows.get(request_id) if self.kv is not None else None

    def positions(self, request_id: Hashable) -> list[int]:
        """Positions of the row's tokens (lookahead slots included) in its sequence."""
        row = self.row_blocks(request_id)
        if row is not None:
            return list(range(row.start, row.context_len))
        item = next(i for i in self.items if i.seq.request_id == request_id)
        return list(range(item.seq.num_computed, item.seq.num_computed + item.num_tokens + item.num_lookahead))

class Scheduler:
    """FCFS scheduler with chunked prefill and preemption by recompute; the owner of the
    KV block manager (see the module docstring).

    Args:
        config: budgets (``max_num_seqs``, ``max_num_batched_tokens``, ``prefill_chunk_size``,
            ``max_num_prefill_seqs``).
        block_manager: the paged :class:`~mlx_ferrum.kv_cache.LayerGroupKvManager` this
            scheduler owns and drives (built by the engine from the runner's
            ``kv_geometry``), or None for the contiguous layout (no block accounting then:
            admission is bounded by ``max_num_seqs`` only).
        max_seq_len: most tokens per sequence.
        wait_for_prefix_in_flight: with prefix caching, a waiting request whose prompt
            shares blocks that a running sequence computes this step waits for them
            (:meth:`_prefix_in_flight`) instead of computing them too.

    Attributes:
        block_manager: as given.
        waiting, running: the queues. num_preemptions: preemptions so far.
        lora_slots: request id -> the adapter slot it pinned (requests with an adapter
            only), from :meth:`add` until :meth:`remove`; each scheduled row carries it.
    """

    def __init__(self, config: RuntimeConfig, block_manager: Optional[LayerGroupKvManager], max_seq_len: int,
                 wait_for_prefix_in_flight: bool = True):
        self.config = config
        self.block_manager = block_manager
        self.max_seq_len = max_seq_len
        self.wait_for_prefix_in_flight = wait_for_prefix_in_flight
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._order = 0
        self._reserved = 0  # blocks this step's decisions take, appended at the end of schedule()
        self.num_preemptions = 0
        self.lora_slots: dict[Hashable, int] = {}

    def add(self, seq: Sequence, lora_slot: int = -1) -> None:
        """Queue a new request; ``lora_slot`` is the runner's adapter slot it pinned
        (-1: the base model), carried by each of its rows (``ScheduledItem.lora_slot``)."""
        if lora_slot >= 0:
            self.lora_slots[seq.request_id] = lora_slot
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the queues (its blocks are freed by
        :meth:`free`, which the engine calls once no step in flight reads them)."""
        self.lora_slots.pop(seq.request_id, None)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    # ------------------------------------------------------------ block ownership
    def free(self, request_id: Hashable, keep_cached: bool = True) -> None:
        """Free every block of ``request_id``'s cache (unknown ids are ignored).
        ``keep_cached=False`` (a request that ended with an error): the blocks it wrote
        leave the prefix cache (see :meth:`PagedKvCacheManager.release
        <mlx_ferrum.kv_cache.PagedKvCacheManager.release>`)."""
        mgr = self.block_manager
        if mgr is not None and mgr.has(request_id):
            mgr.release(request_id, keep_cached)

    def release_lookahead(self, out: SchedulerOutput, item: ScheduledItem, used: int) -> None:
        """Give back the lookahead slots of ``item`` past the first ``used`` (the draft
        proposed fewer tokens than were granted); ``out.kv``'s row keeps ``num_tokens + used``
        slots and ``item.num_lookahead`` becomes ``used``.

        Raises:
            KvCacheError: ``used`` above the granted lookahead.
        """
        if used > item.num_lookahead:
            raise KvCacheError(f"{used} draft tokens for {item.num_lookahead} lookahead slots")
        if self.block_manager is not None and used < item.num_lookahead:
            shrink_row(self.block_manager, out.kv, item.seq.request_id, item.num_tokens + used)
        item.num_lookahead = used

    def commit_draft(self, seq: Sequence, start: int, accepted: Seq[int]) -> None:
        """A verified draft: keep ``start + len(accepted)`` tokens of ``seq``'s cache (the
        rejected draft tokens' blocks are freed) and record the accepted ids, appended
        as unknown, for prefix caching.

        Args:
            start: tokens kept before the draft (its row's token included).
            accepted: the accepted draft token ids (unsalted ints).

        Raises:
            KvCacheError: the cache holds fewer tokens, or a sliding window already freed
                the blocks it would need.
        """
        mgr = self.block_manager
        if mgr is None or not mgr.has(seq.request_id):
            return
        mgr.truncate(seq.request_id, start + len(accepted))
        if accepted and mgr.prefix_cache:
            mgr.set_token_ids(seq.request_id, start, salt_token_ids(accepted, seq.prefix_salt))

    def set_token_ids(self, seq: Sequence, start: int, token_ids: Seq[int]) -> None:
        """Record the ids of ``seq``'s tokens appended before they were read back (a
        pipelined step's in-flight token, stored as ``UNKNOWN_TOKEN``), so prefix caching
        can hash their blocks. A no-op without prefix caching or without a cache.

        Raises:
            KvCacheError: a position already holds a different known id.
        """
        mgr = self.block_manager
        if mgr is not None and mgr.prefix_cache and mgr.has(seq.request_id):
            mgr.set_token_ids(seq.request_id, start, salt_token_ids(token_ids, seq.prefix_salt))

    def rollback(self, out: SchedulerOutput, request_ids: Optional[Seq[Hashable]] = None) -> None:
        """The step of ``out`` did not run (or ran without the rows of ``request_ids``):
        give back every slot it appended to those rows (each row's cache is cut back to
        its ``start``, and the blocks of the given-back slots leave the prefix cache;
        caches released meanwhile are skipped)."""
        if self.block_manager is not None and out.kv is not None:
            undo_rows(self.block_manager, out.kv, request_ids)

    # ------------------------------------------------------------ planning
    def _fits(self, seq: Sequence, n: int) -> bool:
        """True when ``n`` more tokens of ``seq`` fit beside the blocks this step already took."""
        mgr = self.block_manager
        if mgr is None:
            return True
        return mgr.blocks_needed(seq.request_id, n) <= mgr.num_free - self._reserved

    def _ends_by_length(self, seq: Sequence) -> bool:
        """True when ``seq`` already holds its last token (``max_tokens`` or a full context)."""
        return bool(seq.output_ids) and (
            len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_seq_len
        )

    def _alone_cannot_fit(self, seq: Sequence) -> bool:
        if self.block_manager is None:
            return False
        need = -(-seq.num_tokens // self.block_manager.block_size)
        return need > self.block_manager.num_blocks

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        self.free(victim.request_id)
        victim.num_computed = 0
        victim.status = SequenceStatus.WAITING
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self, lookahead: Optional[Callable[[Sequence], int]] = None) -> SchedulerOutput:
        """Plan the next step and append its slots (see the module docstring).

        Args:
            lookahead: speculative tokens a decoding sequence would like to add this step
                (0: none), or None when nothing speculates. After every sequence got its
                tokens, each decode row that asks is granted as many as the remaining token
                budget and free blocks allow (``ScheduledItem.num_lookahead``), oldest first:
                speculation never takes budget or blocks from ordinary work.

        Returns:
            The step's :class:`SchedulerOutput`; its ``kv`` rows hold the slots of every
            item's tokens and lookahead.
        """
        mgr = self.block_manager
        out = SchedulerOutput(kv=BatchBlocks() if mgr is not None else None)
        budget = self.config.max_num_batched_tokens
        chunk = self.config.prefill_chunk_size
        self._reserved = 0

        # running sequences, oldest first; preempt the youngest when blocks run out
        free = mgr.num_free if mgr is not None else 0  # changes only when one is preempted
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.remaining, chunk, budget)
            if self._ends_by_length(seq):
                n = 0  # its last token is still in flight (pipelined engine): nothing more to run
            if n <= 0:
                i += 1
                continue
            # its own need does not change while others are preempted; only the free blocks do
            need = mgr.blocks_needed(seq.request_id, n) if mgr is not None else 0
            while mgr is not None and need > free - self._reserved:
                victim = self.running[-1]
                self._preempt(victim, out)
                free = mgr.num_free
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted itself; the loop index now points at the next one
            self._reserved += need
            out.items.append(ScheduledItem(seq, n, lora_slot=self.lora_slots.get(seq.request_id, -1)))
            budget -= n
            i += 1

        # admit waiting sequences, first come first served
        prefilling = (self._prefilling() if self.waiting and self.wait_for_prefix_in_flight
                      and mgr is not None and mgr.prefix_cache else None)
        deferred: list[Sequence] = []
        # a cap on the sequences that prefill in this step: the running ones still in their
        # prompt count against it (and always run), new ones are admitted below it
        cap = self.config.max_num_prefill_seqs
        prefills = sum(1 for it in out.items if it.seq.num_computed < len(it.seq.prompt_ids)) if cap else 0
        while (self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs
               and (cap is None or prefills < cap)):
            seq = self.waiting[0]
            if self._alone_cannot_fit(seq):
                self.waiting.popleft()
                out.rejected.append(seq)
                continue
            claimed = False
            tokens = None
            if (mgr is not None and mgr.prefix_cache and not mgr.has(seq.request_id) and seq.num_computed == 0
                    and seq.params.prompt_logprobs is None):  # cached blocks bring no logits to score
                tokens = seq.prefix_key_ids()  # salted by its LoRA adapter: no KV shared across adapters
                cached = mgr.longest_cached_prefix(tokens)
                if prefilling is not None and self._prefix_in_flight(tokens, cached, prefilling):
                    deferred.append(self.waiting.popleft())
                    continue
                # taken at once (a prefix-cache query): the blocks it revives are no longer free
                mgr.create(seq.request_id)
                mgr.match_prefix(seq.request_id, tokens, max_tokens=cached)
                claimed = True
                seq.num_computed = cached
                if seq.metrics.num_preemptions == 0:
                    seq.metrics.num_cached_tokens = cached
            n = min(seq.remaining, chunk, budget)
            if not self._fits(seq, n):
                if claimed:
                    # give the shared prefix blocks back (to the back of the eviction order:
                    # they are wanted again soon); they are looked up again next time
                    self.free(seq.request_id)
                    seq.num_computed = 0
                if not self.running and not out.items:
                    # nothing runs and it still does not fit: only eviction of cached
                    # blocks could help, and allocation already evicts, so refuse it
                    self.waiting.popleft()
                    out.rejected.append(seq)
                    continue
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._order += 1
            seq.order = self._order
            self.running.append(seq)
            if mgr is not None:
                self._reserved += mgr.blocks_needed(seq.request_id, n)
            out.items.append(ScheduledItem(seq, n, lora_slot=self.lora_slots.get(seq.request_id, -1)))
            budget -= n
            prefills += 1
            if prefilling is not None and seq.remaining > 0:
                prefilling.append((seq, tokens if tokens is not None else seq.prefix_key_ids()))
        self.waiting.extendleft(reversed(deferred))  # first in the queue again, in their order
        if lookahead is not None:
            self._grant_lookahead(out, budget, lookahead)
        if mgr is not None:
            self._append_slots(out)
        return out

    def _append_slots(self, out: SchedulerOutput) -> None:
        """Append every item's slots (its tokens, then its lookahead), in item order: the
        decisions above counted the blocks, so this always fits; a row that still cannot
        be appended (a defect) goes to ``out.failed`` and leaves the step."""
        mgr = self.block_manager
        prefix_cache = mgr.prefix_cache
        kept = []
        for item in out.items:
            seq = item.seq
            key_ids = None
            if prefix_cache:
                # a token still in flight is -1 in output_ids, i.e. UNKNOWN_TOKEN: its block
                # is hashed once set_token_ids() brings its id
                key_ids = seq.token_at(seq.num_computed, seq.num_computed + item.num_tokens)
                if seq.prefix_salt:
                    key_ids = salt_token_ids(key_ids, seq.prefix_salt)
                if item.num_lookahead:
                    key_ids = key_ids + [UNKNOWN_TOKEN] * item.num_lookahead
            try:
                append_row(mgr, out.kv, seq.request_id, item.num_tokens + item.num_lookahead, key_ids)
            except KvCacheError as e:
                out.failed.append((seq, e))
                continue
            kept.append(item)
        out.items = kept

    def _prefilling(self) -> list[tuple[Sequence, list[int]]]:
        """The running sequences whose prompt is not all computed, with their prefix-cache
        token ids (see :meth:`_prefix_in_flight`)."""
        return [(r, r.prefix_key_ids()) for r in self.running if r.num_computed < len(r.prompt_ids)]

    def _prefix_in_flight(self, tokens: list[int], cached: int, prefilling: list) -> bool:
        """True when a running sequence is about to compute full blocks that ``tokens``
        share past their ``cached`` tokens, and those blocks are worth waiting a step for:
        at least one block, and at least half of what the request would compute now.

        Requests that arrive together with one long common prefix (a chat server's system
        prompt, a burst of few-shot prompts) would otherwise each compute that prefix in
        the same step, since none of it is cached yet; deferred, they find it cached a
        step later and compute only their own tails. This is the prefix-aware admission
        of SGLang's RadixAttention scheduler, reduced to waiting for an in-flight prefix;
        the outputs do not change (a prefix-cache hit gives the same K/V). A deferred
        request keeps its place at the head of the queue; the wait ends when the blocks
        are computed, or when the sequence computing them is preempted or ends.
        """
        block = self.block_manager.block_size
        gain = max(block, -(-(len(tokens) - cached) // 2))
        target = -(-(cached + gain) // block) * block  # the shared tokens that would pay
        if target >= len(tokens):
            return False  # the last token is never taken from the cache
        head = tokens[cached:target]
        for running, ids in prefilling:
            # one slice comparison rejects most candidates; the shared start is checked last
            if running.num_computed < target and ids[cached:target] == head and ids[:cached] == tokens[:cached]:
                return True
        return False

    def _grant_lookahead(self, out: SchedulerOutput, budget: int, lookahead: Callable[[Sequence], int]) -> None:
        mgr = self.block_manager
        for item in out.items:
            seq = item.seq
            if budget <= 0:
                return
            if item.num_tokens != 1 or not item.samples or not seq.output_ids:
                continue
            k = min(lookahead(seq), budget)
            if k <= 0:
                continue
            if mgr is not None:
                base = mgr.blocks_needed(seq.request_id, 1)
                room = mgr.num_free - self._reserved
                while k > 0 and mgr.blocks_needed(seq.request_id, 1 + k) - base > room:
                    k -= 1
                self._reserved += mgr.blocks_needed(seq.request_id, 1 + k) - base
            item.num_lookahead = k
            budget -= k
