"""The server with LoRA adapters, through the official ``openai`` client: model listing with
``parent``, per-adapter completions equal to the engine's, run-time load and unload, 404s in
OpenAI's error shape, per-adapter request counts in ``/metrics``."""

from __future__ import annotations

import httpx
import pytest

import mlx_ferrum as mf
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from support.lora_fixtures import random_peft_adapter
from support.server_helpers import running_server

openai = pytest.importorskip("openai")

MODEL = "stories"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def adapters(stories_path, tmp_path_factory):
    model, _ = mf.load(str(stories_path))
    root = tmp_path_factory.mktemp("lora-serve")
    return {name: str(random_peft_adapter(model, root / name, seed=i, std=0.5)) for i, name in enumerate("abc")}


@pytest.fixture(scope="module")
def expected(stories_path, adapters):
    """Greedy completions of the engine in this process: per adapter, and the base."""
    model, tokenizer = mf.load(str(stories_path))
    eng = Engine(model, tokenizer, RuntimeConfig(kv_layout="paged", enable_lora=True))
    for name, path in adapters.items():
        eng.add_lora(name, path)
    names = [None, "a", "b", "c"]
    outs = eng.generate([PROMPT] * 4, SamplingParams(max_tokens=16, temperature=0.0), lora=names)
    return {n: o.text for n, o in zip(names, outs)}


@pytest.fixture(scope="module")
def server(stories_path, adapters, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-lora")
    args = ["--served-model-name", MODEL, "--lora-modules", f"a={adapters['a']}", f"b={adapters['b']}",
            "--max-loras", "2", "--max-lora-rank", "8"]
    with running_server(stories_path, tmp, args, {"FERRUM_PREFIX_CACHE": "1"}) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(client, model: str) -> str:
    return client.completions.create(model=model, prompt=PROMPT, max_tokens=16, temperature=0.0).choices[0].text


def test_models_list_adapters_with_their_parent(client, adapters):
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {MODEL, "a", "b"}
    assert cards["a"].parent == MODEL and cards["a"].root == adapters["a"]
    assert getattr(cards[MODEL], "parent", None) is None


def test_each_adapter_gets_the_engines_completion(client, expected):
    assert complete(client, MODEL) == expected[None]
    assert complete(client, "a") == expected["a"]
    assert complete(client, "b") == expected["b"]
    assert expected["a"] != expected[None] and expected["a"] != expected["b"]
    assert client.completions.create(model="a", prompt=PROMPT, max_tokens=2).model == "a"


def test_unknown_adapter_is_a_404_in_openai_shape(server, client):
    with pytest.raises(openai.NotFoundError) as info:
        complete(client, "nope")
    assert info.value.status_code == 404
    body = httpx.post(server.url + "/v1/completions", json={"model": "nope", "prompt": "x"}).json()
    assert set(body) == {"error"} and body["error"]["param"] == "model" and "'nope' does not exist" in body["error"]["message"]


def test_load_and_unload_at_run_time(server, client, adapters, expected):
    r = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
    assert r.status_code == 200, r.text
    assert "c" in {m.id for m in client.models.list().data}
    assert complete(client, "c") == expected["c"]  # a third adapter with two slots: one is evicted
    again = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": adapters["c"]})
    assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
    bad = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/no/such/folder"})
    assert bad.status_code == 400 and "no LoRA adapter folder" in bad.json()["error"]["message"]
    assert httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        complete(client, "c")
    gone = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "c"})
    assert gone.status_code == 404 and gone.json()["error"]["type"] == "NotFoundError"
    assert complete(client, "a") == expected["a"]


def test_metrics_count_requests_per_adapter(server, client):
    before = server.metrics()
    complete(client, "b")
    after = server.metrics()
    key = 'mlx_ferrum:lora_requests_total{lora_name="b"}'
    assert after[key] == before.get(key, 0) + 1
    assert after["mlx_ferrum:lora_resident_adapters"] <= 2
