"""AsyncEngine: an asyncio front on :class:`~mlx_ferrum.engine.Engine`.

A background thread drives ``Engine.step()`` while requests are unfinished; each
request's outputs reach its ``async for`` through an ``asyncio.Queue`` fed with
``loop.call_soon_threadsafe``, so one coroutine can stream a request while others run.
"""

from __future__ import annotations

import asyncio
import threading
from typing import AsyncIterator, Optional

from .engine import Engine, RequestOutput
from .prompt import Prompt
from .sampling import SamplingParams


class AsyncEngine:
    """Wraps an :class:`Engine`; use :meth:`astream` from async code.

    Args:
        engine: the engine to drive (its thread-safe ``add_request``/``abort`` are used).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._loop, name="mlx-ferrum-engine", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop:
            if not self.engine.has_unfinished_requests():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            for out in self.engine.step():
                with self._lock:
                    target = self._queues.get(out.request_id)
                if target is not None:
                    loop, q = target
                    loop.call_soon_threadsafe(q.put_nowait, out)

    async def astream(
        self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request and ``async for`` over its outputs; leaving early aborts it."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = request_id
        with self._lock:
            rid = self.engine.add_request(prompt, params, rid)
            self._queues[rid] = (loop, q)
        self._wake.set()
        finished = False
        try:
            while not finished:
                out = await q.get()
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._queues.pop(rid, None)
            if not finished:
                try:
                    self.engine.abort(rid)
                except Exception:  # noqa: BLE001 - it may have finished meanwhile
                    pass

    async def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> RequestOutput:
        """Await the final output of one request."""
        last = None
        async for out in self.astream(prompt, params):
            last = out
        return last

    def shutdown(self) -> None:
        """Stop the background thread."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout=5)
