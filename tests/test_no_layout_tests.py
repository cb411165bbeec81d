"""The layers and models never ask which KV layout is in use: they call the attention
backend the pass's metadata carries (mlx_ferrum.layers.attention), chosen once when the
KV store was built."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent / "mlx_ferrum"

#: what a layout test looks like: a comparison with a layout name or of a ``layout``
#: attribute, or a type test on a layout's metadata, store or backend
LAYOUT_TESTS = [
    re.compile(r"""[!=]=\s*["'](paged|contiguous|none)["']"""),
    re.compile(r"""["'](paged|contiguous|none)["']\s*[!=]="""),
    re.compile(r"""\blayout\s*[!=]="""),
    re.compile(r"""\blayout\s+(not\s+)?in\s*[\(\[\{]"""),
    re.compile(r"""isinstance\([^)]*(Metadata|KvStore|AttentionBackend|KvPool|KvCacheManager)"""),
]


def _sources():
    for folder in ("layers", "models"):
        yield from sorted((ROOT / folder).rglob("*.py"))


def test_the_scan_covers_the_attention_layers_and_the_model_families():
    names = {p.relative_to(ROOT).as_posix() for p in _sources()}
    assert {"layers/attention.py", "layers/quantized_backends.py", "models/llama.py", "models/gemma3.py"} <= names


@pytest.mark.parametrize("pattern", LAYOUT_TESTS, ids=lambda p: p.pattern)
def test_the_patterns_catch_what_the_layers_used_to_write(pattern):
    # each pattern must be able to fail: it matches at least one of the old forms
    old_forms = ['if meta.layout == "paged":', 'meta.layout != "paged"', 'if "paged" == layout:',
                 'if layout in ("paged", "contiguous"):', "isinstance(meta, PagedMetadata)",
                 "if meta.layout == 'none'"]
    assert any(pattern.search(line) for line in old_forms)


def test_no_layer_or_model_tests_the_kv_layout():
    found = []
    for path in _sources():
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if any(p.search(code) for p in LAYOUT_TESTS):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not found, "layout tests in layers/models (call meta.backend instead):\n" + "\n".join(found)
