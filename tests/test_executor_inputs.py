"""The executor refuses ``input_ids`` that are not one sequence of integer token ids."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_ferrum.config import RuntimeConfig
from mlx_ferrum.errors import ExecutorError, InvalidInputIdsError
from mlx_ferrum.executor import DecodeInput, LlmExecutor, PrefillInput
from support.tiny_models import tiny_model

LAYOUTS = ["paged", "contiguous"]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", seed=3)


def executor(model, layout):
    return LlmExecutor(model, RuntimeConfig(kv_layout=layout, block_size=8, max_num_blocks=32))


def _blocks_in_use(ex):
    return ex.manager.num_in_use if ex.manager is not None else 0


BAD_PREFILL = [
    (mx.array([[1.7, 40.2]]), "integer dtype"),
    (np.array([[1.0, 40.0]]), "integer dtype"),
    ([[1.5, 2.5]], "integer dtype"),
    (mx.array([[True, False]]), "integer dtype"),
    (mx.array([1, 2, 3]), r"shape \[1, L\]"),
    ([1, 2, 3], r"shape \[1, L\]"),
    (mx.zeros((1, 2, 3), dtype=mx.int32), r"shape \[1, L\]"),
    (mx.zeros((2, 3), dtype=mx.int32), r"shape \[1, L\]"),
    (mx.zeros((1, 0), dtype=mx.int32), "empty"),
    (mx.array([[1, 97]]), "outside the vocabulary"),
    (mx.array([[-1, 2]]), "outside the vocabulary"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ids,match", BAD_PREFILL, ids=[f"bad{i}" for i in range(len(BAD_PREFILL))])
def test_prefill_refuses_input_ids_that_are_not_one_integer_sequence(model, layout, ids, match):
    ex = executor(model, layout)
    with pytest.raises(InvalidInputIdsError, match=match) as info:
        ex.prefill(PrefillInput(input_ids=ids, cache_id="c"))
    assert isinstance(info.value, ExecutorError)
    assert not ex.has_cache("c") and _blocks_in_use(ex) == 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_decode_batch_decode_and_forward_verify_refuse_bad_ids(model, layout):
    ex = executor(model, layout)
    h = ex.prefill(PrefillInput(input_ids=mx.array([[1, 2, 3]]))).kv_cache
    other = ex.prefill(PrefillInput(input_ids=mx.array([[4, 5]]))).kv_cache
    before = ex.num_tokens(h.cache_id)
    for ids, match in [(mx.array([[4.9]]), "integer dtype"), (mx.array([4]), r"shape \[1, L\]"),
                       (mx.array([[97]]), "outside the vocabulary")]:
        with pytest.raises(InvalidInputIdsError, match=match):
            ex.decode(DecodeInput(input_ids=ids, kv_cache=h))
        with pytest.raises(InvalidInputIdsError, match=match):
            ex.batch_decode([DecodeInput(input_ids=mx.array([[5]]), kv_cache=other), DecodeInput(input_ids=ids, kv_cache=h)])
        with pytest.raises(InvalidInputIdsError, match=match):
            ex.forward_verify([DecodeInput(input_ids=mx.array([[5]]), kv_cache=h), DecodeInput(input_ids=ids, kv_cache=h)])
    assert ex.num_tokens(h.cache_id) == before and ex.num_tokens(other.cache_id) == 2  # nothing was written
    # any integer dtype still works
    a = ex.decode(DecodeInput(input_ids=mx.array([[5]], dtype=mx.int64), kv_cache=h)).logits
    assert a.shape == (1, 97)
    ex.release_cache(h.cache_id)
    ex.release_cache(other.cache_id)
    assert _blocks_in_use(ex) == 0
