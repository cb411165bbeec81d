"""The KV quantization benchmarks' data and their --quick runs."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quality_text_is_long_enough_under_the_stories_tokenizer(stories_path):
    from transformers import AutoTokenizer

    with open(os.path.join(REPO, "benchmarks", "data", "kv_quality_text.txt"), encoding="utf-8") as f:
        text = f.read()
    tok = AutoTokenizer.from_pretrained(str(stories_path))
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) >= 4000
    assert tok.unk_token_id not in ids  # plain English the tokenizer covers
    readme = open(os.path.join(REPO, "benchmarks", "data", "README.md"), encoding="utf-8").read()
    assert "kv_quality_text.txt" in readme and "original" in readme


@pytest.mark.slow
@pytest.mark.parametrize("script", ["bench_kv_quality.py", "bench_kv_memory.py"])
def test_kv_benchmark_quick_mode(script):
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", script), "--quick"], capture_output=True,
                       text=True, timeout=600, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "| int8" in r.stdout and "| int4" in r.stdout
