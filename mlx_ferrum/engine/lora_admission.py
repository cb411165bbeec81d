"""LoRA admission: which requests with an adapter may enter the scheduler.

A request with an adapter holds a pinned adapter slot of the runner from admission to
its end (the runner loads the adapter into it); the scheduler is handed the slot with
the request and puts it on each of its rows (``ScheduledItem.lora_slot``), whence the
row's work carries it to the runner. A request that finds every slot pinned by
other adapters' requests waits here, first come first served, outside the scheduler,
and enters it when a slot can be had (vLLM's ``max_loras`` admission works the same way).
The engine calls these methods with its lock held.
"""

from __future__ import annotations

import collections
from typing import Callable, Optional

from ..errors import LoraError, RequestError
from ..runner import ModelRunner
from .sequence import Sequence


class LoraAdmission:
    """The adapter slots the engine's requests pin, and the requests waiting for one.

    Args:
        runner: the engine's :class:`~mlx_ferrum.runner.ModelRunner` (``acquire_lora`` /
            ``release_lora`` pin and unpin slots).
        scheduler: the engine's :class:`~mlx_ferrum.engine.scheduler.Scheduler`
            (``add`` admits a request with its slot; ``lora_slots`` holds the pinned ones).

    Attributes:
        waiting: requests waiting for a slot, oldest first.
    """

    def __init__(self, runner: ModelRunner, scheduler):
        self.runner = runner
        self.scheduler = scheduler
        self.waiting: collections.deque = collections.deque()

    def executor(self) -> ModelRunner:
        """The runner, once it is known to serve adapters.

        Raises:
            LoraError: LoRA is off.
        """
        if not self.runner.config.enable_lora:
            raise LoraError("LoRA is off for this engine: pass RuntimeConfig(enable_lora=True) "
                            "(FERRUM_ENABLE_LORA=1, --enable-lora)")
        return self.runner

    def check_name(self, name: Optional[str]) -> None:
        """Check that ``name`` (None: the base model) names a registered adapter.

        Raises:
            RequestError: not a str. UnknownLoraError: not registered (the message names
            the known adapters). LoraError: LoRA is off.
        """
        if name is None:
            return
        if not isinstance(name, str):
            raise RequestError(f"lora must be an adapter name (str) or None, got {type(name).__name__}")
        self.executor().lora_path(name)

    def has_waiting_for(self, name: str) -> bool:
        """True when a request waiting for a slot uses adapter ``name``."""
        return any(s.lora == name for s in self.waiting)

    def admit(self, seq: Sequence) -> None:
        """Hand ``seq`` to the scheduler, pinning its adapter's slot first; when every slot
        is pinned by other adapters' requests it waits (FIFO) for one."""
        if seq.lora is None:
            self.scheduler.add(seq)
            return
        slot = None if self.waiting else self.runner.acquire_lora(seq.lora, seq.request_id)
        if slot is None:
            self.waiting.append(seq)
            return
        self.scheduler.add(seq, lora_slot=slot)

    def admit_waiting(self, fail: Callable[[Sequence, LoraError], None]) -> None:
        """Move waiting requests to the scheduler while slots can be had, in order. A
        request whose adapter can no longer be loaded (removed, or its folder unreadable)
        goes to ``fail`` instead (that request only)."""
        while self.waiting:
            seq = self.waiting[0]
            if seq.finished:
                self.waiting.popleft()
                continue
            try:
                slot = self.runner.acquire_lora(seq.lora, seq.request_id)
            except LoraError as e:
                self.waiting.popleft()
                fail(seq, e)
                continue
            if slot is None:
                return
            self.waiting.popleft()
            self.scheduler.add(seq, lora_slot=slot)

    def release(self, seq: Sequence) -> None:
        """Unpin the slot of a request that ended (or drop it from the waiting line).
        A no-op for a request without an adapter; the runner ignores an owner that holds
        no slot."""
        if seq.lora is None:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        else:
            self.runner.release_lora(seq.request_id)
