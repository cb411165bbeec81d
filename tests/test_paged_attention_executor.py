"""PagedAttentionExecutor: outputs computed by hand (numpy) from the one-hot definition."""

import math

import mlx.core as mx
import numpy as np

from mlx_ferrum.executor import DecodeInput, PagedAttentionExecutor, PrefillInput
from mlx_ferrum.kv_cache import LayerGroupKvManager

VOCAB, KVH, HD = 50, 2, 4
W = KVH * HD


def hand_logits(tokens: list[int]) -> np.ndarray:
    """Logits after the last token, from the definition (not from the executor's code)."""
    e = [t % W for t in tokens]
    q = e[-1]
    scale = 1.0 / math.sqrt(HD)
    head_sum = np.zeros(KVH)
    for h in range(KVH):
        scores = np.array([scale if (q // HD == h and ej == q) else 0.0 for ej in e])
        w = np.exp(scores - scores.max())
        w /= w.sum()
        head_sum[h] = sum(wj for wj, ej in zip(w, e) if ej // HD == h)
    return np.array([head_sum[v % KVH] for v in range(VOCAB)])


def test_prefill_decode_match_hand_computed_values():
    ex = PagedAttentionExecutor(vocab_size=VOCAB, num_kv_heads=KVH, head_dim=HD, block_size=8, num_blocks=16)
    toks = [3, 11, 3, 7, 42, 19, 3, 5, 8, 9, 13]
    out = ex.prefill(PrefillInput(input_ids=mx.array([toks[:6]]), return_all_logits=True))
    for i in range(6):
        np.testing.assert_allclose(np.array(out.logits[0, i]), hand_logits(toks[: i + 1]), atol=1e-6)
    h = out.kv_cache
    for i in range(6, len(toks)):
        step = ex.decode(DecodeInput(input_ids=mx.array([[toks[i]]]), kv_cache=h))
        h = step.kv_cache
        np.testing.assert_allclose(np.array(step.logits[0]), hand_logits(toks[: i + 1]), atol=1e-6)
    assert ex.prefill_count == 1 and ex.decode_count == 5
    # a different attention pattern gives a different prediction
    assert not np.allclose(hand_logits([3, 3, 3]), hand_logits([3, 4, 12]))


def test_ragged_batch_truncate_and_shared_manager():
    mgr = LayerGroupKvManager(num_blocks=32, block_size=8, max_blocks_per_seq=8)
    ex = PagedAttentionExecutor(vocab_size=VOCAB, num_kv_heads=KVH, head_dim=HD, kv_manager=mgr)
    seqs = [[1, 2, 3], list(range(5, 25)), [7] * 9, [4]]
    outs = ex.batch_prefill([PrefillInput(input_ids=mx.array([s])) for s in seqs])
    nxt = [9, 17, 7, 4]
    steps = ex.batch_decode([DecodeInput(input_ids=mx.array([[t]]), kv_cache=o.kv_cache) for t, o in zip(nxt, outs)])
    for s, t, st in zip(seqs, nxt, steps):
        np.testing.assert_allclose(np.array(st.logits[0]), hand_logits(s + [t]), atol=1e-6)
    assert ex.decode_count == 4 and ex.prefill_count == 4
    h = ex.truncate_kv(steps[1].kv_cache, 6)
    st = ex.decode(DecodeInput(input_ids=mx.array([[30]]), kv_cache=h))
    np.testing.assert_allclose(np.array(st.logits[0]), hand_logits(seqs[1][:6] + [30]), atol=1e-6)
    assert mgr.num_tokens(h.cache_id) == 7 and len(mgr.block_table(h.cache_id)) == 1
    for o in steps:
        ex.release_cache(o.kv_cache.cache_id)
    assert mgr.num_free == 32


def test_fork_copy_on_write_keeps_both_sequences_right():
    ex = PagedAttentionExecutor(vocab_size=VOCAB, num_kv_heads=KVH, head_dim=HD, block_size=8, num_blocks=16)
    base = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    h = ex.prefill(PrefillInput(input_ids=mx.array([base]))).kv_cache
    f = ex.fork_cache(h)
    a = ex.decode(DecodeInput(input_ids=mx.array([[11]]), kv_cache=h))
    b = ex.decode(DecodeInput(input_ids=mx.array([[12]]), kv_cache=f))
    np.testing.assert_allclose(np.array(a.logits[0]), hand_logits(base + [11]), atol=1e-6)
    np.testing.assert_allclose(np.array(b.logits[0]), hand_logits(base + [12]), atol=1e-6)
    a2 = ex.decode(DecodeInput(input_ids=mx.array([[11]]), kv_cache=a.kv_cache))
    np.testing.assert_allclose(np.array(a2.logits[0]), hand_logits(base + [11, 11]), atol=1e-6)
    assert a.kv_cache.block_table[0] == b.kv_cache.block_table[0]
    assert a.kv_cache.block_table[1] != b.kv_cache.block_table[1]
