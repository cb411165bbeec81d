"""``mlx-ferrum serve`` with a tiny KV pool, the prefix cache and an API key: the 400 for a
request the pool can never hold, ``usage.prompt_tokens_details.cached_tokens``, and 401s."""

from __future__ import annotations

import httpx
import pytest

openai = pytest.importorskip("openai")

from support.server_helpers import running_server  # noqa: E402

KEY = "test-key-123"
BLOCK_SIZE = 16
NUM_BLOCKS = 8  # 128 tokens in the whole pool


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    env = {"FERRUM_KV_MAX_BLOCKS": str(NUM_BLOCKS), "FERRUM_PAGED_BLOCK_SIZE": str(BLOCK_SIZE), "FERRUM_PREFIX_CACHE": "1"}
    with running_server(stories_path, tmp_path_factory.mktemp("serve-limits"), ["--served-model-name", "s", "--api-key", KEY], env) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=120)


def test_api_key(server, client):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.url + "/v1/completions", json={"model": "s", "prompt": "Lily"}, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(server.url + "/health").status_code == 200  # probes need no key
    assert httpx.get(server.url + "/metrics").status_code == 200
    assert client.completions.create(model="s", prompt="Lily", max_tokens=3, temperature=0).choices[0].text


def test_request_the_pool_can_never_hold_is_a_400(client, stories_expected):
    once = stories_expected["once"]
    ids = once["prompt_ids"] + once["generated_ids"][:150]  # 155 tokens: within the 512 context, over the 128-token pool
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="s", prompt=ids, max_tokens=4, temperature=0)
    assert "KV blocks" in str(e.value)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="s", prompt=ids, max_tokens=4, temperature=0, stream=True)
    # the server still serves
    assert client.completions.create(model="s", prompt="Lily", max_tokens=3, temperature=0).choices[0].text


def test_cached_tokens_report_prefix_cache_hits(client, server, stories_expected):
    once = stories_expected["once"]
    ids = once["prompt_ids"] + once["generated_ids"][:60]  # 65 tokens
    hits_before = server.metrics()["mlx_ferrum:prefix_cache_hits_total"]
    first = client.completions.create(model="s", prompt=ids, max_tokens=20, temperature=0)
    second = client.completions.create(model="s", prompt=ids, max_tokens=20, temperature=0)
    # full blocks that still leave the last prompt token to run through the model
    expected = (len(ids) - 1) // BLOCK_SIZE * BLOCK_SIZE
    assert first.usage.prompt_tokens == second.usage.prompt_tokens == len(ids)
    assert second.usage.prompt_tokens_details.cached_tokens == expected
    assert second.choices[0].text == first.choices[0].text
    hits = server.metrics()["mlx_ferrum:prefix_cache_hits_total"] - hits_before
    assert hits >= expected


def test_serve_with_an_unreadable_chat_template_exits_2(stories_path, tmp_path):
    import os
    import subprocess
    import sys

    from support.server_helpers import REPO

    r = subprocess.run([sys.executable, "-m", "mlx_ferrum", "serve", "--model", str(stories_path),
                        "--chat-template", str(tmp_path / "missing.jinja")], capture_output=True, text=True, timeout=120,
                       cwd=str(REPO), env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert r.returncode == 2 and "--chat-template" in r.stderr
