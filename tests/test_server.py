"""``mlx-ferrum serve`` on the real stories260K checkpoint, driven by the official
``openai`` client (and raw httpx where the client cannot send the input).

The expected texts come from the recordings in ../shared/models/stories260K (an
independent numpy llama2.c, transformers and mlx-lm all agree on them), not from this code.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

openai = pytest.importorskip("openai")

from support.server_helpers import PLAIN_TEMPLATE, running_server, wait_until_idle  # noqa: E402

MODEL = "stories"


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    template = tmp / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    with running_server(stories_path, tmp, ["--served-model-name", MODEL, "--chat-template", str(template)],
                        {"FERRUM_PREFIX_CACHE": "0"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def once(stories_expected):
    return stories_expected["once"]


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").status_code == 200


def test_greedy_completion_equals_recording(client, once):
    r = client.completions.create(model=MODEL, prompt=once["prompt"], max_tokens=once["max_new_tokens"], temperature=0)
    assert r.choices[0].text == once["completion_text"]
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(once["prompt_ids"])
    assert r.usage.completion_tokens == len(once["generated_ids"])
    assert r.usage.total_tokens == len(once["prompt_ids"]) + len(once["generated_ids"])
    assert r.usage.prompt_tokens_details.cached_tokens == 0  # prefix cache off


def test_greedy_completion_streamed_equals_recording(client, once):
    stream = client.completions.create(model=MODEL, prompt=once["prompt"], max_tokens=once["max_new_tokens"],
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    texts, reasons, usage = [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            texts.append(c.text)
            reasons.append(c.finish_reason)
    assert "".join(texts) == once["completion_text"]
    assert reasons[-1] == "length" and all(r is None for r in reasons[:-1])
    assert usage.prompt_tokens == 5 and usage.completion_tokens == once["max_new_tokens"]


def test_completion_prompt_as_token_ids(client, once):
    r = client.completions.create(model=MODEL, prompt=once["prompt_ids"], max_tokens=30, temperature=0)
    assert once["completion_text"].startswith(r.choices[0].text) and len(r.choices[0].text) > 20


def test_greedy_chat_equals_recording_streamed_and_not(client, once):
    msgs = [{"role": "user", "content": once["prompt"]}]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=once["max_new_tokens"], temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == once["completion_text"]
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 200
    stream = client.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=once["max_new_tokens"],
                                            temperature=0, stream=True, stream_options={"include_usage": True})
    parts, roles, reasons, usage = [], [], [], None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            roles.append(c.delta.role)
            parts.append(c.delta.content or "")
            reasons.append(c.finish_reason)
    assert roles[0] == "assistant"
    assert "".join(parts) == once["completion_text"]
    assert reasons[-1] == "length"
    assert usage.completion_tokens == 200


def test_stop_strings(client, once):
    full = once["completion_text"]
    for stop in ([" girl"], "Lily."):
        r = client.completions.create(model=MODEL, prompt=once["prompt"], max_tokens=100, temperature=0, stop=stop)
        word = stop[0] if isinstance(stop, list) else stop
        assert r.choices[0].text == full[: full.index(word)]
        assert r.choices[0].finish_reason == "stop"
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": once["prompt"]}],
                                            max_tokens=100, temperature=0, stop=["park"], stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert text == full[: full.index("park")]


def test_seed_reproduces_and_is_batched_with_others(client, server, once):
    kw = dict(model=MODEL, prompt=once["prompt"], max_tokens=40, temperature=1.0, seed=1234)
    a = client.completions.create(**kw).choices[0].text
    b = client.completions.create(**kw).choices[0].text
    assert a == b
    # The same seeded request among unseeded concurrent ones gives the same text (it shares their batch).
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)

    async def together():
        others = [aclient.completions.create(model=MODEL, prompt="Lily", max_tokens=60, temperature=1.0) for _ in range(6)]
        results = await asyncio.gather(aclient.completions.create(**kw), *others)
        await aclient.close()
        return results[0].choices[0].text

    assert asyncio.run(together()) == a
    other = {client.completions.create(**dict(kw, seed=s)).choices[0].text for s in (1, 2, 3)}
    assert len(other | {a}) > 1, "different seeds should not all give the same text"


def test_n_choices(client, once):
    r = client.completions.create(model=MODEL, prompt=once["prompt"], max_tokens=30, temperature=0, n=2)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == r.choices[1].text and once["completion_text"].startswith(r.choices[0].text)
    assert r.usage.completion_tokens == 60 and r.usage.prompt_tokens == 5
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Lily"}], max_tokens=20,
                                       temperature=1.0, seed=7, n=2)
    assert len(r.choices) == 2 and {c.index for c in r.choices} == {0, 1}
    assert all(c.finish_reason in ("stop", "length") for c in r.choices)
    stream = client.completions.create(model=MODEL, prompt=["Once upon a time", "Lily"], max_tokens=10, temperature=0,
                                       n=2, stream=True)
    by_index: dict[int, str] = {}
    finished = set()
    for chunk in stream:
        for c in chunk.choices:
            by_index[c.index] = by_index.get(c.index, "") + c.text
            if c.finish_reason:
                finished.add(c.index)
    assert finished == {0, 1, 2, 3}
    assert by_index[0] == by_index[1] and by_index[2] == by_index[3] and by_index[0] != by_index[2]


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Once upon a time"}],
                                       max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    for item in content:
        assert len(item.top_logprobs) == 3
        assert item.logprob == pytest.approx(max(t.logprob for t in item.top_logprobs))  # greedy = the top token
        assert item.top_logprobs[0].token == item.token
    assert "".join(i.token for i in content) == r.choices[0].message.content
    r = client.completions.create(model=MODEL, prompt="Lily", max_tokens=5, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)


def test_penalties_change_greedy_output(client, once):
    base = client.completions.create(model=MODEL, prompt=once["prompt"], max_tokens=120, temperature=0).choices[0].text
    assert base == once["completion_text"][: len(base)]
    pen = client.completions.create(model=MODEL, prompt=once["prompt"], max_tokens=120, temperature=0,
                                    frequency_penalty=2.0, presence_penalty=2.0).choices[0].text
    assert pen != base  # the recording repeats "Lily was sad ..."; the penalties forbid that


def test_tokenize_and_detokenize(server, once):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": once["prompt"]}).json()
    assert r["tokens"] == once["prompt_ids"] and r["count"] == 5 and r["max_model_len"] == 512
    r = httpx.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": once["prompt"]}]}).json()
    assert r["tokens"] == once["prompt_ids"]
    r = httpx.post(server.url + "/detokenize", json={"tokens": once["prompt_ids"] + once["generated_ids"]}).json()
    assert r["prompt"] == once["full_text"]


def _post(server, path, body, **kw):
    return httpx.post(server.url + path, content=body if isinstance(body, (bytes, str)) else json.dumps(body),
                      headers={"content-type": "application/json"}, timeout=60, **kw)


@pytest.mark.parametrize(
    "body, status, param",
    [
        (b'{"model": "stories", "prompt": "Lily", ', 400, None),  # malformed JSON
        ({"model": MODEL, "prompt": "Lily", "temperature": -1}, 400, "temperature"),
        ({"model": MODEL, "prompt": "Lily", "top_p": 1.5}, 400, "top_p"),
        ({"model": MODEL, "prompt": "Lily", "max_tokens": 0}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "Lily", "presence_penalty": 3}, 400, "presence_penalty"),
        ({"model": MODEL, "prompt": "Lily", "n": 0}, 400, "n"),
        ({"model": MODEL, "prompt": "Lily", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": [1, 99999]}, 400, "prompt"),
        ({"model": MODEL, "prompt": "Lily " * 600}, 400, "prompt"),  # longer than the 512-token context
        ({"model": "gpt-4o", "prompt": "Lily"}, 404, "model"),
    ],
)
def test_bad_inputs_get_openai_errors_and_server_keeps_serving(server, client, body, status, param):
    r = _post(server, "/v1/completions", body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert err["param"] == param
    assert client.completions.create(model=MODEL, prompt="Lily", max_tokens=3, temperature=0).choices[0].text


def test_bad_chat_inputs(server):
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x " * 600}]})
    assert r.status_code == 400
    r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Lily"}],
                                               "max_tokens": 2, "unknown_field": {"a": 1}})
    assert r.status_code == 200  # unknown fields are ignored, as OpenAI does


def test_32_concurrent_streaming_clients(server, client, once):
    prompts = ["Once upon a time", "Lily", "One day", "The cat"]
    solo = {p: client.completions.create(model=MODEL, prompt=p, max_tokens=48, temperature=0).choices[0].text for p in prompts}
    aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def one(i):
        p = prompts[i % len(prompts)]
        if i % 2:
            stream = await aclient.completions.create(model=MODEL, prompt=p, max_tokens=48, temperature=0, stream=True)
            text = "".join([c.choices[0].text async for c in stream if c.choices])
        else:
            stream = await aclient.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": p}],
                                                           max_tokens=48, temperature=0, stream=True)
            text = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
        return p, text

    async def run_all():
        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), timeout=300)
        finally:
            await aclient.close()

    results = asyncio.run(run_all())
    assert len(results) == 32
    for p, text in results:
        assert text == solo[p], p


def test_closing_a_stream_aborts_the_request_and_frees_blocks(server):
    before = server.metrics()
    assert before["mlx_ferrum:num_requests_running"] == 0
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 450, "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as h:
        with h.stream("POST", server.url + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(g.startswith("data: ") for g in got)
            during = server.metrics()
            assert during["mlx_ferrum:num_requests_running"] == 1
            assert during["mlx_ferrum:kv_cache_used_blocks"] > 0
    m = wait_until_idle(server)
    time.sleep(0.5)
    after = server.metrics()
    generated = after["mlx_ferrum:generation_tokens_total"] - before["mlx_ferrum:generation_tokens_total"]
    assert generated < 450, "the request ran to its end instead of being aborted"
    assert after["mlx_ferrum:generation_tokens_total"] == m["mlx_ferrum:generation_tokens_total"]
    assert after['mlx_ferrum:request_success_total{finished_reason="abort"}'] >= 1


def test_metrics_exposition(server, client):
    client.completions.create(model=MODEL, prompt="Lily", max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ("mlx_ferrum:num_requests_running", "mlx_ferrum:num_requests_waiting", "mlx_ferrum:kv_cache_usage_perc",
                 "mlx_ferrum:prefix_cache_hit_rate", "mlx_ferrum:time_to_first_token_seconds_bucket",
                 "mlx_ferrum:inter_token_latency_seconds_bucket", 'mlx_ferrum:request_success_total{finished_reason="length"}'):
        assert name in text, name


def test_one_refused_prompt_fails_the_request_and_aborts_its_siblings(server):
    before = server.metrics()["mlx_ferrum:generation_tokens_total"]
    body = {"model": MODEL, "prompt": ["Lily", "Lily " * 600], "max_tokens": 400, "ignore_eos": True, "n": 2}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    wait_until_idle(server)
    time.sleep(0.3)
    assert server.metrics()["mlx_ferrum:generation_tokens_total"] - before < 2 * 400  # the "Lily" pair did not run to the end


def test_client_leaving_a_non_streamed_request_aborts_it(server):
    before = server.metrics()
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 450, "temperature": 0, "ignore_eos": True}
    # 450 tokens take at least ~0.3 s here even on the compiled decode step (about
    # 0.7 ms a token), so a 0.1 s read timeout leaves while the request still runs
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(10, read=0.1))
    m = wait_until_idle(server)
    time.sleep(0.5)
    after = server.metrics()
    assert after["mlx_ferrum:generation_tokens_total"] - before["mlx_ferrum:generation_tokens_total"] < 450
    assert after['mlx_ferrum:request_success_total{finished_reason="abort"}'] > before.get(
        'mlx_ferrum:request_success_total{finished_reason="abort"}', 0)
