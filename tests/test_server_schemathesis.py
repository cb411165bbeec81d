"""Schema-driven fuzz of ``mlx-ferrum serve``: schemathesis over the app's OpenAPI description.

The description is the app's own ``app.openapi()`` (the served app has ``openapi_url=None``;
the routes carry their request-body schemas, see ``_json_body`` in ``server/app.py``), built
here without a model. schemathesis generates request bodies from it, valid ones (positive
mode) and ones that break the schema (negative mode), for every POST endpoint that reads
JSON, and sends them to a real ``mlx-ferrum serve`` on stories260K over loopback. Asserted
for every answer:

- no 5xx status;
- a 4xx body is OpenAI's error shape ``{"error": {"message": str, "type": str, ...}}``, or
  Anthropic's ``{"type": "error", "error": {"type": str, "message": str}}`` under ``/v1/messages``.

Generation is reproducible (hypothesis ``derandomize=True``, no example database) and bounded
per endpoint; the server runs with ``--kv-capacity 128`` and small choice limits so that a
generated ``max_tokens`` or ``n`` cannot make one request long. The default run sends a few
dozen requests per endpoint; ``-m slow`` runs ten times as many.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

schemathesis = pytest.importorskip("schemathesis")
hypothesis = pytest.importorskip("hypothesis")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402

from server_helpers import REPO, running_server  # noqa: E402

MODEL = "stories"
ANTHROPIC_PREFIX = "/v1/messages"
#: every POST endpoint that reads a JSON body, but the LoRA ones (they need --enable-lora and real adapter folders)
JSON_ENDPOINTS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages",
                  "/v1/messages/count_tokens", "/v1/embeddings", "/tokenize", "/detokenize"]
#: (positive, negative) examples per endpoint
DEFAULT_EXAMPLES = (24, 12)
SLOW_EXAMPLES = (240, 120)
REQUEST_TIMEOUT_S = 60


def openapi_description() -> dict:
    """The app's OpenAPI description, built over a stub (``build_app`` only wires objects together)."""
    from mlx_ferrum.server.app import build_app
    from mlx_ferrum.server.limits import ServerLimits
    from mlx_ferrum.server.metrics import ServerMetrics

    class StubServing:
        metrics, limits, engine = None, ServerLimits(), None

    return build_app(StubServing(), metrics=ServerMetrics(None)).openapi()


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
    """``(schema, base_url)``: the loaded description and a running server on stories260K."""
    schema = schemathesis.openapi.from_dict(openapi_description())
    log_dir = tmp_path_factory.mktemp("schemathesis")
    args = ["--served-model-name", MODEL, "--chat-template", str(REPO / "examples" / "plain_chat_template.jinja"),
            "--kv-capacity", "128", "--max-n", "2", "--max-choices-per-request", "4", "--max-prompts-per-request", "4"]
    with running_server(stories_path, log_dir, args) as server:
        yield schema, server.url, server


def fuzz(fuzz_target, path: str, mode, max_examples: int) -> None:
    """Send ``max_examples`` generated requests of ``mode`` to ``POST path``; fail on a 5xx or a bad error body."""
    schema, base_url, server = fuzz_target
    operation = schema[path]["POST"]

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

    _, base_url, _ = fuzz_target
    response = httpx.post(base_url + path, json=body, timeout=REQUEST_TIMEOUT_S)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "guided_grammar" and "the grammar cannot be used" in error["message"]


@pytest.mark.parametrize("path", JSON_ENDPOINTS)
def test_generated_requests_get_no_5xx_and_well_formed_errors(fuzz_target, path):
    positive, negative = DEFAULT_EXAMPLES
    fuzz(fuzz_target, path, schemathesis.GenerationMode.POSITIVE, positive)
    fuzz(fuzz_target, path, schemathesis.GenerationMode.NEGATIVE, negative)


@pytest.mark.slow
@pytest.mark.parametrize("path", JSON_ENDPOINTS)
def test_many_generated_requests_get_no_5xx_and_well_formed_errors(fuzz_target, path):
    positive, negative = SLOW_EXAMPLES
    fuzz(fuzz_target, path, schemathesis.GenerationMode.POSITIVE, positive)
    fuzz(fuzz_target, path, schemathesis.GenerationMode.NEGATIVE, negative)
