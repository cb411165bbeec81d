"""Start ``mlx-ferrum serve`` as a real process on 127.0.0.1 for the server tests.

``running_server(...)`` is a context manager that always stops the process (SIGTERM,
then SIGKILL) even when the test fails, and yields a :class:`ServerProcess`.
"""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]

#: A plain chat template for stories260K (which has none): BOS, then the message texts.
PLAIN_TEMPLATE = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{% endfor %}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServerProcess:
    process: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def metrics(self) -> dict:
        """Unlabelled samples of /metrics as {name: value}."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@contextlib.contextmanager
def running_server(model: Path, log_dir: Path, extra_args=(), env_extra=None, startup_s: float = 120.0):
    port = free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.update(env_extra or {})
    log = log_dir / f"server-{port}.log"
    args = [sys.executable, "-m", "mlx_ferrum", "serve", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning", *extra_args]
    with open(log, "w") as fh:
        proc = subprocess.Popen(args, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
    server = ServerProcess(proc, port, log)
    try:
        deadline = time.monotonic() + startup_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode}:\n{server.log_text()}")
            try:
                if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not start in {startup_s} s:\n{server.log_text()}")
            time.sleep(0.25)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


_POLLER = r"""
import sys, time, httpx
url, out, stop = sys.argv[1], sys.argv[2], sys.argv[3]
import os
lat, errors = [], 0
with httpx.Client(timeout=5) as c:
    while not os.path.exists(stop):
        t = time.perf_counter()
        try:
            errors += c.get(url + "/health").status_code != 200
        except httpx.HTTPError:
            errors += 1
        lat.append(time.perf_counter() - t)
        if len(lat) == 1:
            open(stop + ".ready", "w").close()
        time.sleep(0.02)
open(out, "w").write(repr({"latencies": lat, "errors": errors}))
"""


class HealthPoller:
    """Polls ``/health`` every 20 ms from its own process (so the test's own threads do not
    delay it); after the ``with`` block, ``latencies`` (seconds) and ``errors`` (count)."""

    def __init__(self, url: str, folder: Path):
        self.url, self.out, self.stop = url, folder / "health.txt", folder / "health.stop"
        self.latencies: list[float] = []
        self.errors = 0

    def __enter__(self):
        self.process = subprocess.Popen([sys.executable, "-c", _POLLER, self.url, str(self.out), str(self.stop)])
        ready = Path(str(self.stop) + ".ready")
        deadline = time.monotonic() + 30
        while not ready.exists():  # polling has begun
            assert self.process.poll() is None and time.monotonic() < deadline, "the /health poller did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        self.stop.touch()
        self.process.wait(30)
        result = ast.literal_eval(self.out.read_text())
        self.latencies, self.errors = result["latencies"], result["errors"]


def wait_until_idle(server, timeout_s: float = 15.0) -> dict:
    """Poll ``/metrics`` until no request runs and no KV block is used; returns those metrics."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = server.metrics()
        if m["mlx_ferrum:num_requests_running"] == 0 and m["mlx_ferrum:kv_cache_used_blocks"] == 0:
            return m
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
