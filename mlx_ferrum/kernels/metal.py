"""Metal paged-attention kernels, launched through ``mx.fast.metal_kernel``.

The kernel sources live in ``metal_kernels/*.metal`` (one kernel per file: a
documentation preamble, then ``// --- header ---``, then ``// --- body ---``; see
:func:`load_kernel_source`). Each ``mx.fast.metal_kernel`` object is built once per
launcher and cached. The functions here take exactly the arguments of the
functions of the same names in :mod:`mlx_ferrum.kernels.reference` and compute the
same thing; :func:`decode_unsupported_reason` / :func:`prefill_unsupported_reason`
say when a shape is outside what the kernels take (dispatch in
:mod:`mlx_ferrum.kernels` then uses the reference).

MLX facts the wrappers respect (MLX 0.32, ``backend/common/metal_kernel.cpp``):
inputs of fewer than 8 elements become ``constant`` pointers, so small metadata
arrays are padded to 8 elements; outputs are fresh and uninitialised, so every
output element is written by the kernels; kernels cannot update inputs in place.

Test hook: :func:`use_launcher` substitutes the kernel factory (e.g. the CPU
harness in the repository's ``tests/support/metal_harness``) and makes the
Metal path available where MLX has no Metal back-end.

Decode packs the query heads of a KV head into one threadgroup (as MLX's
``sdpa_vector_2pass_1_gqa``) and splits long contexts only when there are too few
threadgroups to fill the GPU (:func:`decode_partitions`); :func:`decode_metadata`
builds its launch arrays once per step. :func:`paged_prefill_attention_mma` is the
``simdgroup_matrix`` prefill kernel (opt-in, :data:`PREFILL_MATRIX_KERNEL`).

Quantized KV: :func:`paged_attention_decode` and :func:`paged_prefill_attention` also
read int8 / int4 code pools with their float16 group scales (``kv_cache_dtype``,
``k_scales``, ``v_scales``, ``k_biases``, ``v_biases``; :class:`QuantizedKv`), the same
kernel sources with the ``KV_BITS`` and ``GROUP_SIZE`` template parameters; int4 keys are
stored rotated and the caller passes the rotated query. The matrix prefill kernel takes
float pools only.

Algorithms: vLLM paged attention v1/v2 (Kwon et al., SOSP 2023) with online
softmax (Milakov & Gimelshein 2018; FlashAttention, Dao et al. 2022;
FlashAttention-2, Dao 2023); see ``docs/kernels.md``.

Why this module is one file of over 500 lines: the one place that knows
mx.fast.metal_kernel: source loading, template instantiation and grid sizes for every
kernel, so that no other module depends on Metal.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import mlx.core as mx

from ..config import device_info
from ..errors import KernelError
from .float_window import FIRST_TOKENS as FLOAT_FIRST_TOKENS

HEADER_MARK = "// --- header ---"
BODY_MARK = "// --- body ---"

#: Simdgroups per decode threadgroup (128 threads).
DECODE_NUM_SIMD = 4
#: Query rows (one per simdgroup) per prefill threadgroup (256 threads).
PREFILL_NUM_SIMD = 8
#: Forced decode partition size in tokens (a test hook): when set, any context that
#: can be longer (``max_blocks_per_seq * block_size`` > this) is split over partitions
#: of this size. ``None`` (the default) lets :func:`decode_partitions` decide from
#: occupancy.
DECODE_PARTITION_SIZE: Optional[int] = None
#: Most query heads one decode threadgroup serves (their q and output stay in
#: registers); a larger GQA group is split over threadgroups of a divisor of it.
DECODE_MAX_HEADS_PER_THREADGROUP = 8
#: Split-K never cuts a context into partitions shorter than this many tokens.
DECODE_MIN_PARTITION_TOKENS = 256
#: GPU cores assumed where ``mx.device_info()`` is unavailable (off a Mac, or an
#: unknown architecture): a base M-series chip.
DEFAULT_GPU_CORES = 10
#: Threadgroups in flight per GPU core that decode aims for before splitting contexts.
DECODE_THREADGROUPS_PER_CORE = 4
#: Prefill calls whose longest query chunk exceeds this many rows go to the pure-MLX
#: reference (MLX's matrix-unit SDPA over the gathered blocks): the kernel here uses
#: scalar FMAs and only wins for short chunks (speculative verify, small extends).
PREFILL_KERNEL_MAX_QUERY_LEN = 16
#: Float elements of K (and as many of V) staged per prefill step: 16 KiB of the
#: 32 KiB of threadgroup memory.
PREFILL_TILE_ELEMENTS = 2048
MAX_HEAD_DIM = 256
SUPPORTED_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
#: Small arrays are padded to this many elements so they stay ``device`` pointers.
MIN_DEVICE_ELEMENTS = 8
#: log2(e): the decode kernel works in base 2 (exp2), so q is scaled by scale * LOG2E.
LOG2E = 1.4426950408889634
#: The kernels' empty-state sentinel (Metal's FLT_MAX): no infinity under fast math.
FLT_MAX = 3.4028234663852886e38
#: Math mode (``compile_options={"math_mode": ...}`` of ``mx.fast.metal_kernel``) per
#: kernel, stated rather than left to MLX's default. The kernels use no infinity or
#: NaN (a finite -FLT_MAX sentinel, loop bounds computed up front), so they build in
#: fast mode; the harness builds "fast" kernels with -ffinite-math-only to check
#: exactly that.
KERNEL_MATH_MODE = {
    "paged_attention_decode": "fast",
    "paged_attention_reduce": "fast",
    "paged_prefill_attention": "fast",
    "paged_prefill_attention_mma": "fast",
}
#: Where prefill chunks longer than PREFILL_KERNEL_MAX_QUERY_LEN rows go: False, the
#: pure-MLX reference (MLX's tuned SDPA); True, the matrix-unit kernel
#: (:func:`paged_prefill_attention_mma`), which avoids gathering the context but has
#: not been timed on a Mac against MLX's SDPA yet.
PREFILL_MATRIX_KERNEL = False


# ------------------------------------------------------------------ sources


@dataclass(frozen=True)
class KernelSource:
    """One kernel file split into the parts ``mx.fast.metal_kernel`` takes.

    ``header_line`` and ``body_line`` are the 1-based lines of the file where the
    header and the body text start (for error messages that point into the file).
    """

    name: str
    path: Path
    header: str
    body: str
    header_line: int
    body_line: int


def _candidate_dirs() -> list[Path]:
    here = Path(__file__).resolve()
    dirs = [
        here.parents[1] / "metal_kernels",  # wheel: package-dir maps it to mlx_ferrum/metal_kernels
        here.parents[2] / "metal_kernels",  # source checkout / editable install: <repo>/metal_kernels
    ]
    try:
        from importlib.resources import files

        dirs.append(Path(str(files("mlx_ferrum.metal_kernels"))))
    except Exception:  # noqa: BLE001 - not installed as a package: the paths above decide
        pass
    return dirs


@lru_cache(maxsize=None)
def kernels_dir() -> Path:
    """Directory holding the ``.metal`` files.

    Looked for inside the package as installed from a wheel
    (``mlx_ferrum/metal_kernels``), then beside it in a source checkout or editable
    install (``<repo>/metal_kernels``), then through importlib.resources.

    Raises:
        KernelError: no candidate holds ``paged_attention_decode.metal``.
    """
    tried = _candidate_dirs()
    for d in tried:
        if (d / "paged_attention_decode.metal").is_file():
            return d
    raise KernelError(
        "metal_kernels/ not found (looked in " + ", ".join(map(str, tried)) + "): reinstall mlx_ferrum"
    )


def parse_kernel_file(name: str, path: Path, text: str) -> KernelSource:
    """Split a ``.metal`` file's text at the header and body marker lines.

    Raises:
        KernelError: a marker line is missing or out of order.
    """
    lines = text.splitlines(keepends=True)
    stripped = [ln.strip() for ln in lines]
    try:
        h = stripped.index(HEADER_MARK)
        b = stripped.index(BODY_MARK)
    except ValueError:
        raise KernelError(f"{path}: needs a '{HEADER_MARK}' line and a '{BODY_MARK}' line") from None
    if b < h:
        raise KernelError(f"{path}: '{HEADER_MARK}' must come before '{BODY_MARK}'")
    header = "".join(lines[h + 1 : b])
    body = "".join(lines[b + 1 :])
    return KernelSource(name, path, header, body, h + 2, b + 2)


_ORIGINS: dict[str, tuple[str, int]] = {}


@lru_cache(maxsize=None)
def load_kernel_source(name: str) -> KernelSource:
    """The parts of ``metal_kernels/<name>.metal``.

    Raises:
        KernelError: the file is missing or malformed.
    """
    path = kernels_dir() / f"{name}.metal"
    if not path.is_file():
        raise KernelError(f"kernel source {path} is missing")
    src = parse_kernel_file(name, path, path.read_text())
    if src.header:
        _ORIGINS[src.header] = (str(path), src.header_line)
    _ORIGINS[src.body] = (str(path), src.body_line)
    return src


def source_origin(text: str) -> Optional[tuple[str, int]]:
    """``(path, first line)`` of a header or body loaded by :func:`load_kernel_source`, else None."""
    return _ORIGINS.get(text)


# ----------------------------------------------------------------- launcher

_lock = threading.Lock()
_launcher: Optional[Callable[..., Any]] = None
_kernels: dict[tuple, Any] = {}


@contextmanager
def use_launcher(factory: Callable[..., Any]) -> Iterator[None]:
    """Use ``factory`` instead of ``mx.fast.metal_kernel`` inside the ``with`` block.

    ``factory`` takes ``mx.fast.metal_kernel``'s arguments and returns a callable
    taking those of the object it returns. While it is installed, dispatch in
    :mod:`mlx_ferrum.kernels` treats the Metal path as available (unless
    ``FERRUM_METAL_KERNELS=0``), so tests can stand the CPU harness in for a GPU::

        with metal.use_launcher(metal_harness.metal_kernel):
            out = mlx_ferrum.kernels.paged_attention_decode(...)
    """
    global _launcher
    with _lock:
        previous, _launcher = _launcher, factory
    try:
        yield
    finally:
        with _lock:
            _launcher = previous


def launcher_forced() -> bool:
    """True inside :func:`use_launcher`."""
    return _launcher is not None


def _accepts_compile_options(factory: Callable[..., Any]) -> bool:
    """Whether ``factory`` takes ``compile_options`` (MLX's metal_kernel does from 0.32;
    test launchers may not)."""
    import inspect

    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin without a signature: MLX's nanobind function
        return factory is getattr(mx.fast, "metal_kernel", None)
    return "compile_options" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())


def _kernel(name: str, input_names: Sequence[str], output_names: Sequence[str]) -> Any:
    factory = _launcher or mx.fast.metal_kernel
    key = (factory, name)
    k = _kernels.get(key)
    if k is None:
        src = load_kernel_source(name)
        kwargs: dict[str, Any] = {}
        if _accepts_compile_options(factory):
            kwargs["compile_options"] = {"math_mode": KERNEL_MATH_MODE.get(name, "safe")}
        k = factory(
            name=name,
            input_names=list(input_names),
            output_names=list(output_names),
            source=src.body,
            header=src.header,
            **kwargs,
        )
        _kernels[key] = k
    return k


# -------------------------------------------------------------- shape rules


def _pad(a: mx.array) -> mx.array:
    a = a.reshape(-1)
    if a.size >= MIN_DEVICE_ELEMENTS:
        return a
    return mx.concatenate([a, mx.zeros((MIN_DEVICE_ELEMENTS - a.size,), a.dtype)])


def _params(*values: int) -> mx.array:
    vals = list(values) + [0] * (MIN_DEVICE_ELEMENTS - len(values))
    return mx.array(vals, dtype=mx.int32)


#: Bits per stored K/V element of each ``kv_cache_dtype`` the kernels take (0: the
#: pools hold q's float dtype).
KV_CACHE_DTYPE_BITS = {"auto": 0, "int8": 8, "int4": 4}
#: Dtype of the code pools of each quantized ``kv_cache_dtype``.
KV_CODE_DTYPES = {"int8": mx.int8, "int4": mx.uint8}


@dataclass(frozen=True)
class QuantizedKv:
    """The scales and biases that go with quantized K/V code pools, as the kernels take them.

    Storage contract (mlx_ferrum's quantized KV cache): for ``kv_cache_dtype`` "int8",
    ``k_pool``/``v_pool`` hold int8 codes ``[num_blocks, num_kv_heads, block_size,
    head_dim]`` and ``x = code * scale``; for "int4", uint8 ``[..., head_dim // 2]``
    with element ``2i`` in the low nibble of byte ``i`` and ``2i + 1`` in the high one,
    and ``x = code * scale + bias``. ``k_scales``/``v_scales`` (and for int4
    ``k_biases``/``v_biases``) are float16 ``[num_blocks, num_kv_heads, block_size,
    head_dim // group_size]``: one per group of ``group_size`` consecutive elements.
    int4 keys are stored rotated by a normalised Walsh-Hadamard matrix ``H``; the
    kernels do not rotate: the caller passes ``q @ H`` as q (``q H . k H = q . k``).
    """

    kv_cache_dtype: str
    k_scales: mx.array
    v_scales: mx.array
    k_biases: Optional[mx.array] = None
    v_biases: Optional[mx.array] = None

    @property
    def bits(self) -> int:
        return KV_CACHE_DTYPE_BITS[self.kv_cache_dtype]


def _quantized(
    kv_cache_dtype: str, k_scales: Optional[mx.array], v_scales: Optional[mx.array],
    k_biases: Optional[mx.array], v_biases: Optional[mx.array],
) -> Optional[QuantizedKv]:
    """The :class:`QuantizedKv` of a call's keyword arguments (None for float pools)."""
    if kv_cache_dtype == "auto" and k_scales is None and v_scales is None and k_biases is None and v_biases is None:
        return None
    return QuantizedKv(kv_cache_dtype, k_scales, v_scales, k_biases, v_biases)


def _quantized_reason(q: mx.array, k_pool: mx.array, v_pool: mx.array, kv: QuantizedKv) -> Optional[str]:
    head_dim = q.shape[2]
    if kv.kv_cache_dtype == "auto":
        return "scales or biases given with kv_cache_dtype 'auto' (float pools have none)"
    if kv.kv_cache_dtype not in KV_CODE_DTYPES:
        return f"kv_cache_dtype {kv.kv_cache_dtype!r} (the quantized kernels take 'int8' and 'int4')"
    code_dtype = KV_CODE_DTYPES[kv.kv_cache_dtype]
    if k_pool.dtype != code_dtype or v_pool.dtype != code_dtype:
        return (f"kv_cache_dtype {kv.kv_cache_dtype} stores {code_dtype} codes, but the pools are "
                f"{k_pool.dtype}, {v_pool.dtype}")
    row = head_dim // 2 if kv.bits == 4 else head_dim
    if k_pool.shape[3] != row:
        return f"{kv.kv_cache_dtype} pools need a last dimension of {row} for head_dim {head_dim}, not {k_pool.shape[3]}"
    needs_biases = kv.bits == 4
    for name in ("k_scales", "v_scales", "k_biases", "v_biases"):
        a = getattr(kv, name)
        if a is None:
            if needs_biases or "scales" in name:
                return f"{name} is missing ({kv.kv_cache_dtype} pools need it)"
            continue
        if not needs_biases and "biases" in name:
            return f"{name} given, but {kv.kv_cache_dtype} is symmetric (no biases)"
        if a.dtype != mx.float16 or a.ndim != 4 or a.shape[:3] != k_pool.shape[:3]:
            return (f"{name} must be float16 [num_blocks, num_kv_heads, block_size, head_dim // group_size] "
                    f"beside pools {k_pool.shape}; got {a.dtype} {a.shape}")
        if a.shape != kv.k_scales.shape:
            return f"{name} {a.shape} and k_scales {kv.k_scales.shape} differ in shape"
    groups = kv.k_scales.shape[3]
    if groups < 1 or head_dim % groups or (head_dim // groups) % 8:
        return f"{groups} scale groups for head_dim {head_dim} (the kernels take groups of a multiple of 8 elements)"
    return None


def _common_reason(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array,
    quantized: Optional[QuantizedKv] = None,
) -> Optional[str]:
    if q.ndim != 3 or k_pool.ndim != 4 or v_pool.ndim != 4 or block_tables.ndim != 2:
        return "q must be 3-d, the pools 4-d and block_tables 2-d"
    if k_pool.shape != v_pool.shape:
        return f"k_pool {k_pool.shape} and v_pool {v_pool.shape} differ in shape"
    if q.dtype not in SUPPORTED_DTYPES:
        return f"dtype {q.dtype} (the kernels take float32, float16 and bfloat16)"
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, num_kv_heads, block_size, pool_dim = k_pool.shape
    if quantized is not None:
        reason = _quantized_reason(q, k_pool, v_pool, quantized)
        if reason:
            return reason
    else:
        if k_pool.dtype != q.dtype or v_pool.dtype != q.dtype:
            return f"q ({q.dtype}) and the pools ({k_pool.dtype}, {v_pool.dtype}) differ in dtype"
        if pool_dim != head_dim:
            return f"head_dim of q ({head_dim}) and of the pools ({pool_dim}) differ"
    if head_dim % 8 or not 8 <= head_dim <= MAX_HEAD_DIM:
        return f"head_dim {head_dim} (the kernels take multiples of 8 up to {MAX_HEAD_DIM})"
    if block_size < 8 or block_size > 256 or block_size & (block_size - 1):
        return f"block_size {block_size} (the kernels take powers of two from 8 to 256)"
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        return f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}"
    if q.shape[0] == 0:
        return "no query rows"
    return None


def decode_unsupported_reason(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array, context_lens: mx.array,
    *, kv_cache_dtype: str = "auto", k_scales: Optional[mx.array] = None, v_scales: Optional[mx.array] = None,
    k_biases: Optional[mx.array] = None, v_biases: Optional[mx.array] = None,
) -> Optional[str]:
    """Why :func:`paged_attention_decode` cannot take these arrays, or None when it can.

    ``kv_cache_dtype`` and the scales/biases describe quantized code pools (see
    :class:`QuantizedKv`). Reads only shapes and dtypes (no device synchronisation).
    """
    quantized = _quantized(kv_cache_dtype, k_scales, v_scales, k_biases, v_biases)
    reason = _common_reason(q, k_pool, v_pool, block_tables, quantized)
    if reason:
        return reason
    if block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],):
        return "block_tables and context_lens must have one row per sequence of q"
    return None


def prefill_unsupported_reason(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    host_context_lens: Sequence[int],
    host_query_start_loc: Sequence[int],
    *, kv_cache_dtype: str = "auto", k_scales: Optional[mx.array] = None, v_scales: Optional[mx.array] = None,
    k_biases: Optional[mx.array] = None, v_biases: Optional[mx.array] = None,
) -> Optional[str]:
    """Why :func:`paged_prefill_attention` cannot take these arrays, or None when it can
    (``kv_cache_dtype`` and the scales/biases: see :class:`QuantizedKv`;
    :func:`paged_prefill_attention_mma` takes float pools only)."""
    quantized = _quantized(kv_cache_dtype, k_scales, v_scales, k_biases, v_biases)
    reason = _common_reason(q, k_pool, v_pool, block_tables, quantized)
    if reason:
        return reason
    qsl = list(host_query_start_loc)
    if len(qsl) != len(host_context_lens) + 1 or len(host_context_lens) > block_tables.shape[0]:
        return "query_start_loc must have num_seqs + 1 entries and block_tables a row per sequence"
    if qsl[0] != 0 or qsl[-1] != q.shape[0]:
        return "query_start_loc does not cover the rows of q (first must be 0, last num_tokens)"
    for i, ctx in enumerate(host_context_lens):
        qlen = qsl[i + 1] - qsl[i]
        if qlen < 0 or qlen > ctx:
            return f"sequence {i} has {qlen} new tokens but a context of {ctx}"
    return None


# ------------------------------------------------------------------ kernels


def _pow2_floor(x: int) -> int:
    return 1 << (max(x, 1).bit_length() - 1)


@dataclass(frozen=True)
class DecodeMetadata:
    """Launch metadata of the decode kernel that every layer of a step shares.

    Build it once per decode step with :func:`decode_metadata` and pass it as
    ``metadata=`` to :func:`paged_attention_decode` for each layer, so the padded
    block tables, context lengths and partition plan are not rebuilt per layer.

    Fields: ``block_tables`` ``[max(8, num_seqs * max_blocks_per_seq)]`` int32 and
    ``context_lens`` ``[max(8, num_seqs)]`` int32 (padded, flattened),
    ``num_seqs``, ``max_blocks_per_seq``, ``num_partitions`` and ``partition_size``
    (tokens; 0 when the context is not split).
    """

    block_tables: mx.array
    context_lens: mx.array
    num_seqs: int
    max_blocks_per_seq: int
    num_partitions: int
    partition_size: int


@lru_cache(maxsize=1)
def gpu_cores() -> int:
    """GPU cores of this machine, for the split-K decision.

    On a Mac, read from the architecture name ``mx.device_info()`` reports (the
    last letter is the chip class MLX itself keys its SDPA tuning on: ``p`` phone,
    ``g`` base, ``s`` Pro, ``c`` Max, ``d`` Ultra); elsewhere, or for an unknown name,
    :data:`DEFAULT_GPU_CORES`.
    """
    try:
        if not mx.metal.is_available():
            return DEFAULT_GPU_CORES
        arch = str(device_info().get("architecture", ""))
    except Exception:  # noqa: BLE001 - no device information: use the documented default
        return DEFAULT_GPU_CORES
    return {"p": 5, "g": 10, "s": 18, "c": 40, "d": 76}.get(arch[-1:], DEFAULT_GPU_CORES)


def decode_partitions(num_seqs: int, num_kv_heads: int, max_tokens: int, block_size: int) -> tuple[int, int]:
    """``(num_partitions, partition_size)`` for a decode launch (split-K).

    One threadgroup serves one (sequence, KV head); contexts are split only when
    there are fewer of those than ``gpu_cores() * DECODE_THREADGROUPS_PER_CORE``, into
    just enough partitions (each at least :data:`DECODE_MIN_PARTITION_TOKENS` tokens,
    a multiple of ``block_size``) to fill the GPU. Decided from shapes alone, with no
    device read-back. ``max_tokens`` is ``max_blocks_per_seq * block_size``.
    :data:`DECODE_PARTITION_SIZE`, when set, forces fixed-size partitions instead.
    Returns ``(1, 0)`` for a single pass.
    """
    if DECODE_PARTITION_SIZE is not None:
        psize = max(block_size, -(-DECODE_PARTITION_SIZE // block_size) * block_size)
        parts = -(-max_tokens // psize)
        return (parts, psize) if parts > 1 else (1, 0)
    groups = num_seqs * num_kv_heads
    target = gpu_cores() * DECODE_THREADGROUPS_PER_CORE
    if groups >= target or max_tokens < 2 * DECODE_MIN_PARTITION_TOKENS:
        return 1, 0
    parts = min(-(-target // groups), max_tokens // DECODE_MIN_PARTITION_TOKENS)
    psize = -(-max_tokens // parts)
    psize = -(-psize // block_size) * block_size
    parts = -(-max_tokens // psize)
    return (parts, psize) if parts > 1 else (1, 0)


def decode_metadata(block_tables: mx.array, context_lens: mx.array, num_kv_heads: int, block_size: int) -> DecodeMetadata:
    """The :class:`DecodeMetadata` of one decode step (shared by all its layers).

    Args:
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 physical block ids.
        context_lens: ``[num_seqs]`` int32.
        num_kv_heads, block_size: of the KV pools (they decide the partition plan).
    """
    num_seqs, max_blocks = block_tables.shape
    parts, psize = decode_partitions(num_seqs, num_kv_heads, max_blocks * block_size, block_size)
    return DecodeMetadata(
        _pad(block_tables.astype(mx.int32)), _pad(context_lens.astype(mx.int32)),
        num_seqs, max_blocks, parts, psize,
    )


def paged_attention_decode(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    *,
    host_context_lens=None,
    metadata: Optional[DecodeMetadata] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    kv_cache_dtype: str = "auto",
    k_scales: Optional[mx.array] = None,
    v_scales: Optional[mx.array] = None,
    k_biases: Optional[mx.array] = None,
    v_biases: Optional[mx.array] = None,
) -> mx.array:
    """Attention of one query token per sequence over its paged K/V, on the Metal kernels.

    Same contract as :func:`mlx_ferrum.kernels.reference.paged_attention_decode`:

    Args:
        q: ``[num_seqs, num_heads, head_dim]`` float32/float16/bfloat16; head_dim a
            multiple of 8 up to 256.
        k_pool, v_pool: ``[num_blocks, num_kv_heads, block_size, head_dim]``, q's dtype;
            block_size a power of two from 8 to 256; ``num_heads % num_kv_heads == 0``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32 physical block ids.
        context_lens: ``[num_seqs]`` int32, each in ``[0, max_blocks_per_seq * block_size]``
            (a row with context 0 gives 0).
        scale: softmax scale.
        host_context_lens: accepted for the reference's signature; the kernel reads
            ``context_lens`` on the device.
        metadata: the step's :class:`DecodeMetadata` from :func:`decode_metadata`
            (built here when None); its arrays replace ``block_tables`` and
            ``context_lens``.
        window: sliding window in tokens (None, 0 or negative: none): only the last
            ``window`` tokens of each context are attended, and the kernel starts at
            the block holding the first of them (blocks before it are never read).
        sinks: ``[num_heads]`` attention-sink logits (gpt-oss; any float dtype), or
            None: one extra logit per head in the softmax denominator, with no value.
        kv_cache_dtype: "auto" (the pools hold q's dtype), "int8" or "int4": the pools
            hold codes and ``k_scales``/``v_scales`` (and for int4 ``k_biases``/``v_biases``)
            their float16 group scales, as :class:`QuantizedKv` describes; the kernel
            dequantizes in registers. For int4 the keys are stored rotated and q must
            arrive rotated by the same Walsh-Hadamard matrix (the caller rotates).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in q's dtype. One threadgroup per
        (sequence, KV head) serves the KV head's ``num_heads / num_kv_heads`` query
        heads (groups above :data:`DECODE_MAX_HEADS_PER_THREADGROUP` are split); long contexts with too few threadgroups to fill the GPU are split
        (see :func:`decode_partitions`) and merged by ``paged_attention_reduce``.

    Raises:
        KernelError: the shapes or dtypes are outside what the kernel takes (see
            :func:`decode_unsupported_reason`).
    """
    launch = _decode_launch(q, k_pool, v_pool, block_tables, context_lens, scale, metadata, window, sinks,
                            _quantized(kv_cache_dtype, k_scales, v_scales, k_biases, v_biases))
    if launch.partition_size == 0:
        return launch.partial_out
    reduce = _kernel(
        "paged_attention_reduce",
        ["tmp_out", "max_logits", "exp_sums", "context_lens", "params", "sinks"],
        ["out"],
    )
    return reduce(
        inputs=[launch.partial_out, launch.max_logits, launch.exp_sums, launch.metadata.context_lens,
                _params(launch.num_heads, launch.num_partitions, launch.partition_size, launch.window_tokens),
                _sinks_input(sinks, launch.num_heads)],
        template=[("T", q.dtype), ("HEAD_DIM", q.shape[-1]), ("NUM_PARTITIONS", launch.num_partitions),
                  ("SINKS", int(sinks is not None))],
        grid=(q.shape[-1], launch.num_heads, q.shape[0]),
        threadgroup=(q.shape[-1], 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )[0]


@dataclass(frozen=True)
class DecodePartials:
    """What one launch of the decode kernel returns before its partitions are merged.

    Attributes:
        partial_out: split-K: ``[num_seqs, num_heads, num_partitions, head_dim]`` float32,
            each partition's output normalised by its own sum; one pass: the final
            ``[num_seqs, num_heads, head_dim]`` output in q's dtype.
        max_logits, exp_sums: split-K: ``[num_seqs, num_heads, num_partitions]`` float32,
            each partition's largest logit (log2 units, -FLT_MAX when it scored nothing)
            and its sum of ``exp2(logit - max)``; one pass: 1-element placeholders.
        metadata, num_heads, num_partitions, partition_size, window_tokens: the launch's plan.
    """

    partial_out: mx.array
    max_logits: mx.array
    exp_sums: mx.array
    metadata: DecodeMetadata
    num_heads: int
    num_partitions: int
    partition_size: int
    window_tokens: int


def _decode_launch(
    q: mx.array, k_pool: mx.array, v_pool: mx.array, block_tables: mx.array, context_lens: mx.array, scale: float,
    metadata: Optional[DecodeMetadata], window: Optional[int], sinks: Optional[mx.array],
    quantized: Optional[QuantizedKv], code_bounds: Optional[mx.array] = None,
) -> DecodePartials:
    """One launch of ``paged_attention_decode.metal``; with ``code_bounds`` (``[num_seqs, 2]``
    int32, the float window's ``(code_end, float_from)`` per row) always split-K (one
    partition spanning every block when the plan does not split), so the caller can merge
    the partitions' statistics with its own.

    Raises:
        KernelError: the shapes or dtypes are outside what the kernel takes.
    """
    reason = _common_reason(q, k_pool, v_pool, block_tables, quantized)
    if reason is None and (block_tables.shape[0] != q.shape[0] or context_lens.shape != (q.shape[0],)):
        reason = "block_tables and context_lens must have one row per sequence of q"
    if reason is None and code_bounds is not None and code_bounds.shape != (q.shape[0], 2):
        reason = "code_bounds must be [num_seqs, 2] (code_end, float_from)"
    if reason:
        raise KernelError(f"paged_attention_decode kernel: {reason}")
    num_seqs, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, _ = k_pool.shape
    kv_inputs, kv_template = _kv_format(quantized, head_dim)
    if metadata is None:
        metadata = decode_metadata(block_tables, context_lens, num_kv_heads, block_size)
    num_partitions, psize = metadata.num_partitions, metadata.partition_size
    if code_bounds is not None and num_partitions == 1:
        psize = metadata.max_blocks_per_seq * block_size
    partitioned = psize > 0
    tg = DECODE_NUM_SIMD * 32
    group = num_heads // num_kv_heads
    heads_per_tg = max(d for d in range(1, DECODE_MAX_HEADS_PER_THREADGROUP + 1) if group % d == 0)
    scale_arr = mx.array(scale * LOG2E, dtype=mx.float32)
    window_tokens = max(0, int(window)) if window is not None else 0
    sinks_arr = _sinks_input(sinks, num_heads)
    params = _params(num_heads, num_kv_heads, metadata.max_blocks_per_seq, num_partitions, window_tokens)
    bounds = _pad(code_bounds.astype(mx.int32)) if code_bounds is not None else _no_code_bounds()
    kernel = _kernel(
        "paged_attention_decode",
        ["q", "k_pool", "v_pool", "block_tables", "context_lens", "params", "scale", "sinks", *KV_SCALE_INPUTS,
         "code_bounds"],
        ["out", "max_logits", "exp_sums"],
    )
    out_dtype = mx.float32 if partitioned else q.dtype
    stats_shape = (num_seqs, num_heads, num_partitions) if partitioned else (1,)
    outs = kernel(
        inputs=[q, k_pool, v_pool, metadata.block_tables, metadata.context_lens, params, scale_arr, sinks_arr,
                *kv_inputs, bounds],
        template=[
            ("T", q.dtype),
            ("OutT", out_dtype),
            ("HEAD_DIM", head_dim),
            ("BLOCK_SIZE", block_size),
            *kv_template,
            ("NUM_SIMD", DECODE_NUM_SIMD),
            ("GQA", heads_per_tg),
            ("PARTITION_SIZE", psize if partitioned else 0),
            ("SINKS", int(sinks is not None)),
            ("FLOAT_FIRST", FLOAT_FIRST_TOKENS if code_bounds is not None else 0),
        ],
        grid=(num_heads // heads_per_tg * tg, num_seqs, num_partitions),
        threadgroup=(tg, 1, 1),
        output_shapes=[
            (num_seqs, num_heads, num_partitions, head_dim) if partitioned else q.shape,
            stats_shape,
            stats_shape,
        ],
        output_dtypes=[out_dtype, mx.float32, mx.float32],
    )
    return DecodePartials(outs[0], outs[1], outs[2], metadata, num_heads, num_partitions, psize if partitioned else 0,
                          window_tokens)


def paged_attention_decode_with_float(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    scale: float,
    *,
    float_keys: mx.array,
    float_values: mx.array,
    float_valid: mx.array,
    code_bounds: mx.array,
    metadata: Optional[DecodeMetadata] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    kv_cache_dtype: str = "auto",
    k_scales: Optional[mx.array] = None,
    v_scales: Optional[mx.array] = None,
    k_biases: Optional[mx.array] = None,
    v_biases: Optional[mx.array] = None,
) -> mx.array:
    """:func:`paged_attention_decode` over the codes together with a float window's
    entries, in one softmax (:mod:`mlx_ferrum.kernels.float_window`).

    The kernel skips the codes of the positions the entries cover (``code_bounds``) and
    returns its partitions' outputs with their max and sum (split-K); the entries' scores
    join them here, the way ``paged_attention_reduce`` merges partitions
    (FlashAttention's rescaling by ``exp2(max_p - max)``).

    Args:
        q, k_pool, v_pool, block_tables, context_lens, scale, metadata, window, sinks,
        kv_cache_dtype, k_scales, v_scales, k_biases, v_biases: as in
            :func:`paged_attention_decode` (q already in the keys' basis).
        float_keys, float_values: ``[num_seqs, num_kv_heads, F, head_dim]`` (float16) each
            row's float entries, keys in the pool's basis.
        float_valid: ``[num_seqs, F]`` bool, the entries each row attends to.
        code_bounds: ``[num_seqs, 2]`` int32 per row ``(code_end, float_from)``: the codes
            of positions ``>= code_end`` and of positions below
            :data:`~mlx_ferrum.kernels.float_window.FIRST_TOKENS` that are ``>= float_from``
            are not read (:meth:`~mlx_ferrum.kernels.float_window.FloatRows.code_bounds`).

    Returns:
        ``[num_seqs, num_heads, head_dim]`` in q's dtype (0 for a row that attends to nothing).

    Raises:
        KernelError: the shapes or dtypes are outside what the kernel takes.
    """
    launch = _decode_launch(q, k_pool, v_pool, block_tables, context_lens, scale, metadata, window, sinks,
                            _quantized(kv_cache_dtype, k_scales, v_scales, k_biases, v_biases), code_bounds)
    return merge_partials_with_float(q, scale, launch.partial_out, launch.max_logits, launch.exp_sums,
                                     float_keys, float_values, float_valid, sinks)


def merge_partials_with_float(
    q: mx.array, scale: float, partial_out: mx.array, max_logits: mx.array, exp_sums: mx.array,
    float_keys: mx.array, float_values: mx.array, float_valid: mx.array, sinks: Optional[mx.array] = None,
) -> mx.array:
    """One softmax over a split-K launch's partitions and a float window's entries.

    Args:
        q: ``[S, H, D]`` the launch's queries; scale: its softmax scale.
        partial_out, max_logits, exp_sums: the launch's split-K outputs
            (:class:`DecodePartials`; max in log2 units).
        float_keys, float_values: ``[S, KVH, F, D]``; float_valid: ``[S, F]`` bool.
        sinks: ``[H]`` attention-sink logits (natural units), or None.

    Returns:
        ``[S, H, D]`` in q's dtype: ``(sum_p exp2(m_p - M) l_p o_p + sum_f exp2(s_f - M) v_f)
        / (sum_p exp2(m_p - M) l_p + sum_f exp2(s_f - M) [+ exp2(sink - M)])``, 0 where the
        denominator is 0.
    """
    num_seqs, num_heads, head_dim = q.shape
    num_kv_heads, entries = float_keys.shape[1], float_keys.shape[2]
    group = num_heads // num_kv_heads
    f32 = mx.float32
    qg = (q.astype(f32) * (scale * LOG2E)).reshape(num_seqs, num_kv_heads, group, head_dim)
    scores = (qg @ float_keys.astype(f32).swapaxes(-1, -2)).reshape(num_seqs, num_heads, entries)
    valid = float_valid[:, None, :]
    lowest = mx.array(-FLT_MAX, f32)
    scores = mx.where(valid, scores, lowest)
    top = mx.maximum(max_logits.max(axis=-1), scores.max(axis=-1))  # [S, H]
    sink_logits = None
    if sinks is not None:
        sink_logits = sinks.astype(f32)[None] * LOG2E
        top = mx.maximum(top, sink_logits)
    weights = mx.power(2.0, max_logits - top[..., None]) * exp_sums  # [S, H, P]
    probs = mx.where(valid, mx.power(2.0, scores - top[..., None]), 0.0)  # [S, H, F]
    denom = weights.sum(axis=-1) + probs.sum(axis=-1)
    if sink_logits is not None:
        denom = denom + mx.power(2.0, sink_logits - top)
    numer = (weights[..., None] * partial_out).sum(axis=-2) + (
        probs.reshape(num_seqs, num_kv_heads, group, entries) @ float_values.astype(f32)
    ).reshape(num_seqs, num_heads, head_dim)
    out = mx.where(denom[..., None] > 0, numer / mx.maximum(denom, mx.array(1e-30, f32))[..., None], 0.0)
    return out.astype(q.dtype)


#: The kernels' scale/bias inputs (placeholders for float pools), after their other inputs.
KV_SCALE_INPUTS = ("k_scales", "v_scales", "k_biases", "v_biases")


@lru_cache(maxsize=1)
def _no_code_bounds() -> mx.array:
    # the unread code_bounds placeholder of a launch without a float window
    return mx.zeros((MIN_DEVICE_ELEMENTS,), mx.int32)


@lru_cache(maxsize=1)
def _no_scales() -> mx.array:
    # the unread placeholder of float pools (8 elements: a device pointer, as the real ones)
    return mx.zeros((MIN_DEVICE_ELEMENTS,), mx.float16)


def _kv_format(quantized: Optional[QuantizedKv], head_dim: int) -> tuple[list, list]:
    """The kernels' scale/bias inputs and their ``KV_BITS``/``GROUP_SIZE`` template values."""
    if quantized is None:
        return [_no_scales()] * 4, [("KV_BITS", 0), ("GROUP_SIZE", head_dim)]
    none = _no_scales()
    inputs = [quantized.k_scales, quantized.v_scales,
              quantized.k_biases if quantized.k_biases is not None else none,
              quantized.v_biases if quantized.v_biases is not None else none]
    group_size = head_dim // quantized.k_scales.shape[3]
    return inputs, [("KV_BITS", quantized.bits), ("GROUP_SIZE", group_size)]


@lru_cache(maxsize=16)
def _no_sinks(num_heads: int) -> mx.array:
    # built once per head count: the decode hot path would otherwise allocate it per layer
    return mx.zeros((max(MIN_DEVICE_ELEMENTS, num_heads),), mx.float32)


def _sinks_input(sinks: Optional[mx.array], num_heads: int, log2_units: bool = True) -> mx.array:
    """The kernels' ``sinks`` input: ``[max(8, num_heads)]`` float32 logits (times
    log2(e) for the base-2 kernels); zeros when there are no sinks (then unread).

    Raises:
        KernelError: ``sinks`` is not ``[num_heads]``.
    """
    if sinks is None:
        return _no_sinks(num_heads)
    if sinks.shape != (num_heads,):
        raise KernelError(f"sinks has shape {sinks.shape}; pass one logit per query head: ({num_heads},)")
    values = sinks.astype(mx.float32)
    return _pad(values * LOG2E if log2_units else values)


def _checked_prefill_tiles(
    name: str, q, k_pool, v_pool, block_tables, context_lens, query_start_loc,
    host_context_lens, host_query_start_loc, rows: int = PREFILL_NUM_SIMD, **quantized: Any,
) -> list:
    """The prefill kernels' shared launch check and tiling, decided on the host: the
    lengths as Python ints (read from the arrays when not given), then
    :func:`prefill_tiles`. Raises KernelError naming ``name`` for unsupported shapes."""
    ctx = list(host_context_lens) if host_context_lens is not None else context_lens.tolist()
    qsl = list(host_query_start_loc) if host_query_start_loc is not None else query_start_loc.tolist()
    reason = prefill_unsupported_reason(q, k_pool, v_pool, block_tables, ctx, qsl, **quantized)
    if reason:
        raise KernelError(f"{name} kernel: {reason}")
    return prefill_tiles(ctx, qsl, rows=rows)


def prefill_tiles(
    host_context_lens: Sequence[int], host_query_start_loc: Sequence[int], rows: int = PREFILL_NUM_SIMD
) -> list[int]:
    """Flattened ``[seq, first_row, num_rows, first_position]`` per prefill threadgroup.

    Each sequence's query rows are cut into tiles of at most ``rows`` rows, so a
    tile never spans two sequences. Row ``j`` of sequence ``i`` sits at position
    ``context_lens[i] - q_len_i + j``.
    """
    tiles: list[int] = []
    for i, ctx in enumerate(host_context_lens):
        q0, q1 = host_query_start_loc[i], host_query_start_loc[i + 1]
        for r in range(q0, q1, rows):
            tiles += [i, r, min(rows, q1 - r), ctx - (q1 - q0) + (r - q0)]
    return tiles


def paged_prefill_attention(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    query_start_loc: mx.array,
    scale: float,
    *,
    host_context_lens: Optional[Sequence[int]] = None,
    host_query_start_loc: Optional[Sequence[int]] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
    kv_cache_dtype: str = "auto",
    k_scales: Optional[mx.array] = None,
    v_scales: Optional[mx.array] = None,
    k_biases: Optional[mx.array] = None,
    v_biases: Optional[mx.array] = None,
) -> mx.array:
    """Causal attention of several new tokens per sequence over its paged K/V, on the Metal kernel.

    Same contract as :func:`mlx_ferrum.kernels.reference.paged_prefill_attention`:

    Args:
        q: ``[num_tokens, num_heads, head_dim]`` (rows of all sequences, packed).
        k_pool, v_pool: ``[num_blocks, num_kv_heads, block_size, head_dim]``.
        block_tables: ``[num_seqs, max_blocks_per_seq]`` int32.
        context_lens: ``[num_seqs]`` int32, including the new tokens.
        query_start_loc: ``[num_seqs + 1]`` int32 prefix sums of the query lengths.
        scale: softmax scale.
        host_context_lens, host_query_start_loc: the same values as Python ints (read
            from the arrays when None: the tiling is decided on the host).
        window: sliding window in tokens (None, 0 or negative: none): query ``p``
            attends keys ``p - window + 1 .. p``; blocks wholly before a tile's first
            window are never read.
        sinks: ``[num_heads]`` attention-sink logits (gpt-oss), or None.
        kv_cache_dtype, k_scales, v_scales, k_biases, v_biases: quantized code pools,
            as for :func:`paged_attention_decode` (the staging step dequantizes; int4
            keys are stored rotated and q must arrive rotated, the caller rotates).

    Returns:
        ``[num_tokens, num_heads, head_dim]`` in q's dtype.

    Raises:
        KernelError: shapes outside what the kernel takes (see :func:`prefill_unsupported_reason`),
            or ``sinks`` not ``[num_heads]``.
    """
    tiles = _checked_prefill_tiles(
        "paged_prefill_attention", q, k_pool, v_pool, block_tables, context_lens, query_start_loc,
        host_context_lens, host_query_start_loc, kv_cache_dtype=kv_cache_dtype, k_scales=k_scales,
        v_scales=v_scales, k_biases=k_biases, v_biases=v_biases,
    )
    if not tiles:
        return mx.zeros_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, num_kv_heads, block_size, _ = k_pool.shape
    kv_tile = min(block_size, _pow2_floor(PREFILL_TILE_ELEMENTS // head_dim))
    tg = PREFILL_NUM_SIMD * 32
    window_tokens = max(0, int(window)) if window is not None else 0
    kv_inputs, kv_template = _kv_format(_quantized(kv_cache_dtype, k_scales, v_scales, k_biases, v_biases),
                                        head_dim)
    kernel = _kernel(
        "paged_prefill_attention",
        ["q", "k_pool", "v_pool", "block_tables", "tiles", "params", "scale", "sinks", *KV_SCALE_INPUTS],
        ["out"],
    )
    return kernel(
        inputs=[
            q,
            k_pool,
            v_pool,
            _pad(block_tables.astype(mx.int32)),
            _pad(mx.array(tiles, dtype=mx.int32)),
            _params(num_heads, num_kv_heads, block_tables.shape[1], window_tokens),
            mx.array(scale, dtype=mx.float32),
            _sinks_input(sinks, num_heads, log2_units=False),
            *kv_inputs,
        ],
        template=[
            ("T", q.dtype),
            ("HEAD_DIM", head_dim),
            ("BLOCK_SIZE", block_size),
            *kv_template,
            ("NUM_SIMD", PREFILL_NUM_SIMD),
            ("KV_TILE", kv_tile),
            ("SINKS", int(sinks is not None)),
        ],
        grid=(len(tiles) // 4 * tg, num_heads, 1),
        threadgroup=(tg, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )[0]


def paged_prefill_attention_mma(
    q: mx.array,
    k_pool: mx.array,
    v_pool: mx.array,
    block_tables: mx.array,
    context_lens: mx.array,
    query_start_loc: mx.array,
    scale: float,
    *,
    host_context_lens: Optional[Sequence[int]] = None,
    host_query_start_loc: Optional[Sequence[int]] = None,
    window: Optional[int] = None,
    sinks: Optional[mx.array] = None,
) -> mx.array:
    """:func:`paged_prefill_attention` on the matrix units: ``simdgroup_matrix`` 8x8 tiles
    (FlashAttention-2, Dao 2023, tiled as in MLX's steel attention), the GQA query heads
    of a KV head in one threadgroup sharing each staged K/V tile.

    Same arguments (``window`` and ``sinks`` included), shapes, dtypes, result and errors
    as :func:`paged_prefill_attention` (``[num_tokens, num_heads, head_dim]`` in q's
    dtype; float32 accumulation).

    Raises:
        KernelError: shapes outside what the kernels take (see :func:`prefill_unsupported_reason`).
    """
    tiles = _checked_prefill_tiles(
        "paged_prefill_attention_mma", q, k_pool, v_pool, block_tables, context_lens, query_start_loc,
        host_context_lens, host_query_start_loc, rows=8,
    )
    if not tiles:
        return mx.zeros_like(q)
    num_heads, head_dim = q.shape[1], q.shape[2]
    _, num_kv_heads, block_size, _ = k_pool.shape
    gqa = num_heads // num_kv_heads
    num_simd = min(4, gqa)
    window_tokens = max(0, int(window)) if window is not None else 0
    kernel = _kernel(
        "paged_prefill_attention_mma",
        ["q", "k_pool", "v_pool", "block_tables", "tiles", "params", "scale", "sinks"],
        ["out"],
    )
    return kernel(
        inputs=[
            q,
            k_pool,
            v_pool,
            _pad(block_tables.astype(mx.int32)),
            _pad(mx.array(tiles, dtype=mx.int32)),
            _params(num_heads, num_kv_heads, block_tables.shape[1], window_tokens),
            mx.array(scale * LOG2E, dtype=mx.float32),
            _sinks_input(sinks, num_heads),
        ],
        template=[
            ("T", q.dtype),
            ("HEAD_DIM", head_dim),
            ("BLOCK_SIZE", block_size),
            ("GQA", gqa),
            ("NUM_SIMD", num_simd),
            ("HEADS_PER_SIMD", -(-gqa // num_simd)),
            ("SINKS", int(sinks is not None)),
        ],
        grid=(len(tiles) // 4 * num_simd * 32, num_kv_heads, 1),
        threadgroup=(num_simd * 32, 1, 1),
        output_shapes=[q.shape],
        output_dtypes=[q.dtype],
    )[0]
