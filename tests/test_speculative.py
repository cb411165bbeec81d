"""Speculative decoding: proposers, exact acceptance, rollback, and the engine in both KV layouts.

References are independent of the code under test: the same engine with speculation
off (greedy must match token for token), the stories260K recordings, a brute-force
n-gram search, and exact next-token distributions computed with numpy from full
forward passes (for the chi-square test of the sampled path).
"""

import math
import os
import random
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum import load
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.engine.speculative import (
    DraftModelProposer,
    NgramIndex,
    NgramProposer,
    SpeculativeRequest,
    ngram_propose,
)
from mlx_ferrum.errors import ConfigurationError, SamplingParamsError
from mlx_ferrum.executor import LlmExecutor, PrefillInput
from support.tiny_models import tiny_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LAYOUTS = ["paged", "contiguous"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


@pytest.fixture(scope="module")
def random_draft():
    return tiny_model("llama", seed=99)


def config(layout, **kw):
    # these tests exercise the mechanics of drafting and verifying: every eligible row
    # speculates every step (the policy that turns it off is tested on its own)
    base = dict(kv_layout=layout, block_size=8, max_num_blocks=512, max_num_seqs=32,
                speculative_disable_by_batch_size=1 << 20, speculative_min_acceptance=0.0)
    base.update(kw)
    return RuntimeConfig(**base)


def spec_stats(engine):
    return {k: v for k, v in engine.stats().items() if k.startswith("spec_")}


def mixed_requests(n, seed, vocab=97):
    """Greedy requests, half with repetitive prompts (so n-gram lookup finds matches),
    some opted out of speculation, some with a repetition penalty or a stop token id."""
    r = random.Random(seed)
    reqs = []
    for i in range(n):
        if i % 2:
            unit = [r.randrange(vocab) for _ in range(r.randint(3, 9))]
            prompt = (unit * 8)[: r.randint(10, 50)]
        else:
            prompt = [r.randrange(vocab) for _ in range(r.randint(1, 40))]
        kw = dict(max_tokens=r.randint(1, 30), temperature=0.0, ignore_eos=True)
        if i % 5 == 3:
            kw["speculative"] = False
        if i % 7 == 2:
            kw["repetition_penalty"] = 1.3
        reqs.append((prompt, SamplingParams(**kw)))
    return reqs


# ---------------------------------------------------------------- proposers


def brute_force_ngram(tokens, k, n_min, n_max):
    for n in range(n_max, n_min - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        starts = [s for s in range(len(tokens) - n) if tokens[s : s + n] == suffix]
        if starts:
            ext = list(tokens)
            pos = starts[-1] + n
            for _ in range(k):
                ext.append(ext[pos])
                pos += 1
            return ext[len(tokens):]
    return []


def test_ngram_matches_a_brute_force_search():
    r = random.Random(0)
    for _ in range(300):
        vocab = r.choice([3, 5, 20])
        tokens = [r.randrange(vocab) for _ in range(r.randint(1, 40))]
        k, lo = r.randint(1, 6), r.randint(1, 3)
        hi = lo + r.randint(0, 3)
        assert ngram_propose(tokens, k, lo, hi) == brute_force_ngram(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_the_incremental_index_proposes_what_a_full_scan_does():
    """``NgramIndex`` reads only the tokens added since its last call; its proposals must
    equal ``ngram_propose`` over the whole list after every growth, and a list that is not
    an extension of the indexed one (shorter, or a changed tail) is indexed anew."""
    r = random.Random(1)
    for _ in range(60):
        vocab = r.choice([3, 5, 20])
        lo = r.randint(1, 3)
        hi = lo + r.randint(0, 3)
        index = NgramIndex(lo, hi)
        tokens = [r.randrange(vocab) for _ in range(r.randint(1, 5))]
        for _ in range(25):
            k = r.randint(1, 6)
            assert index.propose(tokens, k) == ngram_propose(tokens, k, lo, hi), (tokens, k, lo, hi)
            roll = r.random()
            if roll < 0.1:
                tokens = tokens[: r.randint(1, len(tokens))]  # shorter: rebuilt
            elif roll < 0.2:
                tokens = tokens[:-1] + [(tokens[-1] + 1) % vocab]  # a changed tail: rebuilt
            else:
                tokens = tokens + [r.randrange(vocab) for _ in range(r.randint(1, 5))]


def test_the_ngram_proposer_keeps_one_index_per_request_until_released():
    proposer = NgramProposer(2, 3)
    a, b = [1, 2, 3, 1, 2], [7, 8, 9, 7, 8]
    got = proposer.propose([SpeculativeRequest("a", a, 2, None), SpeculativeRequest("b", b, 2, None)])
    assert [p.token_ids for p in got] == [[3, 1], [9, 7]]
    assert set(proposer._indexes) == {"a", "b"}
    proposer.release("a")
    proposer.release("a")
    assert set(proposer._indexes) == {"b"}


def test_config_fields_environment_and_errors(monkeypatch):
    monkeypatch.setenv("FERRUM_SPECULATIVE", "ngram")
    monkeypatch.setenv("FERRUM_NUM_SPECULATIVE_TOKENS", "7")
    cfg = RuntimeConfig()
    assert cfg.speculative == "ngram" and cfg.num_speculative_tokens == 7
    assert RuntimeConfig(num_speculative_tokens=2).num_speculative_tokens == 2
    monkeypatch.setenv("FERRUM_SPECULATIVE", "0")
    assert RuntimeConfig().speculative is None
    monkeypatch.delenv("FERRUM_SPECULATIVE")
    monkeypatch.delenv("FERRUM_NUM_SPECULATIVE_TOKENS")
    assert RuntimeConfig().speculative is None and RuntimeConfig().num_speculative_tokens == 4
    monkeypatch.setenv("FERRUM_NUM_SPECULATIVE_TOKENS", "x")
    with pytest.raises(ConfigurationError, match="FERRUM_NUM_SPECULATIVE_TOKENS"):
        RuntimeConfig()
    monkeypatch.delenv("FERRUM_NUM_SPECULATIVE_TOKENS")
    with pytest.raises(ConfigurationError, match="prompt_lookup_min"):
        RuntimeConfig(prompt_lookup_min=5, prompt_lookup_max=2)
    with pytest.raises(ConfigurationError, match="num_speculative_tokens"):
        RuntimeConfig(num_speculative_tokens=0)
    with pytest.raises(SamplingParamsError, match="speculative"):
        SamplingParams(speculative="yes")


def test_draft_with_another_vocabulary_is_refused(model):
    other = tiny_model("llama", seed=1, vocab_size=50)
    with pytest.raises(ConfigurationError, match="vocabulary"):
        Engine(model, None, config("paged"), proposer=DraftModelProposer(other, config("paged"), 97))


# ------------------------------------------------------------ greedy identity


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("proposer", ["ngram", "draft", "random_draft"])
def test_greedy_batched_output_is_identical_with_and_without_speculation(model, random_draft, layout, proposer):
    reqs = mixed_requests(14, seed=21)
    prompts, params = [p for p, _ in reqs], [sp for _, sp in reqs]
    ref = Engine(model, None, config(layout)).generate(prompts, params)
    cfg = config(layout, speculative="ngram", prompt_lookup_min=1, num_speculative_tokens=3)
    prop = None
    if proposer == "draft":
        prop = DraftModelProposer(model, cfg, 97)
    elif proposer == "random_draft":
        prop = DraftModelProposer(random_draft, cfg, 97)
    eng = Engine(model, None, cfg, proposer=prop)
    outs = eng.generate(prompts, params)
    for r, o, sp in zip(ref, outs, params):
        assert o.token_ids == r.token_ids and o.finish_reason == r.finish_reason
    st = spec_stats(eng)
    assert st["spec_proposed_tokens"] > 0, "nothing was speculated: the test is too easy"
    if proposer == "draft":  # the draft is the target: every proposal is the target's argmax
        assert st["spec_acceptance_rate"] == 1.0
        assert st["spec_mean_accepted_length"] > 2.0
    if proposer == "random_draft":  # an unrelated random model almost never agrees
        assert st["spec_acceptance_rate"] < 0.2
    if proposer == "ngram":
        assert 0 < st["spec_accepted_tokens"] < st["spec_proposed_tokens"]
    if layout == "paged":
        mgr = eng.block_manager
        mgr.check_invariants()
        assert mgr.num_free == mgr.num_blocks and not mgr.seqs
        if prop is not None:
            dm = prop.runner.manager
            dm.check_invariants()
            assert dm.num_free == dm.num_blocks and not dm.seqs


def test_opted_out_requests_are_not_verified(model):
    prompt = [5, 6, 7, 8] * 6
    eng = Engine(model, None, config("paged", speculative="ngram"))
    eng.generate([prompt], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, speculative=False))
    assert spec_stats(eng)["spec_num_drafts"] == 0 and eng.num_steps == 20


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stop_token_and_max_tokens_cut_an_accepted_run_short(model, layout):
    prompt = [11, 12, 13, 14, 15] * 6
    full = Engine(model, None, config(layout)).generate(
        [prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0].token_ids
    cfg = config(layout, speculative="ngram", num_speculative_tokens=6, prompt_lookup_min=1)
    for cut in (3, 7, 12):
        eng = Engine(model, None, cfg, proposer=DraftModelProposer(model, cfg, 97))
        stop_tok = full[cut]
        first = full.index(stop_tok)
        out = eng.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_tok]))[0]
        assert out.token_ids == full[: first + 1] and out.finish_reason == "stop"
        eng = Engine(model, None, cfg, proposer=DraftModelProposer(model, cfg, 97))
        out = eng.generate([prompt], SamplingParams(max_tokens=cut, temperature=0.0, ignore_eos=True))[0]
        assert out.token_ids == full[:cut] and out.finish_reason == "length"


def test_no_block_leaks_after_many_rejections_under_kv_pressure(model, random_draft):
    r = random.Random(4)
    reqs = [([r.randrange(97) for _ in range(r.randint(5, 40))],
             SamplingParams(max_tokens=r.randint(5, 30), temperature=r.choice([0.0, 1.0]), seed=i, ignore_eos=True))
            for i in range(40)]
    cfg = config("paged", max_num_blocks=40, max_num_seqs=12, num_speculative_tokens=4, speculative="ngram")
    prop = DraftModelProposer(random_draft, cfg, 97)
    eng = Engine(model, None, cfg, proposer=prop)
    ids = [eng.add_request(p, sp) for p, sp in reqs]
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        eng.block_manager.check_invariants()
        prop.runner.manager.check_invariants()
    st = eng.stats()
    assert st["spec_proposed_tokens"] - st["spec_accepted_tokens"] > 200, "too few rejections"
    assert st["num_preemptions"] > 0, "the pool was never under pressure"
    assert all(done[i].finish_reason == "length" for i in ids)
    for m in (eng.block_manager, prop.runner.manager):
        assert m.num_free == m.num_blocks and not m.seqs


# --------------------------------------------------------- sampling is exact

VOCAB = 8


def chi2_critical(df, z=3.29):
    """Upper chi-square quantile by the Wilson-Hilferty approximation (z = 3.29: alpha ~ 5e-4)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def exact_marginals(model, prompt, temperature, top_k, steps):
    """P(generated token j) for j < steps, by enumerating every prefix (numpy, full forward passes)."""
    ex = LlmExecutor(model, RuntimeConfig(kv_layout="contiguous"))

    def next_probs(ids):
        out = ex.prefill(PrefillInput(input_ids=mx.array([ids])))
        ex.release_cache(out.kv_cache.cache_id)
        x = np.array(out.logits[0, -1].astype(mx.float32), dtype=np.float64) / temperature
        if top_k:
            x[x < np.sort(x)[-top_k]] = -np.inf
        e = np.exp(x - x.max())
        return e / e.sum()

    marginals = [np.zeros(VOCAB) for _ in range(steps)]

    def walk(ids, weight, j):
        p = next_probs(ids)
        marginals[j] += weight * p
        if j + 1 < steps:
            for t in range(VOCAB):
                if p[t] > 0:
                    walk(ids + [t], weight * p[t], j + 1)

    walk(list(prompt), 1.0, 0)
    return marginals


@pytest.mark.parametrize("proposer,temperature,top_k", [("ngram", 2.5, 0), ("ngram", 1.5, 4), ("draft", 2.5, 0)])
def test_sampled_tokens_follow_the_target_distribution(proposer, temperature, top_k):
    target = tiny_model("llama", seed=5, vocab_size=VOCAB, scale=1.0)
    draft = tiny_model("llama", seed=6, vocab_size=VOCAB, scale=1.0)
    # a prompt that ends in the target's own greedy path, so n-gram proposals are often
    # (not always) accepted at these temperatures
    greedy = Engine(target, None, config("paged")).generate(
        [[1, 2, 3]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids
    prompt = [1, 2, 3] + greedy
    n = 1500
    cfg = config("paged", speculative="ngram", prompt_lookup_min=1, num_speculative_tokens=3, max_num_seqs=256,
                 max_num_batched_tokens=4096, max_num_blocks=4096)
    prop = DraftModelProposer(draft, cfg, VOCAB) if proposer == "draft" else None
    eng = Engine(target, None, cfg, proposer=prop)
    params = [SamplingParams(max_tokens=3, temperature=temperature, top_k=top_k, seed=s, ignore_eos=True)
              for s in range(n)]
    outs = eng.generate([prompt] * n, params)
    st = spec_stats(eng)
    # the second token of most requests came through verification (accepted proposal or
    # residual draw; the rest found no n-gram match); the third is the bonus draw after
    # an acceptance, or a plain step
    assert st["spec_num_drafts"] > 0.6 * n
    rejected = st["spec_num_drafts"] - st["spec_accepted_tokens"]  # one proposal each (max_tokens=3)
    assert st["spec_accepted_tokens"] > 0.05 * n and rejected > 0.05 * n, "acceptance and rejection must both occur"
    for j, exact in enumerate(exact_marginals(target, prompt, temperature, top_k, 3)[1:], start=1):
        check_chi_square(np.bincount([o.token_ids[j] for o in outs], minlength=VOCAB), n * exact)


def check_chi_square(counts, expected):
    keep = expected > 5  # pool the rare cells, as the chi-square approximation needs
    obs = np.append(counts[keep], counts[~keep].sum())
    exp = np.append(expected[keep], expected[~keep].sum())
    obs, exp = (obs, exp) if exp[-1] > 0 else (obs[:-1], exp[:-1])
    assert counts[expected == 0].sum() == 0, "a token outside top-k was emitted"
    stat = float(((obs - exp) ** 2 / exp).sum())
    assert stat < chi2_critical(len(obs) - 1), f"chi-square {stat:.1f}: counts {counts}, expected {expected.round(1)}"



# ------------------------------------------------------------- stories260K


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stories260k_reproduces_its_recording_under_ngram_speculation(stories_path, stories_expected, layout):
    model, tokenizer = load(str(stories_path))
    eng = Engine(model, tokenizer, config(layout, speculative="ngram"))
    rec = stories_expected["once"]
    out = eng.generate([rec["prompt_ids"]], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == rec["generated_ids"]
    assert out.text == rec["completion_text"]
    st = spec_stats(eng)
    assert st["spec_accepted_tokens"] > 0 and eng.num_steps < 200
    # a stop string inside an accepted run ends the text where it ends without speculation
    stop = rec["completion_text"][150:158]
    ref = Engine(model, tokenizer, config(layout)).generate(
        [rec["prompt_ids"]], SamplingParams(max_tokens=200, temperature=0.0, stop=[stop]))[0]
    out = Engine(model, tokenizer, config(layout, speculative="ngram")).generate(
        [rec["prompt_ids"]], SamplingParams(max_tokens=200, temperature=0.0, stop=[stop]))[0]
    text = rec["completion_text"]
    assert out.text == ref.text == text[: text.find(stop)] and out.finish_reason == "stop"


def test_cli_generate_with_ngram_speculation_prints_the_recording(stories_path, stories_expected):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "mlx_ferrum", "generate", "--model", str(stories_path), "--prompt",
                        "Once upon a time", "--max-tokens", "200", "--temp", "0", "--speculative", "ngram",
                        "--num-speculative-tokens", "3"], capture_output=True, text=True, env=env, timeout=300,
                       cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout == stories_expected["once"]["completion_text"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stories260k_as_its_own_draft_checkpoint_accepts_everything(stories_path, stories_expected, layout):
    model, tokenizer = load(str(stories_path))
    eng = Engine(model, tokenizer, config(layout, speculative=str(stories_path), num_speculative_tokens=5))
    rec = stories_expected["once"]
    out = eng.generate([rec["prompt_ids"]], SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True))[0]
    assert out.token_ids == rec["generated_ids"]
    st = spec_stats(eng)
    assert st["spec_acceptance_rate"] == 1.0 and st["spec_mean_accepted_length"] > 5.0
    assert eng.num_steps <= 1 + -(-199 // 6)  # the prefill, then 6 tokens per verification


def test_logprobs_of_verified_tokens_match_plain_decoding(model):
    prompt = [21, 22, 23, 24, 25, 26] * 5
    sp = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=3)
    ref = Engine(model, None, config("paged")).generate([prompt], sp)[0]
    eng = Engine(model, None, config("paged", speculative="ngram", prompt_lookup_min=1))
    out = eng.generate([prompt], sp)[0]
    assert spec_stats(eng)["spec_accepted_tokens"] > 0
    assert out.token_ids == ref.token_ids
    np.testing.assert_allclose(out.logprobs, ref.logprobs, atol=1e-4)
    for a, b in zip(out.top_logprobs, ref.top_logprobs):
        assert list(a) == list(b)
        np.testing.assert_allclose(list(a.values()), list(b.values()), atol=1e-4)


def test_cli_chat_with_ngram_speculation(stories_path, stories_expected):
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-m", "mlx_ferrum", "chat", "--model", str(stories_path), "--temp", "0",
                        "--max-tokens", "40", "--speculative", "ngram"], capture_output=True, text=True, env=env,
                       input="Once upon a time\n/exit\n", timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    # no chat template: the reply continues the plain text, as the recording does
    assert stories_expected["once"]["completion_text"][:60] in r.stdout


def test_prefix_cache_with_speculation_keeps_outputs_and_blocks_sound(model):
    r = random.Random(8)
    shared = [r.randrange(97) for _ in range(6)] * 6
    reqs = [(shared + [r.randrange(97) for _ in range(r.randint(0, 12))],
             SamplingParams(max_tokens=r.randint(5, 30), temperature=0.0, ignore_eos=True)) for _ in range(10)]
    prompts, params = [p for p, _ in reqs], [sp for _, sp in reqs]
    ref = Engine(model, None, config("paged")).generate(prompts, params)
    eng = Engine(model, None, config("paged", prefix_cache=True, speculative="ngram", prompt_lookup_min=1))
    for _ in range(2):  # the second round hits blocks written (and partly rolled back) by the first
        outs = eng.generate(prompts, params)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        eng.block_manager.check_invariants()
    st = eng.stats()
    assert st["spec_accepted_tokens"] < st["spec_proposed_tokens"] and st["prefix_cache_hit_rate"] > 0
    assert not eng.block_manager.seqs


@pytest.mark.slow
def test_benchmark_quick_mode(stories_path):
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_speculative.py"), "--quick"],
                       capture_output=True, text=True, timeout=600, cwd=REPO,
                       env=dict(os.environ, PYTHONPATH=REPO, FERRUM_SHARED_MODELS=str(stories_path.parent)))
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "| quote" in r.stdout and "tok/fwd on" in r.stdout


@pytest.mark.parametrize("layout", LAYOUTS)
def test_presence_and_frequency_penalties_are_applied_when_verifying(model, layout):
    """Greedy rows with presence/frequency penalties: the verifier must penalise each
    proposed position by the tokens generated before it, exactly as sample() would."""
    r = random.Random(5)
    prompts, params = [], []
    for i in range(6):
        unit = [r.randrange(97) for _ in range(r.randint(2, 5))]
        prompts.append((unit * 10)[:30])
        params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                     presence_penalty=0.8 if i % 2 else 0.0, frequency_penalty=0.6))
    ref = Engine(model, None, config(layout)).generate(prompts, params)
    eng = Engine(model, None, config(layout, speculative="ngram", prompt_lookup_min=1, num_speculative_tokens=3))
    outs = eng.generate(prompts, params)
    assert spec_stats(eng)["spec_proposed_tokens"] > 0
    for ref_out, out in zip(ref, outs):
        assert out.token_ids == ref_out.token_ids


def test_a_draft_row_is_laid_out_as_decode_rows_with_causal_context_lengths():
    """PagedPassBuilder.passes(as_decode=...) turns an n-token row into n one-query rows over
    the same block table, row j attending to the cache up to its own token."""
    from mlx_ferrum.kv_cache import LayerGroupKvManager, PagedKvPool
    from mlx_ferrum.kv_cache.block_tables import BatchBlocks, append_row
    from mlx_ferrum.kv_cache.store import PagedKvStore
    from mlx_ferrum.runner.inputs import PagedPassBuilder

    mgr = LayerGroupKvManager(32, 4, 16)
    store = PagedKvStore(mgr, PagedKvPool(1, 32, 1, 4, 8, mx.float32), bytes_per_token=64)

    def prepare(items, **kw):  # the slots come from the blocks' owner, as the scheduler's do
        blocks = BatchBlocks()
        for cid, tokens in items:
            append_row(mgr, blocks, cid, len(tokens))
        store.prepare([cid for cid, _ in items], blocks)
        return PagedPassBuilder(store).passes(items, blocks=blocks, **kw), None

    prepare([("a", list(range(6))), ("b", [1, 2, 3])])
    passes, _ = prepare([("a", [7, 8, 9]), ("b", [4]), ("c", [5, 6, 7, 8, 9])], as_decode=[True, False, False])
    f = passes[0].inputs
    # decode rows first: a's three tokens (expanded) and b's one, then c's prefill segment
    assert [passes[0].items[k] for k in range(3)] == [0, 1, 2]
    assert f.num_decode_seqs == 4
    assert f.context_lens.tolist() == [7, 8, 9, 4, 5]
    assert f.positions.tolist()[:4] == [6, 7, 8, 3]
    assert f.query_start_loc.tolist() == [0, 1, 2, 3, 4, 9]
    table_a = mgr.block_table("a")
    assert [row[: len(table_a)].tolist() for row in f.block_tables[0][:3]] == [table_a] * 3


@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_drafts_run_through_the_compiled_decode_step_with_the_same_tokens(model, layout):
    """A batch whose rows all carry drafts is a decode pass: the paged runner runs it through
    the compiled step (spied), and the tokens equal the eager run's and plain decoding's."""
    r = random.Random(9)
    story = [r.randrange(97) for _ in range(12)]
    prompts = [story * 3 for _ in range(3)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        cfg = config(layout, speculative="ngram", enforce_eager=eager)
        eng = Engine(model, None, cfg)
        calls = []
        if layout == "paged" and not eager:
            real = eng.runner._decode_pass

            def spy(work, kv_pass, prev, real=real):
                calls.append(sum(len(work[i].tokens) for i in kv_pass.items) - len(kv_pass.items))
                return real(work, kv_pass, prev)

            eng.runner._decode_pass = spy
        outs[eager] = [o.token_ids for o in eng.generate(prompts, params)]
        assert eng.stats()["spec_accepted_tokens"] > 0
        if layout == "paged" and not eager:
            assert any(extra > 0 for extra in calls), "no drafted pass went through the compiled step"
    plain = [o.token_ids for o in Engine(model, None, config(layout)).generate(prompts, params)]
    assert outs[False] == outs[True] == plain
