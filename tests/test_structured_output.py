"""Structured output in the engine (llguidance masks applied in ``sample()``).

Checked on stories260K at temperature 1 (a model that knows nothing of JSON, so every
valid output is the grammar's doing) in every engine mode: the outputs satisfy their
constraint (``jsonschema`` / ``re.fullmatch`` / a fresh llguidance matcher, the library's
own reference), unconstrained neighbours stay byte-identical to their solo runs, a
constraint that cannot finish within ``max_tokens`` ends with ``"length"``, and a
constraint that does not compile is a :class:`StructuredOutputError` at admission.
"""

import json
import re
import time

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.engine.sampling import SamplerState, sample
from mlx_ferrum.engine.structured import StructuredOutputsParams, apply_token_bitmask
from mlx_ferrum.errors import SamplingParamsError, StructuredOutputError

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")
from llguidance.numpy import apply_token_bitmask_inplace  # noqa: E402

MODES = {
    "pipelined-paged": dict(kv_layout="paged", async_scheduling=True),
    "synchronous-paged": dict(kv_layout="paged", async_scheduling=False),
    "eager-paged": dict(kv_layout="paged", async_scheduling=True, enforce_eager=True),
    "contiguous": dict(kv_layout="contiguous", async_scheduling=True),
    "speculative-ngram": dict(kv_layout="paged", async_scheduling=True, speculative="ngram",
                              speculative_disable_by_batch_size=1 << 20),
    "prefix-cache": dict(kv_layout="paged", async_scheduling=True, prefix_cache=True),
}
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def stories(stories_path):
    from mlx_ferrum import load

    return load(str(stories_path))


def _engine(stories, mode, **kw):
    model, tok = stories
    return Engine(model, tok, RuntimeConfig(block_size=8, max_num_blocks=512, max_num_seqs=16, **{**MODES[mode], **kw}))


def _json_params(seed, max_tokens=160, schema=SCHEMA, **kw):
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens,
                          structured_outputs=StructuredOutputsParams(json=schema), **kw)


def test_bitmask_application_matches_llguidance_reference():
    rng = np.random.default_rng(0)
    for vocab in (5, 32, 97, 512, 1000):
        logits = rng.standard_normal((4, vocab)).astype(np.float32)
        mask = rng.integers(-2**31, 2**31, size=(4, (vocab + 31) // 32), dtype=np.int64).astype(np.int32)
        mask[1] = -1  # an unconstrained row
        want = logits.copy()
        apply_token_bitmask_inplace(want, mask)
        got = np.array(apply_token_bitmask(mx.array(logits), mx.array(mask)))
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(got[1], logits[1])  # bit for bit


def test_sample_with_a_mask_only_picks_allowed_tokens():
    logits = mx.random.normal((3, 64), key=mx.random.key(1))
    mask = np.zeros((3, 2), dtype=np.int32)
    mask[0, 0] = 1 << 5
    mask[1, 1] = (1 << 3) | (1 << 7)
    mask[2] = -1
    states = [SamplerState.create(SamplingParams(temperature=1.0, seed=s)) for s in range(3)]
    free = [SamplerState.create(SamplingParams(temperature=1.0, seed=s)) for s in range(3)]
    for _ in range(20):
        toks = sample(logits, states, allowed=mx.array(mask)).tokens.tolist()
        ref = sample(logits, free).tokens.tolist()
        assert toks[0] == 5 and toks[1] in (35, 39) and toks[2] == ref[2]


@pytest.mark.parametrize("mode", list(MODES))
def test_json_schema_outputs_validate_beside_unconstrained_rows(stories, mode):
    model, tok = stories
    eng = _engine(stories, mode)
    prompts = ["Once upon a time", "Lily and Tom", "The dog", "A big red ball", "One day"]
    free = SamplingParams(temperature=0.0, max_tokens=24)
    solo = [eng.generate([p], free)[0] for p in prompts[:2]]
    params = [free, free] + [_json_params(seed) for seed in range(3)]
    outs = eng.generate(prompts, params)
    assert [o.token_ids for o in outs[:2]] == [o.token_ids for o in solo]  # byte-identical neighbours
    assert [o.text for o in outs[:2]] == [o.text for o in solo]
    for o in outs[2:]:
        assert o.finish_reason == "stop", (o.finish_reason, o.text)
        jsonschema.validate(json.loads(o.text), SCHEMA)
        # the library's own matcher accepts the whole output and is complete after it
        ref = llguidance.LLMatcher(eng.grammar_backend().lltokenizer,
                                   StructuredOutputsParams(json=SCHEMA).llguidance_grammar(), log_level=0)
        ids = [t for t in o.token_ids if t not in tok.eos_token_ids]
        assert ref.consume_tokens(ids) and ref.is_accepting()


@pytest.mark.parametrize("mode", ["pipelined-paged", "synchronous-paged", "speculative-ngram"])
def test_regex_choice_and_lark_grammars(stories, mode):
    eng = _engine(stories, mode)
    lark = 'start: "Hi " NAME "!"\nNAME: /[A-Z][a-z]{1,6}/'
    specs = [StructuredOutputsParams(regex=r"(ab|cd){2,4}x"), StructuredOutputsParams(choice=["yes", "no", "maybe"]),
             StructuredOutputsParams(grammar=lark), StructuredOutputsParams(json_object=True)]
    outs = eng.generate(["Lily"] * 4, [SamplingParams(temperature=1.0, seed=7, max_tokens=64, structured_outputs=s,
                                                       repetition_penalty=1.3) for s in specs])
    assert re.fullmatch(r"(ab|cd){2,4}x", outs[0].text), outs[0].text
    assert outs[1].text in ("yes", "no", "maybe")
    assert re.fullmatch(r"Hi [A-Z][a-z]{1,6}!", outs[2].text), outs[2].text
    assert all(o.finish_reason == "stop" for o in outs[:3])
    if outs[3].finish_reason == "stop":
        assert isinstance(json.loads(outs[3].text), dict)


def test_a_constraint_longer_than_max_tokens_ends_with_length(stories):
    eng = _engine(stories, "pipelined-paged")
    out = eng.generate(["Lily"], SamplingParams(temperature=1.0, seed=3, max_tokens=5,
                                                structured_outputs=StructuredOutputsParams(regex="a{40}")))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 5 and set(out.text) <= {"a"}
    # counted (the server's /metrics shows it): a cut constrained reply does not parse
    assert eng.stats()["structured_length_finishes"] == 1
    eng.generate(["Lily"], SamplingParams(temperature=1.0, seed=3, max_tokens=5, ignore_eos=True))  # unconstrained
    done = eng.generate(["Lily"], SamplingParams(temperature=1.0, seed=3, max_tokens=50,
                                                 structured_outputs=StructuredOutputsParams(choice=["yes", "no"])))[0]
    assert done.finish_reason == "stop" and eng.stats()["structured_length_finishes"] == 1


def _byte_ids(tok, text):
    """``text`` as byte-fallback tokens (one per UTF-8 byte): what the grammar allows of a
    text, apart from how the tokenizer would split it."""
    return [tok.backend.token_to_id(f"<0x{b:02X}>") for b in text.encode()]


def _allows(matcher, tok, text):
    ids = _byte_ids(tok, text)
    m = matcher.matcher.deep_copy()
    if m.validate_tokens(ids) != len(ids):
        return False
    for t in ids:
        assert m.consume_token(t)
    return m.is_accepting()


def test_json_object_is_bounded_where_a_value_could_not_mean_more(stories):
    """json_object: strings of at most 1024 characters, nesting at most 16 deep, numbers of
    at most 17 digits each side of the point (a float64's worth) and 3 of exponent."""
    from mlx_ferrum.engine.structured import JSON_OBJECT_MAX_DEPTH, JSON_OBJECT_MAX_STRING, GrammarBackend

    _, tok = stories
    backend = GrammarBackend(tok, 512)
    m = backend.matcher(StructuredOutputsParams(json_object=True))
    assert JSON_OBJECT_MAX_STRING == 1024 and JSON_OBJECT_MAX_DEPTH == 16
    for text, ok in [
        ('{"a":[1,-2.5e10,true,null,{"b":"\\u00e9\\n"}],"c":"é"}', True),
        ('{"k":"' + "a" * 1024 + '"}', True),
        ('{"k":"' + "a" * 1025 + '"}', False),
        ('{"' + "k" * 1025 + '":1}', False),
        ('{"n":0.00800000000000000}', True),  # 17 digits after the point
        ('{"n":0.008000000000000000}', False),  # 18
        ('{"n":12345678901234567}', True),
        ('{"n":123456789012345678}', False),
        ('{"n":1e308}', True),
        ('{"n":1e3080}', False),
        ('{"n":01}', False),
        ("{" + '"a":{' * 15 + "}" * 15 + "}", True),  # depth 16
        ("{" + '"a":{' * 16 + "}" * 16 + "}", False),  # depth 17
        ('{"a":' + "[" * 15 + "]" * 15 + "}", True),
        ('{"a":' + "[" * 16 + "]" * 16 + "}", False),
        ("[1]", False),
        ('{"a": 1}', False),  # compact: no free whitespace
    ]:
        assert _allows(m, tok, text) is ok, text
        for string in [v for v in [text] if ok]:
            json.loads(string)


def test_a_grammar_in_its_error_state_is_refused_the_same_fresh_or_cached(stories):
    """A schema with no finite instance puts the grammar in its error state at its first
    mask: refused at admission with the same message on every try (the first compiles it,
    the later ones copy the cached grammar), never a finished empty reply."""
    eng = _engine(stories, "pipelined-paged")
    messages = []
    for _ in range(3):
        with pytest.raises(StructuredOutputError) as e:
            eng.add_request("Lily", _json_params(0, schema={"$ref": "#"}))
        messages.append(str(e.value))
    assert len(set(messages)) == 1 and "json_schema constraint" in messages[0] and "\n" not in messages[0]
    assert not eng.has_unfinished_requests()
    # a grammar whose state turns to an error while generating ends its request with "error"
    from mlx_ferrum.engine.structured import GrammarMatcher

    spec = StructuredOutputsParams(regex="a{40}")
    seen = []

    def broken_check(self):
        seen.append(self.kind)
        raise StructuredOutputError("the regex constraint cannot be used: lexer error")

    original = GrammarMatcher.check
    GrammarMatcher.check = broken_check
    try:
        out = eng.generate(["Lily"], SamplingParams(temperature=1.0, seed=1, max_tokens=8, structured_outputs=spec))[0]
    finally:
        GrammarMatcher.check = original
    assert out.finish_reason == "error" and "regex constraint" in out.error and seen == ["regex"]


def test_a_schema_that_does_not_compile_is_refused_quickly(stories):
    eng = _engine(stories, "pipelined-paged")
    start = time.perf_counter()
    with pytest.raises(StructuredOutputError, match="frobnicate"):
        eng.add_request("Lily", _json_params(0, schema={"type": "frobnicate"}))
    with pytest.raises(StructuredOutputError, match="regex"):
        eng.add_request("Lily", SamplingParams(structured_outputs=StructuredOutputsParams(regex="[a-")))
    with pytest.raises(StructuredOutputError):
        eng.add_request("Lily", SamplingParams(structured_outputs=StructuredOutputsParams(grammar="start: undefined_rule")))
    assert time.perf_counter() - start < 5
    assert not eng.has_unfinished_requests()
    # the engine serves on
    assert eng.generate(["Lily"], _json_params(1))[0].finish_reason == "stop"


@pytest.mark.parametrize("grammar", ["", "root ::= (", "%%%"])
def test_a_gbnf_grammar_llguidance_cannot_convert_is_a_structured_output_error(grammar):
    """An empty grammar, or GBNF with a syntax error, is the client's error (it came out of
    llguidance's converter as a bare ValueError: a 500 at the server)."""
    with pytest.raises(StructuredOutputError, match="the grammar cannot be used.*'root' rule"):
        StructuredOutputsParams(grammar=grammar).llguidance_grammar()


def test_structured_outputs_params_are_validated():
    assert issubclass(StructuredOutputError, SamplingParamsError)
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(StructuredOutputError, match="exactly one"):
        StructuredOutputsParams(regex="a", json_object=True)
    with pytest.raises(StructuredOutputError, match="choice"):
        StructuredOutputsParams(choice="abc")
    with pytest.raises(SamplingParamsError, match="structured_outputs"):
        SamplingParams(structured_outputs="json")
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs == StructuredOutputsParams(regex="a+")


def _check_constraint(spec: StructuredOutputsParams, text: str) -> None:
    """The library's own matcher accepts ``text`` in full and is complete after it."""
    from mlx_ferrum.engine.structured import GrammarBackend  # noqa: F401 - llguidance present

    ref = llguidance.LLMatcher(_REF_TOKENIZER[0], spec.llguidance_grammar(), log_level=0)
    assert ref.consume_tokens(_REF_TOKENIZER[1](text)) and ref.is_accepting(), text


_REF_TOKENIZER: list = []


@pytest.fixture(scope="module", autouse=True)
def _reference_tokenizer(stories):
    model, tok = stories
    from mlx_ferrum.engine.structured import GrammarBackend

    backend = GrammarBackend(tok, model.args.vocab_size)
    _REF_TOKENIZER[:] = [backend.lltokenizer, backend.lltokenizer.tokenize_str]
    yield


def _overlap_requests():
    """Constrained rows (seeded, temperature 1, penalties on some) that end at different
    steps, some inside the pipeline's lag, beside unconstrained ones (greedy and seeded)."""
    specs = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(choice=["yes", "no", "maybe"]),
             StructuredOutputsParams(regex=r"[a-z ]{3,40}\."), StructuredOutputsParams(regex=r"(ab|cd){2,4}x"),
             StructuredOutputsParams(choice=["a", "bb"]), StructuredOutputsParams(json_object=True)]
    params = [SamplingParams(temperature=1.0, seed=10 + i, max_tokens=48, structured_outputs=s,
                             repetition_penalty=1.2 if i % 2 else 1.0, presence_penalty=0.3 if i % 3 == 0 else 0.0)
              for i, s in enumerate(specs)]
    params += [SamplingParams(temperature=0.0, max_tokens=20), SamplingParams(temperature=0.9, seed=5, max_tokens=30)]
    prompts = ["Once upon a time", "Lily and Tom", "The dog", "A big red ball", "One day", "Tim", "Sue", "The cat"]
    return prompts, params


def _spy_forward(eng) -> list:
    """Record, per forward pass of ``eng``, whether it was queued while the previous step's
    tokens were still on the device (the executor takes them as ``prev``)."""
    forward, calls = eng.runner.forward, []

    def spy(work, prev, blocks=None):
        calls.append(prev is not None)
        return forward(work, prev, blocks)

    eng.runner.forward = spy
    return calls


@pytest.mark.parametrize("mode,overlap", [("pipelined-paged", True), ("contiguous", True), ("prefix-cache", True),
                                          ("speculative-ngram", True), ("pipelined-paged", False), ("contiguous", False)])
def test_constrained_rows_overlap_and_equal_the_synchronous_step(stories, mode, overlap):
    """With ``overlap_constrained_rows`` the pipelined step builds the forward pass of step
    t+1 before it reads back step t even when every row is constrained (the mask needs the
    token, the pass does not); without it, it waits. Either way the outputs are those of
    the synchronous step, requests ending inside the lag included."""
    prompts, params = _overlap_requests()
    sync = _engine(stories, "synchronous-paged", kv_layout=MODES[mode]["kv_layout"]).generate(prompts, params)
    want = [(o.token_ids, o.text, o.finish_reason) for o in sync]
    assert [o.finish_reason for o in sync[1:4]] == ["stop"] * 3
    # every row must match, except, under speculation, a sampled row: it keeps its
    # distribution, not its draws, and the pipelined step sees a finished neighbour one
    # step later, so the batch-size policy lets it draft at other steps (greedy rows give
    # the same tokens either way); a sampled constrained row must still satisfy its grammar
    exact = [i for i, p in enumerate(params) if "speculative" not in MODES[mode] or p.temperature == 0]

    eng = _engine(stories, mode)
    eng.overlap_constrained_rows = overlap
    piped = eng.generate(prompts, params)
    got = [(o.token_ids, o.text, o.finish_reason) for o in piped]
    assert [got[i] for i in exact] == [want[i] for i in exact]
    for out, p in zip(piped, params):
        if p.structured_outputs is not None and out.finish_reason == "stop":
            _check_constraint(p.structured_outputs, out.text)
    only = _engine(stories, mode)
    only.overlap_constrained_rows = overlap
    calls = _spy_forward(only)
    outs = only.generate(prompts[:6], params[:6])
    assert [(o.token_ids, o.text, o.finish_reason) for o in outs] == want[:6]
    if overlap and "speculative" in MODES[mode]:
        # a row that drafts next step waits for its token (the draft continues it)
        assert any(calls), calls
    elif overlap:  # all rows constrained: most passes are built before the previous step is read back
        assert sum(calls) >= len(calls) // 2, calls
    else:
        assert not any(calls), calls
    mgr = only.block_manager
    if mgr is not None:
        assert mgr.num_in_use == 0 and not mgr.seqs
    assert not only.has_unfinished_requests()


def test_constrained_rows_wait_for_their_token_on_the_cpu_backend(stories):
    """On MLX's CPU backend the overlap measured slower, so it is off there by default."""
    eng = _engine(stories, "pipelined-paged")
    assert eng.overlap_constrained_rows == (mx.default_device().type != mx.DeviceType.cpu)


def test_masks_on_the_calling_thread_equal_the_thread_pools(stories):
    """Few rows are masked on the calling thread, many by llguidance's pool: both give the
    same bits, unconstrained rows all ones."""
    from mlx_ferrum.engine.structured import GrammarBackend

    model, tok = stories
    pooled = GrammarBackend(tok, model.args.vocab_size, parallel_min_rows=1)
    in_turn = GrammarBackend(tok, model.args.vocab_size, parallel_min_rows=1 << 30)
    specs = [StructuredOutputsParams(json=SCHEMA), None, StructuredOutputsParams(regex=r"[a-z ]{3,40}\."),
             StructuredOutputsParams(choice=["yes", "no"])]
    rows = [[b.matcher(s) if s is not None else None for s in specs] for b in (pooled, in_turn)]
    rng = np.random.default_rng(0)
    for _ in range(6):
        want, got = pooled.fill_bitmask(rows[0]), in_turn.fill_bitmask(rows[1])
        np.testing.assert_array_equal(got, want)
        assert (got[1] == -1).all()
        for b, m in enumerate(rows[0]):
            if m is None or m.done:
                continue
            allowed = np.flatnonzero(np.unpackbits(want[b].view(np.uint8), bitorder="little")[:model.args.vocab_size])
            t = int(rng.choice(allowed))
            m.accept(t)
            rows[1][b].accept(t)


def _draftable_requests():
    """Greedy constrained rows whose outputs repeat, so prompt-lookup drafts often, and
    drafts that run past what the grammar allows (the ``{2,10}`` bound, the choice's end)."""
    specs = [StructuredOutputsParams(regex=r"([a-z]+ ){2,30}[a-z]+\."),
             StructuredOutputsParams(json={"type": "object", "properties": {"story": {"type": "string", "maxLength": 120}},
                                           "required": ["story"]}),
             StructuredOutputsParams(regex=r"(ab|cd){2,10}x"),
             StructuredOutputsParams(grammar='start: "Lily" " " ("and Tom " | "had a ball ")+ "."'),
             StructuredOutputsParams(choice=["once upon a time there was a girl", "once upon a time there was a boy"])]
    prompts = ["Once upon a time, there was a little girl named Lily. She",
               "Lily and Tom went to the park. Lily and Tom", "abcdabcdab cdab",
               "Lily had a ball. Lily and Tom had a ball. Lily", "once upon a time there was"]
    return prompts, [SamplingParams(temperature=0.0, max_tokens=60, structured_outputs=s) for s in specs]


@pytest.mark.parametrize("kv_layout", ["paged", "contiguous"])
def test_constrained_rows_draft_and_verify_against_per_position_masks(stories, kv_layout):
    """Under speculation a constrained row drafts too: the draft is cut where the grammar
    stops allowing it, every verified position is masked by the grammar state after the
    draft's earlier tokens, and the grammar is rolled back to the accepted tokens. Greedy
    outputs equal those of the same requests without speculation, token for token."""
    prompts, params = _draftable_requests()
    plain = _engine(stories, "synchronous-paged", kv_layout=kv_layout).generate(prompts, params)
    eng = _engine(stories, "speculative-ngram", kv_layout=kv_layout)
    drafted = eng.generate(prompts, params)
    assert [(o.token_ids, o.text, o.finish_reason) for o in drafted] == \
        [(o.token_ids, o.text, o.finish_reason) for o in plain]
    assert eng.stats()["spec_num_drafts"] > 0 and eng.stats()["spec_accepted_tokens"] > 0  # every row is constrained
    for out, p in zip(drafted, params):
        if out.finish_reason == "stop":
            _check_constraint(p.structured_outputs, out.text)
    mgr = eng.block_manager
    if mgr is not None:
        assert mgr.num_in_use == 0 and not mgr.seqs


def test_a_draft_past_the_grammar_leaves_the_matcher_unchanged(stories):
    """Cutting a draft must not consume-and-roll-back: llguidance's matcher enters an
    error state on a rejected token that ``rollback`` does not undo."""
    eng = _engine(stories, "speculative-ngram")
    spec = StructuredOutputsParams(regex=r"(ab|cd){2,3}x")
    matcher = eng.grammar_backend().matcher(spec)
    tokenize = eng.grammar_backend().lltokenizer.tokenize_str
    a, b, x = (tokenize(c)[0] for c in "abx")
    for t in (a, b, a, b, a, b):
        matcher.accept(t)
    assert matcher.allowed_prefix([a, b, a, b]) == 0  # a fourth "ab" breaks {2,3}
    before = eng.grammar_backend().fill_bitmask([matcher])
    assert matcher.allowed_prefix([x, a]) == 1
    masks = matcher.draft_bitmask([x], eng.grammar_backend().words)
    np.testing.assert_array_equal(masks[0], before[0])
    np.testing.assert_array_equal(eng.grammar_backend().fill_bitmask([matcher]), before)
    assert matcher.error is None
    matcher.accept(x)
    assert matcher.done


def test_a_failure_cutting_one_draft_leaves_the_other_rows_alone(stories, monkeypatch):
    """A grammar that raises while its draft is cut costs that row its draft only: every
    request still gives its non-speculative output, and no block is left behind."""
    from mlx_ferrum.engine.structured import GrammarMatcher

    prompts, params = _draftable_requests()
    plain = _engine(stories, "synchronous-paged").generate(prompts, params)
    real = GrammarMatcher.allowed_prefix
    calls = []

    def flaky(self, token_ids, stop_ids=()):
        calls.append(1)
        if len(calls) % 3 == 0:
            raise RuntimeError("injected")
        return real(self, token_ids, stop_ids)

    monkeypatch.setattr(GrammarMatcher, "allowed_prefix", flaky)
    eng = _engine(stories, "speculative-ngram")
    outs = eng.generate(prompts, params)
    assert len(calls) >= 3
    assert [(o.token_ids, o.finish_reason) for o in outs] == [(o.token_ids, o.finish_reason) for o in plain]
    assert eng.block_manager.num_in_use == 0 and not eng.block_manager.seqs
