"""Text that cannot be tokenized, huge prompts and runaway chat templates fail
fast with a named error, and tokenizing never holds the AsyncEngine lock."""

import asyncio
import threading
import time

import pytest

import mlx_ferrum.tokenizer as tokenizer_module
from support.checkpoints import cached_checkpoint
from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.engine import Engine, SamplingParams
from mlx_ferrum.engine.async_engine import AsyncEngine
from mlx_ferrum.errors import ChatTemplateError, PromptTooLongError, RequestError, TokenizerError
from mlx_ferrum.tokenizer import Tokenizer
from support.tiny_models import tiny_model

MSGS = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_pretrained(cached_checkpoint("llama2"))


@pytest.mark.parametrize("text", ["Once \ud800 upon", "\udcff", "ok \udc80\udc81 bytes"])
def test_lone_surrogates_raise_tokenizer_error(tok, text):
    with pytest.raises(TokenizerError, match="not valid Unicode"):
        tok.encode(text)


def test_invalid_text_in_the_engine_fails_only_that_request(tok):
    model = tiny_model("llama", vocab_size=tok.vocab_size)
    eng = Engine(model, tok, RuntimeConfig(kv_layout="paged", max_num_blocks=64))
    ok = eng.add_request("Once upon", SamplingParams(max_tokens=3, temperature=0))
    with pytest.raises(TokenizerError):
        eng.add_request("Once \ud800", SamplingParams(max_tokens=3))
    with pytest.raises(RequestError):
        eng.add_request(b"Once", SamplingParams(max_tokens=3))
    done = {}
    while eng.has_unfinished_requests():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    assert list(done) == [ok] and done[ok].finish_reason == "length"


def test_a_huge_prompt_is_refused_before_tokenization(tok, monkeypatch):
    class Exploding:
        def encode(self, *a, **k):
            raise AssertionError("tokenized a prompt over the limit")

    monkeypatch.setattr(tok, "_backend", Exploding())
    t0 = time.perf_counter()
    with pytest.raises(PromptTooLongError, match="characters"):
        tok.encode("a" * (tokenizer_module.MAX_INPUT_CHARS + 1))
    assert time.perf_counter() - t0 < 1.0


@pytest.mark.parametrize(
    "template",
    [
        "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}x",
        "{% for i in range(100000) %}{% for j in range(100000) %}{% set k = j %}{% endfor %}{% endfor %}x",
    ],
)
def test_a_template_that_loops_forever_is_stopped_by_the_time_limit(tok, template, monkeypatch):
    monkeypatch.setattr(tokenizer_module, "TEMPLATE_TIMEOUT_S", 0.5)
    t0 = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="longer than"):
        tok.apply_chat_template(MSGS, chat_template=template)
    assert time.perf_counter() - t0 < 5.0


@pytest.mark.parametrize(
    "template",
    [
        "{{ 'x' * 10**8 }}",
        "{{ 10**8 * 'x' }}",
        "{{ ['x'] * 10**8 }}",
        "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
        "{{ 'x'.center(10**8) }}",
    ],
)
def test_a_template_that_builds_a_huge_prompt_is_stopped_by_the_size_limit(tok, template):
    with pytest.raises(ChatTemplateError, match="characters|power"):
        tok.apply_chat_template(MSGS, chat_template=template)


def test_ordinary_templates_still_render(tok):
    t = "{% for m in messages %}<{{ m.role }}>{{ m.content * 2 }}{% endfor %}{% for i in range(3) %}{{ i }}{% endfor %}"
    assert tok.apply_chat_template(MSGS, chat_template=t) == "<user>hihi012"


def test_async_engine_tokenizes_off_the_event_loop_without_its_lock(tok):
    model = tiny_model("llama", vocab_size=tok.vocab_size)
    aeng = AsyncEngine(Engine(model, tok, RuntimeConfig(kv_layout="paged", max_num_blocks=64)))
    seen = []
    real = tok.encode

    def encode(text, *a, **k):
        seen.append((threading.current_thread() is threading.main_thread(), aeng._lock.locked()))
        return real(text, *a, **k)

    tok.encode = encode
    try:
        out = asyncio.run(asyncio.wait_for(aeng.generate("Once upon", SamplingParams(max_tokens=2, temperature=0)), 30))
    finally:
        del tok.encode
        aeng.shutdown()
    assert out.finish_reason == "length"
    assert seen and all(not on_main and not locked for on_main, locked in seen)
