"""A request that fails after its stream has started ends the stream with an error event.

OpenAI's shape for it is an SSE event of its own, ``data: {"error": {...}}`` (what vLLM
sends; the official client raises it as an ``APIError``), then ``[DONE]``; a choice that
ends with ``finish_reason: "error"`` would read as a finished reply to a client. The
failure is real: the model raises inside the engine's step after a few tokens.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import AsyncEngine, Engine
from mlx_ferrum.server.app import build_app
from mlx_ferrum.server.serving import OpenAIServing
from support.server_helpers import PLAIN_TEMPLATE  # noqa: E402


class FailsAfter:
    """The model, raising on its ``calls``-th forward pass (every step calls it: eager)."""

    def __init__(self, model, calls: int):
        self._model, self.calls, self.count = model, calls, 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def __call__(self, *args, **kwargs):
        self.count += 1
        if self.count == self.calls:
            raise RuntimeError("injected failure in the forward pass")
        return self._model(*args, **kwargs)


async def _events(app, path: str, body: dict) -> list[str]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        r = await client.post(path, json=body, timeout=60)
        assert r.status_code == 200, r.text
        return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Once upon a time"}]}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Once upon a time"}],
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}),
    ("/v1/completions", {"prompt": "Once upon a time"}),
], ids=["chat", "chat-with-tools", "completions"])
def test_a_failure_mid_stream_is_an_error_event_not_a_finished_choice(stories_path, path, body):
    from mlx_ferrum import load

    model, tokenizer = load(str(stories_path))
    engine = Engine(model, tokenizer, RuntimeConfig(kv_layout="paged", enforce_eager=True))
    engine.runner.model = FailsAfter(engine.runner.model, calls=6)
    async_engine = AsyncEngine(engine)
    try:
        app = build_app(OpenAIServing(async_engine, ["m"], PLAIN_TEMPLATE), web_ui=False)
        events = asyncio.run(_events(app, path, {"model": "m", "stream": True, "max_tokens": 40,
                                                 "temperature": 0, **body}))
    finally:
        async_engine.shutdown()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "injected failure" in error["message"] and error["code"] == 500, error
    assert any(json.loads(e).get("choices") for e in events[:-2]), "the stream had started before the failure"
    finish = [c.get("finish_reason") for e in events[:-2] for c in json.loads(e).get("choices", [])]
    assert "error" not in finish and "stop" not in finish and "length" not in finish, finish
