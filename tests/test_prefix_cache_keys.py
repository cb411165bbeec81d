"""Prefix-cache keys are a chained SHA-256 digest, and a hit checks the tokens.

Python's ``hash()`` over token tuples lets a crafted prompt collide with another user's
prefix (GHSA-rm76-4mrf-v9r8 / CVE-2025-25183 in vLLM). The reference digest here is
computed independently with hashlib.
"""

import hashlib
import struct

import mlx_ferrum.kv_cache.manager as manager_module
from mlx_ferrum.kv_cache import PagedKvCacheManager

BS = 4


def reference_chain(token_ids, block_size=BS):
    parent, out = b"\x00" * 32, []
    for i in range(len(token_ids) // block_size):
        chunk = token_ids[i * block_size : (i + 1) * block_size]
        parent = hashlib.sha256(parent + b"".join(struct.pack("<q", t) for t in chunk)).digest()
        out.append(parent)
    return out


def test_block_keys_are_the_chained_sha256_of_parent_digest_and_token_bytes():
    mgr = PagedKvCacheManager(16, BS, 8, prefix_cache=True)
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9]
    mgr.create("a")
    mgr.append_slots("a", len(tokens), tokens)
    assert mgr.seqs["a"].block_hashes == reference_chain(tokens)
    # the same block of tokens under a different parent gets a different key
    other = [0, 0, 0, 0] + tokens[4:8]
    mgr.create("b")
    mgr.append_slots("b", len(other), other)
    assert mgr.seqs["b"].block_hashes[1] != mgr.seqs["a"].block_hashes[1]
    mgr.check_invariants()


def test_a_key_collision_is_not_a_hit_the_stored_tokens_are_compared(monkeypatch):
    # force every key to collide, whatever the key function is
    monkeypatch.setattr(manager_module, "hash", lambda _x: 0, raising=False)
    monkeypatch.setattr(manager_module, "block_digest", lambda _p, _t: b"\x01" * 32, raising=False)
    mgr = PagedKvCacheManager(16, BS, 8, prefix_cache=True)
    victim = [10, 11, 12, 13, 14, 15, 16, 17]
    mgr.create("victim")
    mgr.append_slots("victim", len(victim), victim)
    attacker = [20, 21, 22, 23, 24]
    mgr.create("attacker")
    assert mgr.match_prefix("attacker", attacker) == 0, "a block holding other tokens was reused"
    assert mgr.seqs["attacker"].block_ids == []
    # a true prefix still hits
    mgr.create("friend")
    assert mgr.match_prefix("friend", victim[:4] + [99]) == BS
    mgr.check_invariants()


def test_prefix_hits_survive_release_and_reuse_across_sequences():
    mgr = PagedKvCacheManager(8, BS, 8, prefix_cache=True)
    prompt = list(range(1, 10))
    mgr.create("a")
    mgr.append_slots("a", len(prompt), prompt)
    mgr.release("a")
    mgr.create("b")
    assert mgr.match_prefix("b", prompt) == 8
    assert mgr.seqs["b"].block_hashes == reference_chain(prompt)[:2]
    mgr.check_invariants()


def test_a_block_with_a_token_still_being_sampled_is_hashed_only_once_its_id_is_known():
    """The pipelined step stores a token before the host knows its id (UNKNOWN_TOKEN): its
    block must not be registered under a guessed id, and once set_token_ids brings the id
    the chain continues exactly as if the id had been known all along."""
    unknown = manager_module.UNKNOWN_TOKEN
    tokens = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]
    mgr = PagedKvCacheManager(16, BS, 8, prefix_cache=True)
    mgr.create("a")
    mgr.append_slots("a", 7, tokens[:7])
    mgr.append_slots("a", 1, [unknown])  # token 7 completes block 1, but its id is not known
    assert mgr.seqs["a"].block_hashes == reference_chain(tokens[:4])
    mgr.create("probe")
    assert mgr.match_prefix("probe", tokens[:8] + [0]) == BS, "a block was shared before its ids were known"
    mgr.release("probe")
    mgr.append_slots("a", 2, tokens[8:10])  # later tokens arrive while token 7 is still unknown
    assert len(mgr.seqs["a"].block_hashes) == 1
    mgr.set_token_ids("a", 7, [tokens[7]])
    assert mgr.seqs["a"].block_hashes == reference_chain(tokens[:8])
    mgr.create("b")
    assert mgr.match_prefix("b", tokens[:8] + [0]) == 2 * BS
    mgr.check_invariants()


def test_set_token_ids_refuses_a_different_known_id_and_ignores_unstored_positions():
    import pytest

    from mlx_ferrum.errors import KvCacheError

    mgr = PagedKvCacheManager(16, BS, 8, prefix_cache=True)
    mgr.create("a")
    mgr.append_slots("a", 3, [1, 2, 3])
    mgr.set_token_ids("a", 2, [3, 4, 5])  # position 2 agrees; 3 and 4 are not stored yet
    assert mgr.seqs["a"].token_ids == [1, 2, 3]
    with pytest.raises(KvCacheError, match="stored as id 2"):
        mgr.set_token_ids("a", 1, [7])


def test_slots_given_back_unwritten_leave_the_prefix_cache_written_ones_stay():
    """A block's key is registered when its slots are appended, before the pass writes its
    KV. A step that never ran gives its slots back unwritten (``written=False``): every
    block that held one must lose its key, or a later prompt would share KV nobody wrote.
    Tokens cut after their pass ran (rejected draft tokens) keep their full blocks cached."""
    prompt = list(range(1, 14))  # 3 full blocks and one token
    mgr = PagedKvCacheManager(16, BS, 8, prefix_cache=True)
    mgr.create("a")
    mgr.append_slots("a", 4, prompt[:4])  # block 0: an earlier step, written
    mgr.append_slots("a", 9, prompt[4:])  # blocks 1-2 and a token: a step that did not run
    mgr.truncate("a", 4, written=False)
    mgr.release("a")
    mgr.create("b")
    assert mgr.match_prefix("b", prompt) == BS, "a block whose KV was never written is still matched"
    mgr.check_invariants()

    # cut back to the middle of a block: the block holding the given-back slots loses its key
    mgr = PagedKvCacheManager(16, BS, 8, prefix_cache=True)
    mgr.create("a")
    mgr.append_slots("a", 6, prompt[:6])
    mgr.append_slots("a", 7, prompt[6:])
    mgr.truncate("a", 6, written=False)
    mgr.release("a")
    mgr.create("b")
    assert mgr.match_prefix("b", prompt) == BS

    # after a pass: the cut tokens' full blocks stay cached
    mgr = PagedKvCacheManager(16, BS, 8, prefix_cache=True)
    mgr.create("a")
    mgr.append_slots("a", 13, prompt)
    mgr.truncate("a", 4)
    mgr.release("a")
    mgr.create("b")
    assert mgr.match_prefix("b", prompt) == 3 * BS
    mgr.check_invariants()


def test_a_failed_sequence_takes_the_blocks_it_wrote_out_of_the_cache_not_the_ones_it_shared():
    """``release(keep_cached=False)``: the blocks the sequence wrote leave the prefix cache
    (a failed evaluation may have left them holding anything), while the blocks it matched
    from the cache, written by others, stay."""
    shared, own = [7, 7, 7, 7, 8, 8, 8, 8], [1, 2, 3, 4, 5, 6, 7, 8, 9]
    mgr = PagedKvCacheManager(16, BS, 8, prefix_cache=True)
    mgr.create("writer")
    mgr.append_slots("writer", len(shared) + 1, shared + [0])
    mgr.release("writer")
    mgr.create("failed")
    assert mgr.match_prefix("failed", shared + own) == 2 * BS
    assert mgr.seqs["failed"].num_shared_blocks == 2
    mgr.append_slots("failed", len(own), own)
    mgr.release("failed", keep_cached=False)
    mgr.create("next")
    assert mgr.match_prefix("next", shared + own) == 2 * BS, "the shared blocks should stay, its own should go"
    mgr.check_invariants()
    # a fork shares every block it was given; only the blocks it wrote after leave
    mgr.append_slots("next", len(own), own)
    mgr.fork("next", "child")
    mgr.append_slots("child", 4, [5, 5, 5, 5])
    mgr.release("child", keep_cached=False)
    mgr.release("next")
    mgr.create("probe")
    assert mgr.match_prefix("probe", shared + own + [0]) == 4 * BS
    mgr.check_invariants()
