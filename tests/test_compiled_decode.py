"""Compiled paged decode passes (``mx.compile``) against the same executor run op by op.

A paged pass in which every sequence brings one token and wants one logits row runs
as one compiled step (``LlmExecutor._decode_pass``); ``RuntimeConfig(enforce_eager=True)``
builds the same pass op by op. The eager executor is the reference: for every model
family the project loads, logits must agree to float32 rounding and greedy choices
must be identical, while batches grow, shrink, cross block boundaries and free blocks
outside sliding windows. The engine must produce the same tokens either way, a model
that reads a value on the host must fall back to eager once (and still be right),
and the configuration switch must behave as documented.

Every compiled executor here counts the calls of its compiled step, so a test cannot
pass because the compiled path was silently skipped.
"""

from __future__ import annotations

import logging
import random

import mlx.core as mx
import numpy as np
import pytest

import mlx_ferrum as mf
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import SamplingParams
from mlx_ferrum.errors import ConfigurationError
from mlx_ferrum.executor import DecodeInput, LlmExecutor, PrefillInput
from mlx_ferrum.executor.llm_executor import SeqWork
from mlx_ferrum.kv_cache.manager import FREED_BLOCK
from mlx_ferrum.models.llama import Model
from support.tiny_models import tiny_model

RTOL = ATOL = 1e-5
WINDOW = 12  # sliding window of the windowed families: smaller than every context below
STEPS = 20
LOGGER = "mlx_ferrum.runner.llm_runner"


# ----------------------------------------------------------------------------- models


def _hf_model(family: str, tmp_path_factory):
    from support import hf_reference  # skips the case when torch/transformers are missing

    from mlx_ferrum.models import load_model

    folder = tmp_path_factory.mktemp(family)
    hf_reference.make_checkpoint(family, folder, window=WINDOW)
    return load_model(folder)[0]


def _quantized_model(tmp_path_factory):
    pytest.importorskip("mlx_lm.convert")
    from support.checkpoints import cached_checkpoint

    from mlx_ferrum.models import load_model

    return load_model(cached_checkpoint("qwen2", quantized=True))[0]


# family -> how the project gets a model of it
FAMILIES = {
    "llama": lambda f: tiny_model("llama", seed=1),
    "qwen2": lambda f: tiny_model("qwen2", seed=2),  # q/k/v bias
    "qwen3": lambda f: tiny_model("qwen3", seed=3),  # q/k RMSNorm
    "mistral_window": lambda f: _hf_model("mistral", f),  # one window for every layer: blocks freed
    "gemma3_text": lambda f: _hf_model("gemma3_text", f),  # sliding + full layers: layer groups
    "gpt_oss": lambda f: _hf_model("gpt_oss", f),  # attention sinks, MoE, sliding + full layers
    "qwen3_moe": lambda f: _hf_model("qwen3_moe", f),
    "phi3": lambda f: _hf_model("phi3", f),  # longrope, one window for every layer
    "qwen2_4bit": _quantized_model,  # MLX affine 4-bit written by mlx_lm.convert
}
WINDOWED = ("mistral_window", "gemma3_text", "gpt_oss", "phi3")

_MODELS: dict = {}


@pytest.fixture(scope="module")
def family_model(tmp_path_factory):
    """``get(name)``: the model of a family in :data:`FAMILIES`, built once per module."""

    def get(name):
        if name not in _MODELS:
            _MODELS[name] = FAMILIES[name](tmp_path_factory)
        return _MODELS[name]

    yield get
    _MODELS.clear()


def paged(compiled: bool, block_size: int = 8, **kw) -> RuntimeConfig:
    base = dict(kv_layout="paged", block_size=block_size, max_num_blocks=256, kv_capacity=256,
                enforce_eager=not compiled)
    base.update(kw)
    return RuntimeConfig(**base)


def count_compiled_calls(ex: LlmExecutor) -> list[int]:
    """Wrap the executor's compiled step; the returned one-item list counts its calls."""
    assert ex.compiled_decode, "the executor does not compile decode passes"
    ex = getattr(ex, "runner", ex)  # an LlmExecutor's compiled step is its runner's
    make_step, calls = ex._compiled_step, [0]

    def counted_step(shape):
        step = make_step(shape)

        def counted(*args):
            calls[0] += 1
            return step(*args)

        return counted

    ex._compiled_step = counted_step
    return calls


def prompts_for(model, lengths, seed):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(3, model.args.vocab_size, n)] for n in lengths]


def as_rows(logits: list[mx.array]) -> np.ndarray:
    return np.concatenate([np.array(row.astype(mx.float32)).reshape(1, -1) for row in logits])


def assert_same(compiled: np.ndarray, eager: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(compiled, eager, rtol=RTOL, atol=ATOL, err_msg=what)
    assert (compiled.argmax(-1) == eager.argmax(-1)).all(), what


def tables(mgr, cid) -> list[int]:
    """Every block table entry of ``cid``, over all layer groups."""
    groups = getattr(mgr, "groups", None)
    if groups is None:
        return list(mgr.block_table(cid))
    return [b for g in range(len(groups)) for b in mgr.block_table(cid, g)]


class Lockstep:
    """The same sequences through a compiled and an eager executor, pass by pass.

    Each pass's logits are compared; the next token of every sequence is the eager
    side's argmax, fed to both, so the two sides always see identical inputs.
    """

    def __init__(self, model, block_size=8, **kw):
        self.ex = {True: LlmExecutor(model, paged(True, block_size, **kw)),
                   False: LlmExecutor(model, paged(False, block_size, **kw))}
        self.compiled_calls = count_compiled_calls(self.ex[True])
        self.handles: dict[bool, dict] = {True: {}, False: {}}
        self.next_token: dict[str, int] = {}
        self.passes = 0

    def _take(self, cids, rows: dict[bool, np.ndarray], what: str) -> None:
        assert_same(rows[True], rows[False], f"pass {self.passes} ({what}) over {cids}")
        for c, t in zip(cids, rows[False].argmax(-1)):
            self.next_token[c] = int(t)
        self.passes += 1

    def prefill(self, prompts: dict[str, list[int]]) -> None:
        rows = {}
        for side, ex in self.ex.items():
            outs = ex.batch_prefill([PrefillInput(input_ids=mx.array([p]), cache_id=c) for c, p in prompts.items()])
            for c, o in zip(prompts, outs):
                self.handles[side][c] = o.kv_cache
            rows[side] = as_rows([o.logits[0, -1] for o in outs])
        self._take(list(prompts), rows, "prefill")

    def decode(self, cids: list[str]) -> None:
        rows = {}
        for side, ex in self.ex.items():
            outs = ex.batch_decode(
                [DecodeInput(input_ids=mx.array([[self.next_token[c]]]), kv_cache=self.handles[side][c]) for c in cids]
            )
            for c, o in zip(cids, outs):
                self.handles[side][c] = o.kv_cache
            rows[side] = as_rows([o.logits for o in outs])
        self._take(cids, rows, "decode")

    def mixed(self, decoding: list[str], prompts: dict[str, list[int]]) -> None:
        """One pass of new prompts and one-token decodes (op by op, unless every item brings one token)."""
        rows = {}
        for side, ex in self.ex.items():
            work = [SeqWork(c, p) for c, p in prompts.items()] + [SeqWork(c, [self.next_token[c]]) for c in decoding]
            rows[side] = as_rows(ex.run(work))
            for w in work:
                self.handles[side][w.cache_id] = ex._handle(w.cache_id)
        self._take(list(prompts) + decoding, rows, "mixed")

    def fork(self, cid: str, new_cid: str) -> None:
        for side, ex in self.ex.items():
            self.handles[side][new_cid] = ex.fork_cache(self.handles[side][cid], new_cid)
        self.next_token[new_cid] = self.next_token[cid]

    def release(self, cid: str) -> None:
        for side, ex in self.ex.items():
            ex.release_cache(cid)
            self.handles[side].pop(cid, None)
        del self.next_token[cid]


# ----------------------------------------------------------------------------- 1. every family


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ragged_batch_decode_equals_eager_for_every_family(family_model, family):
    model = family_model(family)
    # contexts just before, on and past block boundaries (block_size 8); 20 steps cross
    # two or three boundaries each, and run every context past the window of the windowed families
    lengths = [3, 7, 8, 15, 22]
    run = Lockstep(model, block_size=8)
    cids = [f"s{i}" for i in range(len(lengths))]
    run.prefill(dict(zip(cids, prompts_for(model, lengths, seed=11))))
    for _ in range(STEPS):
        run.decode(cids)
    assert run.ex[True].compiled_decode, f"{family}: the compiled path fell back to eager"
    assert run.compiled_calls[0] == STEPS, f"{family}: {run.compiled_calls[0]} of {STEPS} decode passes compiled"
    assert not run.ex[False].compiled_decode
    if family in WINDOWED:
        for side, ex in run.ex.items():
            assert FREED_BLOCK in tables(ex.manager, cids[-1]), f"{family}: the window freed no block"
        assert tables(run.ex[True].manager, cids[-1]) == tables(run.ex[False].manager, cids[-1])


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_block_size_16_equals_eager(family_model, family):
    model = family_model(family)
    lengths = [1, 15, 16, 30]  # 20 steps cross 16 and 32
    run = Lockstep(model, block_size=16)
    cids = [f"s{i}" for i in range(len(lengths))]
    run.prefill(dict(zip(cids, prompts_for(model, lengths, seed=12))))
    for _ in range(STEPS):
        run.decode(cids)
    assert run.compiled_calls[0] == STEPS and run.ex[True].compiled_decode


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_moe"])
def test_moe_batch_past_the_expert_sort_threshold(family_model, family):
    """36 sequences x 2 experts each = 72 (token, expert) pairs: the MoE layer sorts
    tokens by expert (``layers.moe._SORT_THRESHOLD`` is 64) inside the compiled step."""
    from mlx_ferrum.layers import moe

    model = family_model(family)
    n = 36
    assert 2 * n >= moe._SORT_THRESHOLD
    run = Lockstep(model, block_size=8)
    cids = [f"s{i}" for i in range(n)]
    run.prefill(dict(zip(cids, prompts_for(model, [1 + i % 17 for i in range(n)], seed=13))))
    for _ in range(4):
        run.decode(cids)
    assert run.compiled_calls[0] == 4 and run.ex[True].compiled_decode


def test_phi3_longrope_switch_inside_the_compiled_step(family_model):
    """Phi-3's LongRoPE switches to its long factors once a pass reaches past
    ``original_max_position_embeddings`` (256 here), a device-side choice that the
    compiled step must make as the eager one does."""
    model = family_model("phi3")
    rope = model.model.layers[0].self_attn.rope
    assert rope._long_freqs is not None and rope._switch_at == 256
    run = Lockstep(model, block_size=16, kv_capacity=512)
    run.prefill(dict(zip(["long", "short"], prompts_for(model, [248, 5], seed=81))))
    for _ in range(16):  # the long sequence's positions go 248 .. 263
        run.decode(["long", "short"])
    assert run.compiled_calls[0] == 16 and run.ex[True].compiled_decode


# ----------------------------------------------------------------------------- 2. changing batches


@pytest.mark.parametrize("family", ["llama", "mistral_window", "gemma3_text", "gpt_oss"])
def test_batch_changing_between_steps_equals_eager_and_leaks_no_block(family_model, family):
    model = family_model(family)
    run = Lockstep(model, block_size=8, max_num_blocks=64)
    free_at_start = {side: ex.manager.num_free for side, ex in run.ex.items()}
    first = dict(zip(["a", "b", "c", "d"], prompts_for(model, [5, 9, 16, 30], seed=21)))
    late = dict(zip(["e", "f", "g"], prompts_for(model, [11, 6, 2], seed=22)))
    run.prefill(first)
    live = list(first)
    decode_passes = 0
    for step in range(26):
        if step == 4:
            run.release("b")  # leaves mid-way: the batch shrinks
            live.remove("b")
        if step == 7:
            run.prefill({"e": late["e"]})  # a new sequence joins at the end
            live.append("e")
        if step == 10:
            # prefill and decodes in one pass (eager on both sides), then decode again
            run.mixed(live, {"f": late["f"]})
            live.append("f")
            continue
        if step == 14:
            for c in ("a", "c"):
                run.release(c)
                live.remove(c)
            live.reverse()  # a new order of the same sequences
        if step == 18:
            if family in WINDOWED:
                for ex in run.ex.values():
                    assert FREED_BLOCK in tables(ex.manager, "d"), "the window freed no block"
            for c in live[1:]:
                run.release(c)
            live = live[:1]  # one sequence alone
        if step == 22:
            run.prefill({"g": late["g"]})
            live = ["g"] + live
        run.decode(live)
        decode_passes += 1
    assert run.ex[True].compiled_decode
    assert run.compiled_calls[0] == decode_passes
    for c in list(live):
        run.release(c)
    for side, ex in run.ex.items():
        mgr = ex.manager
        mgr.check_invariants()
        assert not mgr.seqs, side
        assert mgr.num_free == free_at_start[side], f"compiled={side}: blocks were left behind"
        assert mgr.num_in_use == 0, side


@pytest.mark.parametrize("family", ["gemma3_text", "gpt_oss"])
def test_layer_groups_with_different_block_ids_equal_eager(family_model, family):
    """The full and the sliding group of a layer-group model hold different block ids
    once the sliding group reuses blocks its window freed, so a decode step that gave
    every layer one group's tables would read the wrong blocks."""
    model = family_model(family)
    run = Lockstep(model, block_size=8, max_num_blocks=16)
    x, y, z = prompts_for(model, [60, 60, 20], seed=41)
    run.prefill({"x": x, "y": y})  # the full group's 16 blocks are all in use
    run.release("y")
    run.prefill({"z": z})  # full group: y's blocks; sliding group: blocks its window freed earlier
    mgr = run.ex[True].manager
    assert mgr.block_table("z", 0) != mgr.block_table("z", 1), "the groups' block ids did not diverge"
    for _ in range(STEPS):
        run.decode(["x", "z"])
    assert run.compiled_calls[0] == STEPS and run.ex[True].compiled_decode


@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_forked_sequences_copy_on_write_inside_compiled_steps(family_model, family):
    """Forks share a half-full last block; the copy made before the first write of each
    child lands in the pool that the compiled step gets as input."""
    model = family_model(family)
    run = Lockstep(model, block_size=8)
    run.prefill({"p": prompts_for(model, [13], seed=51)[0]})
    run.decode(["p"])
    run.fork("p", "c1")
    run.fork("p", "c2")
    run.next_token["c2"] = (run.next_token["p"] + 1) % model.args.vocab_size  # the children diverge
    for _ in range(12):
        run.decode(["p", "c1", "c2"])
    assert run.compiled_calls[0] == 13 and run.ex[True].compiled_decode
    for side, ex in run.ex.items():
        for c in ("p", "c1", "c2"):
            ex.release_cache(c)
        assert ex.manager.num_in_use == 0, side


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_one_token_prompts_join_a_decode_pass_compiled(family_model, family):
    """A new sequence whose prompt is one token makes a pass of one token per sequence:
    it is created and prefilled inside the compiled step."""
    model = family_model(family)
    run = Lockstep(model, block_size=8)
    run.prefill({"a": prompts_for(model, [9], seed=61)[0]})
    run.decode(["a"])
    run.mixed(["a"], {"b": [7]})  # b's whole prompt, with a's next token: every item brings one token
    assert run.compiled_calls[0] == 2, "a pass of one-token items did not compile"
    for _ in range(10):
        run.decode(["b", "a"])
    assert run.compiled_calls[0] == 12


def test_prefix_cache_hit_leaving_one_token_equals_eager(family_model):
    """Identical 17-token prompts with block_size 8: later requests find 16 tokens cached
    and compute one, in a pass shaped like a decode."""
    model = family_model("llama")
    prompt = prompts_for(model, [17], seed=71)[0]
    reqs = [(prompt, SamplingParams(max_tokens=6 + i, temperature=0.0, ignore_eos=True)) for i in range(3)]
    reqs += [(prompt[:9] + [5], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))]
    outs = {}
    for compiled in (False, True):
        cfg = paged(compiled, max_num_seqs=1, prefix_cache=True)  # one at a time: each later one hits the cache
        eng = mf.Engine(model, None, cfg)
        calls = count_compiled_calls(eng.runner) if compiled else None
        ex, one_token_prefills = eng.runner, []
        forward = ex.forward

        def spy(work, prev=None, blocks=None):
            # the row's start: tokens its cache held before the pass (the scheduler's slots)
            one_token_prefills.extend(w for w in work if len(w.tokens) == 1 and blocks.rows[w.cache_id].start == 16)
            return forward(work, prev, blocks)

        ex.forward = spy
        outs[compiled] = [o.token_ids for o in eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])]
        assert eng.stats()["prefix_cache_hit_rate"] > 0
        assert len(one_token_prefills) >= 2, "no cache hit left one prompt token to compute"
    assert outs[True] == outs[False]
    assert calls[0] > 0


# ----------------------------------------------------------------------------- 3. engine


def engine_requests(n, seed, vocab, stop_ids=()):
    r = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [r.randrange(3, vocab) for _ in range(r.randint(1, 30))]
        kw = dict(max_tokens=r.randint(4, 24), ignore_eos=True, stop_token_ids=list(stop_ids))
        if i % 2 == 0:
            sp = SamplingParams(temperature=0.0, **kw)
        else:
            sp = SamplingParams(temperature=r.choice([0.7, 1.0]), top_p=r.choice([1.0, 0.9]), top_k=r.choice([0, 20]),
                                min_p=r.choice([0.0, 0.05]), seed=1000 + i, **kw)
        out.append((prompt, sp))
    return out


def run_engine(model, compiled, async_scheduling, reqs, **kw):
    cfg = paged(compiled, block_size=8, max_num_seqs=16, async_scheduling=async_scheduling, **kw)
    eng = mf.Engine(model, None, cfg)
    calls = count_compiled_calls(eng.runner) if compiled else None
    outs = eng.generate([p for p, _ in reqs], [sp for _, sp in reqs])
    mgr = eng.block_manager
    assert mgr.num_in_use == 0 and not mgr.seqs, "blocks were left behind"
    return [(o.token_ids, o.finish_reason) for o in outs], eng, calls


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["pipelined", "synchronous"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_engine_tokens_equal_eager(family_model, family, async_scheduling):
    model = family_model(family)
    vocab = model.args.vocab_size
    # stop ids the model produces often, so several requests stop early
    free_run, _, _ = run_engine(model, False, async_scheduling, engine_requests(8, 3, vocab))
    counts: dict[int, int] = {}
    for ids, _ in free_run:
        for t in ids[1:]:
            counts[t] = counts.get(t, 0) + 1
    stop_ids = sorted(counts, key=counts.get, reverse=True)[:2]
    reqs = engine_requests(8, 3, vocab, stop_ids)
    eager, _, _ = run_engine(model, False, async_scheduling, reqs)
    compiled, eng, calls = run_engine(model, True, async_scheduling, reqs)
    assert compiled == eager
    assert {reason for _, reason in eager} == {"stop", "length"}, "the requests do not exercise both finishes"
    assert eng.runner.compiled_decode and calls[0] > 0


def test_engine_with_preemption_and_prefix_cache_equals_eager(family_model):
    model = family_model("mistral_window")
    r = random.Random(7)
    shared = [r.randrange(3, 128) for _ in range(16)]
    reqs = [((shared if i % 2 else []) + [r.randrange(3, 128) for _ in range(r.randint(3, 20))],
             SamplingParams(max_tokens=r.randint(8, 20), temperature=0.0, ignore_eos=True)) for i in range(12)]
    kw = dict(max_num_blocks=10, prefix_cache=True)
    eager, eng_e, _ = run_engine(model, False, True, reqs, **kw)
    compiled, eng_c, calls = run_engine(model, True, True, reqs, **kw)
    assert eng_c.stats()["num_preemptions"] > 0, "the pool was never under pressure: the test is too easy"
    assert compiled == eager
    assert eng_c.runner.compiled_decode and calls[0] > 0


@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_speculative_engine_equals_eager(family_model, proposer):
    """Speculative steps mix verify passes (eager) with plain decode passes (compiled);
    a draft model's executor compiles its own decode passes too."""
    from mlx_ferrum.engine.speculative import DraftModelProposer

    model = family_model("llama")
    vocab = model.args.vocab_size
    r = random.Random(9)
    reqs = [([r.randrange(3, 12) for _ in range(r.randint(8, 24))],  # repetitive: n-grams find drafts
             SamplingParams(max_tokens=r.randint(8, 20), temperature=0.0, ignore_eos=True)) for _ in range(6)]
    outs, calls = {}, {}
    for compiled in (False, True):
        cfg = paged(compiled, max_num_seqs=8, speculative="ngram", prompt_lookup_min=1, num_speculative_tokens=3,
                    speculative_disable_by_batch_size=1 << 20)
        prop = DraftModelProposer(model, cfg, vocab) if proposer == "draft" else None
        eng = mf.Engine(model, None, cfg, proposer=prop)
        if compiled:
            calls["target"] = count_compiled_calls(eng.runner)
            if prop is not None:
                calls["draft"] = count_compiled_calls(prop.runner)
        outs[compiled] = [(o.token_ids, o.finish_reason) for o in eng.generate([p for p, _ in reqs],
                                                                            [sp for _, sp in reqs])]
        assert eng.stats()["spec_proposed_tokens"] > 0, "nothing was speculated: the test is too easy"
    assert outs[True] == outs[False]
    # with a draft every row is verified (all logits: eager), so only the draft's passes compile
    compiled_side = "draft" if proposer == "draft" else "target"
    assert calls[compiled_side][0] > 0, {k: c[0] for k, c in calls.items()}


# ----------------------------------------------------------------------------- 4. fallback


class HostReadingModel(Model):
    """A llama model whose forward reads a value back to the host (a data-dependent
    Python branch), which ``mx.compile`` cannot trace."""

    def __call__(self, input_ids, meta=None):
        if int(input_ids.max()) < 0:  # never true: only the read matters
            raise AssertionError("unreachable")
        return super().__call__(input_ids, meta)


def test_a_model_reading_the_host_falls_back_to_eager_once(caplog):
    base = tiny_model("llama", seed=4)
    model = HostReadingModel(base.args)
    model.update(base.parameters())
    mx.eval(model.parameters())
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = Lockstep(model, block_size=8)
    assert run.ex[True].compiled_decode  # nothing traced yet
    cids = ["a", "b", "c"]
    run.prefill(dict(zip(cids, prompts_for(model, [4, 9, 17], seed=31))))
    for _ in range(10):
        run.decode(cids)
    assert not run.ex[True].compiled_decode
    assert run.compiled_calls[0] == 1, "the compiled step was tried again after it failed"
    records = [r for r in caplog.records if r.name == LOGGER]
    assert len(records) == 1 and records[0].levelno == logging.INFO, [r.getMessage() for r in records]
    # the eager side and the fallen-back side keep the same pool contents and block tables
    for c in cids:
        assert tables(run.ex[True].manager, c) == tables(run.ex[False].manager, c)
    # the host-reading model really is the one running: same logits as the plain model eagerly
    plain = LlmExecutor(base, paged(False))
    p = PrefillInput(input_ids=mx.array([prompts_for(model, [6], seed=32)[0]]))
    q = PrefillInput(input_ids=p.input_ids)
    assert mx.array_equal(plain.prefill(p).logits, run.ex[True].prefill(q).logits)
    # the failed trace leaves nothing behind: a new executor over a traceable model still compiles
    fresh = Lockstep(base, block_size=8)
    fresh.prefill({"a": prompts_for(base, [5], seed=33)[0]})
    for _ in range(3):
        fresh.decode(["a"])
    assert fresh.compiled_calls[0] == 3 and fresh.ex[True].compiled_decode


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["pipelined", "synchronous"])
def test_engine_over_a_host_reading_model_falls_back_and_equals_eager(async_scheduling, caplog):
    base = tiny_model("llama", seed=4)
    model = HostReadingModel(base.args)
    model.update(base.parameters())
    caplog.set_level(logging.INFO, logger=LOGGER)
    reqs = engine_requests(6, 5, model.args.vocab_size)
    eager, _, _ = run_engine(model, False, async_scheduling, reqs)
    fallen_back, eng, calls = run_engine(model, True, async_scheduling, reqs)
    assert fallen_back == eager
    assert not eng.runner.compiled_decode and calls[0] == 1
    assert len([r for r in caplog.records if r.name == LOGGER]) == 1


class BufferReadingModel(Model):
    """A llama model whose forward reads its input through the buffer protocol
    (``memoryview``, as ``np.frombuffer`` or a zero-copy hand-off to another library would)."""

    def __call__(self, input_ids, meta=None):
        if memoryview(input_ids).nbytes < 0:  # never true: only the read matters
            raise AssertionError("unreachable")
        return super().__call__(input_ids, meta)


def test_a_model_reading_the_host_through_a_buffer_falls_back_too(caplog):
    base = tiny_model("llama", seed=4)
    model = BufferReadingModel(base.args)
    model.update(base.parameters())
    caplog.set_level(logging.INFO, logger=LOGGER)
    run = Lockstep(model, block_size=8)
    run.prefill({"a": prompts_for(model, [6], seed=34)[0]})
    for _ in range(3):
        run.decode(["a"])
    assert not run.ex[True].compiled_decode


# ----------------------------------------------------------------------------- 5. configuration


def test_enforce_eager_from_the_environment(monkeypatch):
    model = tiny_model("llama", seed=1)
    monkeypatch.delenv("FERRUM_ENFORCE_EAGER", raising=False)
    assert LlmExecutor(model, RuntimeConfig(kv_layout="paged", max_num_blocks=32)).compiled_decode
    monkeypatch.setenv("FERRUM_ENFORCE_EAGER", "1")
    assert RuntimeConfig().enforce_eager is True
    assert not LlmExecutor(model, RuntimeConfig(kv_layout="paged", max_num_blocks=32)).compiled_decode
    # an explicit setting wins over the environment
    assert LlmExecutor(model, RuntimeConfig(kv_layout="paged", max_num_blocks=32, enforce_eager=False)).compiled_decode
    monkeypatch.setenv("FERRUM_ENFORCE_EAGER", "0")
    assert not LlmExecutor(model, RuntimeConfig(kv_layout="paged", max_num_blocks=32, enforce_eager=True)).compiled_decode
    monkeypatch.setenv("FERRUM_ENFORCE_EAGER", "maybe")
    with pytest.raises(ConfigurationError, match="FERRUM_ENFORCE_EAGER"):
        RuntimeConfig(kv_layout="paged")


def test_the_contiguous_layout_never_compiles(monkeypatch):
    monkeypatch.setenv("FERRUM_ENFORCE_EAGER", "0")
    model = tiny_model("llama", seed=1)
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="contiguous", kv_capacity=64, enforce_eager=False))
    assert not ex.compiled_decode
    out = ex.prefill(PrefillInput(input_ids=mx.array([[5, 6, 7]])))
    for _ in range(3):
        out = ex.decode(DecodeInput(input_ids=mx.array([[int(mx.argmax(out.logits.reshape(-1)))]]), kv_cache=out.kv_cache))
    assert not ex.compiled_decode


# ----------------------------------------------------------------------------- 6. shape buckets


def test_shape_buckets_cover_every_size_with_under_a_quarter_wasted():
    from mlx_ferrum.executor.llm_executor import shape_bucket

    sizes = [shape_bucket(n) for n in range(1, 1025)]
    assert all(n <= b < n * 5 / 4 + 1 for n, b in zip(range(1, 1025), sizes))
    assert sizes[:8] == list(range(1, 9)) and sizes == sorted(sizes)
    assert len(set(sizes)) == 8 + 4 * 7  # four per octave above 8: logarithmically many traces


def test_padded_rows_write_only_the_scratch_block():
    """Five sequences run as a padded batch of six: the pad row writes the scratch block
    past the manager's blocks, so every live block holds what the eager side holds."""
    model = tiny_model("llama", seed=6)
    run = Lockstep(model, block_size=8)
    cids = [f"s{i}" for i in range(5)]
    run.prefill(dict(zip(cids, prompts_for(model, [4, 9, 2, 12, 7], seed=41))))
    for _ in range(6):
        run.decode(cids)
    compiled, eager = run.ex[True], run.ex[False]
    scratch = compiled.manager.num_blocks
    assert compiled.pool.num_blocks == scratch + 1
    live = sorted({b for c in cids for b in compiled.manager.block_table(c)})
    assert scratch not in live
    assert sorted({b for c in cids for b in eager.manager.block_table(c)}) == live
    for layer in range(len(model.layers)):
        for pools in ("k", "v"):
            got = np.array(getattr(compiled.pool, pools)[layer][mx.array(live)])
            want = np.array(getattr(eager.pool, pools)[layer][mx.array(live)])
            np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_traces_are_bounded_and_results_survive_a_reset(monkeypatch):
    """Past MAX_DECODE_TRACES shapes the compiled step is rebuilt (its traces dropped);
    the passes before and after stay equal to eager."""
    import threading

    from mlx_ferrum.runner import compiled_decode

    monkeypatch.setattr(compiled_decode, "MAX_DECODE_TRACES", 2)
    model = tiny_model("llama", seed=7)
    run = Lockstep(model, block_size=8)
    cids = [f"s{i}" for i in range(9)]
    run.prefill(dict(zip(cids, prompts_for(model, [5] * 9, seed=42))))
    functions = []  # kept alive, so identity tells them apart
    for size in (1, 2, 3, 4, 6, 9, 1, 2):  # buckets 1, 2, 3, 4, 6, 10, 1, 2
        run.decode(cids[:size])
        function, shapes = run.ex[True].runner._compiled_decode[threading.get_ident()]
        if not any(function is f for f in functions):
            functions.append(function)
        assert len(shapes) <= 2
    assert len(functions) >= 4  # rebuilt as the shapes went past the limit


def test_pipelined_compiled_steps_update_the_pool_in_place():
    """Steps queued with mx.async_eval before the previous one finished (the engine's
    pipelined loop) must not copy the pool: given pool arrays still pending from the
    previous step, a compiled step used to copy every layer's K and V (peak memory up by
    whole pools, tens of ms per step on a large pool)."""
    model = tiny_model("llama", seed=1)
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=40000))
    pool_bytes = ex.pool.k[0].nbytes  # ~20 MB per layer's K (or V)
    cids = [f"s{i}" for i in range(4)]
    ex.run([SeqWork(c, [1, 2, 3, 4, 5]) for c in cids])
    tokens = mx.zeros((4,), mx.int32)
    mx.eval(tokens)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    for _ in range(40):
        logits, state = ex.forward([SeqWork(c, [0], prev_row=i) for i, c in enumerate(cids)], tokens)
        tokens = mx.argmax(logits, -1).astype(mx.int32)
        mx.async_eval(tokens, *state)
    mx.eval(tokens, state)
    assert ex.compiled_decode
    assert mx.get_peak_memory() - base < pool_bytes / 2, "a pipelined compiled step copied a pool"


# ------------------------------------------------------------ packed [T] tokens (Model.packed_tokens)
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("compiled", [False, True])
def test_packed_tokens_equal_a_batch_of_one_row(family_model, family, compiled):
    """Paged passes give the model its packed tokens as [T]; the [1, T] form must give the
    same logits (prefill chunks and decodes mixed, then decode passes)."""
    model = family_model(family)
    assert model.packed_tokens
    prompts = prompts_for(model, [5, 9, 1], seed=21)
    outs = {}
    for packed in (True, False):
        ex = LlmExecutor(model, paged(compiled))
        ex.runner._packed_tokens = packed
        got = [np.asarray(x) for x in ex.run([SeqWork(f"s{i}", p) for i, p in enumerate(prompts)])]
        for step in range(3):
            got += [np.asarray(x) for x in ex.run([SeqWork(f"s{i}", [(7 * step + i) % 50 + 3]) for i in range(3)])]
        outs[packed] = got
    for a, b in zip(outs[True], outs[False]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_a_packed_decode_step_has_no_flatten_around_its_projections(family_model):
    import re
    import tempfile

    model = family_model("llama")
    ex = LlmExecutor(model, paged(True))
    ex.run([SeqWork("a", [1, 2, 3]), SeqWork("b", [4, 5])])
    logits, state = ex.forward([SeqWork("a", [6]), SeqWork("b", [7])])
    with tempfile.TemporaryDirectory() as d:
        mx.export_to_dot(f"{d}/step.dot", logits, *state)
        labels = re.findall(r'label ="([^"]*)", shape=rectangle', open(f"{d}/step.dot").read())
    assert "Matmul" in labels or any("Compiled" in x for x in labels)
    # a [1, T, dim] activation costs a Flatten and an Unflatten around every matmul
    assert "Flatten" not in labels and "Unflatten" not in labels, sorted(set(labels))


def test_rope_attention_refuses_packed_input_without_a_paged_pass():
    from mlx_ferrum.layers.attention import rope_attention
    from mlx_ferrum.layers.rope import Rope

    q = mx.zeros((3, 2, 8))
    with pytest.raises(ValueError, match="paged"):
        rope_attention(q, q, q, Rope(8, {"rope_theta": 10000.0}), None, 0, 1.0)
