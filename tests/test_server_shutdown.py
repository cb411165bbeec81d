"""Graceful shutdown of ``mlx-ferrum serve``: on SIGTERM or SIGINT in-flight requests end
with finish reason ``abort``, the server stops accepting, and the process exits 0."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import pytest

from support.server_helpers import running_server


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_ends_in_flight_requests_and_exits_zero(stories_path, tmp_path, sig):
    with running_server(stories_path, tmp_path, ["--served-model-name", "s"]) as server:
        body = {"model": "s", "prompt": "Once upon a time", "max_tokens": 500, "temperature": 0, "ignore_eos": True}
        result = {}

        def non_streaming():
            result["plain"] = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()

        t = threading.Thread(target=non_streaming)
        t.start()
        events = []
        with httpx.Client(timeout=60) as h:
            with h.stream("POST", server.url + "/v1/completions", json=dict(body, stream=True)) as r:
                lines = r.iter_lines()
                for line in lines:
                    if line.startswith("data: "):
                        events.append(line[6:])
                        break
                deadline = time.monotonic() + 10
                while server.metrics()["mlx_ferrum:num_requests_running"] < 2:
                    assert time.monotonic() < deadline
                    time.sleep(0.02)
                server.process.send_signal(sig)
                events.extend(line[6:] for line in lines if line.startswith("data: "))
        t.join(timeout=60)
        assert server.process.wait(timeout=60) == 0, server.log_text()
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"][0]["finish_reason"] == "abort"
    generated = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])
    assert len(generated) > 0
    assert result["plain"]["choices"][0]["finish_reason"] == "abort"
    assert result["plain"]["usage"]["completion_tokens"] < 500
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)
