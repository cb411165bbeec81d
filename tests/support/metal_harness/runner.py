"""Persistent worker processes, one per compiled kernel, with a timeout per launch.

Compiling and starting a process once per kernel (not per launch) keeps a model
run of thousands of launches fast. A worker that crashes or times out is killed
and replaced at the next launch; its stderr becomes the error message, with the
faulting instruction mapped back to the ``.metal`` line when a symbolizer exists.
"""

from __future__ import annotations

import atexit
import os
import pickle
import re
import select
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

from mlx_ferrum.errors import KernelError

WORKER = Path(__file__).resolve().parent / "worker.py"
MAX_WORKERS = 8


class Worker:
    """One child process serving launches of one shared object."""

    def __init__(self, so_path: Path):
        self.so_path = so_path
        self.stderr = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKER), str(so_path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )

    def _stderr_text(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read().decode(errors="replace")

    def _read_exact(self, n: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        chunks = []
        while n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError
            c = os.read(fd, min(n, 1 << 20))
            if not c:
                raise EOFError
            chunks.append(c)
            n -= len(c)
        return b"".join(chunks)

    def request(self, req: dict, timeout: float, what: str) -> dict:
        """Send one launch; return the reply dict.

        Raises:
            KernelError: the worker crashed (out-of-bounds access, stack overflow, ...)
                or did not answer within ``timeout`` seconds (a hang).
        """
        data = pickle.dumps(req, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            self.proc.stdin.write(struct.pack("<Q", len(data)))
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
            deadline = time.monotonic() + timeout
            n = struct.unpack("<Q", self._read_exact(8, deadline))[0]
            return pickle.loads(self._read_exact(n, deadline))
        except TimeoutError:
            self.close()
            raise KernelError(
                f"{what}: the launch did not finish within {timeout:.0f} s "
                "(a hang: an infinite loop, or a barrier some threads never reach?)"
            ) from None
        except (EOFError, BrokenPipeError):
            rc = self.proc.wait()
            text = self._stderr_text()
            self.close()
            raise KernelError(f"{what}: the kernel crashed (exit status {rc}):\n{_explain_fault(text)}") from None

    def alive(self) -> bool:
        """True while the child process runs."""
        return self.proc.poll() is None

    def close(self) -> None:
        """Stop the child process."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=2)
            except Exception:
                self.proc.send_signal(signal.SIGKILL)
                self.proc.wait()
        self.stderr.close()


def _explain_fault(text: str) -> str:
    """Append the ``.metal`` file:line of a faulting instruction when it can be found."""
    m = re.search(r"MSL_FAULT_PC (\S+) (0x[0-9a-f]+)", text)
    if not m:
        return text.strip()
    tool = shutil.which("llvm-symbolizer-19") or shutil.which("llvm-symbolizer") or shutil.which("addr2line")
    if tool is None:
        return text.strip()
    so, off = m.group(1), m.group(2)
    if "addr2line" in tool:
        cmd = [tool, "-e", so, "-f", "-C", off]
    else:
        cmd = [tool, f"--obj={so}", "--inlining", off]
    try:
        loc = subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return text.strip()
    return text.strip() + "\nfaulting instruction:\n" + loc


_WORKERS: "OrderedDict[Path, Worker]" = OrderedDict()


def get_worker(so_path: Path) -> Worker:
    """The live worker for ``so_path``, started on first use (least recently used ones are stopped)."""
    w = _WORKERS.get(so_path)
    if w is not None and w.alive():
        _WORKERS.move_to_end(so_path)
        return w
    if w is not None:
        w.close()
    w = Worker(so_path)
    _WORKERS[so_path] = w
    while len(_WORKERS) > MAX_WORKERS:
        _, old = _WORKERS.popitem(last=False)
        old.close()
    return w


def launch(so_path: Path, req: dict, timeout: float, what: str) -> tuple[list[bytes], dict]:
    """Run one launch request (see ``worker.py``); return the output buffers and the
    launch's cost counters (``worker.COUNT_NAMES``).

    Raises:
        KernelError: the launch failed (deadlock, crash, timeout, schedule-dependent results).
    """
    reply = get_worker(so_path).request(req, timeout, what)
    if not reply["ok"]:
        raise KernelError(f"{what}: {reply['error']}")
    return reply["outputs"], reply["counts"]


def shutdown() -> None:
    """Stop every worker process."""
    while _WORKERS:
        _, w = _WORKERS.popitem()
        w.close()


atexit.register(shutdown)
