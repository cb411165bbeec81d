"""benchmarks/bench_serving.py --compare --quick runs end to end against both servers
(slow: it starts mlx-ferrum serve twice and mlx_lm.server once)."""

import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_bench_serving_quick_compare(stories_path, tmp_path):
    pytest.importorskip("mlx_lm")
    out = tmp_path / "raw.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_serving.py"), "--compare", "--quick",
                        "--model", str(stories_path), "--json", str(out)],
                       capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=REPO), cwd=REPO)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "mlx_lm.server" in r.stdout and "| server |" in r.stdout
    import json

    raw = json.loads(out.read_text())
    for workload in ("random", "shared-prefix"):
        for side, runs in raw[workload].items():
            if side.startswith("mlx-ferrum"):  # mlx_lm.server may reset connections past its listen backlog
                assert all(run["failed"] == 0 for run in runs), (workload, side, runs)
            assert all(run["completed"] > 0 for run in runs), (workload, side, runs)
