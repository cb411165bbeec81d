"""What the server refuses rather than answers wrongly, and completions text that reads as
the tokenizer decodes it, through ``mlx-ferrum serve`` on stories260K (SentencePiece) and
SmolLM2 (byte-level BPE):

- a constraint with no valid output (its grammar's error state) is a 400 naming the
  constraint, identical on every try, never a finished empty reply;
- a completion's ``text`` is what the tokenizer decodes of prompt + completion past the
  prompt (OpenAI's and vLLM's text); ``echo`` offsets point into the returned text;
- a ``tool`` message without ``tool_call_id`` or content, and ``max_tokens`` beyond the
  remaining context, are 400s.
"""

from __future__ import annotations

import json

import httpx
import pytest

from support.server_helpers import PLAIN_TEMPLATE, running_server

MODEL = "stories"


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-refusals")
    template = tmp / "plain.jinja"
    template.write_text(PLAIN_TEMPLATE)
    with running_server(stories_path, tmp, ["--served-model-name", MODEL, "--chat-template", str(template)]) as s:
        yield s


def _post(server, path, body):
    return httpx.post(server.url + path, json={"model": MODEL, **body}, timeout=60)


def _stream_events(server, path, body):
    with httpx.stream("POST", server.url + path, json={"model": MODEL, "stream": True, **body}, timeout=60) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.json()
        return 200, [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


# ------------------------------------------------------------------ constraints that cannot finish

NO_OUTPUT = [
    ("response_format", {"response_format": {"type": "json_schema", "json_schema": {"name": "loop", "schema": {"$ref": "#"}}}}),
    ("guided_json", {"guided_json": {"$ref": "#"}}),
]


@pytest.mark.parametrize("param,body", NO_OUTPUT, ids=[p for p, _ in NO_OUTPUT])
def test_a_constraint_with_no_finite_output_is_a_400_every_time(server, param, body):
    answers = []
    for _ in range(3):  # the first compiles, the later ones come from the grammar cache
        r = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Lily"}], "max_tokens": 8, **body})
        assert r.status_code == 400, r.text
        answers.append(r.json()["error"])
        status, events = _stream_events(server, "/v1/chat/completions",
                                        {"messages": [{"role": "user", "content": "Lily"}], "max_tokens": 8, **body})
        assert status == 400, events
        answers.append(events["error"])
    assert all(a == answers[0] for a in answers), answers
    err = answers[0]
    assert err["param"] == param and "json_schema constraint" in err["message"], err
    assert "<state>" not in err["message"] and "\n" not in err["message"], err  # no parser dump


def test_a_huge_repetition_behaves_the_same_fresh_and_cached(server):
    """A regex whose first request compiles it and whose later ones copy the compiled
    grammar: every answer is the same (status, text and finish reason)."""
    body = {"prompt": "Lily", "max_tokens": 6, "temperature": 0, "guided_regex": "a{1000000}"}
    cut_before = server.metrics()["mlx_ferrum:structured_output_length_finishes_total"]
    answers = []
    for _ in range(3):
        r = _post(server, "/v1/completions", body)
        answers.append((r.status_code, r.json()))
    first = answers[0]
    for status, payload in answers:
        assert status == first[0]
        if status == 200:
            c = payload["choices"][0]
            assert c["text"] == first[1]["choices"][0]["text"] and c["finish_reason"] == "length", payload
            assert c["text"] and set(c["text"]) == {"a"}, payload  # a finished empty reply is never a success
        else:
            assert status == 400 and payload == first[1]
    if first[0] == 200:  # each reply was cut by max_tokens before its grammar was complete: counted
        assert server.metrics()["mlx_ferrum:structured_output_length_finishes_total"] - cut_before == 3


# ------------------------------------------------------------------ completions text


def _greedy_ids(model_path, prompt_ids, n):
    """``n`` greedy ids after ``prompt_ids`` from mlx-lm's model (the independent reference)."""
    import mlx.core as mx

    model, _ = pytest.importorskip("mlx_lm.utils").load_model(model_path)
    ids = list(prompt_ids)
    for _ in range(n):
        ids.append(int(mx.argmax(model(mx.array([ids]))[0, -1]).item()))
    return ids[len(prompt_ids):]


def _check_completion_text(server, model_path, prompt):
    """``text`` == the tokenizer's decode of prompt + completion past decode(prompt) (OpenAI's
    and vLLM's text) and the tokens joined; streamed the same; with ``echo`` the prompt
    comes first and each ``text_offset`` is where its token's text starts."""
    from tokenizers import Tokenizer as HfTokenizer

    hf = HfTokenizer.from_file(str(model_path / "tokenizer.json"))
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    completion_ids = _greedy_ids(model_path, prompt_ids, 6)
    whole, head = hf.decode(prompt_ids + completion_ids), hf.decode(prompt_ids)
    assert whole.startswith(head)
    expected = whole[len(head):]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "logprobs": 0, "ignore_eos": True}
    c = _post(server, "/v1/completions", body).json()["choices"][0]
    assert c["text"] == expected, (c["text"], expected)
    assert "".join(c["logprobs"]["tokens"]) == expected
    assert c["logprobs"]["text_offset"] == [len(hf.decode(prompt_ids + completion_ids[:i])) - len(head) for i in range(6)]
    status, events = _stream_events(server, "/v1/completions", body)
    assert status == 200
    chunks = [json.loads(e)["choices"][0] for e in events if e != "[DONE]" and json.loads(e)["choices"]]
    assert "".join(ch["text"] for ch in chunks) == expected
    for stream in (False, True):
        echo = {**body, "echo": True}
        if stream:
            status, events = _stream_events(server, "/v1/completions", echo)
            chunks = [json.loads(e)["choices"][0] for e in events if e != "[DONE]" and json.loads(e)["choices"]]
            text = "".join(ch["text"] for ch in chunks)
            offsets = [o for ch in chunks if ch.get("logprobs") for o in ch["logprobs"]["text_offset"]]
        else:
            e = _post(server, "/v1/completions", echo).json()["choices"][0]
            text, offsets = e["text"], e["logprobs"]["text_offset"]
        assert text == prompt + expected, (stream, text)
        # token i starts where the decode of the tokens before it ends (a hidden <s> takes no room)
        want = [len(hf.decode(prompt_ids[:i])) for i in range(len(prompt_ids))]
        want += [len(prompt) + len(hf.decode(prompt_ids + completion_ids[:i])) - len(head) for i in range(6)]
        assert offsets == want, (stream, offsets, want)


def test_completion_text_is_the_decode_past_the_prompt_sentencepiece(server, stories_path):
    _check_completion_text(server, stories_path, "Once upon")


@pytest.fixture(scope="module")
def smollm2_path(stories_path):
    path = stories_path.parent / "SmolLM2-135M-Instruct"
    if not (path / "config.json").exists():
        pytest.skip(f"SmolLM2-135M-Instruct not found at {path}")
    return path


@pytest.fixture(scope="module")
def smol_server(smollm2_path, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve-refusals-smol")
    with running_server(smollm2_path, tmp, ["--served-model-name", MODEL]) as s:
        yield s


def test_completion_text_is_the_decode_past_the_prompt_byte_level(smol_server, smollm2_path):
    _check_completion_text(smol_server, smollm2_path, "Once upon")


# ------------------------------------------------------------------ fields that cannot take effect


@pytest.mark.parametrize("message,param", [
    ({"role": "tool", "content": "sunny"}, "messages.1.tool_call_id"),
    ({"role": "tool", "tool_call_id": "", "content": "sunny"}, "messages.1.tool_call_id"),
    ({"role": "tool", "tool_call_id": "call_1"}, "messages.1.content"),
    ({"role": "tool", "tool_call_id": "call_1", "content": None}, "messages.1.content"),
])
def test_a_tool_message_without_its_call_id_or_content_is_a_400(server, message, param):
    """OpenAI answers these with a 400: the result cannot be tied to its call."""
    messages = [{"role": "user", "content": "Lily"}, message]
    r = _post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    ok = _post(server, "/v1/chat/completions", {"messages": [messages[0], {**message, "tool_call_id": "call_1",
                                                                          "content": "sunny"}], "max_tokens": 2})
    assert ok.status_code == 200, ok.text


def test_max_tokens_beyond_the_remaining_context_is_a_400(server):
    """vLLM's policy: the limit the client asked for cannot be met, so it is refused; the
    default (field left out) is the rest of the context."""
    context = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    prompt_ids = httpx.post(server.url + "/tokenize", json={"prompt": "Lily"}).json()["tokens"]
    room = context - len(prompt_ids)
    for path, body, name in (
            ("/v1/completions", {"prompt": "Lily", "max_tokens": room + 1}, "max_tokens"),
            ("/v1/completions", {"prompt": "Lily", "max_tokens": 10**6, "stream": True}, "max_tokens"),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Lily"}], "max_completion_tokens": context},
             "max_completion_tokens")):
        r = _post(server, path, {"temperature": 0, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == name and str(context) in err["message"], err
    # exactly the room left, and the default, run to the end of the context
    for extra in ({"max_tokens": room}, {}):
        r = _post(server, "/v1/completions", {"prompt": "Lily", "temperature": 0, "ignore_eos": True, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == room and r.json()["choices"][0]["finish_reason"] == "length"
