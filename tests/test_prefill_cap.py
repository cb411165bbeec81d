"""``RuntimeConfig.max_num_prefill_seqs``: at most that many sequences with prompt tokens in
one engine step. Outputs must equal an uncapped run token for token; a burst is admitted
over several steps while the running requests keep decoding; ``serve`` caps at 4 unless a
flag or variable says otherwise, and the Python API does not cap."""

from __future__ import annotations

import random

import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.errors import ConfigurationError
from support.tiny_models import tiny_model


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=8)


def _requests(n, seed):
    r = random.Random(seed)
    prompts = [[r.randrange(1, 97) for _ in range(r.randint(3, 30))] for _ in range(n)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=r.randint(4, 12), ignore_eos=True)
              for i in range(n)]
    return prompts, params


def _run(model, layout, cap, prompts, params):
    """Outputs, and per step the number of sequences that prefilled and that decoded."""
    eng = Engine(model, None, RuntimeConfig(kv_layout=layout, block_size=8, max_num_blocks=256,
                                            max_num_prefill_seqs=cap))
    steps = []
    schedule = eng.scheduler.schedule

    def counted(*args, **kwargs):
        out = schedule(*args, **kwargs)
        prefill = sum(1 for it in out.items if it.seq.num_computed < len(it.seq.prompt_ids))
        steps.append((prefill, len(out.items) - prefill))
        return out

    eng.scheduler.schedule = counted
    outs = eng.generate(prompts, params)
    return [(o.token_ids, o.finish_reason) for o in outs], steps


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_a_burst_is_prefilled_a_few_at_a_time_with_the_same_tokens(model, layout):
    prompts, params = _requests(9, seed=1)
    free, free_steps = _run(model, layout, None, prompts, params)
    capped, capped_steps = _run(model, layout, 2, prompts, params)
    assert capped == free
    assert max(p for p, _ in free_steps) == 9  # uncapped, the burst prefills in one step
    assert max(p for p, _ in capped_steps) == 2
    # the first admitted decode while the rest of the burst is still being prefilled
    assert any(p > 0 and d > 0 for p, d in capped_steps)


def test_a_chunked_prompt_holds_its_place_and_the_cap_counts_it(model):
    """A prompt longer than a chunk keeps prefilling across steps; with a cap of one, no
    new prompt joins it, and the outputs still equal the uncapped run."""
    prompts = [[(7 * i) % 96 + 1 for i in range(70)], [5, 6, 7], [9, 10, 11, 12]]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)] * 3
    eng_cfg = dict(kv_layout="paged", block_size=8, max_num_blocks=256, prefill_chunk_size=16)
    free = Engine(model, None, RuntimeConfig(**eng_cfg)).generate(prompts, params)
    eng = Engine(model, None, RuntimeConfig(max_num_prefill_seqs=1, **eng_cfg))
    seen = []
    schedule = eng.scheduler.schedule

    def counted(*args, **kwargs):
        out = schedule(*args, **kwargs)
        seen.append(sum(1 for it in out.items if it.seq.num_computed < len(it.seq.prompt_ids)))
        return out

    eng.scheduler.schedule = counted
    capped = eng.generate(prompts, params)
    assert [o.token_ids for o in capped] == [o.token_ids for o in free]
    assert max(seen) == 1 and seen[:5] == [1] * 5  # 70 tokens in chunks of 16, alone


def test_serve_caps_at_four_and_the_library_does_not(monkeypatch):
    from mlx_ferrum.cli import build_parser
    from mlx_ferrum.cli.serve import SERVE_MAX_NUM_PREFILL_SEQS, serve_config

    monkeypatch.delenv("FERRUM_MAX_NUM_PREFILL_SEQS", raising=False)
    parse = build_parser().parse_args
    assert RuntimeConfig().max_num_prefill_seqs is None
    assert SERVE_MAX_NUM_PREFILL_SEQS == 4
    assert serve_config(parse(["serve", "--model", "m"])).max_num_prefill_seqs == 4
    assert serve_config(parse(["serve", "--model", "m", "--max-num-prefill-seqs", "16"])).max_num_prefill_seqs == 16
    monkeypatch.setenv("FERRUM_MAX_NUM_PREFILL_SEQS", "2")
    assert serve_config(parse(["serve", "--model", "m"])).max_num_prefill_seqs == 2
    assert RuntimeConfig().max_num_prefill_seqs == 2
    monkeypatch.setenv("FERRUM_MAX_NUM_PREFILL_SEQS", "0")
    with pytest.raises(ConfigurationError, match="FERRUM_MAX_NUM_PREFILL_SEQS"):
        RuntimeConfig()
