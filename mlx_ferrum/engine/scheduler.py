"""Scheduler: which sequences run in the next step, and how many tokens each brings.

First come, first served, in the style of vLLM's unified scheduler (and nano-vllm):

- Running sequences go first, in admission order. A decoding sequence brings one token;
  one still prefilling brings its next chunk (at most ``prefill_chunk_size`` tokens).
  Chunks and decode tokens of all sequences go into ONE forward pass.
- Then waiting sequences are admitted while there are sequence slots
  (``max_num_seqs``), token budget (``max_num_batched_tokens``) and free blocks. With
  prefix caching, an admitted sequence first takes the cached blocks of its prompt
  (``SchedulerOutput.prefix_lookups``), and one whose prompt shares blocks that a
  running sequence computes in this step waits for them (``Scheduler._prefix_in_flight``).
- Preemption by recompute: when the pool cannot grow a running sequence, the most
  recently admitted running sequence is preempted: its blocks are to be freed
  (``SchedulerOutput.preempted``) and it returns to the front of the waiting queue, to
  be recomputed (prompt + outputs so far) later.

The scheduler only READS the host-side
:class:`~mlx_ferrum.kv_cache.LayerGroupKvManager` (block tables), never arrays, and
never writes it: the releases and prefix claims it decides are recorded in a
:class:`~mlx_ferrum.kv_cache.block_plan.BlockPlan` (so later decisions of the same step
count with them) and applied by the engine, through the executor, right after
:meth:`Scheduler.schedule` returns (:func:`mlx_ferrum.engine.engine.apply_kv_plan`). The
executor appends the slots when it runs the step.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..config import RuntimeConfig
from ..kv_cache import LayerGroupKvManager
from ..kv_cache.block_plan import BlockPlan
from .sequence import Sequence, SequenceStatus


@dataclass
class ScheduledItem:
    """``num_tokens`` new tokens of ``seq`` (from ``seq.num_computed`` on) for this step.

    ``num_lookahead``: speculative tokens this decode row may add after its one token
    (vLLM's ``num_lookahead_slots``): the step's token budget and the pool's free blocks
    already count them, so the engine may append up to that many proposed tokens.
    """

    seq: Sequence
    num_tokens: int
    num_lookahead: int = 0

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the sequence's last token, so its logits are sampled."""
        return self.seq.num_computed + self.num_tokens == self.seq.num_tokens


@dataclass
class PrefixLookup:
    """A prefix-cache lookup the scheduler made for a waiting sequence; the engine performs
    it (``executor.claim_prefix``) after the step is planned, in the scheduler's order.

    Attributes:
        seq: the sequence (its cache does not exist yet).
        num_tokens: cached tokens found at the start of the sequence's tokens (a
            multiple of ``block_size``; its last token is never among them).
        admitted: True: ``seq`` was admitted and its cache starts with those tokens
            (``seq.num_computed`` counts them). False: it did not fit this step; the
            lookup is claimed and released at once, so it still counts as a prefix-cache
            query and the blocks it found move to the back of the eviction order (they
            are wanted again soon), as when the scheduler made the match itself.
    """

    seq: Sequence
    num_tokens: int
    admitted: bool


@dataclass
class SchedulerOutput:
    """One step's plan: the items to run, and sequences preempted or refused.

    Attributes:
        items: what runs this step, running sequences first, then admitted ones.
        preempted: sequences preempted this step, in order; the engine frees their
            caches (if they hold one) before anything else.
        rejected: sequences that can never run (the engine fails them).
        prefix_lookups: the prefix-cache lookups of this step, in order (after the
            preemptions' releases): :class:`PrefixLookup`.
    """

    items: list[ScheduledItem] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    rejected: list[Sequence] = field(default_factory=list)
    prefix_lookups: list[PrefixLookup] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens in the step's forward pass."""
        return sum(i.num_tokens for i in self.items)


class Scheduler:
    """FCFS scheduler with chunked prefill and preemption by recompute.

    Args:
        config: budgets (``max_num_seqs``, ``max_num_batched_tokens``, ``prefill_chunk_size``,
            ``max_num_prefill_seqs``).
        manager: the executor's paged manager (only read), or None for the contiguous
            layout (no block accounting then: admission is bounded by ``max_num_seqs`` only).
        max_seq_len: most tokens per sequence.
        wait_for_prefix_in_flight: with prefix caching, a waiting request whose prompt
            shares blocks that a running sequence computes this step waits for them
            (:meth:`_prefix_in_flight`) instead of computing them too.
    """

    def __init__(self, config: RuntimeConfig, manager: Optional[LayerGroupKvManager], max_seq_len: int,
                 wait_for_prefix_in_flight: bool = True):
        self.config = config
        self.manager = manager
        self.max_seq_len = max_seq_len
        self.wait_for_prefix_in_flight = wait_for_prefix_in_flight
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._order = 0
        self._reserved = 0
        self._plan: Optional[BlockPlan] = None  # this step's pending releases and prefix claims
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue a new request."""
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Drop a finished or aborted sequence from the queues (its blocks are freed by the engine)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)

    def _fits(self, seq: Sequence, n: int) -> bool:
        """True when ``n`` more tokens of ``seq`` fit beside the blocks this step already reserved."""
        if self._plan is None:
            return True
        return self._plan.blocks_needed(seq.request_id, n) <= self._plan.num_free - self._reserved

    def _reserve(self, seq: Sequence, n: int) -> None:
        if self._plan is not None:
            self._reserved += self._plan.blocks_needed(seq.request_id, n)

    def _ends_by_length(self, seq: Sequence) -> bool:
        """True when ``seq`` already holds its last token (``max_tokens`` or a full context)."""
        return bool(seq.output_ids) and (
            len(seq.output_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_seq_len
        )

    def _alone_cannot_fit(self, seq: Sequence) -> bool:
        if self.manager is None:
            return False
        need = -(-seq.num_tokens // self.manager.block_size)
        return need > self.manager.num_blocks

    def _preempt(self, victim: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(victim)
        if self._plan is not None and self._plan.has(victim.request_id):
            self._plan.release(victim.request_id)  # the engine frees it (out.preempted)
        victim.num_computed = 0
        victim.status = SequenceStatus.WAITING
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self, lookahead: Optional[Callable[[Sequence], int]] = None) -> SchedulerOutput:
        """Plan the next step (see the module docstring).

        Args:
            lookahead: speculative tokens a decoding sequence would like to add this step
                (0: none), or None when nothing speculates. After every sequence got its
                tokens, each decode row that asks is granted as many as the remaining token
                budget and free blocks allow (``ScheduledItem.num_lookahead``), oldest first:
                speculation never takes budget or blocks from ordinary work.
        """
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunk = self.config.prefill_chunk_size
        self._reserved = 0
        self._plan = BlockPlan(self.manager) if self.manager is not None else None

        # running sequences, oldest first; preempt the youngest when blocks run out
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.remaining, chunk, budget)
            if self._ends_by_length(seq):
                n = 0  # its last token is still in flight (pipelined engine): nothing more to run
            if n <= 0:
                i += 1
                continue
            plan = self._plan
            # its own need does not change while others are preempted; only the free blocks do
            need = plan.blocks_needed(seq.request_id, n) if plan is not None else 0
            while plan is not None and need > plan.num_free - self._reserved:
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted itself; the loop index now points at the next one
            self._reserved += need
            out.items.append(ScheduledItem(seq, n))
            budget -= n
            i += 1

        # admit waiting sequences, first come first served
        prefilling = (self._prefilling() if self.waiting and self.wait_for_prefix_in_flight
                      and self._plan is not None and self.manager.prefix_cache else None)
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
            lookup = None
            plan = self._plan
            tokens = None
            if (plan is not None and not plan.has(seq.request_id) and seq.num_computed == 0 and self.manager.prefix_cache
                    and seq.params.prompt_logprobs is None):  # cached blocks bring no logits to score
                tokens = seq.prefix_key_ids()  # salted by its LoRA adapter: no KV shared across adapters
                cached = plan.longest_cached_prefix(tokens)
                if prefilling is not None and self._prefix_in_flight(tokens, cached, prefilling):
                    deferred.append(self.waiting.popleft())
                    continue
                # counted as taken at once: the blocks it revives are no longer free
                plan.claim(seq.request_id, tokens, cached)
                lookup = PrefixLookup(seq, cached, admitted=False)
                out.prefix_lookups.append(lookup)
                seq.num_computed = cached
                if seq.metrics.num_preemptions == 0:
                    seq.metrics.num_cached_tokens = cached
            n = min(seq.remaining, chunk, budget)
            if not self._fits(seq, n):
                if lookup is not None:
                    # give the shared prefix blocks back; they are looked up again next time
                    plan.cancel_claim(seq.request_id)
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
            if lookup is not None:
                lookup.admitted = True
            self._reserve(seq, n)
            out.items.append(ScheduledItem(seq, n))
            budget -= n
            prefills += 1
            if prefilling is not None and seq.remaining > 0:
                prefilling.append((seq, tokens if tokens is not None else seq.prefix_key_ids()))
        self.waiting.extendleft(reversed(deferred))  # first in the queue again, in their order
        if lookahead is not None:
            self._grant_lookahead(out, budget, lookahead)
        return out

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
        block = self.manager.block_size
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
        for item in out.items:
            seq = item.seq
            if budget <= 0:
                return
            if item.num_tokens != 1 or not item.samples or not seq.output_ids:
                continue
            k = min(lookahead(seq), budget)
            if k <= 0:
                continue
            if self._plan is not None:
                base = self._plan.blocks_needed(seq.request_id, 1)
                room = self._plan.num_free - self._reserved
                while k > 0 and self._plan.blocks_needed(seq.request_id, 1 + k) - base > room:
                    k -= 1
                self._reserved += self._plan.blocks_needed(seq.request_id, 1 + k) - base
            item.num_lookahead = k
            budget -= k
