"""mf.load / mf.generate / mf.stream_generate on the real stories260K checkpoint and test checkpoints."""

import pytest

import mlx_ferrum as mf
from support.checkpoints import cached_checkpoint
from mlx_ferrum.errors import PromptTooLongError, SamplingParamsError

LAYOUTS = [mf.RuntimeConfig(kv_layout="contiguous"), mf.RuntimeConfig(kv_layout="paged", block_size=16)]


@pytest.fixture(scope="module")
def stories(stories_path):
    return mf.load(stories_path)


@pytest.mark.parametrize("cfg", LAYOUTS, ids=["contiguous", "paged"])
def test_generate_reproduces_both_recordings(stories, stories_expected, cfg):
    model, tok = stories
    once = stories_expected["once"]
    assert tok.encode(once["prompt"]) == once["prompt_ids"]
    assert mf.generate(model, tok, once["prompt"], max_tokens=200, temperature=0.0, config=cfg) == once["completion_text"]
    bos = stories_expected["bos"]
    chunks = list(mf.stream_generate(model, tok, bos["prompt_ids"], max_tokens=200, temperature=0.0, config=cfg))
    assert [c.token for c in chunks] == bos["generated_ids"]
    assert "".join(c.text for c in chunks) == bos["completion_text"]
    assert chunks[-1].finish_reason == "length" and chunks[-1].generation_tokens == 200
    assert all(c.finish_reason is None for c in chunks[:-1])


def test_stops_seeds_and_errors(stories, stories_expected):
    model, tok = stories
    text = stories_expected["once"]["completion_text"]
    out = mf.generate(model, tok, "Once upon a time", max_tokens=200, temperature=0.0, stop=["red ball"])
    assert out == text[: text.index("red ball")]
    ids = stories_expected["once"]["generated_ids"]
    chunks = list(mf.stream_generate(model, tok, "Once upon a time", max_tokens=200, temperature=0.0,
                                     stop_token_ids=[ids[5]]))
    assert chunks[-1].finish_reason == "stop" and [c.token for c in chunks] == ids[:6]
    a = mf.generate(model, tok, "Once upon a time", max_tokens=30, temperature=1.0, seed=3)
    b = mf.generate(model, tok, "Once upon a time", max_tokens=30, temperature=1.0, seed=3)
    c = mf.generate(model, tok, "Once upon a time", max_tokens=30, temperature=1.0, seed=4)
    assert a == b and a != c
    with pytest.raises(PromptTooLongError, match="512"):
        mf.generate(model, tok, [3 + i % 500 for i in range(512)], max_tokens=4)
    with pytest.raises(SamplingParamsError, match="temperature"):
        mf.generate(model, tok, "x", temperature=-1)


def test_generation_stops_at_the_end_of_the_context(stories):
    model, tok = stories
    chunks = list(mf.stream_generate(model, tok, list(range(3, 503)), max_tokens=100, temperature=0.0,
                                     ignore_eos=True))
    assert len(chunks) == 12 and chunks[-1].finish_reason == "length"  # 500 prompt + 12 = 512


def test_messages_use_the_chat_template():
    path = cached_checkpoint("qwen2")
    model, tok = mf.load(path)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    assert "<|im_start|>assistant" in tok.apply_chat_template(msgs, add_generation_prompt=True)
    via_messages = mf.generate(model, tok, msgs, max_tokens=12, temperature=0.0, ignore_eos=True)
    via_ids = mf.generate(model, tok, ids, max_tokens=12, temperature=0.0, ignore_eos=True)
    assert via_messages == via_ids and via_messages


def test_repeated_calls_reuse_one_engine_and_load_a_draft_checkpoint_once(stories, stories_path, monkeypatch):
    """mf.generate builds its engine (pool, compiled steps, proposer) once per model and
    configuration: a draft-model speculative config must not reload the draft per call."""
    import mlx_ferrum.models.loader as loader

    model, tok = stories
    loads = []
    real = loader.load_model

    def counting(*args, **kwargs):
        loads.append(args[0] if args else kwargs.get("path_or_repo_id"))
        return real(*args, **kwargs)

    monkeypatch.setattr(loader, "load_model", counting)
    cfg = mf.RuntimeConfig(kv_layout="paged", speculative=str(stories_path), num_speculative_tokens=2)
    first = mf.generate(model, tok, "Once upon a time", max_tokens=12, temperature=0.0, config=cfg)
    second = mf.generate(model, tok, "Once upon a time", max_tokens=12, temperature=0.0, config=cfg)
    assert first == second
    assert loads == [str(stories_path)], f"draft loaded {len(loads)} times"
    assert mf.engine_for(model, tok, cfg) is mf.engine_for(model, tok, cfg)
    # the same text as without speculation (greedy): the cached engine is a normal engine
    assert first == mf.generate(model, tok, "Once upon a time", max_tokens=12, temperature=0.0)


class _DetokenizerFault(Exception):
    """Raised by :class:`_FailingTokenizer`'s detokenizer: a failure type of no library."""


class _FailingTokenizer:
    """A tokenizer whose detokenizer raises ``error`` at the ``after``-th token: the engine
    fails that request with the exception, which the API must re-raise as it was."""

    eos_token_ids = ()
    chat_template = None

    def __init__(self, error: BaseException, after: int = 2):
        self.error, self.after = error, after

    def detokenizer(self, prompt_ids=()):
        tokenizer = self

        class Detokenizer:
            count = 0

            def add_token(self, token):
                self.count += 1
                if self.count >= tokenizer.after:
                    raise tokenizer.error
                return ""

            def finalize(self):
                return ""

        return Detokenizer()


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
@pytest.mark.parametrize("error", [
    _DetokenizerFault("the detokenizer broke"),
    # a FerrumError subclass whose message starts with another error type's name: the
    # API used to parse that name out of the engine's error string
    mf.errors.TokenizerError("NonFiniteLogitsError: this is not about logits"),
], ids=["own_type", "ferrum_type"])
def test_a_failure_in_the_engine_keeps_its_exception_type(layout, error):
    """generate / stream_generate re-raise the exception that failed the request (the
    engine's RequestOutput carries it), not a FerrumError made from its text."""
    from support.tiny_models import tiny_model

    model = tiny_model("llama", seed=3)
    cfg = mf.RuntimeConfig(kv_layout=layout)
    with pytest.raises(type(error)) as caught:
        mf.generate(model, _FailingTokenizer(error), [1, 2, 3], max_tokens=6, temperature=0.0, config=cfg)
    assert caught.value is error and type(caught.value) is type(error)
    # the engine behind the API still serves the next request
    chunks = list(mf.stream_generate(model, _FailingTokenizer(error, after=100), [1, 2, 3], max_tokens=3,
                                     temperature=0.0, config=cfg))
    assert len(chunks) == 3
