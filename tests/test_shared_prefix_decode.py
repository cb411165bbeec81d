"""Decode attention that reads the blocks heading many rows' tables once for all of them
(``kernels.reference.plan_shared_prefix`` / ``SharedPrefix``), against a float64 numpy
definition of attention, and the engine with it against the same engine without it and
against the stories260K recording."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_ferrum as mf
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.kernels import reference
from mlx_ferrum.kernels.reference import fusing
from support.tiny_models import tiny_model

H, KVH, D, BS = 8, 2, 16, 8


def _definition(q, keys, values, sinks, scale):
    """softmax(q K^T * scale) V of one row, with sink logits in the denominator: q
    ``[H, D]``, keys/values ``[KVH, T, D]`` (float64) -> ``[H, D]``."""
    group = H // KVH
    k, v = np.repeat(keys, group, axis=0), np.repeat(values, group, axis=0)
    s = np.einsum("hd,htd->ht", q, k) * scale
    top = s.max(-1, keepdims=True) if sinks is None else np.maximum(s.max(-1, keepdims=True), sinks[:, None])
    p = np.exp(s - top)
    denom = p.sum(-1, keepdims=True) + (0.0 if sinks is None else np.exp(sinks[:, None] - top))
    return np.einsum("ht,htd->hd", p, v) / denom


def _batch(num_rows, shared_blocks, non_members, seed):
    """Pools and host tables of ``num_rows`` decode rows: all but the first ``non_members``
    begin with the same ``shared_blocks`` blocks, then hold blocks of their own."""
    rng = np.random.default_rng(seed)
    own = rng.integers(1, 5, num_rows)
    lens = [int((shared_blocks if i >= non_members else 0) * BS + rng.integers(1, BS * n + 1))
            for i, n in enumerate(own)]
    width = max(-(-n // BS) for n in lens)
    num_blocks = shared_blocks + num_rows * width + 2
    k_pool = rng.standard_normal((num_blocks, KVH, BS, D)).astype(np.float32)
    v_pool = rng.standard_normal((num_blocks, KVH, BS, D)).astype(np.float32)
    free = list(rng.permutation(num_blocks))
    prefix = [free.pop() for _ in range(shared_blocks)]
    table = np.zeros((num_rows, width), np.int32)
    for i, n in enumerate(lens):
        head = prefix if i >= non_members else []
        blocks = head + [free.pop() for _ in range(-(-n // BS) - len(head))]
        table[i, : len(blocks)] = blocks
    return rng, k_pool, v_pool, table, np.array(lens, np.int32)


def test_the_plan_takes_the_most_common_head_and_what_every_member_has_filled():
    table = np.array([[7, 8, 9, 10, 11, 12, 20], [7, 8, 9, 10, 11, 12, 21], [7, 8, 9, 10, 11, 13, 22],
                      [7, 8, 9, 10, 11, 12, 23], [7, 8, 9, 10, 11, 12, 24], [3, 4, 5, 6, 0, 0, 0]], np.int32)
    lens = np.array([7 * BS, 7 * BS, 6 * BS + 1, 7 * BS, 7 * BS, 4 * BS], np.int32)
    plan = reference.plan_shared_prefix(table, lens, BS)
    # rows 0-4 hold 7, 8, 9, 10, 11 in common (row 2 differs at the sixth block)
    assert plan.table.tolist() == [7, 8, 9, 10, 11]
    assert plan.tail_starts.tolist() == [5 * BS] * 5 + [0]
    assert plan.tails[:5, :2].tolist() == [[12, 20], [12, 21], [13, 22], [12, 23], [12, 24]]
    assert plan.tails[5, :4].tolist() == [3, 4, 5, 6]
    # a member whose current token falls in the fifth block sees only four blocks whole
    short = lens.copy()
    short[3] = 4 * BS + 1
    assert reference.plan_shared_prefix(table, short, BS).table.tolist() == [7, 8, 9, 10]
    # eleven shared blocks round down to a trace bucket (10); too few rows or blocks: none
    wide = np.tile(np.arange(1, 13, dtype=np.int32), (4, 1))
    wide[:, 11] = [30, 31, 32, 33]
    assert len(reference.plan_shared_prefix(wide, np.full(4, 12 * BS, np.int32), BS).table) == 10
    assert reference.plan_shared_prefix(wide[:3], np.full(3, 12 * BS, np.int32), BS) is None
    assert reference.plan_shared_prefix(table, np.full(6, 3 * BS + 1, np.int32), BS) is None


def test_the_rows_of_one_draft_count_as_one_sequence():
    """A verified draft lays one sequence out as several decode rows with one table: its
    rows alone never make a plan, and members are counted by sequence."""
    table = np.tile(np.arange(1, 9, dtype=np.int32), (5, 1))
    lens = np.arange(8 * BS - 4, 8 * BS + 1, dtype=np.int32)
    assert reference.plan_shared_prefix(table, lens, BS) is not None  # counted as 5 rows
    assert reference.plan_shared_prefix(table, lens, BS, row_seqs=np.zeros(5, np.int64)) is None
    # four sequences, two rows each, all under one prefix: a plan over all eight rows
    wide = np.tile(np.arange(1, 9, dtype=np.int32), (8, 1))
    wide[:, 7] = np.repeat(np.arange(30, 34, dtype=np.int32), 2)
    plan = reference.plan_shared_prefix(wide, np.full(8, 8 * BS, np.int32), BS,
                                        row_seqs=np.repeat(np.arange(4), 2))
    assert plan is not None and plan.tail_starts.tolist() == [7 * BS] * 8
    # one sequence's five rows and three other sequences: the head with the most rows is
    # one sequence, which is too few
    mixed = np.concatenate([table, np.array([[40 + i] + list(range(50 + 8 * i, 57 + 8 * i)) for i in range(3)],
                                            np.int32)])
    assert reference.plan_shared_prefix(mixed, np.full(8, 8 * BS, np.int32), BS) is not None
    assert reference.plan_shared_prefix(mixed, np.full(8, 8 * BS, np.int32), BS,
                                        row_seqs=np.array([0] * 5 + [1, 2, 3])) is None


def test_a_verify_pass_of_one_sequence_makes_no_plan_and_four_sequences_do():
    """``PagedPassBuilder.passes`` hands the plan each row's sequence: one request's draft
    rows read its blocks as before; drafts of four requests under one prefix share them."""
    from mlx_ferrum.runner import LlmRunner

    from mlx_ferrum.kv_cache.block_tables import BatchBlocks, append_row

    model = tiny_model("llama")
    runner = LlmRunner(model, RuntimeConfig(kv_layout="paged", block_size=BS, max_num_blocks=256,
                                            prefix_cache=False))
    mgr = runner.store.geometry.new_block_manager()  # the blocks' owner (the scheduler, in the engine)

    def prepare(items, **kw):
        blocks = BatchBlocks()
        for cid, tokens in items:
            append_row(mgr, blocks, cid, len(tokens))
        runner.store.prepare([cid for cid, _ in items], blocks)
        return runner.passes.passes(items, blocks=blocks, **kw), None

    prepare([("a", list(range(1, 6 * BS + 1)))])
    one, _ = prepare([("a", [3, 4, 5, 6, 7])], as_decode=[True])
    assert one[0].inputs.shared_prefixes == []
    for cid in "bcd":
        mgr.fork("a", cid)
    four, _ = prepare([(cid, [3, 4]) for cid in "abcd"], as_decode=[True] * 4)
    assert four[0].inputs.shared_prefixes and four[0].inputs.shared_prefixes[0] is not None


def test_the_shared_blocks_round_down_to_the_runners_trace_buckets():
    """The plan rounds its shared block count down to the sizes the runner rounds its
    compiled step's shapes up to, so a longer prefix reuses a trace."""
    from mlx_ferrum.runner import shape_bucket

    buckets = sorted({shape_bucket(n) for n in range(1, 2049)})
    for n in range(1, 1025):
        assert reference._floor_bucket(n) == max(b for b in buckets if b <= n)


@pytest.mark.parametrize("non_members", [0, 3])
@pytest.mark.parametrize("use_sinks", [False, True])
@pytest.mark.parametrize("compiled", [False, True])
def test_decode_over_a_shared_prefix_matches_the_definition(non_members, use_sinks, compiled):
    rng, k_pool, v_pool, table, lens = _batch(9, 6, non_members, seed=non_members + 2 * use_sinks)
    q = rng.standard_normal((len(lens), H, D)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32) if use_sinks else None
    scale = D ** -0.5
    plan = reference.plan_shared_prefix(table, lens, BS)
    assert plan is not None and len(plan.table) == 6
    assert (plan.tail_starts > 0).sum() == 9 - non_members

    def attend(q, k_pool, v_pool, table, lens, tails, starts, shared_table):
        index = reference.decode_index(table, lens, KVH, BS, reference.SharedPrefix(shared_table, tails, starts))
        return reference.paged_attention_decode(q, k_pool, v_pool, table, lens, scale, index=index,
                                                sinks=None if sinks is None else mx.array(sinks))

    args = [mx.array(x) for x in (q, k_pool, v_pool, table, lens, plan.tails, plan.tail_starts, plan.table)]
    if compiled:
        with fusing():  # the compiled decode step's 2 ** x
            out = mx.compile(attend)(*args)
    else:
        out = attend(*args)
    expected = []
    for i, n in enumerate(lens):
        keys = k_pool[table[i]].transpose(1, 0, 2, 3).reshape(KVH, -1, D)[:, :n].astype(np.float64)
        values = v_pool[table[i]].transpose(1, 0, 2, 3).reshape(KVH, -1, D)[:, :n].astype(np.float64)
        expected.append(_definition(q[i].astype(np.float64), keys, values, sinks, scale))
    np.testing.assert_allclose(np.array(out), np.stack(expected), rtol=0, atol=2e-5)


def test_rows_without_tail_keys_stay_finite():
    """The compiled step's pad rows read the shared blocks and no key of their own
    (context 1 under a member's start): their output must stay finite, since it feeds the
    K/V they write into the scratch block."""
    rng, k_pool, v_pool, table, lens = _batch(6, 5, 0, seed=9)
    plan = reference.plan_shared_prefix(table, lens, BS)
    lens[-1] = 1  # a pad row
    q = mx.array(rng.standard_normal((6, H, D)).astype(np.float32))
    index = reference.decode_index(mx.array(table), mx.array(lens), KVH, BS, plan.to_device())
    out = reference.paged_attention_decode(q, mx.array(k_pool), mx.array(v_pool), mx.array(table), mx.array(lens),
                                           D ** -0.5, index=index)
    assert np.isfinite(np.array(out)).all()


def _count_shared_reads(monkeypatch) -> list:
    calls = [0]
    inner = reference._decode_over_shared_prefix

    def counted(*a, **kw):
        calls[0] += 1
        return inner(*a, **kw)

    monkeypatch.setattr(reference, "_decode_over_shared_prefix", counted)
    return calls


@pytest.mark.parametrize("pipelined", [True, False])
def test_the_engine_gives_the_same_tokens_with_and_without_the_shared_read(monkeypatch, pipelined):
    """Nine requests (one compiled-step pad row) behind a 50-token prefix, greedy and
    seeded, with tails of different lengths: token for token the same as with every
    row's blocks gathered on its own."""
    model = tiny_model("llama", seed=3)
    rng = np.random.default_rng(4)
    prefix = rng.integers(1, 97, 50).tolist()
    prompts = [prefix + rng.integers(1, 97, int(n)).tolist() for n in rng.integers(1, 12, 9)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=24, ignore_eos=True)
              for i in range(9)]
    cfg = RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=256, prefix_cache=True,
                        async_scheduling=pipelined)

    def run():
        eng = Engine(model, None, cfg)
        eng.generate([prefix], [SamplingParams(max_tokens=1)])  # caches the prefix's blocks
        return [o.token_ids for o in eng.generate(prompts, params)]

    calls = _count_shared_reads(monkeypatch)
    shared = run()
    assert calls[0] > 0
    monkeypatch.setattr(reference, "plan_shared_prefix", lambda *a, **kw: None)
    assert run() == shared


def test_rows_continuing_the_recording_from_a_shared_prefix_reproduce_it(stories_path, stories_expected, monkeypatch):
    """stories260K: nine requests whose prompts are the recorded sequence cut after 70 to
    78 generated tokens share its first blocks; greedy, each continues the recording."""
    rec = stories_expected["once"]
    ids = rec["prompt_ids"] + rec["generated_ids"]
    starts = [len(rec["prompt_ids"]) + k for k in range(70, 79)]
    calls = _count_shared_reads(monkeypatch)
    model, tokenizer = mf.load(stories_path)
    eng = Engine(model, tokenizer, RuntimeConfig(kv_layout="paged", block_size=16, max_num_blocks=256,
                                                 prefix_cache=True))
    eng.generate([ids[: starts[0]]], [SamplingParams(max_tokens=1)])
    outs = eng.generate([ids[:s] for s in starts], [SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
                                                    for _ in starts])
    assert calls[0] > 0
    for s, out in zip(starts, outs):
        assert out.token_ids == ids[s : s + 40]
