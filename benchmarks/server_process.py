"""``mlx-ferrum serve`` as a child process on 127.0.0.1, for the benchmarks that drive it.

Shared by ``bench_structured.py`` and ``mc_task.py`` (each imports it; neither imports
the other).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``mlx-ferrum serve`` on 127.0.0.1 (stopped with SIGINT, then SIGKILL)."""

    def __init__(self, model: Path, clients: int, log_dir: Path):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_dir / "server.log", "w")
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_ferrum", "serve", "--model", str(model), "--port", str(self.port),
             "--served-model-name", "bench", "--max-num-seqs", str(max(clients, 8)), "--log-level", "warning"],
            stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited; see {log_dir / 'server.log'}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("the server did not start in 120 s")
            time.sleep(0.3)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.log.close()
