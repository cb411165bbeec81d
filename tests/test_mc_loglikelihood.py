"""A multiple-choice loglikelihood task (lm-eval's ``loglikelihood`` requests) scored
through ``mlx-ferrum serve`` (``/v1/completions``, ``echo: true``, ``logprobs``,
``max_tokens: 0``) equals the same task scored with mlx-lm's forward of stories260K
(float32): the same choice for every item, each choice's summed loglikelihood within 1e-4.

The items come from ``benchmarks/mc_task.py`` (seeded); 20 in the default run, all 200
with ``-m slow``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("mlx_lm.utils")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import mc_task  # noqa: E402
from support.server_helpers import running_server  # noqa: E402


@pytest.fixture(scope="module")
def server(stories_path, tmp_path_factory):
    with running_server(stories_path, tmp_path_factory.mktemp("serve-mc"), ["--served-model-name", "bench"]) as s:
        yield s


@pytest.fixture(scope="module")
def encoded(stories_path):
    from mlx_ferrum.tokenizer import Tokenizer

    items = mc_task.build_items(200)
    return items, mc_task.token_ids(Tokenizer.from_pretrained(stories_path), items)


def _agree(server, stories_path, items, encoded):
    ours = mc_task.score_server(server.url, "bench", encoded)
    theirs = mc_task.score_mlx_lm(stories_path, encoded)
    result = mc_task.compare(ours, theirs, items)
    assert result["choices_equal"] == len(items), result
    assert result["max_abs_diff"] <= 1e-4, result
    return result


def test_items_are_deterministic_and_well_formed():
    a, b = mc_task.build_items(200), mc_task.build_items(200)
    assert a == b and mc_task.build_items(20) == a[:20]
    for it in a:
        assert len(it["choices"]) == 4 == len(set(it["choices"])) and 0 <= it["gold"] < 4


def test_twenty_items_through_the_server_equal_mlx_lm(server, stories_path, encoded):
    items, enc = encoded
    _agree(server, stories_path, items[:20], enc[:20])


@pytest.mark.slow
def test_two_hundred_items_through_the_server_equal_mlx_lm(server, stories_path, encoded):
    items, enc = encoded
    result = _agree(server, stories_path, items, enc)
    assert 0.25 < result["accuracy_mlx_lm"] < 1.0  # close calls are in the set: not all answers are easy
