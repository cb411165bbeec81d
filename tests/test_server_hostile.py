"""A hostile run against ``mlx-ferrum serve --api-key``: generated requests, no 5xx.

A small seeded fuzzer builds requests from valid ones by mutation: wrong types, missing
and unknown fields, huge ``n`` / ``max_tokens`` / ids, lone surrogates, unimplemented
OpenAI fields, non-JSON and truncated bodies, wrong content types, oversized bodies,
missing or wrong keys. Two rounds of the same number of requests; asserted:

- no response has a 5xx status (every answer is a 2xx or a 4xx in OpenAI's error shape,
  Anthropic's under ``/v1/messages``), over every endpoint: chat, completions,
  Responses, Messages, count_tokens, embeddings, tokenize;
- ``/health``, polled from a thread the whole time, answers with p99 latency <= 100 ms;
- the server's RSS grows by at most 10 % from the end of round one to the end of round two.
"""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from support.server_helpers import PLAIN_TEMPLATE, HealthPoller, running_server

KEY = "hostile-key"
MODEL = "stories"
REQUESTS_PER_ROUND = 160  # two rounds: 320 requests
HEALTH_P99_S = 0.100
ROUND_DEADLINE_S = 120

def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


WEIRD_VALUES = [None, True, -1, 0, 1, 2**63, -(2**70), 1e308, float("inf"), "x", "", "\ud800", [], [1, "a"], {}, {"a": [1]},
                [[[]]], "Lily " * 50, list(range(600)), 10**6]


def _completion(r: random.Random) -> dict:
    prompt = r.choice(["Lily", "Once upon a time", [1, 400, 30], [[1, 2], [3]], ["a", "b"]])
    body = {"model": MODEL, "prompt": prompt, "max_tokens": r.randint(1, 8), "temperature": r.choice([0, 0.7, 1.0])}
    if r.random() < 0.3:
        body["stream"] = True
    if r.random() < 0.3:
        body["logprobs"] = r.randint(0, 5)
    return body


def _chat(r: random.Random) -> dict:
    content = r.choice(["Lily", [{"type": "text", "text": "Once"}], "One day"])
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": r.randint(1, 8), "temperature": 0}
    if r.random() < 0.3:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    if r.random() < 0.3:
        body["logprobs"] = True
        body["top_logprobs"] = r.randint(0, 5)
    return body


def _responses(r: random.Random) -> dict:
    item = r.choice([{"role": "user", "content": "Lily"}, {"type": "message", "role": "developer", "content": [
        {"type": "input_text", "text": "Once"}]}, {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "ok"}, {"type": "reasoning", "summary": []}])
    body = {"model": MODEL, "input": r.choice(["Lily", [item], [item, {"role": "user", "content": "One day"}]]),
            "max_output_tokens": r.randint(1, 8), "temperature": 0}
    if r.random() < 0.3:
        body["stream"] = True
    if r.random() < 0.3:
        body["tools"] = [{"type": "function", "name": "f", "parameters": {"type": "object"}}, {"type": "web_search"}]
        body["tool_choice"] = r.choice(["auto", "none", "required", {"type": "function", "name": "f"}])
    if r.random() < 0.2:
        body["previous_response_id"] = r.choice(["resp_nope", "", 5])
    if r.random() < 0.2:
        body["text"] = {"format": r.choice([{"type": "json_object"}, {"type": "json_schema", "name": "x", "schema": {}}])}
    return body


def _messages(r: random.Random) -> dict:
    content = r.choice(["Lily", [{"type": "text", "text": "Once"}], [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}],
                        [{"type": "image", "source": {}}]])
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": r.randint(1, 8),
            "temperature": 0, "system": r.choice(["Ben", [{"type": "text", "text": "Ben"}], None])}
    if r.random() < 0.3:
        body["stream"] = True
    if r.random() < 0.3:
        body["tools"] = [{"name": "f", "input_schema": {"type": "object"}}]
        body["tool_choice"] = r.choice([{"type": "auto"}, {"type": "any"}, {"type": "tool", "name": "f"}, {"type": "x"}])
    return body


def _embeddings(r: random.Random) -> dict:
    return {"model": MODEL, "input": r.choice(["Lily", ["a", "b"], [1, 400], [[1], [2, 3]], [], ""]),
            "encoding_format": r.choice(["float", "base64", "x"])}


FIELDS = ["model", "prompt", "messages", "input", "max_output_tokens", "system", "stop_sequences", "instructions", "max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "stop", "seed",
          "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "stream",
          "stream_options", "logit_bias", "stop_token_ids", "ignore_eos", "suffix", "best_of", "echo", "functions",
          "tools", "response_format", "user", "max_completion_tokens", "unknown_field"]


def make_request(r: random.Random):
    """(method, path, headers, content) of one generated request."""
    auth = {"Authorization": f"Bearer {KEY}"}
    kind = r.random()
    path = r.choice(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/responses",
                     "/v1/messages", "/v1/messages/count_tokens", "/v1/embeddings"])
    if path.startswith("/v1/messages") and r.random() < 0.5:
        auth = {"x-api-key": KEY}  # Anthropic's clients send the key so
    if kind < 0.05:  # wrong or missing key
        return "POST", "/v1/completions", r.choice([{}, {"Authorization": "Bearer nope"}, {"Authorization": KEY}]), \
            json.dumps(_completion(r))
    if kind < 0.10:  # not JSON, truncated JSON, wrong content type
        content = r.choice(["prompt=Lily", '{"prompt": "Lily", ', "\x00\xff", "[1, 2", "null", "42"])
        ctype = r.choice(["application/json", "application/x-www-form-urlencoded", "text/plain", ""])
        return "POST", path, {**auth, "content-type": ctype}, content
    if kind < 0.13:  # oversized bodies, declared or chunked
        return "POST", path, auth, json.dumps({"model": MODEL, "prompt": "Lily " * r.choice([300_000, 1_000_000])})
    if kind < 0.16:  # many containers
        return "POST", path, auth, json.dumps({"model": MODEL, "prompt": [[1]] * r.choice([100, 20_000, 40_000])})
    if kind < 0.19:  # other methods and paths
        return r.choice(["GET", "PUT", "DELETE"]), r.choice(["/v1/completions", "/v1/models", "/nope", "/health"]), auth, None
    if path == "/tokenize":
        body = r.choice([{"prompt": "Lily"}, {"messages": [{"role": "user", "content": "Lily"}]}, {}])
    elif path == "/detokenize":
        body = {"tokens": r.choice([[1, 400], [], [-1], [99999], "x", [1.5]])}
    elif path == "/v1/responses":
        body = _responses(r)
    elif path.startswith("/v1/messages"):
        body = _messages(r)
    elif path == "/v1/embeddings":
        body = _embeddings(r)
    else:
        body = _completion(r) if path == "/v1/completions" else _chat(r)
    for _ in range(r.randint(0, 3)):  # mutations
        op = r.random()
        field = r.choice(FIELDS)
        if op < 0.6:
            body[field] = r.choice(WEIRD_VALUES)
        elif op < 0.8:
            body.pop(field, None)
        elif field in ("n", "max_tokens", "best_of", "top_logprobs", "logprobs"):
            body[field] = r.choice([10**6, 10**9, -5, 64, 2])
        else:
            body["logit_bias"] = r.choice([{"400": 100}, {"abc": 1}, {"1": 1e9}, {str(i): -100 for i in range(300)}])
    return "POST", path, auth, json.dumps(body)


def send(server_url: str, request) -> tuple[int, str]:
    method, path, headers, content = request
    try:
        with httpx.Client(timeout=60) as c:
            r = c.request(method, server_url + path, headers=headers, content=content)
            return r.status_code, r.text[:300]
    except httpx.HTTPError as e:  # a refused upload may reset the connection: not a 5xx
        return 0, repr(e)


def run_round(server, requests) -> list[tuple[int, str, tuple]]:
    deadline = time.monotonic() + ROUND_DEADLINE_S
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(lambda req: send(server.url, req), requests))
    assert time.monotonic() < deadline, "the round took too long"
    return [(status, text, req) for (status, text), req in zip(results, requests)]


def test_hostile_requests_get_no_5xx_and_health_stays_fast(stories_path, tmp_path):
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    with running_server(stories_path, tmp_path, ["--served-model-name", MODEL, "--chat-template", str(template),
                                                  "--api-key", KEY]) as server:
        rss = []
        r = random.Random(1)
        requests = [make_request(r) for _ in range(REQUESTS_PER_ROUND)]
        rounds = [requests, requests]  # the same requests twice: what the first round kept, the second must not add to
        with HealthPoller(server.url, tmp_path) as health:
            for requests in rounds:
                results = run_round(server, requests)
                bad = [(status, text, req[:2]) for status, text, req in results if status >= 500]
                assert not bad, bad[:5]
                statuses = {status for status, _, _ in results}
                assert 200 in statuses and 400 in statuses and 401 in statuses and 413 in statuses, statuses
                rss.append(rss_bytes(server.process.pid))
        assert health.errors == 0
        lat = sorted(health.latencies)
        p99 = lat[int(0.99 * (len(lat) - 1))]
        assert len(lat) > 50 and p99 <= HEALTH_P99_S, f"/health p99 {p99 * 1000:.0f} ms over {len(lat)} polls"
        assert rss[1] <= 1.10 * rss[0], f"RSS grew from {rss[0] >> 20} MiB to {rss[1] >> 20} MiB"
        # still serving
        r = httpx.post(server.url + "/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                       json={"model": MODEL, "prompt": "Lily", "max_tokens": 3, "temperature": 0})
        assert r.status_code == 200, r.text
