"""Structured output on a real chat model: SmolLM2-135M-Instruct, 8 requests batched, with
a handful of schemas (an object with an enum, an array of objects, nested objects) and a
``json_object`` request, greedy and sampled, in both KV layouts: every output parses and
validates with ``jsonschema`` (the independent reference) and ends by itself ("stop").

The engine tests run the folder's weights dequantized to float32 (batched steps cost
about one step through BLAS); the server test runs the 4-bit folder as a user serves it
(slow: its batched steps cost a step per row on this CPU).
"""

from __future__ import annotations

import json

import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.engine.structured import StructuredOutputsParams
from support.smollm_support import dequantized_float32, smollm_path

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

CITY = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "continent": {"enum": ["Africa", "Americas", "Asia", "Europe", "Oceania"]},
    },
    "required": ["city", "continent"],
    "additionalProperties": False,
}
COLORS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 16}, "hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}},
        "required": ["name", "hex"],
        "additionalProperties": False,
    },
    "minItems": 1,
    "maxItems": 3,
}
PERSON = {
    "type": "object",
    "properties": {
        "person": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "address": {
                    "type": "object",
                    "properties": {"city": {"type": "string", "maxLength": 24},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
            },
            "required": ["name", "age", "address"],
            "additionalProperties": False,
        }
    },
    "required": ["person"],
    "additionalProperties": False,
}
ANY_OBJECT = {"type": "object"}
#: (question, schema; None = a json_object request, checked against ANY_OBJECT)
REQUESTS = [
    ("What is the capital of France, and on which continent is it? Answer in JSON.", CITY),
    ("Name up to three primary colors with their hex codes, as a JSON array.", COLORS),
    ("Invent a person with a name, an age and an address (city and zip code). Answer in JSON.", PERSON),
    ("Describe a cat as a small JSON object with a name and a color.", None),
]
MAX_TOKENS = 96  # the longest schema output here is about 50 tokens
#: a json_object reply is a short object, or a runaway key that any limit cuts (see _check)
JSON_OBJECT_MAX_TOKENS = 64


@pytest.fixture(scope="module")
def smollm_f32():
    return dequantized_float32()


def _messages(question):
    return [{"role": "system", "content": "You answer only with JSON."}, {"role": "user", "content": question}]


#: greedy, and sampling as chat front ends do (an unconstrained json_object at temperature 1
#: without a nucleus may wander into endless keys and numbers, as any free text may)
GREEDY = (0.0, 1.0, None)
SAMPLED = (0.7, 0.9, 1234)


def _params(schema, temperature, top_p, seed):
    spec = StructuredOutputsParams(json_object=True) if schema is None else StructuredOutputsParams(json=schema)
    return SamplingParams(temperature=temperature, top_p=top_p, seed=seed,
                          max_tokens=JSON_OBJECT_MAX_TOKENS if schema is None else MAX_TOKENS, structured_outputs=spec)


def _check(text, schema, finish_reason, sampled=False):
    """The output parses and validates. Every schema here bounds its strings and arrays, so
    its output must end by itself; an unconstrained ``json_object`` sampled from a 135M model
    may instead spend ``max_tokens`` inside one endless key (about 1 seed in 12 at
    temperature 0.7, top_p 0.9): such an output must then be a prefix that a fresh
    llguidance matcher (the library's own reference) accepts, and None is returned."""
    if schema is None and sampled and finish_reason == "length":
        import llguidance

        ref = llguidance.LLMatcher(_REFERENCE[0], StructuredOutputsParams(json_object=True).llguidance_grammar(),
                                   log_level=0)
        assert ref.consume_tokens(_REFERENCE[1](text)), text
        return None
    assert finish_reason == "stop", f"the JSON did not end within max_tokens: {text!r}"
    value = json.loads(text)
    jsonschema.validate(value, ANY_OBJECT if schema is None else schema)
    return value


#: (llguidance tokenizer, text -> ids) of the model under test, for :func:`_check`
_REFERENCE: list = []


def _run_batch(model, tok, layout, samplings):
    """8 requests (4 requests x ``samplings``: (temperature, top_p, seed)) in one engine batch."""
    engine = Engine(model, tok, RuntimeConfig(kv_layout=layout, max_num_seqs=8))
    _REFERENCE[:] = [engine.grammar_backend().lltokenizer, lambda text: tok.encode(text, add_special_tokens=False)]
    prompts, params, schemas, sampled = [], [], [], []
    for temperature, top_p, seed in samplings:
        for i, (question, schema) in enumerate(REQUESTS):
            prompts.append(_messages(question))
            params.append(_params(schema, temperature, top_p, None if seed is None else seed + i))
            schemas.append(schema)
            sampled.append(temperature > 0)
    assert len(prompts) == 8
    outs = engine.generate(prompts, params)
    return [_check(out.text, schema, out.finish_reason, s) for out, schema, s in zip(outs, schemas, sampled)]


def test_greedy_and_sampled_json_validates_batched_paged(smollm_f32):
    model, tok = smollm_f32
    values = _run_batch(model, tok, "paged", [GREEDY, SAMPLED])
    assert values[0]["continent"] == "Europe"  # greedy: the model knows where Paris is


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
@pytest.mark.parametrize("samplings", [[GREEDY, GREEDY], [(0.7, 0.9, 7), (0.7, 0.9, 99)]], ids=["greedy", "sampled"])
def test_json_validates_batched(smollm_f32, layout, samplings):
    _run_batch(*smollm_f32, layout, samplings)


@pytest.mark.slow
def test_json_validates_in_the_contiguous_layout_greedy_and_sampled(smollm_f32):
    _run_batch(*smollm_f32, "contiguous", [GREEDY, SAMPLED])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["paged", "contiguous"])
def test_response_format_on_the_4bit_folder_through_the_server(tmp_path, layout):
    """``response_format`` json_schema / json_object through ``/v1/chat/completions``, 8
    concurrent requests (4 greedy, 4 sampled) against the 4-bit folder as served."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from support.server_helpers import running_server

    def body(question, schema, temperature, top_p, seed):
        if schema is None:
            fmt = {"type": "json_object"}
        else:
            fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        return {"messages": _messages(question), "max_tokens": JSON_OBJECT_MAX_TOKENS if schema is None else MAX_TOKENS,
                "temperature": temperature,
                "top_p": top_p, "seed": seed, "response_format": fmt}

    jobs = [(q, s, t, p, 100 + i) for t, p, _ in (GREEDY, SAMPLED) for i, (q, s) in enumerate(REQUESTS)]
    with running_server(smollm_path(), tmp_path, ["--kv-layout", layout, "--max-num-seqs", "8"]) as server:
        def post(job):
            r = httpx.post(server.url + "/v1/chat/completions", json=body(*job), timeout=900)
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]

        with ThreadPoolExecutor(8) as pool:
            choices = list(pool.map(post, jobs))
    for choice, (_, schema, temperature, _, _) in zip(choices, jobs):
        if not (schema is None and temperature > 0 and choice["finish_reason"] == "length"):
            _check(choice["message"]["content"], schema, choice["finish_reason"])
