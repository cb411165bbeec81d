"""The engine uses nothing of its runner beyond the ModelRunner protocol (the runner
never allocates KV blocks: the scheduler owns them), and the draft proposer drives its
own low-level executor (which owns its blocks) through a handful of its calls."""

from __future__ import annotations

import random

import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.engine.speculative import DraftModelProposer
from mlx_ferrum.executor import LlmExecutor
from mlx_ferrum.runner import LlmRunner, ModelRunner
from support.tiny_models import tiny_model

#: every name the protocol declares: its methods and its attributes
PROTOCOL = {name for name in vars(ModelRunner) if not name.startswith("_")} | set(ModelRunner.__annotations__)


class RecordingRunner:
    """Stands in for a runner and records the name of every attribute read through it."""

    def __init__(self, inner):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "used", set())

    def __getattr__(self, name):
        value = getattr(self._inner, name)  # a name the runner lacks is not a use
        self.used.add(name)
        return value


def mixed_workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Shared prefixes (prefix caching), repetitive prompts (n-gram speculation finds
    matches, some rejected), penalties, a stop id, seeds and an opt-out."""
    r = random.Random(5)
    system = [r.randrange(3, vocab) for _ in range(24)]  # three full blocks of 8
    prompts, params = [], []
    for i in range(10):
        if i % 2:
            unit = [r.randrange(3, vocab) for _ in range(r.randint(3, 6))]
            prompt = (unit * 8)[: r.randint(12, 30)]
        else:
            prompt = system + [r.randrange(3, vocab) for _ in range(r.randint(1, 6))]
        kw = dict(max_tokens=r.randint(4, 14), temperature=0.0 if i % 3 else 0.8, seed=i, ignore_eos=True)
        if i % 4 == 1:
            kw.update(repetition_penalty=1.3)
        if i % 4 == 2:
            kw.update(presence_penalty=0.5, frequency_penalty=0.3)
        if i == 6:
            kw.update(stop_token_ids=[prompt[-1]])
        if i == 7:
            kw.update(speculative=False)
        prompts.append(prompt)
        params.append(SamplingParams(**kw))
    return prompts, params


def config(layout: str, **kw) -> RuntimeConfig:
    base = dict(kv_layout=layout, block_size=8, max_num_blocks=256, max_num_seqs=4, speculative="ngram",
                prompt_lookup_min=1, num_speculative_tokens=3, prefix_cache=layout == "paged",
                speculative_disable_by_batch_size=1 << 20, speculative_min_acceptance=0.0)
    base.update(kw)
    return RuntimeConfig(**base)


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_the_engine_calls_only_model_runner_methods(layout):
    model = tiny_model("llama", seed=3)
    cfg = config(layout)
    runner = RecordingRunner(LlmRunner(model, cfg))
    assert isinstance(runner, ModelRunner)
    eng = Engine(model, None, cfg, executor=runner)
    prompts, params = mixed_workload(model.args.vocab_size)
    outs = eng.generate(prompts[:6], params[:6])
    eng.add_request(prompts[6], params[6], request_id="aborted")
    eng.step()
    eng.abort("aborted")
    outs += eng.generate(prompts[7:], params[7:])
    assert all(o.token_ids for o in outs)
    stats = eng.stats()
    assert stats["spec_proposed_tokens"] > stats["spec_accepted_tokens"] > 0, "speculation was not exercised"
    if layout == "paged":
        assert stats["prefix_cache_hit_rate"] > 0, "prefix caching was not exercised"
        # the engine builds its scheduler's block manager from the runner's geometry; it
        # never asks the runner to claim, hash or free blocks
        assert "kv_geometry" in runner.used
    assert not {"claim_prefix", "set_token_ids", "manager", "has_cache", "num_tokens"} & runner.used
    assert {"forward", "trim_cache", "release_cache", "kv_capacity", "cache_metrics_snapshot"} <= runner.used
    assert runner.used <= PROTOCOL, f"the engine used {sorted(runner.used - PROTOCOL)} outside ModelRunner"


def test_the_draft_proposer_calls_only_model_runner_methods():
    model = tiny_model("llama", seed=3)
    draft = tiny_model("llama", seed=99)
    cfg = config("paged")
    proposer = DraftModelProposer(draft, cfg, model.args.vocab_size)
    proposer.runner = RecordingRunner(proposer.runner)
    target = RecordingRunner(LlmRunner(model, cfg))
    eng = Engine(model, None, cfg, executor=target, proposer=proposer)
    prompts, params = mixed_workload(model.args.vocab_size)
    assert all(o.token_ids for o in eng.generate(prompts, params))
    assert eng.stats()["spec_proposed_tokens"] > 0
    # the draft has no scheduler: its LlmExecutor owns the draft's blocks
    allowed = {"run", "has_cache", "num_tokens", "trim_cache", "release_cache", "kv_capacity"}
    assert {"run", "has_cache", "release_cache"} <= proposer.runner.used
    assert proposer.runner.used <= allowed, f"the proposer used {sorted(proposer.runner.used - allowed)}"
    assert target.used <= PROTOCOL, f"the engine used {sorted(target.used - PROTOCOL)}"


def test_an_executor_given_to_the_engine_is_driven_through_its_runner():
    model = tiny_model("llama", seed=3)
    cfg = RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64)
    executor = LlmExecutor(model, cfg)
    eng = Engine(model, None, cfg, executor=executor)
    assert eng.runner is executor.runner
    out = eng.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    assert executor.status().prefill_operations == 0  # the engine never goes through the adapter
    # one block manager: the scheduler drove the executor's own and released its cache there
    assert eng.block_manager is executor.manager and eng.scheduler.block_manager is executor.manager
    assert executor.manager.peak_in_use > 0 and not executor.manager.seqs


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_the_engine_serves_lora_adapters_through_model_runner_methods(layout, tmp_path):
    """Adapters on (n-gram drafts, prefix caching, a slot wait): every call the engine
    makes for LoRA is a ModelRunner method too."""
    from support.lora_fixtures import random_peft_adapter

    model = tiny_model("llama", seed=3)
    cfg = config(layout, enable_lora=True, max_loras=1)
    runner = RecordingRunner(LlmRunner(model, cfg))
    eng = Engine(model, None, cfg, executor=runner)
    for i, name in enumerate("ab"):
        eng.add_lora(name, str(random_peft_adapter(model, tmp_path / name, seed=i)))
    prompts, params = mixed_workload(model.args.vocab_size)
    loras = ["a", "b", None, "a", "b", None, "a", "b", "a", None]
    assert all(o.token_ids for o in eng.generate(prompts, params, lora=loras))
    assert eng.list_loras() == ["a", "b"] and eng.lora_metrics_snapshot()["pinned_slots"] == 0
    eng.remove_lora("b")
    assert {"add_lora", "lora_path", "acquire_lora", "release_lora", "list_loras", "lora_metrics_snapshot",
            "remove_lora"} <= runner.used
    assert runner.used <= PROTOCOL, f"the engine used {sorted(runner.used - PROTOCOL)} outside ModelRunner"
