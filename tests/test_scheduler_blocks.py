"""The scheduler owns the KV blocks: unit tests of its block manager use, no model.

Each test drives :class:`Scheduler` over a real :class:`LayerGroupKvManager` and checks
the manager's state against values computed here from first principles (block
arithmetic, token positions), not from the scheduler's own answers:

- admission allocates ``ceil(tokens / block_size)`` blocks and the row's slots are
  ``table[p // bs] * bs + p % bs`` for its positions;
- finishing, aborting and preemption give every block back;
- a shared prompt prefix is one set of blocks with reference count 2;
- lookahead slots for speculation are appended with the row, given back when the draft
  is shorter, and the rejected draft's blocks freed by ``commit_draft``;
- the block tables and slot mapping the runner's ``PagedPassBuilder`` builds from ``SchedulerOutput.kv``
  are the manager's;
- a step that did not run is rolled back.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine.sampling import SamplingParams
from mlx_ferrum.engine.scheduler import Scheduler
from mlx_ferrum.engine.sequence import Sequence, SequenceStatus
from mlx_ferrum.kv_cache import LayerGroupKvManager, PagedKvPool
from mlx_ferrum.kv_cache.manager import UNKNOWN_TOKEN
from mlx_ferrum.kv_cache.store import PagedKvStore
from mlx_ferrum.runner.inputs import PagedPassBuilder

BS = 8


def config(**kw) -> RuntimeConfig:
    base = dict(kv_layout="paged", block_size=BS, max_num_seqs=8, max_num_batched_tokens=256, prefill_chunk_size=256)
    base.update(kw)
    return RuntimeConfig(**base)


def seq(rid: str, prompt: list[int], max_tokens: int = 50) -> Sequence:
    return Sequence.create(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), None, ())


def run_step(out, token: int = 7) -> None:
    """What the engine does after a step ran: each row's tokens are computed, and a row
    that reached its last token gets one more (a stand-in for sampling)."""
    for it in out.items:
        s = it.seq
        s.num_computed += it.num_tokens
        if s.num_computed == s.num_tokens:
            s.output_ids.append(token)


def expected_slots(table: list[int], start: int, n: int) -> list[int]:
    return [table[p // BS] * BS + p % BS for p in range(start, start + n)]


def test_admission_allocates_the_rows_blocks_and_slots():
    mgr = LayerGroupKvManager(16, BS, 8)
    sched = Scheduler(config(), mgr, max_seq_len=64)
    a, b = seq("a", list(range(20))), seq("b", list(range(5)))
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [it.seq.request_id for it in out.items] == ["a", "b"]
    assert mgr.num_in_use == 3 + 1  # ceil(20 / 8) + ceil(5 / 8)
    for s, n in ((a, 20), (b, 5)):
        row = out.kv.rows[s.request_id]
        table = mgr.block_table(s.request_id)
        assert row.start == 0 and row.num_tokens == n and len(table) == -(-n // BS)
        assert row.block_tables == [table]
        assert row.slots == [expected_slots(table, 0, n)]
    # the next step appends one decode slot per sequence, after the prompt
    run_step(out)
    out = sched.schedule()
    for s, start in ((a, 20), (b, 5)):
        row = out.kv.rows[s.request_id]
        assert row.start == start and row.slots == [expected_slots(mgr.block_table(s.request_id), start, 1)]
    assert mgr.num_in_use == 3 + 1  # both decode tokens fit in their last blocks
    mgr.check_invariants()


def test_finish_and_abort_free_every_block():
    mgr = LayerGroupKvManager(16, BS, 8)
    sched = Scheduler(config(), mgr, max_seq_len=64)
    a, b = seq("a", list(range(17))), seq("b", list(range(9)))
    for s in (a, b):
        sched.add(s)
    run_step(sched.schedule())
    assert mgr.num_in_use == 3 + 2
    # finishing: the engine removes it from the queues and frees it once no step reads it
    a.status = SequenceStatus.FINISHED
    sched.remove(a)
    sched.free("a")
    assert mgr.num_in_use == 2 and not mgr.has("a")
    # aborting a request that is scheduled this step: its slots are given back too
    sched.schedule()
    sched.remove(b)
    sched.free("b")
    assert mgr.num_in_use == 0 and mgr.num_free == mgr.num_blocks
    sched.free("b")  # idempotent
    mgr.check_invariants()


def test_preemption_frees_the_youngest_and_it_is_recomputed_later():
    # 4 blocks of 8: two sequences of 15 prompt tokens each take 2 blocks; the first
    # decode step of each needs a third block, so the younger one is preempted
    mgr = LayerGroupKvManager(4, BS, 8)
    sched = Scheduler(config(), mgr, max_seq_len=64)
    old, young = seq("old", list(range(16))), seq("young", list(range(16)))
    sched.add(old)
    sched.add(young)
    run_step(sched.schedule())
    assert mgr.num_free == 0
    out = sched.schedule()
    assert out.preempted == [young] and not mgr.has("young")
    assert [it.seq.request_id for it in out.items] == ["old"]
    assert mgr.num_in_use == 3 and young.num_computed == 0 and young.status == SequenceStatus.WAITING
    assert sched.waiting[0] is young and sched.num_preemptions == 1
    # once the old one finishes, the young one is admitted again with its prompt + output
    run_step(out)
    sched.remove(old)
    sched.free("old")
    out = sched.schedule()
    row = out.kv.rows["young"]
    assert row.start == 0 and row.num_tokens == young.num_tokens == 17
    assert mgr.num_in_use == 3
    mgr.check_invariants()


def test_a_shared_prefix_is_one_set_of_blocks_with_two_references():
    mgr = LayerGroupKvManager(16, BS, 8, prefix_cache=True)
    sched = Scheduler(config(), mgr, max_seq_len=64, wait_for_prefix_in_flight=False)
    shared = list(range(100, 116))  # two full blocks
    a = seq("a", shared + [1, 2, 3])
    sched.add(a)
    run_step(sched.schedule())
    b = seq("b", shared + [4, 5])
    sched.add(b)
    out = sched.schedule()
    row = out.kv.rows["b"]
    # b computes only its own tail, in a new block; its first two blocks are a's
    assert row.start == 16 and row.num_tokens == 2 and b.metrics.num_cached_tokens == 16
    table_a, table_b = mgr.block_table("a"), mgr.block_table("b")
    assert table_b[:2] == table_a[:2] and table_b[2] not in table_a
    counts = mgr.groups[0].allocator.ref_counts
    assert [counts[x] for x in table_a[:2]] == [2, 2] and counts[table_a[2]] == 1 and counts[table_b[2]] == 1
    assert mgr.num_in_use == 4
    # freeing one holder keeps the shared blocks; freeing the other makes them evictable
    sched.remove(a)
    sched.free("a")
    assert [counts[x] for x in table_b[:2]] == [1, 1] and mgr.num_in_use == 3
    sched.remove(b)
    sched.free("b")
    assert mgr.num_in_use == 0 and all(mgr.groups[0].allocator.is_evictable(x) for x in table_b[:2])
    mgr.check_invariants()


def test_lookahead_slots_are_reserved_with_the_row_and_released_with_the_rejected_draft():
    mgr = LayerGroupKvManager(16, BS, 8, prefix_cache=True)
    sched = Scheduler(config(), mgr, max_seq_len=64)
    s = seq("s", list(range(6)))  # 6 prompt tokens + 1 output = 7: one slot left in block 0
    sched.add(s)
    run_step(sched.schedule())
    out = sched.schedule(lookahead=lambda _: 4)
    item = out.items[0]
    assert item.num_tokens == 1 and item.num_lookahead == 4
    row = out.kv.rows["s"]
    table = mgr.block_table("s")
    # position 6 (the token) and 7..10 (lookahead): the draft crosses into a second block
    assert row.start == 6 and row.slots == [expected_slots(table, 6, 5)] and len(table) == 2
    assert mgr.num_tokens("s") == 11
    assert mgr.groups[0].seqs["s"].token_ids[7:] == [UNKNOWN_TOKEN] * 4  # draft ids are not known yet
    # the draft proposed one token: the other three slots go back (the second block stays)
    sched.release_lookahead(out, item, 1)
    assert item.num_lookahead == 1 and row.num_tokens == 2 and mgr.num_tokens("s") == 8
    assert row.slots == [expected_slots(table, 6, 2)] and len(mgr.block_table("s")) == 1
    # verified: the drafted token was rejected, so only the row's own token stays
    run_step(out)
    sched.commit_draft(s, 7, [])
    assert mgr.num_tokens("s") == 7 and mgr.num_in_use == 1
    # next step (run_step sampled the next token): a draft of 2 accepted in full keeps
    # the row's token and both drafted ones, and learns the drafted ids
    out = sched.schedule(lookahead=lambda _: 2)
    sched.release_lookahead(out, out.items[0], 2)
    run_step(out)
    sched.commit_draft(s, 8, [21, 22])
    assert mgr.num_tokens("s") == 10 and mgr.groups[0].seqs["s"].token_ids[8:10] == [21, 22]
    with pytest.raises(Exception):
        sched.release_lookahead(out, out.items[0], 3)  # more than was granted
    mgr.check_invariants()


def test_lookahead_never_takes_blocks_from_ordinary_work():
    # 2 blocks: the decoding row's token fits in its block, a draft would need a new block
    # that the admitted prompt takes first
    mgr = LayerGroupKvManager(2, BS, 8)
    sched = Scheduler(config(), mgr, max_seq_len=64)
    s = seq("s", list(range(6)))
    sched.add(s)
    run_step(sched.schedule())
    sched.add(seq("t", list(range(3))))
    out = sched.schedule(lookahead=lambda _: 4)
    lookahead = {it.seq.request_id: it.num_lookahead for it in out.items}
    assert lookahead == {"s": 1, "t": 0}  # position 7 is the last slot of s's block
    assert mgr.num_free == 0 and mgr.num_tokens("s") == 8
    mgr.check_invariants()


def test_the_runner_reads_the_scheduler_output_tables_and_slots():
    mgr = LayerGroupKvManager(32, BS, 8)
    store = PagedKvStore(mgr, PagedKvPool(1, 33, 1, BS, 4, mx.float32), bytes_per_token=32)
    sched = Scheduler(config(), mgr, max_seq_len=64)
    a, b, c = seq("a", list(range(19))), seq("b", list(range(3))), seq("c", list(range(9)))
    for s in (a, b):
        sched.add(s)
    run_step(sched.schedule())
    sched.add(c)
    out = sched.schedule()  # a and b decode, c prefills
    items = [(it.seq.request_id, [0] * it.num_tokens) for it in out.items]
    store.prepare([cid for cid, _ in items], out.kv)
    passes = PagedPassBuilder(store).passes(items, blocks=out.kv)
    f = passes[0].inputs
    order = [items[i][0] for i in passes[0].items]
    assert order == ["a", "b", "c"]  # decode rows first
    tables = [mgr.block_table(cid) for cid in order]
    width = max(map(len, tables))
    want = np.zeros((3, width), np.int32)
    for r, t in enumerate(tables):
        want[r, : len(t)] = t
    np.testing.assert_array_equal(f.block_tables[0], want)
    starts = {"a": 19, "b": 3, "c": 0}
    slots = [x for cid in order for x in expected_slots(mgr.block_table(cid), starts[cid], out.kv.rows[cid].num_tokens)]
    assert f.slot_mappings[0].tolist() == slots
    assert f.context_lens.tolist() == [20, 4, 9]
    # the builder refuses a row whose slots were not appended
    with pytest.raises(Exception, match="allocate its slots"):
        PagedPassBuilder(store).passes([("zz", [1])], blocks=out.kv)


def test_a_step_that_did_not_run_is_rolled_back():
    mgr = LayerGroupKvManager(16, BS, 8)
    sched = Scheduler(config(), mgr, max_seq_len=64)
    s = seq("s", list(range(10)))
    sched.add(s)
    run_step(sched.schedule())
    before = (mgr.num_tokens("s"), mgr.num_in_use)
    out = sched.schedule(lookahead=lambda _: 7)
    assert mgr.num_tokens("s") == 11 + out.items[0].num_lookahead > before[0]
    sched.rollback(out)
    assert (mgr.num_tokens("s"), mgr.num_in_use) == before == (10, 2)
    mgr.check_invariants()


def test_contiguous_layout_has_no_block_accounting():
    sched = Scheduler(config(max_num_seqs=2), None, max_seq_len=64)
    for i in range(3):
        sched.add(seq(f"s{i}", list(range(40))))
    out = sched.schedule()
    assert out.kv is None and [it.seq.request_id for it in out.items] == ["s0", "s1"]
    assert out.row_blocks("s0") is None and out.positions("s0") == list(range(40))
