"""The LoRA benchmark scripts run end to end in their --quick mode (slow: run by .ci/run with -m slow)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("script,extra", [("bench_lora.py", True), ("bench_lora_products.py", False)])
def test_lora_benchmarks_quick_mode(script, extra, stories_path):
    args = [sys.executable, os.path.join(REPO, "benchmarks", script), "--quick"]
    if extra:
        args += ["--model", str(stories_path)]
    r = subprocess.run(args, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "| " in r.stdout  # a results table
    assert ("mixed / base" if extra else "gather_mm") in r.stdout
