"""The ferrum-style executor surface (an adapter over the runner) reproduces the stories260K
recordings through prefill / batch_prefill / decode / batch_decode / forward_verify / truncate_kv."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_ferrum as mf
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.executor import DecodeInput, LlmExecutor, ModelExecutor, PrefillInput


def argmax(row: mx.array) -> int:
    return int(mx.argmax(row.reshape(-1)).item())


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_the_adapter_surface_reproduces_the_recordings(stories_path, stories_expected, layout):
    model, _ = mf.load(stories_path)
    ex = LlmExecutor(model, RuntimeConfig(kv_layout=layout, block_size=16, max_num_blocks=64))
    assert isinstance(ex, ModelExecutor)
    once, bos = stories_expected["once"], stories_expected["bos"]
    records = [once["generated_ids"], bos["generated_ids"]]
    steps = 24

    # both prompts in one pass, then both sequences decoded together
    outs = ex.batch_prefill([PrefillInput(input_ids=mx.array([once["prompt_ids"]])),
                             PrefillInput(input_ids=mx.array([bos["prompt_ids"]]))])
    handles = [o.kv_cache for o in outs]
    got = [[argmax(o.last_token_logits())] for o in outs]
    for _ in range(steps - 1):
        res = ex.batch_decode([DecodeInput(input_ids=mx.array([[g[-1]]]), kv_cache=h) for g, h in zip(got, handles)])
        handles = [r.kv_cache for r in res]
        for g, r in zip(got, res):
            g.append(argmax(r.logits))
    assert got[0] == records[0][:steps] and got[1] == records[1][:steps]
    assert handles[0].num_tokens == len(once["prompt_ids"]) + steps - 1

    # a verify pass of the last sampled token, three recorded tokens and a wrong one
    rec = records[0]
    wrong = (rec[steps + 3] + 1) % model.args.vocab_size
    fed = [got[0][-1], rec[steps], rec[steps + 1], rec[steps + 2], wrong]
    rows = ex.forward_verify([DecodeInput(input_ids=mx.array([[t]]), kv_cache=handles[0]) for t in fed])
    assert [argmax(r.logits) for r in rows[:4]] == rec[steps : steps + 4]
    full = len(once["prompt_ids"]) + steps + 4
    assert rows[-1].kv_cache.num_tokens == full
    # roll the rejected token back, then go on decoding one sequence at a time
    h = ex.truncate_kv(rows[-1].kv_cache, full - 1)
    assert h.num_tokens == full - 1
    if layout == "paged":
        assert len(h.block_table) == -(-h.num_tokens // 16), "blocks past the kept tokens were not freed"
    tokens = [rec[steps + 3]]
    for _ in range(8):
        step = ex.decode(DecodeInput(input_ids=mx.array([[tokens[-1]]]), kv_cache=h))
        h = step.kv_cache
        tokens.append(argmax(step.logits))
    assert tokens == rec[steps + 3 : steps + 12]

    # a single prompt through prefill equals its recording's first token, on a fresh cache
    single = ex.prefill(PrefillInput(input_ids=mx.array([bos["prompt_ids"]])))
    assert argmax(single.last_token_logits()) == records[1][0]
    for cid in (h.cache_id, handles[1].cache_id, single.kv_cache.cache_id):
        ex.release_cache(cid)
    if layout == "paged":
        assert ex.manager.num_free == ex.manager.num_blocks
    assert ex.status().decode_operations == steps - 1 + 1 + 8
