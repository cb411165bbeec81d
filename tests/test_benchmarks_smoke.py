"""The benchmark scripts run end to end in their --quick mode (slow: run by .ci/run with -m slow)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = [
    "bench_generate.py", "bench_paged.py", "bench_kv_write.py", "bench_engine.py", "bench_moe.py",
    "bench_sliding_window_memory.py", "bench_quant_modes.py", "bench_kv_speed.py", "bench_cpu_attention.py",
    "bench_weight_layout.py",
]


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_quick_mode(script):
    path = os.path.join(REPO, "benchmarks", script)
    if not os.path.exists(path):
        pytest.skip(f"{script} is not in this checkout")
    r = subprocess.run([sys.executable, path, "--quick"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "|" in r.stdout  # a results table
    if script not in ("bench_kv_write.py", "bench_kv_speed.py", "bench_cpu_attention.py",
                      "bench_weight_layout.py"):  # mlx_ferrum (or MLX) against itself
        assert "mlx-lm" in r.stdout
