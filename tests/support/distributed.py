"""Run a spec on 2 processes over the ring backend on loopback (``mlx.launch``), and the
same requests in this process, for the parallel-identity tests."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

WORKER = Path(__file__).with_name("distributed_worker.py")
ROOT = Path(__file__).resolve().parents[2]


def mlx_launch() -> Optional[str]:
    """``mlx.launch`` next to this interpreter (the venv's), else the one on PATH."""
    local = Path(sys.executable).with_name("mlx.launch")
    return str(local) if local.exists() else shutil.which("mlx.launch")


def launch_ranks(spec: dict, tmp_path: Path, size: int = 2, timeout: float = 240.0):
    """Launch ``size`` ranks of tests/support/distributed_worker.py on ``spec``:
    ``(completed process, folder of the ranks' result files)``."""
    launcher = mlx_launch()
    if launcher is None:
        pytest.skip("mlx.launch is not installed (it ships with the mlx package)")
    spec_file = tmp_path / "spec.json"
    spec_file.write_text(json.dumps(spec))
    out = tmp_path / "ranks"
    out.mkdir()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    cmd = [launcher, "--backend", "ring", "-n", str(size), "--hosts", "127.0.0.1", "--",
           sys.executable, str(WORKER), str(spec_file), str(out)]
    proc = subprocess.run(cmd, cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=timeout)
    return proc, out


def run_ranks(spec: dict, tmp_path: Path, size: int = 2, timeout: float = 240.0) -> list[dict]:
    """Launch ``size`` ranks of tests/support/distributed_worker.py on ``spec``; return
    every rank's result (the test fails naming the rank when one failed or wrote nothing)."""
    proc, out = launch_ranks(spec, tmp_path, size, timeout)
    results = []
    for rank in range(size):
        file = out / f"rank{rank}.json"
        assert file.exists(), f"rank {rank} wrote no result (rc {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        res = json.loads(file.read_text())
        assert res["ok"], f"rank {rank} failed:\n{res.get('error')}\n{proc.stderr[-2000:]}"
        results.append(res)
    return results


def one_process_tokens(model, case: dict) -> list[list[int]]:
    """The case's requests run by a plain :class:`~mlx_ferrum.engine.Engine` in this process."""
    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.engine import Engine
    from mlx_ferrum.engine.sampling import SamplingParams

    config = RuntimeConfig(kv_layout=case["layout"], max_num_seqs=case.get("max_num_seqs", 32),
                           max_num_blocks=case.get("max_num_blocks"), speculative=case.get("speculative"),
                           speculative_disable_by_batch_size=case.get("speculative_disable_by_batch_size"),
                           kv_cache_dtype=case.get("kv_cache_dtype"), tensor_parallel_size=1, pipeline_parallel_size=1)
    engine = Engine(model, None, config)
    outs = engine.generate([list(p) for p in case["prompts"]], [SamplingParams(**p) for p in case["params"]])
    return [list(o.token_ids) for o in outs]
