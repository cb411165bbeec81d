"""A stand-in for ``mx.fast.metal_kernel`` that runs kernels in the CPU harness.

``metal_kernel(...)`` takes the arguments of ``mx.fast.metal_kernel`` and returns a
callable taking those of the object MLX returns (``inputs``, ``output_shapes``,
``output_dtypes``, ``grid``, ``threadgroup``, ``template``, ``init_value``,
``verbose``, ``stream``). Each call generates MLX's source (:mod:`source`),
translates it (:mod:`translate`), compiles it once (:mod:`compiler`) and runs the
launch in a worker process (:mod:`runner`) under each schedule of
:func:`options`, then returns the outputs as MLX arrays. Inputs are made row
contiguous (as MLX does with ``ensure_row_contiguous=True``; the harness does so
always). Outputs start filled with NaN bytes (0xFF) unless ``init_value`` is
given, so a value the kernel never writes shows up.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import Any, Iterator, Optional, Sequence

import mlx.core as mx
import numpy as np

from mlx_ferrum.errors import KernelError

from . import compiler, runner
from .source import GeneratedKernel, arg_info, generate
from .translate import Origin, to_cpp

_SCHEDULE_IDS = {"serial": 0, "reversed": 1, "random": 2}

_NP_DTYPES = {
    mx.float32: np.float32,
    mx.float16: np.float16,
    mx.bfloat16: np.uint16,  # raw bits; numpy has no bfloat16
    mx.float64: np.float64,
    mx.bool_: np.bool_,
    mx.int8: np.int8,
    mx.int16: np.int16,
    mx.int32: np.int32,
    mx.int64: np.int64,
    mx.uint8: np.uint8,
    mx.uint16: np.uint16,
    mx.uint32: np.uint32,
    mx.uint64: np.uint64,
}


@dataclass(frozen=True)
class HarnessOptions:
    """How launches run.

    - ``schedules``: names from ``serial``, ``reversed``, ``random``; every launch runs
      once per schedule and fails when the outputs differ bitwise between them.
    - ``seed``: seed of the random schedule (each launch adds its launch count).
    - ``timeout_s``: seconds a launch may take before it counts as a hang.

    - ``variant``: the build, one of :data:`compiler.VARIANTS`: ``default``;
      ``counting`` (every load and store is counted, and each output element must be
      written exactly once; fills :func:`record_costs`); ``ubsan`` (signed overflow,
      misaligned access and out-of-bounds array indexing trap); ``cxx14`` (the kernel
      text compiled as C++14 with warnings, a warning in a ``.metal`` file fails).
    - ``check_writes``: in the ``counting`` variant, fail a launch that writes an
      output element other than exactly once (on by default).
    - ``finite_math``: build every kernel with ``-ffinite-math-only`` (kernels built
      with ``compile_options={"math_mode": "fast" | "relaxed"}`` always are).
    """

    schedules: tuple[str, ...] = ("serial", "reversed", "random")
    seed: int = 0
    timeout_s: float = 120.0
    variant: str = "default"
    finite_math: bool = False
    check_writes: bool = True


_options = HarnessOptions()
#: Launches per kernel ``name`` (as given to ``metal_kernel``) since import.
LAUNCHES: Counter = Counter()
_COST_RECORDS: list[list["LaunchCost"]] = []


@dataclass(frozen=True)
class LaunchCost:
    """What one launch cost in the harness's machine-independent model.

    - ``simd_ops``: simdgroup functions (``simd_sum``, ``simd_shuffle_xor``, ...),
      counted once per simdgroup per call (a call all 32 lanes make is one operation);
    - ``simdgroup_barriers``, ``threadgroup_barriers``: once per simdgroup / group;
    - ``device_bytes_read`` / ``device_bytes_written``: bytes the kernel's loads and
      stores move to and from its buffers, each thread's access counted (caches are
      not modelled: a K row read by two threadgroups counts twice).
    Byte counts are 0 unless the launch ran in the ``counting`` variant.
    """

    name: str
    grid: tuple[int, int, int]
    threadgroup: tuple[int, int, int]
    template: tuple
    simd_ops: int
    simdgroup_barriers: int
    threadgroup_barriers: int
    device_bytes_read: int
    device_bytes_written: int


@contextmanager
def record_costs(variant: str = "counting") -> Iterator[list[LaunchCost]]:
    """Collect a :class:`LaunchCost` per launch inside the block (counting build by default)::

        with mh.record_costs() as costs:
            metal.paged_attention_decode(...)
        costs[0].simd_ops
    """
    records: list[LaunchCost] = []
    _COST_RECORDS.append(records)
    try:
        with options(variant=variant):
            yield records
    finally:
        _COST_RECORDS.remove(records)


@dataclass(frozen=True)
class SparseArray:
    """An input too large to hold in memory: a row-major array of ``shape`` and
    ``dtype`` that is zero except for ``chunks``, ``{element offset: numpy array}``.

    The worker maps it with ``MAP_NORESERVE`` and writes only the chunks, so e.g. a KV
    pool of more than 2^31 elements whose block tables point at its top blocks costs
    only those blocks. It has ``shape``, ``dtype``, ``ndim``, ``size`` like an MLX
    array, enough for the kernel wrappers' shape checks; only the harness can launch it.
    """

    shape: tuple[int, ...]
    dtype: mx.Dtype
    chunks: dict

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.size
_ORIGINS: dict[str, Origin] = {}


def current_options() -> HarnessOptions:
    """The options launches use now."""
    return _options


@contextmanager
def options(**changes: Any) -> Iterator[HarnessOptions]:
    """Temporarily change :class:`HarnessOptions` fields, e.g. ``options(schedules=("serial",))``.

    Raises:
        ValueError: an unknown schedule name.
    """
    global _options
    new = replace(_options, **changes)
    bad = [s for s in new.schedules if s not in _SCHEDULE_IDS]
    if bad or not new.schedules:
        raise ValueError(f"unknown schedules {bad}: use serial, reversed or random")
    if new.variant not in compiler.VARIANTS:
        raise ValueError(f"unknown variant {new.variant!r}: use one of {', '.join(compiler.VARIANTS)}")
    old, _options = _options, new
    try:
        yield new
    finally:
        _options = old


def register_origin(text: str, path: str, first_line: int) -> None:
    """Declare that kernel text ``text`` (a header or body) starts at ``path:first_line``.

    Compiler messages and deadlock reports then name that file and line. Kernels
    loaded by :mod:`mlx_ferrum.kernels.metal` are found without registering.
    """
    _ORIGINS[text] = Origin(str(path), int(first_line))


def _origin(text: str) -> Optional[Origin]:
    if not text:
        return None
    if text in _ORIGINS:
        return _ORIGINS[text]
    try:
        from mlx_ferrum.kernels import metal
    except ImportError:
        return None
    found = metal.source_origin(text)
    return Origin(*found) if found else None


def clang_available() -> bool:
    """True when clang++-19 (or ``$FERRUM_HARNESS_CLANG``) is installed."""
    return compiler.find_clang() is not None


def _to_bytes(a: mx.array) -> bytes:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    if a.dtype not in _NP_DTYPES:
        raise KernelError(f"the harness cannot pass arrays of dtype {a.dtype}")
    return np.ascontiguousarray(np.array(a)).tobytes()


def _chunk_bytes(values: Any, dtype: mx.Dtype) -> bytes:
    if isinstance(values, mx.array):
        return _to_bytes(values.astype(dtype))
    return _to_bytes(mx.array(np.asarray(values)).astype(dtype))


def _from_bytes(data: bytes, shape: Sequence[int], dtype: mx.Dtype) -> mx.array:
    arr = np.frombuffer(data, dtype=_NP_DTYPES[dtype]).reshape(tuple(shape))
    out = mx.array(arr)
    return out.view(mx.bfloat16) if dtype == mx.bfloat16 else out


def _fill_bytes(dtype: mx.Dtype, init_value: Optional[float]) -> bytes:
    if init_value is None:
        return b"\xff"  # NaN in float32, float16 and bfloat16; -1 in signed ints
    if dtype == mx.bfloat16:
        return np.array(mx.array(init_value, mx.bfloat16).view(mx.uint16)).tobytes()
    return np.array(init_value, dtype=_NP_DTYPES[dtype]).tobytes()


class HarnessKernel:
    """What :func:`metal_kernel` returns: call it like the object ``mx.fast.metal_kernel`` returns."""

    def __init__(
        self,
        name: str,
        input_names: Sequence[str],
        output_names: Sequence[str],
        source: str,
        header: str = "",
        ensure_row_contiguous: bool = True,
        atomic_outputs: bool = False,
        compile_options: Optional[dict] = None,
    ):
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = ensure_row_contiguous
        self.atomic_outputs = atomic_outputs
        self.compile_options = compile_options
        self._built: dict[tuple, tuple[GeneratedKernel, Any]] = {}

    def _build(self, arrays: list[mx.array], output_dtypes: list, template: list) -> tuple[GeneratedKernel, Any]:
        key = (
            _options.variant,
            _options.finite_math,
            tuple((a.dtype, a.ndim, a.size < 8) for a in arrays),
            tuple(output_dtypes),
            tuple((n, v) for n, v in template),
        )
        hit = self._built.get(key)
        if hit is not None:
            return hit
        infos = [arg_info(n, a) for n, a in zip(self.input_names, arrays)]
        gen = generate(
            self.name,
            self.input_names,
            self.output_names,
            self.source,
            self.header,
            infos,
            output_dtypes,
            template,
            self.atomic_outputs,
        )
        cpp = to_cpp(gen, _origin(self.header), _origin(self.source))
        opts = _options
        math_mode = (self.compile_options or {}).get("math_mode", "safe")
        finite = opts.finite_math or math_mode in ("fast", "relaxed")
        so = compiler.compile_kernel(cpp, gen.kernel_name, variant=opts.variant, finite_math=finite)
        self._built[key] = (gen, so)
        return gen, so

    def __call__(
        self,
        *,
        inputs: Sequence[Any],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        template: Optional[Sequence[tuple[str, Any]]] = None,
        init_value: Optional[float] = None,
        verbose: bool = False,
        stream: Any = None,
    ) -> list[mx.array]:
        """Run one launch in the harness; returns the outputs.

        Raises:
            ValueError: list lengths disagree (as MLX raises).
            KernelError: compile error (naming the ``.metal`` line), deadlock,
                out-of-bounds access, hang, or schedule-dependent results.
        """
        arrays = [a if isinstance(a, (mx.array, SparseArray)) else mx.array(a) for a in inputs]
        for got, want, what in (
            (len(arrays), len(self.input_names), "inputs"),
            (len(output_shapes), len(self.output_names), "output_shapes"),
            (len(output_dtypes), len(self.output_names), "output_dtypes"),
        ):
            if got != want:
                raise ValueError(f"[metal_kernel] Expected `{what}` to have size {want} but got size {got}.")
        output_dtypes = list(output_dtypes)
        template = list(template or [])
        gen, so = self._build(arrays, output_dtypes, template)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{gen.source}\n```")

        mx.eval(*[a for a in arrays if isinstance(a, mx.array)])
        buffers = []
        for p in gen.params:
            if p.kind == "attribute":
                continue
            if p.kind == "output":
                k = self.output_names.index(p.name)
                dt = output_dtypes[k]
                nbytes = int(np.prod(output_shapes[k], dtype=np.int64)) * dt.size
                buffers.append(
                    dict(name=p.name, data=None, nbytes=nbytes, fill=_fill_bytes(dt, init_value),
                         readonly=False, output=True, itemsize=dt.size)
                )
                continue
            a = arrays[p.input_index]
            if p.kind == "input" and isinstance(a, SparseArray):
                chunks = [(int(off) * a.dtype.size, _chunk_bytes(v, a.dtype)) for off, v in sorted(a.chunks.items())]
                buffers.append(dict(name=p.name, data=None, nbytes=a.nbytes, fill=None, readonly=True,
                                    output=False, itemsize=a.dtype.size, chunks=chunks))
                continue
            if p.kind == "input":
                data = _to_bytes(a)
            elif p.kind == "shape":
                data = np.array(a.shape, dtype=np.int32).tobytes()
            elif p.kind == "strides":
                strides = np.cumprod((list(a.shape[1:]) + [1])[::-1])[::-1] if a.ndim else []
                data = np.array(strides, dtype=np.int64).tobytes()
            else:
                data = np.array(a.ndim, dtype=np.int32).tobytes()
            buffers.append(dict(name=p.name, data=data, nbytes=len(data), fill=None, readonly=True,
                                output=False, itemsize=1))
        opts = _options
        LAUNCHES[self.name] += 1
        seed = opts.seed + LAUNCHES[self.name]
        req = dict(
            buffers=buffers,
            grid=tuple(int(g) for g in grid),
            threadgroup=tuple(int(t) for t in threadgroup),
            schedules=[(_SCHEDULE_IDS[s], seed) for s in opts.schedules],
            counting=opts.variant == "counting",
            check_writes=opts.variant == "counting" and opts.check_writes,
        )
        outs, counts = runner.launch(so, req, opts.timeout_s, f"kernel {gen.kernel_name}")
        if _COST_RECORDS:
            cost = LaunchCost(self.name, req["grid"], req["threadgroup"], tuple(template), **counts)
            for records in _COST_RECORDS:
                records.append(cost)
        return [_from_bytes(b, s, d) for b, s, d in zip(outs, output_shapes, output_dtypes)]


def metal_kernel(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str = "",
    ensure_row_contiguous: bool = True,
    atomic_outputs: bool = False,
    compile_options: Optional[dict] = None,
) -> HarnessKernel:
    """Drop-in replacement for ``mx.fast.metal_kernel`` (same arguments) that runs on the CPU.

    Raises:
        ValueError: no output names.
    """
    return HarnessKernel(
        name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs, compile_options
    )

