"""The scheduler owns the paged KV block manager (../shared/DESIGN.md): in a whole
engine run it is the only caller that changes it; the runner holds none.

- The scheduler's manager is wrapped in a proxy that records, for every mutating
  call, the first caller outside ``mlx_ferrum.kv_cache``; whole engine runs with
  preemption, prefix-cache hits, speculation and aborts must show the scheduler as
  the only writer (before the change the runner's store appended the slots and the
  engine applied releases and prefix claims).
- The same mixed workload (shared prefixes, preemption in a small pool, chunked
  prefill, aborts) gives every request the tokens of its solo run, with the prefix
  cache on and off, and leaks no block.
- ``num_cached_tokens`` equals what the block hashes imply, computed here from the
  token lists: the longest common prefix with an earlier stored sequence, in whole
  blocks, leaving the last prompt token to compute.
"""

from __future__ import annotations

import random
import sys

import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from support.tiny_models import tiny_model

BS = 8
MANAGER_WRITES = ("create", "release", "append_slots", "match_prefix", "truncate", "fork", "trim_to_window",
                  "set_token_ids")


def _writer() -> str:
    """Module of the first frame (below this file) outside the kv_cache package."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if not name.startswith("mlx_ferrum.kv_cache"):
            return name
        frame = frame.f_back
    return "?"


class WriteRecorder:
    """A view of a manager that records which module calls each of its mutating methods."""

    def __init__(self, target, writers: set):
        object.__setattr__(self, "_target", target)
        object.__setattr__(self, "_writers", writers)

    def __getattr__(self, name):
        value = getattr(self._target, name)
        if name in MANAGER_WRITES:
            def recorded(*args, **kwargs):
                self._writers.add(_writer())
                return value(*args, **kwargs)

            return recorded
        return value


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def config(**kw):
    base = dict(kv_layout="paged", block_size=BS, max_num_blocks=512, prefill_chunk_size=512, max_num_seqs=32)
    base.update(kw)
    return RuntimeConfig(**base)


def mixed_requests(seed: int, n: int = 20, vocab: int = 97):
    """Prompts behind one of three shared prefixes (or none); greedy, EOS ignored."""
    r = random.Random(seed)
    prefixes = [[r.randrange(vocab) for _ in range(r.randint(17, 40))] for _ in range(3)]
    reqs = []
    for _ in range(n):
        prompt = r.choice(prefixes + [[]]) + [r.randrange(vocab) for _ in range(r.randint(1, 20))]
        reqs.append((prompt, SamplingParams(max_tokens=r.randint(2, 16), temperature=0.0, ignore_eos=True)))
    return prefixes, reqs


def solo(model, prompt, params):
    return Engine(model, None, config()).generate([prompt], params)[0].token_ids


def run_with_aborts(engine: Engine, reqs, abort_every: int = 5, abort_after_steps: int = 3):
    """Submit every request, abort every ``abort_every``-th after a few steps, run to the end."""
    ids = [engine.add_request(p, sp) for p, sp in reqs]
    aborted = set(ids[::abort_every])
    final = {}
    steps = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        steps += 1
        if steps == abort_after_steps:
            for rid in aborted:
                if rid not in final:
                    engine.abort(rid)
    return ids, aborted, final


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("speculative", [None, "ngram"])
def test_only_the_scheduler_writes_the_block_manager(model, prefix_cache, speculative):
    prefixes, reqs = mixed_requests(seed=1)
    engine = Engine(model, None, config(max_num_blocks=20, max_num_seqs=8, max_num_batched_tokens=64,
                                        prefill_chunk_size=16, prefix_cache=prefix_cache, speculative=speculative,
                                        speculative_disable_by_batch_size=1 << 20))
    assert not hasattr(engine.runner, "manager") and not hasattr(engine.runner.store, "manager")
    manager = engine.block_manager
    writers: set = set()
    engine.scheduler.block_manager = WriteRecorder(manager, writers)
    # warm the prefix cache with the shared prefixes, then the mixed workload
    engine.generate([p + [1] for p in prefixes], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    ids, aborted, final = run_with_aborts(engine, reqs)
    assert engine.scheduler.num_preemptions > 0, "the pool was never under pressure: the test is too easy"
    if prefix_cache:
        assert any(final[rid].metrics.num_cached_tokens > 0 for rid in ids)
    if speculative:
        assert engine.stats()["spec_num_drafts"] > 0, "speculation was not exercised"
    for rid, (prompt, sp) in zip(ids, reqs):
        if rid not in aborted:
            assert final[rid].finish_reason == "length"
            assert final[rid].token_ids == solo(model, prompt, sp), f"{rid} differs from its solo run"
    assert writers == {"mlx_ferrum.engine.scheduler"}, f"the block manager was changed from {sorted(writers)}"
    manager.check_invariants()
    assert manager.num_free == manager.num_blocks and not manager.seqs


def test_prefix_cache_on_and_off_give_solo_tokens_under_preemption(model):
    """Prefix hits, preemption (20 blocks of 8 tokens), chunked prefill and aborts."""
    prefixes, reqs = mixed_requests(seed=4, n=24)
    outputs = {}
    for prefix_cache in (False, True):
        engine = Engine(model, None, config(max_num_blocks=20, max_num_seqs=8, max_num_batched_tokens=64,
                                            prefill_chunk_size=16, prefix_cache=prefix_cache))
        engine.generate([p + [1] for p in prefixes], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        ids, aborted, final = run_with_aborts(engine, reqs)
        assert engine.scheduler.num_preemptions > 0
        if prefix_cache:
            assert any(final[rid].metrics.num_cached_tokens > 0 for rid in ids)
        outputs[prefix_cache] = {i: final[rid].token_ids for i, rid in enumerate(ids) if rid not in aborted}
        manager = engine.block_manager
        manager.check_invariants()
        assert manager.num_free == manager.num_blocks and not manager.seqs
    assert outputs[True] == outputs[False]
    for i, tokens in outputs[True].items():
        assert tokens == solo(model, *reqs[i])


def implied_cached_tokens(prompt, stored) -> int:
    """Prefix-cache hit of ``prompt`` over the token lists ``stored`` (each a sequence whose
    KV is in the pool): whole blocks of the longest common prefix, last prompt token excluded."""
    best = 0
    for s in stored:
        lcp = 0
        while lcp < min(len(prompt), len(s)) and prompt[lcp] == s[lcp]:
            lcp += 1
        best = max(best, min(lcp, len(prompt) - 1) // BS * BS)
    return best


def test_num_cached_tokens_is_what_the_hashes_imply(model):
    """A roomy pool (nothing is evicted) and one step that admits the whole wave, so each
    request's hit depends only on the sequences stored before it: the warm-up requests."""
    prefixes, reqs = mixed_requests(seed=7, n=16)
    engine = Engine(model, None, config(prefix_cache=True, prefill_chunk_size=16, max_num_batched_tokens=512))
    warm = [p + [1, 2] for p in prefixes]
    warm_outs = engine.generate(warm, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    # stored: the prompt and every output but the last (never fed back)
    stored = [p + o.token_ids[:-1] for p, o in zip(warm, warm_outs)]
    ids, aborted, final = run_with_aborts(engine, reqs, abort_every=4, abort_after_steps=2)
    want = [implied_cached_tokens(p, stored) for p, _ in reqs]
    got = [final[rid].metrics.num_cached_tokens for rid in ids]
    assert got == want and sum(want) > 0
    for rid, (prompt, _), cached in zip(ids, reqs, want):
        if rid not in aborted:
            assert final[rid].metrics.num_prefilled_tokens == len(prompt) - cached
    kv = engine.stats()["kv"]
    warm_hits = [o.metrics.num_cached_tokens for o in warm_outs]
    assert kv["prefix_hit_tokens"] == sum(got) + sum(warm_hits)
