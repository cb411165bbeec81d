"""The block-owning scheduler plans, and leaves the block manager, exactly as the
scheduler that first wrote the manager did.

``WritingScheduler`` below is the scheduler as it stood at commit 7f28a49: it called
``manager.create`` / ``match_prefix`` / ``release`` itself and left the slot appends to
the executor. Today's :class:`Scheduler` owns the manager and also appends every row's
slots inside ``schedule()`` (``SchedulerOutput.kv``). Both run the same mixed workloads
(shared prompt prefixes, preemption in a small pool, chunked prefill, aborts,
rejections; one plain manager and one per-layer-group manager with a sliding group);
for the oracle the driver appends the slots after ``schedule()`` as the old store did.
Every step's plan (items with their token counts and ``num_computed``, preemptions,
rejections) and the manager's block state after the step (free blocks, reference
counts, evictable order, block tables) must be identical, and the new scheduler's
``SchedulerOutput.kv`` must name exactly the slots the oracle's appends produced. No
model runs: this is block bookkeeping only, so it is fast.
"""

from __future__ import annotations

import random

import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine.sampling import SamplingParams
from mlx_ferrum.engine.scheduler import ScheduledItem, Scheduler, SchedulerOutput
from mlx_ferrum.engine.sequence import Sequence, SequenceStatus
from mlx_ferrum.kv_cache import LayerGroupKvManager, PagedKvCacheManager

BS = 8


class WritingScheduler(Scheduler):
    """The pre-change scheduler (7f28a49), kept verbatim as the oracle: it writes the manager."""

    def _fits(self, seq, n):
        if self.block_manager is None:
            return True
        cid = seq.request_id if self.block_manager.has(seq.request_id) else None
        return self.block_manager.blocks_needed(cid, n) <= self.block_manager.num_free - self._reserved

    def _reserve(self, seq, n):
        if self.block_manager is not None:
            cid = seq.request_id if self.block_manager.has(seq.request_id) else None
            self._reserved += self.block_manager.blocks_needed(cid, n)

    def _preempt(self, victim, out):
        self.running.remove(victim)
        if self.block_manager is not None and self.block_manager.has(victim.request_id):
            self.block_manager.release(victim.request_id)
        victim.num_computed = 0
        victim.status = SequenceStatus.WAITING
        victim.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)
        out.preempted.append(victim)

    def schedule(self):
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        chunk = self.config.prefill_chunk_size
        self._reserved = 0
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.remaining, chunk, budget)
            if self._ends_by_length(seq):
                n = 0
            if n <= 0:
                i += 1
                continue
            while not self._fits(seq, n):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            if seq.status != SequenceStatus.RUNNING:
                continue
            self._reserve(seq, n)
            out.items.append(ScheduledItem(seq, n))
            budget -= n
            i += 1
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            if self._alone_cannot_fit(seq):
                self.waiting.popleft()
                out.rejected.append(seq)
                continue
            if self.block_manager is not None and not self.block_manager.has(seq.request_id):
                self.block_manager.create(seq.request_id)
                if seq.num_computed == 0 and self.block_manager.prefix_cache:
                    cached = self.block_manager.match_prefix(seq.request_id, seq.token_at(0, seq.num_tokens))
                    seq.num_computed = cached
                    if seq.metrics.num_preemptions == 0:
                        seq.metrics.num_cached_tokens = cached
            n = min(seq.remaining, chunk, budget)
            if not self._fits(seq, n):
                if self.block_manager is not None and self.block_manager.num_tokens(seq.request_id) == seq.num_computed:
                    self.block_manager.release(seq.request_id)
                    seq.num_computed = 0
                if not self.running and not out.items:
                    self.waiting.popleft()
                    out.rejected.append(seq)
                    continue
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self._order += 1
            seq.order = self._order
            self.running.append(seq)
            self._reserve(seq, n)
            out.items.append(ScheduledItem(seq, n))
            budget -= n
        return out


def workload(seed: int, n: int = 40, vocab: int = 50):
    """``(arrival step, prompt, max_tokens, abort step or None)`` per request; prompts
    start with one of three shared prefixes (or none), so the prefix cache hits."""
    r = random.Random(seed)
    prefixes = [[r.randrange(vocab) for _ in range(r.randint(8, 40))] for _ in range(3)]
    reqs = []
    for i in range(n):
        head = r.choice(prefixes + [[]])
        prompt = head + [r.randrange(vocab) for _ in range(r.randint(1, 30))]
        if i % 17 == 5:
            prompt = [r.randrange(vocab) for _ in range(200)]  # alone needs more blocks than the pool has
        arrival = r.randint(0, 30)
        abort = arrival + r.randint(0, 12) if r.random() < 0.15 else None
        reqs.append((arrival, prompt, r.randint(1, 20), abort))
    return reqs


def _next_token(rid: str, position: int, vocab: int = 50) -> int:
    """A deterministic stand-in for sampling, different per request and position."""
    return (sum(map(ord, rid)) * 31 + position * 17) % vocab


def _block_state(manager) -> tuple:
    groups = manager.groups
    return tuple(
        (g.allocator.num_free, tuple(g.allocator.ref_counts), tuple(g.allocator._evictable),
         tuple(g.allocator._free), tuple(sorted((cid, s.num_tokens, tuple(s.block_ids)) for cid, s in g.seqs.items())),
         g.prefix_queries, g.prefix_query_tokens, g.prefix_hit_tokens)
        for g in groups
    )


def run(scheduler_cls, manager, config: RuntimeConfig, reqs, max_steps: int = 400):
    """Drive a scheduler like the engine (synchronous step) without a model; return
    the per-step trace and counters. The owning scheduler runs with the oracle's
    admission (no waiting for a prefix in flight, a later policy tested in test_engine)."""
    if scheduler_cls is Scheduler:
        sched = scheduler_cls(config, manager, max_seq_len=200, wait_for_prefix_in_flight=False)
    else:
        sched = scheduler_cls(config, manager, max_seq_len=200)
    seqs: dict[str, Sequence] = {}
    live: set[str] = set()
    trace = []
    stats = dict(preempted=0, claimed_tokens=0, chunked=0, aborted=0, rejected=0, finished=0)

    def finish(seq):
        seq.status = SequenceStatus.FINISHED
        sched.remove(seq)
        if manager.has(seq.request_id):
            manager.release(seq.request_id)
        live.discard(seq.request_id)

    for step in range(max_steps):
        for i, (arrival, prompt, max_tokens, abort) in enumerate(reqs):
            rid = f"r{i}"
            if arrival == step:
                seq = Sequence.create(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, ())
                seqs[rid] = seq
                live.add(rid)
                sched.add(seq)
            if abort == step and rid in live:
                finish(seqs[rid])
                stats["aborted"] += 1
        if step > 30 and not sched.has_unfinished():
            break
        out = sched.schedule()
        owning = scheduler_cls is not WritingScheduler
        if owning:
            assert not out.failed and set(out.kv.rows) == {it.seq.request_id for it in out.items}
        for s in out.rejected:
            finish(s)
        trace.append((
            step,
            [(it.seq.request_id, it.num_tokens, it.seq.num_computed) for it in out.items],
            [s.request_id for s in out.preempted],
            [s.request_id for s in out.rejected],
            [(s.request_id, s.metrics.num_cached_tokens) for s in seqs.values()],
        ))
        stats["preempted"] += len(out.preempted)
        stats["rejected"] += len(out.rejected)
        # the step runs: for the oracle, slots appended as the old store did (the owning
        # scheduler appended them in schedule()); then one token sampled
        slots = []
        for it in out.items:
            s = it.seq
            rid = s.request_id
            if owning:
                row = out.kv.rows[rid]
                assert row.start == s.num_computed and row.num_tokens == it.num_tokens
                assert row.block_tables == [g.seqs[rid].block_ids for g in manager.groups]
                slots.append([list(x) for x in row.slots])
            else:
                if manager.has(rid):
                    manager.trim_to_window(rid)
                else:
                    manager.create(rid)
                assert manager.num_tokens(rid) == s.num_computed
                tokens = s.token_at(s.num_computed, s.num_computed + it.num_tokens)
                results = manager.append_slots(rid, it.num_tokens, tokens if manager.prefix_cache else None)
                slots.append([r.slots for r in results])
        # every row's slots are in place before any row is sampled (as in the engine: the
        # forward pass takes the whole step's slots, then the step's tokens are read)
        for it in out.items:
            s = it.seq
            rid = s.request_id
            if it.num_tokens < s.remaining:
                stats["chunked"] += 1
            s.num_computed += it.num_tokens
            if s.num_computed == s.num_tokens:
                s.output_ids.append(_next_token(rid, s.num_tokens))
                if len(s.output_ids) >= s.params.max_tokens:
                    finish(s)
                    stats["finished"] += 1
        manager.check_invariants()
        trace.append(_block_state(manager))
        trace.append(("slots", slots))
    assert not sched.has_unfinished(), "the workload did not finish"
    stats["claimed_tokens"] = manager.groups[0].prefix_hit_tokens
    return trace, stats, sched.num_preemptions


def managers(kind: str, num_blocks: int, prefix_cache: bool):
    if kind == "paged":  # one layer group, as for a model without windows
        return LayerGroupKvManager(num_blocks, BS, max_blocks_per_seq=25, prefix_cache=prefix_cache)
    return LayerGroupKvManager(num_blocks, BS, 25, layer_windows=[None, 16, None], prefix_cache=prefix_cache)


@pytest.mark.parametrize("kind", ["paged", "layer_groups"])
@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("num_blocks,max_num_seqs,max_num_batched_tokens,prefill_chunk_size",
                         [(16, 6, 48, 16), (20, 5, 24, 8)])
def test_owning_scheduler_plans_what_the_writing_scheduler_did(kind, prefix_cache, seed, num_blocks, max_num_seqs,
                                                                  max_num_batched_tokens, prefill_chunk_size):
    config = RuntimeConfig(kv_layout="paged", block_size=BS, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, prefill_chunk_size=prefill_chunk_size)
    reqs = workload(seed)
    old_trace, old_stats, old_preemptions = run(WritingScheduler, managers(kind, num_blocks, prefix_cache), config, reqs)
    new_trace, new_stats, new_preemptions = run(Scheduler, managers(kind, num_blocks, prefix_cache), config, reqs)
    # the workload exercises what it should
    assert new_stats["preempted"] > 0 and new_stats["chunked"] > 0
    assert new_stats["aborted"] > 0 and new_stats["rejected"] > 0 and new_stats["finished"] > 0
    if prefix_cache:
        assert new_stats["claimed_tokens"] > 0
    assert new_preemptions == old_preemptions
    assert len(new_trace) == len(old_trace)
    for old, new in zip(old_trace, new_trace):
        assert new == old
    assert {k: v for k, v in new_stats.items() if k != "claimed_tokens"} == \
        {k: v for k, v in old_stats.items() if k != "claimed_tokens"}


def test_longest_cached_prefix_agrees_with_match_prefix():
    """The read-only lookup predicts match_prefix, including the last-token rule and a
    partial final block; in a layer-group manager the shortest group wins."""
    r = random.Random(3)
    mgr = PagedKvCacheManager(64, BS, max_blocks_per_seq=16, prefix_cache=True)
    base = [r.randrange(30) for _ in range(64)]
    mgr.create("base")
    mgr.append_slots("base", 64, base)
    for i, length in enumerate([1, 7, 8, 9, 16, 17, 40, 64, 65]):
        probe = (base + [5])[:length]
        want = mgr.longest_cached_prefix(probe)
        assert want == min(length - 1, 64) // BS * BS
        mgr.create(f"p{i}")
        assert mgr.match_prefix(f"p{i}", probe) == want
    groups = LayerGroupKvManager(64, BS, 16, layer_windows=[None, 16], prefix_cache=True)
    groups.create("base")
    groups.append_slots("base", 64, base)
    table = groups.block_table("base", 1)
    groups.release("base")
    sliding = groups.groups[1].allocator
    for b in table[:3]:  # used again, so the fourth block is the least recently freed
        sliding.acquire(b)
        sliding.free(b)
    sliding.allocate_n(sliding.num_free - len(table) + 1)  # evicts it in the sliding group only
    want = groups.longest_cached_prefix(base)
    assert want == 3 * BS and groups.groups[0].longest_cached_prefix(base) == 7 * BS
    groups.create("x")
    assert groups.match_prefix("x", base) == want
    assert all(g.num_tokens("x") == want for g in groups.groups)
