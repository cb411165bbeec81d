"""AsyncEngine: an asyncio front on :class:`~mlx_ferrum.engine.Engine`.

A background thread drives ``Engine.step()`` while requests are unfinished; each
request's outputs reach its ``async for`` through an ``asyncio.Queue`` fed with
``loop.call_soon_threadsafe``, so one coroutine can stream a request while others run.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import itertools
import logging
import os
import threading
import time
import weakref
from typing import AsyncIterator, Optional

from ..errors import EngineShutdownError, RequestError
from .engine import Engine
from .output_processor import RequestOutput
from .sampling import SamplingParams
from .sequence import Prompt, encode_prompt

logger = logging.getLogger(__name__)

# Engines whose stepping thread is alive. MLX keeps a per-thread compile cache (its
# activations are mx.compile'd) whose destructor runs when the OS thread ends and takes
# the GIL; if that happens while the interpreter finalizes, Python ends the thread with
# pthread_exit inside a C++ destructor and the process aborts ("terminate called without
# an active exception", exit 134). So every live engine's thread is stopped at exit, and
# the interpreter waits until the OS thread is really gone.
_live_engines: "weakref.WeakSet[AsyncEngine]" = weakref.WeakSet()


def _wait_for_os_thread_exit(native_id, timeout_s: float = 5.0) -> None:
    """Wait until a joined thread's OS thread has run its thread-local destructors.

    ``Thread.join`` returns when the Python thread state is gone, slightly before that.
    Linux lists live threads in ``/proc/self/task``; elsewhere a short sleep suffices.
    """
    if native_id is None:
        return
    task = f"/proc/self/task/{native_id}"
    if not os.path.isdir("/proc/self/task"):
        time.sleep(0.05)
        return
    deadline = time.monotonic() + timeout_s
    while os.path.exists(task) and time.monotonic() < deadline:
        time.sleep(0.002)


@atexit.register
def _shutdown_live_engines() -> None:
    for engine in list(_live_engines):
        engine.shutdown()


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():  # the caller was cancelled
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _put_all(items: list) -> None:
    for queue, out in items:
        queue.put_nowait(out)


_SHUTDOWN_MESSAGE = "this AsyncEngine was shut down: create a new AsyncEngine to submit requests"


class _Shutdown:
    """Put in a request's queue by :meth:`AsyncEngine.shutdown`: its stream raises."""


class _Refused:
    """Put in a request's queue when the engine refused it at admission: its stream raises ``error``."""

    def __init__(self, error: BaseException):
        self.error = error


def _is_token_ids(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt)


class AsyncEngine:
    """Wraps an :class:`Engine`; use :meth:`astream` from async code.

    Args:
        engine: the engine to drive (its thread-safe ``add_request``/``abort`` are used).

    After :meth:`shutdown`, :meth:`astream` and :meth:`generate` raise
    :class:`~mlx_ferrum.errors.EngineShutdownError` at once, and so does a stream that
    was still running when it was called (its request is aborted).
    """

    def __init__(self, engine: Engine):
        self.engine = engine
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        # requests and aborts handed to the stepping thread: the event loop never waits
        # for the engine's lock, which a step holds while it schedules and emits
        self._submissions: collections.deque = collections.deque()
        self._aborts: collections.deque = collections.deque()
        # functions to run on the stepping thread between two steps (run_between_steps)
        self._calls: collections.deque = collections.deque()
        self._ids = itertools.count()
        self._thread = threading.Thread(target=self._loop, name="mlx-ferrum-engine", daemon=True)
        self._thread.start()
        _live_engines.add(self)

    def _loop(self) -> None:
        # The loop never dies: Engine.step() fails a broken step's requests itself; an
        # exception that still escapes is logged, every request then in the engine is
        # failed (its client gets a final "error" output), and serving goes on.
        while not self._stop:
            self._admit()
            try:
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                outs = self.engine.step()
            except BaseException as e:  # noqa: BLE001 - even SystemExit from a step must not strand the clients
                logger.exception("engine step failed; failing the requests in flight and serving on")
                outs = self._fail_all(e)
            self._deliver_all(outs)

    def _admit(self) -> None:
        """On the stepping thread: add the submitted requests to the engine (a refusal goes
        to its stream), then apply the aborts."""
        while self._submissions:
            rid, prompt, params, lora = self._submissions.popleft()
            with self._lock:
                target = self._queues.get(rid)
            if target is None:
                continue  # its stream ended before it was admitted
            try:
                self.engine.add_request(prompt, params, rid, lora=lora)
            except Exception as e:  # noqa: BLE001 - this request only: its stream raises it
                try:
                    target[0].call_soon_threadsafe(target[1].put_nowait, _Refused(e))
                except RuntimeError:
                    pass
        while self._aborts:
            rid = self._aborts.popleft()
            try:
                self.engine.abort(rid)
            except Exception:  # noqa: BLE001 - it finished meanwhile, or was never admitted
                pass
        while self._calls:
            fn, loop, future = self._calls.popleft()
            try:
                result, error = fn(), None
            except Exception as e:  # noqa: BLE001 - the caller's failure only: it gets the exception
                result, error = None, e
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the caller's event loop is closed
                pass

    def _deliver_all(self, outs: list[RequestOutput]) -> None:
        """Hand a step's outputs to their streams with ONE wake-up per event loop: a
        ``call_soon_threadsafe`` per output would wake the loop (a self-pipe write and a
        GIL hand-over) once per request and step, which at 32 streams costs the server
        more than the step itself on a small model."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for out in outs:
                target = self._queues.get(out.request_id)
                if target is not None:
                    by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the client's event loop is closed: nobody is listening
                pass

    def _fail_all(self, exc: BaseException) -> list[RequestOutput]:
        """Fail every request the engine holds (after a step raised past the engine)."""
        return self.engine.fail_all(exc)

    async def astream(
        self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
        lora: Optional[str] = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit a request (with LoRA adapter ``lora``, or the base model) and ``async for``
        over its outputs; leaving early aborts it.

        Raises:
            EngineShutdownError: the engine was shut down (before the call or while it ran).
            PromptTooLongError, RequestError, SamplingParamsError, TokenizerError: see
                :meth:`Engine.add_request`.
        """
        if self._stop:
            raise EngineShutdownError(_SHUTDOWN_MESSAGE)
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        rid = request_id
        if isinstance(prompt, (str, list, tuple)) and not _is_token_ids(prompt):
            # tokenize (and render the chat template) on a worker thread, holding no lock,
            # so a long prompt blocks neither the event loop nor the engine
            vocab = getattr(getattr(self.engine.runner, "info", None), "vocab_size", None)
            prompt = await asyncio.to_thread(encode_prompt, self.engine.tokenizer, prompt, vocab)
        if rid is None:
            rid = f"async-{id(self):x}-{next(self._ids)}"
        with self._lock:
            # checked under the lock shutdown() takes: a request registered here is one
            # shutdown() will end
            if self._stop:
                raise EngineShutdownError(_SHUTDOWN_MESSAGE)
            if rid in self._queues:
                raise RequestError(f"request id {rid!r} is in use: pick another")
            self._queues[rid] = (loop, q)
        # the stepping thread admits it (Engine.add_request) before its next step; a
        # refusal (too long, bad ids, a bad constraint ...) comes back through the queue
        self._submissions.append((rid, prompt, params, lora))
        self._wake.set()
        finished = False
        admitted = False
        try:
            while not finished:
                out = await q.get()
                if isinstance(out, _Shutdown):
                    raise EngineShutdownError(_SHUTDOWN_MESSAGE + " (it was shut down while this request ran)")
                if isinstance(out, _Refused):
                    finished = True
                    raise out.error
                admitted = True
                finished = out.finished
                yield out
        finally:
            with self._lock:
                self._queues.pop(rid, None)
            if not finished or not admitted:
                self._aborts.append(rid)
                self._wake.set()

    async def run_between_steps(self, fn):
        """Run ``fn()`` on the stepping thread between two engine steps and await its result.

        For work that uses the model outside the engine's requests (an embedding's forward
        pass): on the stepping thread it can never overlap a step's forward pass, and MLX
        arrays the step left scheduled stay on the thread that owns their stream.

        Raises:
            EngineShutdownError: the engine was shut down; else whatever ``fn`` raised.
        """
        if self._stop:
            raise EngineShutdownError(_SHUTDOWN_MESSAGE)
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._calls.append((fn, loop, future))
        self._wake.set()
        return await future

    async def generate(self, prompt: Prompt, params: Optional[SamplingParams] = None) -> RequestOutput:
        """Await the final output of one request.

        Raises:
            EngineShutdownError: the engine was shut down; others as :meth:`astream`.
        """
        last = None
        async for out in self.astream(prompt, params):
            last = out
        return last

    def is_alive(self) -> bool:
        """True while the stepping thread runs (False after :meth:`shutdown`, or should it die)."""
        return self._thread.is_alive()

    def shutdown(self) -> None:
        """Stop the background thread (after the step it is running); idempotent.

        Streams still waiting raise :class:`~mlx_ferrum.errors.EngineShutdownError` and
        their requests are aborted (their KV blocks freed); later calls raise it at once.
        Called for every live engine at interpreter exit as well.
        """
        with self._lock:
            self._stop = True
        self._wake.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=30)
            _wait_for_os_thread_exit(self._thread.native_id)
        with self._lock:
            waiting = list(self._queues.items())
        for rid, (loop, q) in waiting:
            try:
                self.engine.abort(rid)
            except RequestError:  # it finished meanwhile
                pass
            try:
                loop.call_soon_threadsafe(q.put_nowait, _Shutdown())
            except RuntimeError:  # the client's event loop is closed: nobody is listening
                pass
        while self._calls:  # functions that never ran: their callers raise
            _, loop, future = self._calls.popleft()
            try:
                loop.call_soon_threadsafe(_settle, future, None, EngineShutdownError(_SHUTDOWN_MESSAGE))
            except RuntimeError:
                pass
        _live_engines.discard(self)
