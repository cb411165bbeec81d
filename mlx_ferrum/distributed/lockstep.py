"""The engine in lockstep across ranks: rank 0 owns the requests, every rank runs the same steps.

Design (the one of mlx-lm's distributed server, with one broadcast per step instead of
one per request): every rank holds an identical :class:`~mlx_ferrum.engine.Engine`
over its shard of the model. Only rank 0 takes requests and aborts (the API, HTTP,
the terminal); it queues them, and at the start of each engine step it sends the
step's queue to every rank in ONE collective. Every rank then applies the same
additions and aborts in the same order and runs ``Engine.step()``. The scheduler,
the KV block manager, prefix caching, preemption and the samplers are deterministic
functions of that history, and the tensor-parallel forward pass gives every rank the
same logits (the ``all_sum`` result is the same array on every rank; the LM head is
replicated), so every rank schedules and samples the same tokens with no further
traffic. A request without a seed gets one drawn on rank 0, so unseeded sampling
agrees too.

The broadcast is an ``all_sum`` of a zero-filled ``uint8`` buffer into which only rank 0
writes ``[length: 4 bytes little-endian][pickled message]``: one collective of
:data:`HEADER_BYTES` per step; a step whose message is longer (many or long prompts
at once) adds a second ``all_sum`` for the rest. The message is trusted: it comes
from rank 0 of the same job.

Idle ranks: while rank 0 has nothing to run it sends a heartbeat broadcast every
``heartbeat_s`` seconds (a thread), so the followers' step watchdog
(:class:`~mlx_ferrum.distributed.group.Watchdog`) fires only when a rank really died
or hangs. :meth:`LockstepEngine.close` on rank 0 sends ``stop``, which ends
:meth:`LockstepEngine.follow` on the others.

Refused at start-up with :class:`~mlx_ferrum.errors.DistributedConfigurationError`:
LoRA and draft-model speculation (neither adapters nor a draft model are split across
ranks); refused per request: structured output and LoRA adapters. Prompt-lookup
(``ngram``) speculation runs: its proposals are a function of each request's tokens, the
same on every rank.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from ..config import RuntimeConfig
from ..engine.engine import Engine, context_full_message
from ..engine.sampling import SamplingParams
from ..engine.sequence import Prompt, encode_prompt
from ..errors import (
    DistributedConfigurationError,
    DistributedError,
    DistributedPeerLostError,
    EngineShutdownError,
    PromptTooLongError,
    RequestError,
)
from .group import WATCHDOG_EXIT_STATUS, ParallelGroup, Watchdog

logger = logging.getLogger(__name__)

#: bytes of the one ``all_sum`` each step sends (4 of them are the message length)
HEADER_BYTES = 4096

#: seconds between rank 0's heartbeats while it runs no step
HEARTBEAT_S = 1.0

#: seconds rank 0's ``stop`` broadcast may wait (the others may be gone after Ctrl-C)
CLOSE_TIMEOUT_S = 5.0

_request_numbers = iter(range(1, 1 << 62))


@contextlib.contextmanager
def _interrupt_waits_for_driver(rank: int):
    """While following rank 0 in the main thread: the first SIGINT is logged and
    otherwise ignored, the second raises ``KeyboardInterrupt`` (see ``follow``)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    interrupts = 0

    def on_interrupt(signum, frame):
        nonlocal interrupts
        interrupts += 1
        if interrupts > 1:
            raise KeyboardInterrupt
        sys.stderr.write(f"rank {rank}: Ctrl-C: waiting for rank 0 to finish and stop the group "
                         "(Ctrl-C again to leave now)\n")
        sys.stderr.flush()

    previous = signal.signal(signal.SIGINT, on_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def check_lockstep_config(config: RuntimeConfig) -> None:
    """Refuse the settings a lockstep run cannot honour.

    Raises:
        DistributedConfigurationError: ``enable_lora`` is set, or ``speculative`` names a
            draft model (the message names the setting and the fix).
    """
    if config.enable_lora:
        raise DistributedConfigurationError(
            "LoRA adapters are not supported with tensor or pipeline parallelism (the adapter weights are not "
            "split across ranks): unset FERRUM_ENABLE_LORA / --enable-lora / --adapter-path / --lora-modules, "
            "or run one process"
        )
    if config.speculative is not None and config.speculative != "ngram":
        raise DistributedConfigurationError(
            f"draft-model speculative decoding ({config.speculative!r}) is not supported with tensor or pipeline "
            "parallelism (the draft model is not split across ranks): use --speculative ngram, unset "
            "FERRUM_SPECULATIVE / --speculative, or run one process"
        )


class Broadcaster:
    """Sends a Python object from rank 0 to every rank with ``all_sum`` (see the module doc).

    Attributes:
        messages: messages exchanged. collectives: ``all_sum`` calls made (one per
            message, two for a message longer than ``HEADER_BYTES - 4``).
    """

    def __init__(self, parallel: ParallelGroup, header_bytes: int = HEADER_BYTES):
        self.parallel = parallel
        self.header_bytes = header_bytes
        self.messages = 0
        self.collectives = 0

    def _all_sum(self, buffer: np.ndarray) -> bytes:
        self.collectives += 1
        out = mx.distributed.all_sum(mx.array(buffer), group=self.parallel.group, stream=mx.cpu)
        mx.eval(out)
        return bytes(np.asarray(out))

    def exchange(self, message: Any = None) -> Any:
        """Rank 0: send ``message`` and return it. Other ranks: return rank 0's message.

        Blocks until every rank calls it (the caller's watchdog bounds the wait).
        """
        self.messages += 1
        room = self.header_bytes - 4
        header = np.zeros(self.header_bytes, dtype=np.uint8)
        payload = b""
        if self.parallel.is_driver:
            payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
            header[:4] = np.frombuffer(len(payload).to_bytes(4, "little"), dtype=np.uint8)
            head = np.frombuffer(payload[:room], dtype=np.uint8)
            header[4 : 4 + head.size] = head
        got = self._all_sum(header)
        length = int.from_bytes(got[:4], "little")
        data = got[4 : 4 + min(length, room)]
        if length > room:
            rest = np.zeros(length - room, dtype=np.uint8)
            if self.parallel.is_driver:
                rest[:] = np.frombuffer(payload[room:], dtype=np.uint8)
            data += self._all_sum(rest)
        return message if self.parallel.is_driver else pickle.loads(data)


class LockstepEngine(Engine):
    """An :class:`~mlx_ferrum.engine.Engine` run by every rank of a parallel group in lockstep.

    On rank 0 it is used like any engine (``add_request``, ``abort``, ``step``,
    ``generate``, ``stream``, or wrapped in an ``AsyncEngine`` by the server); the other
    ranks call :meth:`follow`, which returns when rank 0 calls :meth:`close`.

    Args:
        model, tokenizer, config: as for ``Engine`` (the model is this rank's shard).
        parallel: the group (:func:`~mlx_ferrum.distributed.init_group`).
        heartbeat_s: rank 0's heartbeat period while idle (seconds).
        watchdog: guard every step with a :class:`Watchdog` of ``parallel.timeout_s``.
        exit_on_peer_loss: when a broadcast fails (a rank died), print the
            :class:`~mlx_ferrum.errors.DistributedPeerLostError` and exit the process
            (status 3), as the watchdog does; False raises it instead.

    Attributes:
        broadcaster: counts the broadcasts (``messages``) and their collectives.
        stopped: True once ``stop`` was exchanged.

    Raises:
        DistributedConfigurationError: see :func:`check_lockstep_config`; also, on a
            rank other than 0, from ``add_request`` (only rank 0 takes requests).
    """

    def __init__(self, model, tokenizer, config: RuntimeConfig, parallel: ParallelGroup,
                 heartbeat_s: float = HEARTBEAT_S, watchdog: bool = True, exit_on_peer_loss: bool = True):
        check_lockstep_config(config)
        stage = getattr(model, "pipeline_stage", None)
        if stage is not None:
            stage.micro_batches = config.pipeline_micro_batches
            stage.split_steps = 0
            if not config.enforce_eager:
                # a pipeline stage evaluates each pass's logits while building it
                # (pipeline._finish_pass), which a compiled trace cannot do
                config = dataclasses.replace(config, enforce_eager=True)
        super().__init__(model, tokenizer, config)
        self.parallel = parallel
        self.exit_on_peer_loss = exit_on_peer_loss
        self.broadcaster = Broadcaster(parallel)
        self.stopped = False
        self.heartbeats = 0
        self.steps_run = 0  # calls of Engine.step (num_steps counts only steps that ran a pass)
        self._commands: list[tuple] = []
        self._queued_ids: set[str] = set()
        self._commands_lock = threading.Lock()
        self._last_exchange = time.monotonic()
        self.watchdog: Optional[Watchdog] = Watchdog(parallel.rank, parallel.timeout_s) if watchdog else None
        self._heartbeat_s = heartbeat_s
        self._heartbeat: Optional[threading.Thread] = None
        if parallel.is_driver and heartbeat_s > 0:
            self._heartbeat = threading.Thread(target=self._heartbeat_loop, name="mlx-ferrum-heartbeat", daemon=True)
            self._heartbeat.start()

    # ------------------------------------------------------------ requests (rank 0)
    def add_request(self, prompt: Prompt, params: Optional[SamplingParams] = None, request_id: Optional[str] = None,
                    lora: Optional[str] = None) -> str:
        """Queue a request for the next step (rank 0 only); the checks of
        ``Engine.add_request`` run here, so a bad request is refused before any rank sees it.

        Raises:
            DistributedError: called on a rank other than 0, or after :meth:`close`.
            DistributedConfigurationError: ``lora`` or ``params.structured_outputs`` given.
            PromptTooLongError, RequestError, SamplingParamsError, TokenizerError: as
                ``Engine.add_request``.
        """
        if not self.parallel.is_driver:
            raise DistributedError(f"rank {self.parallel.rank} takes no requests: only rank 0 does")
        if self.stopped:
            raise EngineShutdownError("this parallel engine was closed: start the ranks again")
        if lora is not None:
            check_lockstep_config(dataclasses.replace(self.config, enable_lora=True))
        params = params if params is not None else SamplingParams()
        if params.structured_outputs is not None:
            raise DistributedConfigurationError(
                "structured output is not supported with tensor or pipeline parallelism: drop the response_format / "
                "structured_outputs of this request, or run one process"
            )
        ids = encode_prompt(self.tokenizer, prompt, vocab_size=self.runner.info.vocab_size)
        limit = self.max_sequence_tokens()
        if len(ids) >= limit:
            if self._pool_tokens is not None and limit == self._pool_tokens:
                raise PromptTooLongError(self._pool_full_message(len(ids)))
            raise PromptTooLongError(context_full_message(len(ids), limit, self.model.args.max_position_embeddings))
        params.check_vocab(self.model.args.vocab_size)
        if params.seed is None:
            # drawn here, from MLX's generator (mx.random.seed makes it reproducible), and
            # sent with the request: every rank's sampler then starts from the same key
            seed = int(mx.random.randint(0, 2**31 - 1, shape=(1,)).item())
            params = dataclasses.replace(params, seed=seed)
        rid = request_id if request_id is not None else f"req-dist-{next(_request_numbers)}"
        with self._lock, self._commands_lock:
            if rid in self._seqs or rid in self._queued_ids:
                raise RequestError(f"request id {rid!r} is in use: pick another")
            self._queued_ids.add(rid)
            self._commands.append(("add", rid, list(ids), params))
        return rid

    def abort(self, request_id: str) -> None:
        """Queue an abort for the next step (rank 0 only).

        Raises:
            RequestError: unknown (or finished and collected) request id.
        """
        with self._lock, self._commands_lock:
            if request_id not in self._seqs and request_id not in self._queued_ids:
                raise RequestError(f"unknown request {request_id!r}: it finished or was never added")
            self._commands.append(("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        """True while a request waits, runs or is queued for the next step."""
        with self._commands_lock:
            if self._commands:
                return True
        return super().has_unfinished_requests()

    # ------------------------------------------------------------------- steps
    def _take_message(self, kind: str) -> dict:
        with self._commands_lock:
            if kind == "heartbeat":
                return {"kind": kind, "commands": []}
            commands, self._commands, self._queued_ids = self._commands, [], set()
        return {"kind": kind, "commands": commands}

    def _exchange(self, kind: str, timeout_s: Optional[float] = None, exit_status: Optional[int] = None) -> dict:
        message = self._take_message(kind) if self.parallel.is_driver else None
        if self.watchdog is not None:
            self.watchdog.arm(f"engine step {self.num_steps} ({kind if self.parallel.is_driver else 'waiting'})",
                              timeout_s, exit_status)
        try:
            message = self.broadcaster.exchange(message)
        except Exception as exc:  # noqa: BLE001 - the backend's error type varies (RuntimeError for ring)
            self._peer_lost(exc)
        finally:
            if self.watchdog is not None:
                self.watchdog.disarm()
        self._last_exchange = time.monotonic()
        return message

    def _peer_lost(self, exc: BaseException) -> None:
        """A broadcast failed: the group is broken for good. Exit with the named error
        (``exit_on_peer_loss``), or raise it."""
        error = DistributedPeerLostError(
            f"rank {self.parallel.rank}: engine step {self.num_steps}'s broadcast failed ({exc}): another rank died "
            "or its connection broke; restart every rank with mlx.launch"
        )
        self.stopped = True
        if not self.exit_on_peer_loss:
            raise error from exc
        sys.stderr.write(f"error: {type(error).__name__}: {error}\n")
        sys.stderr.flush()
        os._exit(WATCHDOG_EXIT_STATUS)

    def _apply(self, commands: list) -> None:
        for command in commands:
            if command[0] == "add":
                _, rid, ids, params = command
                try:
                    Engine.add_request(self, ids, params, rid)
                except Exception:  # noqa: BLE001 - checked on rank 0 already; the same on every rank
                    logger.exception("rank %d: request %s could not be added", self.parallel.rank, rid)
            elif command[0] == "abort":
                try:
                    Engine.abort(self, command[1])
                except RequestError:
                    pass  # finished in the meantime, on every rank alike

    def step(self) -> list:
        """One lockstep step: the broadcast of rank 0's queue, then ``Engine.step()``.

        Returns:
            The step's outputs (on ranks other than 0 nobody reads them).

        Raises:
            EngineShutdownError: the engine was stopped.
        """
        with self._step_lock:
            if self.stopped:
                raise EngineShutdownError("this parallel engine was closed: start the ranks again")
            while True:
                message = self._exchange("step")
                if message["kind"] == "heartbeat":
                    self.heartbeats += 1
                    continue  # followers only: wait for the next real step
                break
            if message["kind"] == "stop":
                self.stopped = True
                return []
            with self._lock:
                self._apply(message["commands"])
            self.steps_run += 1
            if self.watchdog is not None:
                self.watchdog.arm(f"engine step {self.num_steps} (forward pass)")
            try:
                return super().step()
            finally:
                if self.watchdog is not None:
                    self.watchdog.disarm()

    def _heartbeat_loop(self) -> None:
        while not self.stopped:
            time.sleep(self._heartbeat_s / 4)
            if time.monotonic() - self._last_exchange < self._heartbeat_s:
                continue
            if not self._step_lock.acquire(blocking=False):
                continue
            try:
                if not self.stopped and time.monotonic() - self._last_exchange >= self._heartbeat_s:
                    self._exchange("heartbeat")
                    self.heartbeats += 1
            except Exception:  # noqa: BLE001 - the watchdog ends the process if the group is gone
                logger.exception("heartbeat broadcast failed")
            finally:
                self._step_lock.release()

    def follow(self) -> int:
        """Ranks other than 0: run the steps rank 0 sends until it sends ``stop``.

        Ctrl-C in a terminal reaches every rank of the job at once. Rank 0 decides when
        the run ends (a server first finishes the requests in flight, then broadcasts
        ``stop``), so a follower that left at the first Ctrl-C would strand rank 0 in its
        next broadcast with half its group gone, the in-flight requests lost. A follower
        therefore waits for ``stop`` after the first Ctrl-C and leaves at the second.

        Returns:
            The number of engine steps run.

        Raises:
            KeyboardInterrupt: a second Ctrl-C arrived before rank 0's ``stop``.
        """
        with _interrupt_waits_for_driver(self.parallel.rank):
            while not self.stopped:
                self.step()
        self._close_watchdog()
        return self.num_steps

    def close(self) -> None:
        """Rank 0: tell every rank to stop (their :meth:`follow` returns); idempotent."""
        if self.parallel.is_driver:
            with self._step_lock:
                if not self.stopped:
                    # bounded: on Ctrl-C the other ranks may have left already
                    self._exchange("stop", timeout_s=min(CLOSE_TIMEOUT_S, self.parallel.timeout_s), exit_status=0)
                    self.stopped = True
        self._close_watchdog()

    def _close_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()

    def health_problem(self) -> Optional[str]:
        """A message while a step has waited on the other ranks for more than a quarter
        of the watchdog's timeout (the server then answers 503), else None."""
        if self.watchdog is None:
            return None
        waited = self.watchdog.waiting_for_s()
        if waited > self.watchdog.timeout_s / 4:
            return (f"a rank of the parallel group has not answered for {waited:.0f} s (rank {self.parallel.rank} "
                    f"exits after {self.watchdog.timeout_s:g} s): retry later")
        return None

    def stats(self) -> dict:
        """``Engine.stats()`` plus the parallel run's facts (rank, sizes, broadcasts)."""
        out = super().stats()
        out.update({
            "parallel": self.parallel.mode,
            "rank": self.parallel.rank,
            "world_size": self.parallel.size,
            "tensor_parallel_size": self.parallel.tensor_parallel_size,
            "pipeline_parallel_size": self.parallel.pipeline_parallel_size,
            "lockstep_broadcasts": self.broadcaster.messages,
            "lockstep_collectives": self.broadcaster.collectives,
            "heartbeats": self.heartbeats,
            "lockstep_steps": self.steps_run,
            "pipeline_micro_batched_steps": getattr(getattr(self.model, "pipeline_stage", None), "split_steps", 0),
        })
        return out
