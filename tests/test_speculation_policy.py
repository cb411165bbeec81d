"""The speculation policy: when a request drafts, and when it backs off.

The unit tests drive :class:`SpeculationPolicy` step by step; the engine tests count
which requests the proposer is asked for at each step of a real run, so a rule that
the engine stops honouring fails them.
"""

import random

import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.engine.speculative import SpeculationPolicy
from support.tiny_models import tiny_model


def policy(**kw):
    return SpeculationPolicy(RuntimeConfig(speculative="ngram", **kw))


# ---------------------------------------------------------------- unit rules


def test_by_default_only_a_request_running_alone_speculates():
    p = policy()
    assert p.enabled_for_batch(1)
    assert not p.enabled_for_batch(2)
    raised = policy(speculative_disable_by_batch_size=5)
    assert raised.enabled_for_batch(4) and not raised.enabled_for_batch(5)


def test_a_request_alone_that_finds_nothing_proposes_again_next_step():
    p = policy()
    for step in range(10, 20):
        p.record("a", 0, 0, step, num_running=1)
        assert p.wants("a", step + 1)


def test_beside_other_requests_finding_nothing_backs_off_at_most_two_steps():
    p = policy(speculative_disable_by_batch_size=8)
    p.record("a", 0, 0, 10, num_running=3)
    assert not p.wants("a", 11) and p.wants("a", 12)  # 1 step
    p.record("a", 0, 0, 12, num_running=3)
    assert not p.wants("a", 14) and p.wants("a", 15)  # 2 steps
    p.record("a", 0, 0, 15, num_running=3)
    assert not p.wants("a", 17) and p.wants("a", 18)  # still 2: the cap
    assert p.wants("b", 11), "another request's record was touched"


def test_poorly_accepted_drafts_back_off_exponentially_and_a_good_one_clears_it():
    p = policy()
    step, skips = 0, []
    for _ in range(10):
        p.record("a", 4, 0, step)
        nxt = step + 1
        while not p.wants("a", nxt):
            nxt += 1
        skips.append(nxt - step - 1)
        step = nxt
    # the moving average starts at 1: 0.5, 0.25 stay above 0.2, then 1, 2, 4 ... 64
    assert skips == [0, 0, 1, 2, 4, 8, 16, 32, 64, 64]
    for _ in range(3):  # well-accepted drafts lift the average over the threshold
        p.record("a", 4, 4, step)
    assert p.wants("a", step + 1)


def test_min_acceptance_zero_never_backs_off():
    p = policy(speculative_min_acceptance=0.0)
    for step in range(20):
        p.record("a", 4, 0, step, num_running=4)
        p.record("b", 0, 0, step, num_running=4)
        assert p.wants("a", step + 1) and p.wants("b", step + 1)


# ---------------------------------------------------------------- in the engine


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def proposals_per_step(engine):
    """Wrap the engine's proposer; returns two lists filled per call: the ``(request id,
    step)`` pairs it is asked for, and the requests in the engine at that moment."""
    asked, running = [], []
    real = engine._proposer.propose

    def propose(requests):
        asked.append({(r.request_id, engine.num_steps) for r in requests})
        running.append(len(engine.scheduler.running) + len(engine.scheduler.waiting))
        return real(requests)

    engine._proposer.propose = propose
    return asked, running


def never_repeating_prompt(n, seed):
    r = random.Random(seed)
    return r.sample(range(3, 97), n)


@pytest.mark.parametrize("pipelined", [True, False])
def test_a_request_alone_asks_for_a_draft_at_every_decode_step(model, pipelined):
    """With nothing to match the proposer finds no draft, and a request running alone
    still asks for one at every step (its synchronous step costs it nothing)."""
    eng = Engine(model, None, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64,
                                            speculative="ngram", async_scheduling=pipelined))
    asked, _ = proposals_per_step(eng)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    rid = eng.add_request(never_repeating_prompt(20, seed=1), params)
    while eng.has_unfinished_requests():
        eng.step()
    steps = sorted(step for s in asked for r, step in s if r == rid)
    # every step after the prefill (which samples the first token) proposes, until the
    # last token, which has no room for a draft
    assert steps == list(range(1, 11))
    assert eng.stats()["spec_num_drafts"] == 0


def test_two_requests_do_not_speculate_by_default(model):
    eng = Engine(model, None, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64,
                                            speculative="ngram"))
    _, running = proposals_per_step(eng)
    unit = [5, 6, 7, 8]
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 30)]
    eng.generate([unit * 6, unit * 5], params)
    # (pipelined, two requests never ask in the same step: one's token is always in flight)
    assert running and set(running) == {1}, f"asked with {running} requests in the engine"
    # the longer request's last steps ran alone: those do draft
    assert eng.stats()["spec_num_drafts"] > 0


def test_beside_others_a_request_that_finds_nothing_skips_steps(model):
    eng = Engine(model, None, RuntimeConfig(kv_layout="paged", block_size=8, max_num_blocks=64,
                                            speculative="ngram", speculative_disable_by_batch_size=8))
    asked, _ = proposals_per_step(eng)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    ids = [eng.add_request(never_repeating_prompt(20, seed=s), params) for s in (1, 2, 3)]
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats()["spec_num_drafts"] == 0
    for rid in ids:
        steps = sorted(step for s in asked for r, step in s if r == rid)
        assert 0 < len(steps) < 12, f"{rid} asked at steps {steps}: no back-off beside other requests"
