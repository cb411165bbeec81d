"""``mlx-ferrum serve`` against requests that used to stall it or get wrong answers.

- The server's limits: each refusal (400 / 413 / 429) names the limit and its flag, and
  ``/health`` keeps answering within 100 ms while the requests that used to block the
  event loop arrive ({"n": 1000000}, 20,000 prompts, 5,000,000 token ids, a 50 MB prompt).
- Streaming with logprobs (chat and completions) through the official client, equal to
  the non-streamed logprobs.
- Error statuses and messages: surrogates, non-JSON bodies, union-branch names, content parts.
- The field policy: OpenAI fields the server does not implement are refused by name;
  ``logit_bias`` is honoured.
"""

from __future__ import annotations

import statistics

import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from support.server_helpers import PLAIN_TEMPLATE, HealthPoller, running_server  # noqa: E402

KEY = "hardening-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "stories"
# The target is 100 ms (benchmarks/bench_serving-style runs and the hostile
# test check p99 against it). Single worst probes here run beside a busy server on a
# 2-core machine, where the OS alone can delay one answer past 100 ms; a blocked event
# loop (what these tests guard against) stalled /health for 5 to 120 s, so the bound on
# the worst probe is 0.5 s and the median must still meet the 100 ms target.
HEALTH_BUDGET_S = 0.500
HEALTH_TARGET_S = 0.100


def _start(stories_path, tmp, extra=()):
    template = tmp / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    return running_server(stories_path, tmp, ["--served-model-name", MODEL, "--chat-template", str(template),
                                              "--api-key", KEY, *extra], {"FERRUM_PREFIX_CACHE": "0"})


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    """A server with the default limits."""
    with _start(stories_path, tmp_path_factory.mktemp("serve-hard")) as s:
        yield s


@pytest.fixture(scope="module")
def small(stories_path, tmp_path_factory):
    """A server with every limit set small by its flag."""
    flags = ["--max-request-body-bytes", "4096", "--max-n", "3", "--max-prompts-per-request", "4",
             "--max-choices-per-request", "6", "--max-prompt-tokens-per-request", "60", "--max-queued-tokens", "100"]
    with _start(stories_path, tmp_path_factory.mktemp("serve-small"), flags) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def post(server, path, body, headers=None, **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    h = {"content-type": "application/json", **AUTH, **(headers or {})}
    return httpx.post(server.url + path, content=content, headers=h, timeout=120, **kw)


def error_of(r, status):
    assert r.status_code == status, r.text[:500]
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ------------------------------------------------------------------ the limits


HOSTILE = {
    "n=1000000": ({"model": MODEL, "prompt": "Lily", "n": 1_000_000}, 400, "--max-n"),
    "20000 token-id lists": ({"model": MODEL, "prompt": [[1, 400, 30, 50]] * 20_000, "max_tokens": 4},
                             400, "--max-prompts-per-request"),
    "5000000 token ids": ({"model": MODEL, "prompt": [1] * 5_000_000, "max_tokens": 4}, 413, "--max-request-body-bytes"),
    "50 MB prompt": ({"model": MODEL, "prompt": "Lily " * 10_000_000, "max_tokens": 4}, 413, "--max-request-body-bytes"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_requests_that_stalled_the_server_are_refused_while_health_answers(server, client, case, tmp_path):
    body, status, flag = HOSTILE[case]
    raw = json.dumps(body).encode()
    with HealthPoller(server.url, tmp_path) as probe:
        time.sleep(0.1)
        t = time.perf_counter()
        r = post(server, "/v1/completions", raw)
        took = time.perf_counter() - t
        time.sleep(0.1)
    err = error_of(r, status)
    assert flag in err["message"], err
    assert took < 10, f"the refusal took {took:.1f} s"
    assert probe.errors == 0 and len(probe.latencies) >= 5
    assert max(probe.latencies) <= HEALTH_BUDGET_S, f"/health took {max(probe.latencies) * 1000:.0f} ms"
    assert statistics.median(probe.latencies) <= HEALTH_TARGET_S
    assert client.completions.create(model=MODEL, prompt="Lily", max_tokens=3, temperature=0).choices[0].text


@pytest.mark.parametrize("prompt, flag", [
    ([[5]] * 30_000, "--max-prompts-per-request"),  # just under the JSON-container limit: the slowest body to parse
    ([5] * 300_000, "--max-prompt-tokens-per-request"),  # just under the body limit: 300,000 numbers
    ("Lily " * 200_000, "context"),  # 1,000,000 characters to tokenize
])
def test_the_largest_bodies_admitted_parse_off_the_event_loop(server, prompt, flag, tmp_path):
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": 2}).encode()
    assert len(body) < 1024 * 1024
    with HealthPoller(server.url, tmp_path) as probe:
        time.sleep(0.1)
        r = post(server, "/v1/completions", body)
        time.sleep(0.1)
    assert flag in error_of(r, 400)["message"]
    assert max(probe.latencies) <= HEALTH_BUDGET_S, f"/health took {max(probe.latencies) * 1000:.0f} ms"
    assert statistics.median(probe.latencies) <= HEALTH_TARGET_S


def test_json_containers_are_counted_outside_strings(server):
    err = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": [[5]] * 40_000}), 413)
    assert "--max-request-json-containers" in err["message"]
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "[{" * 40_000})  # brackets inside text
    assert r.status_code == 400 and "containers" not in r.text, r.text[:300]


def test_a_chunked_body_over_the_limit_is_a_413(small):
    def chunks():
        for _ in range(10):
            yield b" " * 1000  # whitespace: valid JSON padding, 10 kB in all

    r = httpx.post(small.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json", **AUTH})
    assert "--max-request-body-bytes" in error_of(r, 413)["message"]


@pytest.mark.parametrize("body, status, flag, param", [
    ({"prompt": "Lily", "n": 4}, 400, "--max-n", "n"),
    ({"prompt": ["a", "b", "c", "d", "e"]}, 400, "--max-prompts-per-request", "prompt"),
    ({"prompt": ["a", "b", "c"], "n": 3}, 400, "--max-choices-per-request", "n"),
    ({"prompt": [[1] + [400] * 40, [1] + [400] * 40]}, 400, "--max-prompt-tokens-per-request", "prompt"),
    ({"prompt": "Lily " * 70}, 400, "--max-prompt-tokens-per-request", "prompt"),
    ({"prompt": [1] + [400] * 35, "n": 3}, 400, "--max-queued-tokens", "prompt"),
    ({"prompt": "x" * 5000}, 413, "--max-request-body-bytes", None),
])
def test_each_limit_is_refused_by_its_flag(small, body, status, flag, param):
    err = error_of(post(small, "/v1/completions", {"model": MODEL, "max_tokens": 2, **body}), status)
    assert flag in err["message"] and err["param"] == param, err
    r = post(small, "/v1/completions", {"model": MODEL, "prompt": "Lily", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_queued_tokens_over_the_limit_get_a_429_until_the_queue_drains(stories_path):
    """The queued-token account, in process: engine streams that never finish hold their
    prompt tokens until they are closed."""
    import asyncio
    from types import SimpleNamespace

    import mlx_ferrum
    from mlx_ferrum.engine import AsyncEngine, Engine, SamplingParams
    from mlx_ferrum.server import ServerLimits
    from mlx_ferrum.server.serving import OpenAIServing, ServingError

    model, tokenizer = mlx_ferrum.load(stories_path)
    async_engine = AsyncEngine(Engine(model, tokenizer))
    try:
        serving = OpenAIServing(async_engine, [MODEL], limits=ServerLimits(max_queued_tokens=100))

        async def held(ids, params, request_id=None):
            yield SimpleNamespace(finished=False, finish_reason=None)
            await asyncio.Event().wait()  # never finishes: closed by the test

        serving.async_engine = SimpleNamespace(astream=held)

        def plan(num_tokens, n=1):
            return [(0, [1] * num_tokens, SamplingParams()) for _ in range(n)]

        async def scenario():
            first = await serving._submit(plan(50))
            second = await serving._submit(plan(25, n=2))
            assert serving.queued_tokens == 100
            with pytest.raises(ServingError) as busy:
                await serving._submit(plan(2))
            assert busy.value.status == 429 and "--max-queued-tokens" in busy.value.message
            with pytest.raises(ServingError) as alone:
                await serving._submit(plan(101))
            assert alone.value.status == 400 and "--max-queued-tokens" in alone.value.message
            await serving._close(first)
            assert serving.queued_tokens == 50
            third = await serving._submit(plan(50))
            await serving._close(second + third)
            assert serving.queued_tokens == 0 and not serving._inflight

        asyncio.run(scenario())
    finally:
        async_engine.shutdown()


# --------------------------------------------------------- streamed logprobs


def test_streamed_chat_logprobs_equal_the_non_streamed_ones(client):
    messages = [{"role": "user", "content": "Once upon a time"}]
    for top in (None, 0, 3):
        kw = dict(model=MODEL, messages=messages, max_tokens=16, temperature=0, logprobs=True)
        if top is not None:
            kw["top_logprobs"] = top
        full = client.chat.completions.create(**kw)
        chunks = list(client.chat.completions.create(stream=True, **kw))
        streamed = [lp for ch in chunks for choice in ch.choices if choice.logprobs for lp in choice.logprobs.content]
        expected = full.choices[0].logprobs.content
        assert [x.token for x in streamed] == [x.token for x in expected] and len(expected) == 16
        assert [x.logprob for x in streamed] == pytest.approx([x.logprob for x in expected], abs=1e-5)
        assert [[t.token for t in x.top_logprobs] for x in streamed] == [[t.token for t in x.top_logprobs] for x in expected]
        assert all(len(x.top_logprobs) == (top or 0) for x in streamed)
        text = "".join(choice.delta.content or "" for ch in chunks for choice in ch.choices)
        assert text == full.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason == "length"


@pytest.mark.parametrize("logprobs", [0, 1, 2, 5])
def test_streamed_completion_logprobs_equal_the_non_streamed_ones(client, logprobs):
    kw = dict(model=MODEL, prompt="Lily", max_tokens=12, temperature=0, logprobs=logprobs)
    full = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    tokens, values, tops = [], [], []
    for ch in chunks:
        for choice in ch.choices:
            if choice.logprobs:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
    assert tokens == full.logprobs.tokens and len(tokens) == 12
    assert values == pytest.approx(full.logprobs.token_logprobs, abs=1e-5)
    assert [sorted(t or {}) for t in tops] == [sorted(t or {}) for t in full.logprobs.top_logprobs]
    assert all(len(t or {}) == logprobs for t in tops)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.text


# ------------------------------------------------------------- error statuses


def test_a_lone_surrogate_is_a_400_that_names_it(server):
    for path, body in (("/v1/completions", '{"model": "stories", "prompt": "Lily \\ud800"}'),
                       ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}'),
                       ("/tokenize", '{"prompt": "a\\udfff b"}')):
        err = error_of(post(server, path, body), 400)
        assert "surrogate" in err["message"], err


def test_a_body_that_is_not_json_is_a_400_that_says_to_send_json(server):
    r = httpx.post(server.url + "/v1/completions", data={"prompt": "Lily"}, headers=AUTH)  # curl -d style
    err = error_of(r, 400)
    assert "application/json" in err["message"] and "x-www-form-urlencoded" in err["message"]
    for raw in (b"", b"[1, 2]", b"null"):
        assert error_of(post(server, "/v1/completions", raw), 400)["message"]


@pytest.mark.parametrize("path, body, param, expected", [
    ("/v1/completions", {"prompt": {"text": "Lily"}}, "prompt", "a list of token ids"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt", "a list of token ids"),
    ("/v1/completions", {"prompt": "Lily", "stop": 5}, "stop", "a string or a list of strings"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "messages.0.content", "content parts"),
])
def test_errors_name_fields_not_union_branches(server, path, body, param, expected):
    err = error_of(post(server, path, {"model": MODEL, **body}), 400)
    assert err["param"] == param and expected in err["message"], err
    for leak in (".str", "list[", "int]", "function-"):
        assert leak not in err["message"] and leak not in (err["param"] or ""), err


def test_detokenize_errors_name_tokens(server):
    err = error_of(post(server, "/detokenize", {"tokens": [1, 99999]}), 400)
    assert err["param"] == "tokens" and "prompt" not in err["message"], err
    assert post(server, "/detokenize", {"tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize("part", [{"type": "text", "text": {"a": 1}}, {"type": "text"}, {"type": "text", "text": 5}])
def test_a_content_part_whose_text_is_not_a_string_is_a_400(server, part):
    err = error_of(post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": [part]}]}), 400)
    assert err["param"] == "messages.0.content.0.text", err


# ---------------------------------------------------------------- field policy


@pytest.mark.parametrize("path, field, value", [
    ("/v1/completions", "suffix", "The end."),
    ("/v1/completions", "best_of", 3),
    ("/v1/chat/completions", "functions", [{"name": "f", "parameters": {}}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "audio", {"voice": "alloy", "format": "mp3"}),
])
def test_unimplemented_openai_fields_are_refused_by_name(server, path, field, value):
    body = {"model": MODEL, "max_tokens": 2, field: value}
    body.update({"prompt": "Lily"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Lily"}]})
    err = error_of(post(server, path, body), 400)
    assert err["param"] == field and f"'{field}'" in err["message"], err


def test_neutral_values_of_those_fields_are_accepted(server):
    ok = [("/v1/completions", {"prompt": "Lily", "best_of": 1, "echo": False}),
          ("/v1/completions", {"prompt": "Lily", "best_of": 2, "n": 2}),
          ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Lily"}], "tools": [], "tool_choice": "none",
                                    "response_format": {"type": "text"}, "some_vendor_field": 1})]
    for path, body in ok:
        r = post(server, path, {"model": MODEL, "max_tokens": 2, **body})
        assert r.status_code == 200, r.text


def test_logit_bias_forces_and_bans_tokens(server, client):
    forced = 400

    def continuation(prompt_ids):  # the text of the forced tokens after the prompt, as decode reads it
        whole = post(server, "/detokenize", {"tokens": prompt_ids + [forced] * 6}).json()["prompt"]
        return whole[len(post(server, "/detokenize", {"tokens": prompt_ids}).json()["prompt"]):]

    want = continuation(post(server, "/tokenize", {"prompt": "Lily"}).json()["tokens"])
    got = client.completions.create(model=MODEL, prompt="Lily", max_tokens=6, temperature=0, logit_bias={str(forced): 100})
    assert got.choices[0].text == want
    base = client.completions.create(model=MODEL, prompt="Lily", max_tokens=6, temperature=0, logprobs=0)
    first = post(server, "/tokenize", {"prompt": "Lily" + base.choices[0].logprobs.tokens[0]}).json()["tokens"][-1]
    banned = client.completions.create(model=MODEL, prompt="Lily", max_tokens=6, temperature=0, logprobs=0,
                                       logit_bias={str(first): -100})
    assert banned.choices[0].logprobs.tokens[0] != base.choices[0].logprobs.tokens[0]
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Lily"}], max_tokens=6,
                                          temperature=0, logit_bias={str(forced): 100}, stream=True)
    chat_ids = post(server, "/tokenize", {"messages": [{"role": "user", "content": "Lily"}]}).json()["tokens"]
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices) == continuation(chat_ids)


@pytest.mark.parametrize("bias", [{"abc": 1}, {"99999": 1}, {"5": 101}, {"5": "x"}, {"-1": 1}])
def test_bad_logit_bias_is_a_400(server, bias):
    err = error_of(post(server, "/v1/completions", {"model": MODEL, "prompt": "Lily", "logit_bias": bias}), 400)
    assert err["param"].startswith("logit_bias"), err
