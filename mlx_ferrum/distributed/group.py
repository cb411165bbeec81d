"""The process group of a parallel run: strict start-up checks and a step watchdog.

A parallel run is ``tensor_parallel_size * pipeline_parallel_size`` processes started
by ``mlx.launch`` (MLX's launcher: it sets the rank, the world size and the peers'
addresses for the chosen backend). :func:`init_group` joins that group with
``mx.distributed.init(strict=True)``, so a process started without the launcher, or a
backend that is not up, is an error and never a silent group of one (MLX falls back
to a singleton group when ``strict`` is off, which would make every "rank" generate
alone with a full model).

:class:`Watchdog` bounds every engine step: a peer that died or hangs leaves the
others blocked inside a collective, which MLX cannot interrupt, so a watchdog thread
ends the process with :class:`~mlx_ferrum.errors.DistributedTimeoutError`'s message
once a step has waited longer than ``RuntimeConfig.distributed_timeout``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import mlx.core as mx

from ..config import RuntimeConfig
from ..errors import DistributedConfigurationError, DistributedTimeoutError

logger = logging.getLogger(__name__)

#: exit status of a rank whose watchdog fired (distinct from errors (1, 2) and Ctrl-C (130))
WATCHDOG_EXIT_STATUS = 3

#: ``mlx.launch`` sets these in every rank's environment (the ring and JACCL backends)
LAUNCH_VARIABLES = ("MLX_RANK", "MLX_HOSTFILE", "MLX_IBV_DEVICES", "MLX_JACCL_COORDINATOR", "OMPI_COMM_WORLD_SIZE")


@dataclass
class ParallelGroup:
    """One rank's view of the group.

    Attributes:
        group: the ``mx.distributed.Group`` (all ranks).
        rank, size: this process's rank and the number of ranks.
        tensor_parallel_size, pipeline_parallel_size: the sizes; ``size`` is their product.
        timeout_s: seconds a step may wait on the other ranks (see :class:`Watchdog`).
        pipeline_split: layers per pipeline rank (``"3,2"``), or None for an even split.
    """

    group: Any
    rank: int
    size: int
    tensor_parallel_size: int
    pipeline_parallel_size: int
    timeout_s: float = 60.0
    pipeline_split: Optional[str] = None

    @property
    def is_driver(self) -> bool:
        """True on rank 0, which owns the requests (the API, HTTP, the terminal)."""
        return self.rank == 0

    @property
    def pipeline_rank(self) -> int:
        """This rank's pipeline stage: ``rank // tensor_parallel_size``."""
        return self.rank // self.tensor_parallel_size

    @property
    def tensor_rank(self) -> int:
        """This rank's place within its stage's tensor split: ``rank % tensor_parallel_size``."""
        return self.rank % self.tensor_parallel_size

    @property
    def mode(self) -> str:
        """``"tensor"``, ``"pipeline"`` or ``"tensor+pipeline"``."""
        modes = [m for m, n in (("tensor", self.tensor_parallel_size), ("pipeline", self.pipeline_parallel_size))
                 if n > 1]
        return "+".join(modes) or "none"


def launched_by_mlx_launch() -> bool:
    """True when the environment carries ``mlx.launch``'s (or mpirun's) rank variables."""
    return any(v in os.environ for v in LAUNCH_VARIABLES)


def init_group(config: RuntimeConfig, init: Optional[Callable[..., Any]] = None) -> Optional[ParallelGroup]:
    """Join the group the parallel sizes of ``config`` ask for; None when both are 1.

    Args:
        config: ``tensor_parallel_size``, ``pipeline_parallel_size``,
            ``distributed_backend`` and ``distributed_timeout`` are read.
        init: ``mx.distributed.init`` (replaceable for tests).

    Returns:
        The :class:`ParallelGroup`, or None for a one-process run.

    Raises:
        DistributedConfigurationError: no backend came up (the process was not started
            by ``mlx.launch``; the message gives the launch command), the group's size is
            not ``tensor_parallel_size * pipeline_parallel_size``, or the process is one
            rank of a launched group while both sizes are 1.
    """
    init = init if init is not None else mx.distributed.init
    want = config.world_size
    sizes = (f"tensor_parallel_size={config.tensor_parallel_size} x "
             f"pipeline_parallel_size={config.pipeline_parallel_size}")
    if want == 1:
        if launched_by_mlx_launch():
            raise DistributedConfigurationError(
                "this process is one rank of an mlx.launch group but no parallelism is set, so every rank would "
                "run the whole model alone: pass --tensor-parallel-size N or --pipeline-parallel-size N "
                "(FERRUM_TENSOR_PARALLEL_SIZE / FERRUM_PIPELINE_PARALLEL_SIZE) with N the number of ranks"
            )
        return None
    try:
        group = init(strict=True, backend=config.distributed_backend)
    except Exception as exc:  # MLX raises RuntimeError / ValueError when no backend is up
        raise DistributedConfigurationError(
            f"{sizes} needs {want} processes joined by mx.distributed, but backend "
            f"{config.distributed_backend!r} is not up ({exc}): start every rank with mlx.launch, e.g. "
            f"`mlx.launch --backend ring -n {want} --hosts 127.0.0.1 -- mlx-ferrum generate ...`"
        ) from None
    if group is None or group.size() != want:
        found = None if group is None else group.size()
        raise DistributedConfigurationError(
            f"{sizes} needs a group of {want} ranks, but mlx.launch started {found}: launch with -n {want} "
            "(or the hosts file's slots), or change the sizes so that their product is the group size"
        )
    return ParallelGroup(group, group.rank(), group.size(), config.tensor_parallel_size,
                         config.pipeline_parallel_size, float(config.distributed_timeout), config.pipeline_split)


class Watchdog:
    """Ends the process when a guarded section (an engine step) outlives ``timeout_s``.

    MLX's collectives block in C++ and cannot be cancelled from Python, so a rank
    waiting for a dead peer would wait forever; the watchdog's thread prints one
    ``error: DistributedTimeoutError: ...`` line naming the rank, the section and the
    timeout, and calls ``os._exit(WATCHDOG_EXIT_STATUS)`` (a normal exit would wait for
    the blocked thread). Every rank guards its steps, so a failure anywhere ends all
    ranks within about ``timeout_s``.

    Args:
        rank: for the message.
        timeout_s: the bound, in seconds.
        on_timeout: what to call instead of exiting (tests); gets the error.
    """

    def __init__(self, rank: int, timeout_s: float, on_timeout: Optional[Callable[[BaseException], None]] = None):
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self._on_timeout = on_timeout
        self._deadline: Optional[float] = None
        self._what = ""
        self._armed_for = self.timeout_s
        self._exit_status = WATCHDOG_EXIT_STATUS
        self._cond = threading.Condition()
        self._closed = False
        self.fired = False
        self._thread = threading.Thread(target=self._run, name="mlx-ferrum-watchdog", daemon=True)
        self._thread.start()

    def arm(self, what: str, timeout_s: Optional[float] = None, exit_status: Optional[int] = None) -> None:
        """Start guarding ``what`` (e.g. ``"engine step 12"``) for ``timeout_s`` seconds
        (default: the watchdog's); ``exit_status`` replaces :data:`WATCHDOG_EXIT_STATUS`
        for this section (a shutdown that finds the peers already gone is no error)."""
        with self._cond:
            self._deadline = time.monotonic() + (self.timeout_s if timeout_s is None else float(timeout_s))
            self._armed_for = self.timeout_s if timeout_s is None else float(timeout_s)
            self._exit_status = WATCHDOG_EXIT_STATUS if exit_status is None else exit_status
            self._what = what
            self._cond.notify()

    def disarm(self) -> None:
        """The guarded section finished in time."""
        with self._cond:
            self._deadline = None

    def waiting_for_s(self) -> float:
        """Seconds the guarded section has run (0 when none is armed), for health checks."""
        with self._cond:
            if self._deadline is None:
                return 0.0
            return max(0.0, time.monotonic() - (self._deadline - self._armed_for))

    def close(self) -> None:
        """Stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                self.fired = True
                error = DistributedTimeoutError(
                    f"rank {self.rank}: {self._what} waited more than {self._armed_for:g} s for the other ranks "
                    "(a rank died or hangs); exiting. Restart every rank with mlx.launch, or raise "
                    "FERRUM_DISTRIBUTED_TIMEOUT (--distributed-timeout) if steps are legitimately that slow"
                )
                self._deadline = None
                break
        if not self.fired:
            return
        if self._on_timeout is not None:
            self._on_timeout(error)
            return
        try:
            sys.stderr.write(f"error: {type(error).__name__}: {error}\n")
            sys.stderr.flush()
        finally:
            os._exit(self._exit_status)
