"""Engine: requests -> scheduler -> runner -> sampler -> detokenizer.

- :class:`Engine`: continuous batching with chunked prefill, preemption, prefix caching.
- :class:`AsyncEngine`: an asyncio front.
- :class:`SamplingParams`, :func:`sample`: sampling.
"""

from .async_engine import AsyncEngine
from .engine import Engine
from .output_processor import RequestOutput
from .sampling import SamplerState, SamplingParams, sample
from .scheduler import Scheduler, SchedulerOutput
from .sequence import RequestMetrics, Sequence, SequenceStatus
from .structured import StructuredOutputsParams

__all__ = [
    "AsyncEngine",
    "Engine",
    "RequestMetrics",
    "RequestOutput",
    "SamplerState",
    "SamplingParams",
    "Scheduler",
    "SchedulerOutput",
    "Sequence",
    "SequenceStatus",
    "StructuredOutputsParams",
    "sample",
]
