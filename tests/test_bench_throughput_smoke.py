"""benchmarks/bench_throughput.py and benchmarks/profile_step.py run end to end on stories260K
(small settings; the figures are not checked, only that both sides ran and agree)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(args):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)


@pytest.mark.slow
def test_bench_throughput_runs_both_sides(stories_path):
    r = _run(["benchmarks/bench_throughput.py", "--model", str(stories_path), "--concurrency", "1,3",
              "--max-tokens", "6", "--repeats", "1", "--with-sync"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| 3 ")]
    assert len(rows) == 4, r.stdout  # the ratio row, then ferrum, ferrum-sync, mlx-lm
    assert rows[0].rstrip(" |").endswith("1.000"), "greedy tokens differ from mlx-lm's"


@pytest.mark.slow
def test_profile_step_runs(stories_path):
    r = _run(["benchmarks/profile_step.py", "--model", str(stories_path), "--concurrency", "2", "--steps", "3"])
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    assert "mlx_ferrum paged" in r.stdout and "mlx-lm" in r.stdout
