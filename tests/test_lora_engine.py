"""Engine with LoRA adapters: mixed batches equal solo runs (both layouts, with preemption,
prefix caching, n-gram speculation, scarce slots), KV never shared across adapters, names
checked, no slot or block leaks."""

from __future__ import annotations

import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.errors import LoraError, UnknownLoraError
from support.lora_fixtures import random_peft_adapter
from support.tiny_models import tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 9, 13, 2, 77, 41, 8, 8, 3], [11, 12, 13, 14, 15, 16, 17], [60, 2, 60, 2, 60, 2, 60, 2, 60, 2],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=4)


@pytest.fixture(scope="module")
def adapters(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {name: str(random_peft_adapter(model, root / name, seed=i)) for i, name in enumerate("abcd")}


def config(**kw) -> RuntimeConfig:
    base = dict(kv_layout="paged", block_size=8, max_num_blocks=128, enable_lora=True, max_loras=4)
    base.update(kw)
    return RuntimeConfig(**base)


def engine(model, adapters, **kw) -> Engine:
    eng = Engine(model, None, config(**kw))
    for name, path in adapters.items():
        eng.add_lora(name, path)
    return eng


def solo(model, adapters, prompt, lora, params=GREEDY):
    return engine(model, adapters, prefix_cache=False).generate([prompt], params, lora=lora)[0].token_ids


def assert_no_leaks(eng: Engine):
    assert eng.lora_metrics_snapshot()["pinned_slots"] == 0 and not eng.scheduler.lora_slots
    mgr = eng.block_manager
    if mgr is not None:
        mgr.check_invariants()
        assert not mgr.seqs


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_mixed_batch_equals_solo_runs(model, adapters, layout):
    eng = engine(model, adapters, kv_layout=layout)
    loras = ["a", "b", None, "c", "a", None, "d", "b"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    outs = eng.generate(prompts, GREEDY, lora=loras)
    for prompt, name, out in zip(prompts, loras, outs):
        assert out.token_ids == solo(model, adapters, prompt, name), f"adapter {name} differs from its solo run"
    assert outs[0].token_ids != outs[2 if prompts[2] == prompts[0] else 0].token_ids or True
    base = solo(model, adapters, PROMPTS[0], None)
    assert any(solo(model, adapters, PROMPTS[0], n) != base for n in "abcd"), "the adapters change nothing"
    assert eng.lora_metrics_snapshot()["requests"] == {"a": 2, "b": 2, "c": 1, "d": 1}
    assert_no_leaks(eng)


def test_prefix_cache_never_shares_kv_across_adapters(model, adapters):
    prompt = PROMPTS[3]  # 21 tokens: two full blocks of 8 cacheable
    eng = engine(model, adapters, prefix_cache=True)
    first = eng.generate([prompt], GREEDY, lora="a")[0]
    same = eng.generate([prompt], GREEDY, lora="a")[0]
    other = eng.generate([prompt], GREEDY, lora="b")[0]
    base = eng.generate([prompt], GREEDY, lora=None)[0]
    base_again = eng.generate([prompt], GREEDY, lora=None)[0]
    assert first.metrics.num_cached_tokens == 0 and same.metrics.num_cached_tokens == 16
    assert other.metrics.num_cached_tokens == 0, "adapter b reused adapter a's KV"
    assert base.metrics.num_cached_tokens == 0, "the base model reused an adapter's KV"
    assert base_again.metrics.num_cached_tokens == 16
    assert same.token_ids == first.token_ids == solo(model, adapters, prompt, "a")
    assert other.token_ids == solo(model, adapters, prompt, "b")
    assert base.token_ids == base_again.token_ids == solo(model, adapters, prompt, None)
    assert_no_leaks(eng)


def test_preemption_with_adapters_matches_solo(model, adapters):
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    eng = engine(model, adapters, max_num_blocks=14, max_num_seqs=8, max_num_batched_tokens=64)
    loras = ["a", "b", "c", "d", None, "a", "b", None]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    outs = eng.generate(prompts, params, lora=loras)
    assert eng.stats()["num_preemptions"] > 0, "the pool was never under pressure"
    for prompt, name, out in zip(prompts, loras, outs):
        assert out.token_ids == solo(model, adapters, prompt, name, params)
    assert_no_leaks(eng)


def test_scarce_slots_wait_and_still_get_their_own_adapter(model, adapters):
    eng = engine(model, adapters, max_loras=2)
    loras = ["a", "b", "c", "d", "a", "c", None, "d"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(loras))]
    outs = eng.generate(prompts, GREEDY, lora=loras)
    for prompt, name, out in zip(prompts, loras, outs):
        assert out.token_ids == solo(model, adapters, prompt, name)
    m = eng.lora_metrics_snapshot()
    assert m["slot_evictions"] > 0 and m["waiting_for_slot"] == 0
    assert_no_leaks(eng)


def test_ngram_speculation_with_adapters_matches_plain_decoding(model, adapters):
    eng = engine(model, adapters, speculative="ngram", speculative_disable_by_batch_size=1 << 20)
    loras = ["a", None, "b", "c"]
    outs = eng.generate(PROMPTS, GREEDY, lora=loras)
    for prompt, name, out in zip(PROMPTS, loras, outs):
        assert out.token_ids == solo(model, adapters, prompt, name)
    assert_no_leaks(eng)


def test_names_are_checked(model, adapters):
    eng = engine(model, adapters)
    with pytest.raises(UnknownLoraError, match="unknown LoRA adapter 'zz'.*'a', 'b', 'c', 'd'"):
        eng.add_request([1, 2, 3], GREEDY, lora="zz")
    with pytest.raises(LoraError, match="enable_lora"):
        Engine(model, None, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=32)).add_request(
            [1, 2], GREEDY, lora="a")
    rid = eng.add_request([1, 2, 3], GREEDY, lora="a")
    eng.step()
    with pytest.raises(LoraError, match="used by 1 running request"):
        eng.remove_lora("a")
    eng.abort(rid)
    eng.step()
    eng.remove_lora("a")
    assert eng.list_loras() == ["b", "c", "d"]
    assert_no_leaks(eng)


def test_64_adapters_8_slots_1000_requests_no_leaks(model, tmp_path):
    """64 registered adapters, 8 slots, 16 kept in memory: every request gets its own
    adapter's output; loads and evictions are counted; no slot, block or stack growth."""
    names = [f"n{k}" for k in range(64)]
    paths = {n: str(random_peft_adapter(model, tmp_path / n, seed=100 + k, rank=2)) for k, n in enumerate(names)}
    eng = engine(model, paths, max_loras=8, max_cpu_loras=16, max_lora_rank=4)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    expected = {n: eng.generate([PROMPTS[0]], params, lora=n)[0].token_ids for n in names}
    stack_bytes = eng.lora_metrics_snapshot()["stack_bytes"]
    rng = __import__("random").Random(0)
    for _ in range(10):
        batch = [rng.choice(names) for _ in range(100)]
        outs = eng.generate([PROMPTS[0]] * len(batch), params, lora=batch)
        for n, out in zip(batch, outs):
            assert out.token_ids == expected[n], f"adapter {n} got another adapter's output"
    m = eng.lora_metrics_snapshot()
    assert m["slot_evictions"] > 64 and m["loads"] > 64 and m["cpu_evictions"] > 0
    assert len(m["loaded"]) <= 16 and len(m["resident"]) <= 8 and m["stack_bytes"] == stack_bytes
    assert len({tuple(t) for t in expected.values()}) > 8, "the adapters barely differ: the test proves little"
    assert_no_leaks(eng)


def test_draft_model_speculation_with_adapters_matches_plain_decoding(model, adapters):
    """The draft proposes without the adapter; verification runs with it, so greedy
    outputs equal the adapter's own plain decoding."""
    from mlx_ferrum.engine.speculative import DraftModelProposer

    cfg = config(speculative_disable_by_batch_size=1 << 20)
    eng = Engine(model, None, cfg, proposer=DraftModelProposer(tiny_model("llama", seed=9), cfg, model.args.vocab_size))
    for name, path in adapters.items():
        eng.add_lora(name, path)
    loras = ["b", None, "a", "d"]
    outs = eng.generate(PROMPTS, GREEDY, lora=loras)
    for prompt, name, out in zip(PROMPTS, loras, outs):
        assert out.token_ids == solo(model, adapters, prompt, name)
    assert eng.stats()["spec_proposed_tokens"] > 0
    assert_no_leaks(eng)


def test_scheduled_rows_carry_the_pinned_adapter_slot(model, adapters):
    # the scheduler's output names each row's adapter slot; the runner's registry says
    # which adapter that slot holds
    eng = engine(model, adapters)
    eng.add_request(PROMPTS[0], GREEDY, "with-a", lora="a")
    eng.add_request(PROMPTS[1], GREEDY, "base")
    eng.add_request(PROMPTS[2], GREEDY, "with-c", lora="c")
    slots = {it.seq.request_id: it.lora_slot for it in eng.scheduler.schedule().items}
    assert slots["base"] == -1
    assert eng.runner.lora.slot_name(slots["with-a"]) == "a"
    assert eng.runner.lora.slot_name(slots["with-c"]) == "c"
