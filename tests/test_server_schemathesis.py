"""Schema-driven fuzz of ``mlx-ferrum serve``: schemathesis over the app's OpenAPI description.

The description is the app's own ``app.openapi()`` (the served app has ``openapi_url=None``;
the routes carry their request-body schemas, see ``json_body`` in ``server/routing.py``), built
here without a model. schemathesis generates request bodies from it, valid ones (positive
mode) and ones that break the schema (negative mode), for every POST endpoint that reads
JSON, and sends them to a real ``mlx-ferrum serve`` on stories260K over loopback. Asserted
for every answer:

- no 5xx status;
- a 4xx body is OpenAI's error shape ``{"error": {"message": str, "type": str, ...}}``, or
  Anthropic's ``{"type": "error", "error": {"type": str, "message": str}}`` under ``/v1/messages``.

Generation is reproducible (hypothesis ``derandomize=True``, no example database) and bounded
per endpoint; the server runs with ``--kv-capacity 64`` and small choice limits so that a
generated ``max_tokens`` or ``n`` cannot make one request long. The default run sends a few
dozen requests per endpoint; ``-m slow`` runs ten times as many.
"""

from __future__ import annotations

import copy
import json

import pytest

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, Phase, given, settings
from support.server_helpers import REPO, running_server

MODEL = "stories"
ANTHROPIC_PREFIX = "/v1/messages"
#: every POST endpoint that reads a JSON body, but the LoRA ones (they need --enable-lora and real adapter folders)
JSON_ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                  "/v1/messages/count_tokens", "/v1/embeddings", "/tokenize", "/detokenize"]
#: examples per endpoint: (positive from the app's description, positive from the narrowed one, negative)
DEFAULT_EXAMPLES = (12, 20, 10)
SLOW_EXAMPLES = (160, 240, 100)
REQUEST_TIMEOUT_S = 60


def openapi_description() -> dict:
    """The app's OpenAPI description, built over a stub (``build_app`` only wires objects together)."""
    from mlx_ferrum.server.app import build_app
    from mlx_ferrum.server.limits import ServerLimits
    from mlx_ferrum.server.metrics import ServerMetrics

    class StubServing:
        metrics, limits, engine = None, ServerLimits(), None

    return build_app(StubServing(), metrics=ServerMetrics(None)).openapi()


# The app's description types many fields loosely (``prompt`` and ``input`` are "anything",
# message contents free objects): the routes validate them by hand, with messages in the
# client's terms. Generated from it, most valid-by-schema bodies stop at that validation. The
# narrowed description below types the core fields as the APIs document them and drops the
# free-form ones, so that its positive examples reach tokenization, templates, generation and
# streaming; the app's own description still drives the rest (breadth, negative examples).
TEXT = {"type": "string", "maxLength": 40}
TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 511}, "minItems": 1, "maxItems": 16}
PROMPT = {"anyOf": [TEXT, {"type": "array", "items": TEXT, "minItems": 1, "maxItems": 3}, TOKEN_IDS,
                    {"type": "array", "items": TOKEN_IDS, "minItems": 1, "maxItems": 3}]}
SMALL = {"type": "integer", "minimum": 1, "maximum": 16}


def text_message(roles: list) -> dict:
    parts = {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "required": ["type", "text"], "additionalProperties": False,
        "properties": {"type": {"enum": ["text"]}, "text": TEXT}}}
    return {"type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {"role": {"enum": roles}, "content": {"anyOf": [TEXT, parts]}}}


def messages_of(roles: list) -> dict:
    return {"type": "array", "minItems": 1, "maxItems": 3, "items": text_message(roles)}


COMMON = {"model": {"enum": [MODEL]}, "max_tokens": SMALL, "n": {"type": "integer", "minimum": 1, "maximum": 2}}
NARROWED = {
    "/v1/chat/completions": {**COMMON, "messages": messages_of(["system", "user", "assistant"]),
                             "top_logprobs": {"type": "integer", "minimum": 0, "maximum": 5}},
    "/v1/completions": {**COMMON, "prompt": PROMPT, "logprobs": {"type": "integer", "minimum": 0, "maximum": 5}},
    "/v1/responses": {"model": COMMON["model"], "max_output_tokens": SMALL, "instructions": TEXT,
                      "input": {"anyOf": [TEXT, messages_of(["user", "assistant", "system", "developer"])]}},
    "/v1/messages": {"model": COMMON["model"], "max_tokens": SMALL, "system": TEXT,
                     "messages": messages_of(["user", "assistant"])},
    "/v1/messages/count_tokens": {"model": COMMON["model"], "system": TEXT, "messages": messages_of(["user", "assistant"])},
    "/v1/embeddings": {"model": COMMON["model"], "input": PROMPT, "encoding_format": {"enum": ["float", "base64"]}},
    "/tokenize": {"model": COMMON["model"], "prompt": TEXT, "messages": messages_of(["system", "user", "assistant"])},
    "/detokenize": {"model": COMMON["model"], "tokens": TOKEN_IDS},
}


def _free_form(schema: dict) -> bool:
    """True for a property that takes any value or any object."""
    branches = schema.get("anyOf", [schema])
    return any(b == {} or b.get("additionalProperties") is True for b in branches)


def narrowed_description() -> dict:
    """The app's description with the fields of ``NARROWED`` typed as documented, and the free-form ones left out."""
    spec = copy.deepcopy(openapi_description())
    for path, fields in NARROWED.items():
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        body["properties"] = {name: schema for name, schema in body["properties"].items()
                              if not _free_form(schema) and "$ref" not in json.dumps(schema)}
        body["properties"].update(fields)
        body["additionalProperties"] = False
    return spec


def error_shape_problem(path: str, status: int, text: str):
    """None when ``text`` is a well-formed error body for ``path``; else what is wrong with it."""
    try:
        body = json.loads(text)
    except ValueError:
        return f"the {status} body is not JSON: {text[:200]!r}"
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str) or not isinstance(error.get("type"), str):
        return f"the {status} body has no error object with a message and a type: {text[:300]!r}"
    if path.startswith(ANTHROPIC_PREFIX) and body.get("type") != "error":
        return f"an Anthropic error body must have type 'error': {text[:300]!r}"
    return None


@pytest.fixture(scope="module")
def fuzz_target(stories_path, tmp_path_factory):
    """``(schemas, base_url, server)``: the loaded descriptions (``raw``, ``narrowed``) and a running server on stories260K."""
    schemas = {"raw": schemathesis.openapi.from_dict(openapi_description()),
               "narrowed": schemathesis.openapi.from_dict(narrowed_description())}
    log_dir = tmp_path_factory.mktemp("schemathesis")
    args = ["--served-model-name", MODEL, "--chat-template", str(REPO / "examples" / "plain_chat_template.jinja"),
            "--kv-capacity", "64", "--max-n", "2", "--max-choices-per-request", "4", "--max-prompts-per-request", "4"]
    with running_server(stories_path, log_dir, args) as server:
        yield schemas, server.url, server


def fuzz(fuzz_target, description: str, path: str, mode, max_examples: int) -> None:
    """Send ``max_examples`` requests of ``mode`` generated from ``description`` (``raw`` or
    ``narrowed``) to ``POST path``; fail on a 5xx or a bad error body."""
    schemas, base_url, server = fuzz_target
    operation = schemas[description][path]["POST"]

    @settings(max_examples=max_examples, derandomize=True, database=None, deadline=None,
              phases=[Phase.explicit, Phase.generate, Phase.shrink],
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case):
        response = case.call(base_url=base_url, timeout=REQUEST_TIMEOUT_S)
        assert response.status_code < 500, (
            f"{response.status_code} for POST {path} with {case.body!r}: {response.text[:500]}\n"
            f"server log:\n{server.log_text()[-2000:]}")
        if response.status_code >= 400:
            problem = error_shape_problem(path, response.status_code, response.text)
            assert problem is None, f"POST {path} with {case.body!r}: {problem}"

    check()


def test_openapi_description_has_a_request_schema_for_every_json_endpoint():
    """Every fuzzed endpoint has a JSON request body in the description, and its references resolve
    from the document's root (``#/components/schemas/...``)."""
    spec = openapi_description()
    for path in JSON_ENDPOINTS + ["/v1/load_lora_adapter", "/v1/unload_lora_adapter"]:
        body = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body.get("properties"), path
    text = json.dumps(spec)
    assert '"#/$defs/' not in text
    for name in ("ChatMessage", "StreamOptions"):
        assert name in spec["components"]["schemas"]


@pytest.mark.parametrize("path, body", [("/v1/chat/completions", {"messages": [], "guided_grammar": ""}),
                                        ("/v1/completions", {"prompt": "", "guided_grammar": ""}),
                                        ("/v1/completions", {"prompt": "Lily", "guided_grammar": "root ::= ("})])
def test_a_grammar_llguidance_cannot_convert_is_a_400_naming_the_field(fuzz_target, path, body):
    """Found by the fuzz: an empty or malformed GBNF ``guided_grammar`` was a 500."""
    import httpx

    base_url = fuzz_target[1]
    response = httpx.post(base_url + path, json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_grammar" and "the grammar cannot be used" in error["message"]


@pytest.mark.parametrize("path, body", [("/v1/embeddings", {"input": [[None]]}), ("/v1/embeddings", {"input": [[5, None]]}),
                                        ("/v1/completions", {"prompt": [[None]], "max_tokens": 1})])
def test_a_null_token_id_is_a_400_naming_it(fuzz_target, path, body):
    """Found by the fuzz: a null among an input's token ids passed the id check (which
    returned the first bad id, None, as "no bad id"): embeddings failed later with a 500,
    completions with the engine's message instead of the id check's."""
    import httpx

    response = httpx.post(fuzz_target[1] + path, json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 400, response.text
    assert "None, which is not a token id" in response.json()["error"]["message"]


@pytest.mark.parametrize("path", JSON_ENDPOINTS)
def test_generated_requests_get_no_5xx_and_well_formed_errors(fuzz_target, path):
    raw, narrowed, negative = DEFAULT_EXAMPLES
    fuzz(fuzz_target, "raw", path, schemathesis.GenerationMode.POSITIVE, raw)
    fuzz(fuzz_target, "narrowed", path, schemathesis.GenerationMode.POSITIVE, narrowed)
    fuzz(fuzz_target, "raw", path, schemathesis.GenerationMode.NEGATIVE, negative)


@pytest.mark.slow
@pytest.mark.parametrize("path", JSON_ENDPOINTS)
def test_many_generated_requests_get_no_5xx_and_well_formed_errors(fuzz_target, path):
    raw, narrowed, negative = SLOW_EXAMPLES
    fuzz(fuzz_target, "raw", path, schemathesis.GenerationMode.POSITIVE, raw)
    fuzz(fuzz_target, "narrowed", path, schemathesis.GenerationMode.POSITIVE, narrowed)
    fuzz(fuzz_target, "raw", path, schemathesis.GenerationMode.NEGATIVE, negative)
