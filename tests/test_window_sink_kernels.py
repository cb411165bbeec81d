"""Reference paged attention with a sliding window and attention sinks, against a dense
numpy implementation written from the definitions (Mistral's window: query ``p`` sees
keys ``p - window + 1 .. p``; gpt-oss's sinks: one extra logit per head in the softmax
denominator, with no value)."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum import kernels
from mlx_ferrum.kernels import reference

H, KVH, D, BS = 4, 2, 16, 8


def _dense(q, keys, values, qpos, window, sinks, scale):
    """q [H, D] at position qpos; keys/values [KVH, T, D]."""
    g = H // KVH
    out = np.zeros((H, D), np.float64)
    t = np.arange(keys.shape[1])
    ok = t <= qpos
    if window is not None:
        ok &= t > qpos - window
    for h in range(H):
        s = keys[h // g] @ q[h] * scale
        s = np.where(ok, s, -np.inf)
        m = s.max() if sinks is None else max(s.max(), sinks[h])
        p = np.exp(s - m)
        den = p.sum() + (0.0 if sinks is None else np.exp(sinks[h] - m))
        out[h] = (p @ values[h // g]) / den
    return out


def _setup(lens, seed=0):
    rng = np.random.default_rng(seed)
    nb_per = [-(-n // BS) for n in lens]
    num_blocks = sum(nb_per) + 3
    k_pool = rng.standard_normal((num_blocks, KVH, BS, D)).astype(np.float32)
    v_pool = rng.standard_normal((num_blocks, KVH, BS, D)).astype(np.float32)
    perm = rng.permutation(num_blocks)
    tables, start = [], 0
    for nb in nb_per:
        tables.append(list(perm[start : start + nb]))
        start += nb
    width = max(nb_per)
    table = np.array([t + [0] * (width - len(t)) for t in tables], np.int32)
    dense = []
    for t, n in zip(tables, lens):
        ks = k_pool[t].transpose(1, 0, 2, 3).reshape(KVH, -1, D)[:, :n]
        vs = v_pool[t].transpose(1, 0, 2, 3).reshape(KVH, -1, D)[:, :n]
        dense.append((ks, vs))
    return rng, k_pool, v_pool, table, dense


def _prefill_case(lens, qlens, seed, window, use_sinks):
    """A packed prefill of sequences with ``lens`` tokens whose last ``qlens`` are queries:
    ``(q, k_pool, v_pool, table, query start offsets, sinks, scale, expected rows)``."""
    rng, k_pool, v_pool, table, dense = _setup(lens, seed=seed)
    q = rng.standard_normal((sum(qlens), H, D)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32) if use_sinks else None
    scale = D ** -0.5
    qsl = np.concatenate([[0], np.cumsum(qlens)]).tolist()
    expected = [_dense(q[qsl[i] + j], *dense[i], n - ql + j, window, sinks, scale)
                for i, (n, ql) in enumerate(zip(lens, qlens)) for j in range(ql)]
    return q, k_pool, v_pool, table, qsl, sinks, scale, expected


@pytest.mark.parametrize("window,use_sinks", [(None, True), (5, False), (11, True)])
def test_decode_window_and_sinks(window, use_sinks):
    lens = [3, 17, 30]
    rng, k_pool, v_pool, table, dense = _setup(lens)
    q = rng.standard_normal((len(lens), H, D)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32) if use_sinks else None
    scale = D ** -0.5
    expected = np.stack([_dense(q[i], *dense[i], lens[i] - 1, window, sinks, scale) for i in range(len(lens))])
    args = (mx.array(q), mx.array(k_pool), mx.array(v_pool), mx.array(table), mx.array(lens, dtype=mx.int32), scale)
    sk = None if sinks is None else mx.array(sinks)
    blockwise = reference.paged_attention_decode(*args, window=window, sinks=sk)
    assert np.abs(np.array(blockwise) - expected).max() < 1e-4
    # the single-sequence fast path, and the dispatcher (the reference here: no Metal, no launcher)
    for i in range(len(lens)):
        one = kernels.paged_attention_decode(
            mx.array(q[i : i + 1]), mx.array(k_pool), mx.array(v_pool), mx.array(table[i : i + 1]),
            mx.array([lens[i]], dtype=mx.int32), scale, host_context_lens=[lens[i]], window=window, sinks=sk,
        )
        assert np.abs(np.array(one)[0] - expected[i]).max() < 1e-4


@pytest.mark.parametrize("window,use_sinks", [(None, True), (6, False), (9, True)])
def test_prefill_window_and_sinks(window, use_sinks):
    lens, qlens = [12, 29], [12, 10]  # the second: a chunk after 19 cached tokens
    rng, k_pool, v_pool, table, dense = _setup(lens, seed=1)
    q = rng.standard_normal((sum(qlens), H, D)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32) if use_sinks else None
    scale = D ** -0.5
    qsl = [0, qlens[0], qlens[0] + qlens[1]]
    expected = []
    for i, (n, ql) in enumerate(zip(lens, qlens)):
        for j in range(ql):
            expected.append(_dense(q[qsl[i] + j], *dense[i], n - ql + j, window, sinks, scale))
    out = kernels.paged_prefill_attention(
        mx.array(q), mx.array(k_pool), mx.array(v_pool), mx.array(table), mx.array(lens, dtype=mx.int32),
        mx.array(qsl, dtype=mx.int32), scale, window=window, sinks=None if sinks is None else mx.array(sinks),
    )
    assert np.abs(np.array(out) - np.stack(expected)).max() < 1e-4



@pytest.mark.parametrize("window,use_sinks", [(None, False), (7, True)])
def test_prefill_of_many_segments_matches_the_definition(window, use_sinks):
    # one long chunk and several short tails over cached prefixes, in one packed pass
    lens = [9, 40, 23, 64, 11, 37, 5]
    qlens = [2, 3, 23, 60, 1, 4, 5]
    q, k_pool, v_pool, table, qsl, sinks, scale, expected = _prefill_case(lens, qlens, 3, window, use_sinks)
    out = reference.paged_prefill_attention(
        mx.array(q), mx.array(k_pool), mx.array(v_pool), mx.array(table), mx.array(lens, dtype=mx.int32),
        mx.array(qsl, dtype=mx.int32), scale, window=window, sinks=None if sinks is None else mx.array(sinks),
    )
    assert np.abs(np.array(out) - np.stack(expected)).max() < 1e-4

def test_masked_attention_branches_agree(monkeypatch):
    # the CPU backend's base-2 softmax and the fused SDPA that GPUs run, on one masked
    # grouped-query problem with sinks (the fused call also runs on the CPU backend)
    rng = np.random.default_rng(5)
    q, k, v = (mx.array(rng.standard_normal(s).astype(np.float32)) for s in ((3, 8, 5, 16), (3, 2, 20, 16), (3, 2, 20, 16)))
    allowed = rng.random((3, 1, 5, 20)) < 0.7
    allowed[..., 0] = True
    sinks = mx.array(rng.standard_normal(8).astype(np.float32))
    cpu = reference._masked_attention(q, k, v, mx.array(allowed), 0.25, sinks)

    class _Gpu:
        type = "gpu"

    monkeypatch.setattr(reference.mx, "default_device", lambda: _Gpu())
    fused = reference._masked_attention(q, k, v, mx.array(allowed), 0.25, sinks)
    assert np.abs(np.array(cpu) - np.array(fused)).max() < 1e-5


@pytest.mark.parametrize("qlen", [1, 3, 12])  # score rows (group * qlen) under and over head_dim
@pytest.mark.parametrize("with_sinks", [False, True])
def test_cpu_prefill_skips_the_mask_of_visible_keys_and_sums_through_the_values(qlen, with_sinks):
    # A prompt tail over its cached prefix: every query sees the first `visible` keys, and
    # the CPU path neither masks them nor sums the scores separately when the rows
    # outnumber head_dim (the denominator is the last column of p @ [V | 1]). Against the
    # float64 definition; a wrong `visible` (keys past it left unmasked) would see the
    # future and fail.
    rng = np.random.default_rng(qlen)
    tokens, visible = 40, 40 - qlen
    q = rng.standard_normal((1, H, qlen, D)).astype(np.float32)
    keys = rng.standard_normal((1, KVH, tokens, D)).astype(np.float32)
    values = rng.standard_normal((1, KVH, tokens, D)).astype(np.float32)
    sinks = rng.standard_normal(H).astype(np.float32) if with_sinks else None
    qpos = np.arange(visible, tokens)
    allowed = np.arange(tokens)[None, :] <= qpos[:, None]
    out = reference._masked_attention_base2(
        mx.array(q), mx.array(keys), mx.array(values), mx.array(allowed[None, None]), 0.3,
        None if sinks is None else mx.array(sinks), visible)
    expected = np.stack([_dense(q[0, :, i].astype(np.float64), keys[0].astype(np.float64),
                                values[0].astype(np.float64), qpos[i], None, sinks, 0.3) for i in range(qlen)], axis=1)
    assert np.abs(np.array(out[0]) - expected).max() < 1e-5
    # the same problem with no keys declared visible takes the fully masked path
    whole = reference._masked_attention_base2(
        mx.array(q), mx.array(keys), mx.array(values), mx.array(allowed[None, None]), 0.3,
        None if sinks is None else mx.array(sinks), 0)
    assert np.abs(np.array(whole[0]) - expected).max() < 1e-5


@pytest.mark.parametrize("use_sinks", [False, True])
def test_short_prefill_segments_share_padded_calls_and_match_the_definition(monkeypatch, use_sinks):
    # A burst of short prompt chunks over short cached prefixes (a prefix-cache hit on a
    # batch of short prompts) pads into shared calls; every query still sees exactly its
    # own context. Fresh prompts, cached prefixes and one-token tails are mixed, with
    # block tables of different widths (entries past a sequence's blocks are reused ids).
    lens = [5, 32, 17, 16, 33, 9, 24, 2, 31]
    qlens = [5, 16, 1, 16, 17, 3, 8, 2, 15]
    q, k_pool, v_pool, table, qsl, sinks, scale, expected = _prefill_case(lens, qlens, 7, None, use_sinks)
    calls = []
    real = reference._masked_attention
    monkeypatch.setattr(reference, "_masked_attention", lambda qg, *a: calls.append(qg.shape[0]) or real(qg, *a))
    out = reference.paged_prefill_attention(
        mx.array(q), mx.array(k_pool), mx.array(v_pool), mx.array(table), mx.array(lens, dtype=mx.int32),
        mx.array(qsl, dtype=mx.int32), scale, sinks=None if sinks is None else mx.array(sinks),
    )
    assert np.abs(np.array(out) - np.stack(expected)).max() < 1e-4
    assert sum(calls) == len(lens) and len(calls) < len(lens), f"no sequences shared a call: {calls}"
