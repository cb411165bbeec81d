"""CPU harness for Metal kernels written for ``mx.fast.metal_kernel``.

It builds the exact source MLX 0.32 would generate around a kernel body
(:mod:`.source`), compiles it as C++ with clang-19 against a small Metal
compatibility header (:mod:`.translate`, :mod:`.compiler`, ``msl_compat.h``), and
runs each launch in a child process (:mod:`.runner`, ``worker.py``): one
threadgroup at a time, each Metal thread a fiber, barriers and simdgroup
functions synchronising the fibers for real (``msl_runtime.cpp``).

Typical use: stand the harness in for ``mx.fast.metal_kernel``::

    from mlx_ferrum.kernels import metal
    from support import metal_harness as mh
    with metal.use_launcher(mh.metal_kernel):
        out = metal.paged_attention_decode(...)

Needs clang++-19 (``apt-get install -y clang-19``); :func:`clang_available` says
whether it is there. Design: the same source as MLX compiles (after a prototype that ran
vLLM-style paged-attention kernels this way).
"""

from .kernel import (
    LAUNCHES,
    HarnessKernel,
    HarnessOptions,
    LaunchCost,
    SparseArray,
    clang_available,
    current_options,
    metal_kernel,
    options,
    record_costs,
    register_origin,
)
from .source import capture_mlx_source, generate

__all__ = [
    "LAUNCHES",
    "HarnessKernel",
    "HarnessOptions",
    "LaunchCost",
    "SparseArray",
    "capture_mlx_source",
    "clang_available",
    "current_options",
    "generate",
    "metal_kernel",
    "options",
    "record_costs",
    "register_origin",
]
