"""``mlx-ferrum serve --speculative ngram``: the recording still comes back (greedy
speculation is exact) and ``/metrics`` counts the proposed and accepted tokens."""

from __future__ import annotations

import re

import httpx
import pytest

openai = pytest.importorskip("openai")

from support.server_helpers import running_server  # noqa: E402


def _counter(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:_total)? ([0-9.e+]+)$", text, re.MULTILINE)
    assert match, f"{name} missing from /metrics"
    return float(match.group(1))


def test_serve_with_ngram_speculation_reproduces_the_recording_and_exports_counters(
        stories_path, stories_expected, tmp_path):
    once = stories_expected["once"]
    with running_server(stories_path, tmp_path, ["--served-model-name", "stories", "--speculative", "ngram",
                                                 "--num-speculative-tokens", "3"], {}) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        r = client.completions.create(model="stories", prompt=once["prompt"], max_tokens=once["max_new_tokens"],
                                      temperature=0)
        assert r.choices[0].text == once["completion_text"]
        text = httpx.get(server.url + "/metrics").text
    proposed = _counter(text, "mlx_ferrum:spec_decode_num_draft_tokens")
    accepted = _counter(text, "mlx_ferrum:spec_decode_num_accepted_tokens")
    assert proposed > 0 and 0 < accepted <= proposed
    assert _counter(text, "mlx_ferrum:spec_decode_num_drafts") > 0
