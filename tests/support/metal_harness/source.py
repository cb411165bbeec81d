"""The kernel source MLX 0.32 builds around an ``mx.fast.metal_kernel`` body.

A line-by-line model of ``write_signature``, ``write_template`` and the kernel
naming in MLX's ``mlx/backend/common/metal_kernel.cpp`` (v0.32): the header, a
``template <...>`` line when template arguments are given, the ``[[kernel]]``
signature (inputs with ``[[buffer(i)]]``, ``constant`` address space for arrays of
fewer than 8 elements, references for 0-d arrays, ``_shape``/``_strides``/``_ndim``
extras when their names occur in the body, outputs, attributes found by substring),
the body, ``}`` and the explicit instantiation. MLX prepends ``metal::utils()``
(its ``kernels/utils.h``) when it compiles; that part is not included here.

The upstream quirk is kept on purpose: with shape/stride extras, two or more
outputs and no attribute, ``) {`` is written twice and the source does not compile,
as on a Mac. :func:`capture_mlx_source` reads MLX's own text (through
``mx.export_function``, which records the kernel without a Metal device) so tests
can compare the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import mlx.core as mx

#: Inputs with fewer elements than this are passed in the ``constant`` address space.
MAX_CONSTANT_ARRAY_SIZE = 8

#: Metal kernel attributes MLX adds when their name occurs in the body, in MLX's order.
METAL_ATTRIBUTES: tuple[tuple[str, str], ...] = (
    ("dispatch_quadgroups_per_threadgroup", "uint"),
    ("dispatch_simdgroups_per_threadgroup", "uint"),
    ("dispatch_threads_per_threadgroup", "uint3"),
    ("grid_origin", "uint3"),
    ("grid_size", "uint3"),
    ("quadgroup_index_in_threadgroup", "uint"),
    ("quadgroups_per_threadgroup", "uint"),
    ("simdgroup_index_in_threadgroup", "uint"),
    ("simdgroups_per_threadgroup", "uint"),
    ("thread_execution_width", "uint"),
    ("thread_index_in_quadgroup", "uint"),
    ("thread_index_in_simdgroup", "uint"),
    ("thread_index_in_threadgroup", "uint"),
    ("thread_position_in_grid", "uint3"),
    ("thread_position_in_threadgroup", "uint3"),
    ("threadgroup_position_in_grid", "uint3"),
    ("threadgroups_per_grid", "uint3"),
    ("threads_per_grid", "uint3"),
    ("threads_per_simdgroup", "uint"),
    ("threads_per_threadgroup", "uint3"),
)

_TYPE_STRINGS = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.float64: "double",
    mx.complex64: "complex64_t",
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}


def type_string(dtype: mx.Dtype) -> str:
    """The Metal type name MLX writes for ``dtype`` (``get_type_string`` in MLX).

    Raises:
        ValueError: the dtype has no Metal type (as MLX raises).
    """
    try:
        return _TYPE_STRINGS[dtype]
    except KeyError:
        raise ValueError(f"Unsupported compilation type {dtype}") from None


@dataclass(frozen=True)
class ArgInfo:
    """What the generated signature needs to know about one input array."""

    name: str
    dtype: mx.Dtype
    ndim: int
    size: int


@dataclass(frozen=True)
class Param:
    """One parameter of the generated kernel function, in signature order.

    ``kind`` is ``input``, ``shape``, ``strides``, ``ndim``, ``output`` or
    ``attribute``; ``decl`` is the C type as written (``const device float*``,
    ``const constant int&``, ``uint3``); ``buffer`` is the ``[[buffer(i)]]`` index or
    -1 for attributes; ``input_index`` names the input an extra belongs to.
    """

    kind: str
    name: str
    decl: str
    buffer: int
    input_index: int = -1


@dataclass(frozen=True)
class GeneratedKernel:
    """The source MLX would generate, plus where each part lies in it.

    ``header_span`` and ``body_span`` are ``(start, end)`` character offsets of the
    header and the body in ``source``; ``template_def`` is ``"<float, 8, 16>"`` or ``""``.
    """

    kernel_name: str
    source: str
    params: tuple[Param, ...]
    template_def: str
    header_span: tuple[int, int]
    body_span: tuple[int, int]


def _template_kind(value: Any) -> str:
    if isinstance(value, mx.Dtype):
        return "typename"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    raise ValueError(f"template argument {value!r} is not a bool, int or mlx Dtype")


def _template_value(value: Any) -> str:
    if isinstance(value, mx.Dtype):
        return type_string(value)
    if isinstance(value, bool):
        return "1" if value else "0"  # std::ostream << bool
    return str(int(value))


def write_template(template: Sequence[tuple[str, Any]]) -> str:
    """``<float, 3, 1>`` for ``[("T", mx.float32), ("N", 3), ("B", True)]``."""
    return "<" + ", ".join(_template_value(v) for _, v in template) + ">"


def make_template_hash(template_def: str) -> str:
    """MLX's name suffix: ``<``, ``>`` and ``-`` become ``_``, ``", "`` becomes ``_``, last char dropped.

    (MLX 0.32.4 also maps the minus sign of negative int arguments to ``_``, unlike
    the 0.32.2 source; the generator test against MLX pins this down.)
    """
    out = []
    i = 0
    while i < len(template_def):
        c = template_def[i]
        if c in "<>-":
            out.append("_")
        elif c == "," and i + 1 < len(template_def) and template_def[i + 1] == " ":
            out.append("_")
            i += 1
        else:
            out.append(c)
        i += 1
    return "".join(out)[:-1]


def attributes_in(body: str) -> list[tuple[str, str]]:
    """``(name, type)`` of each Metal attribute whose name occurs in ``body`` (substring test)."""
    return [(n, t) for n, t in METAL_ATTRIBUTES if n in body]


def kernel_name(
    name: str,
    inputs: Sequence[ArgInfo],
    output_dtypes: Sequence[mx.Dtype],
    template: Sequence[tuple[str, Any]],
) -> str:
    """The host name MLX gives the instantiated kernel (encodes template, dtypes, address spaces)."""
    kname = "custom_kernel_" + name
    if template:
        kname += "_" + make_template_hash(write_template(template))
    for a in inputs:
        kname += "_" + type_string(a.dtype)
        if a.ndim == 0:
            kname += "s"
        elif a.size < MAX_CONSTANT_ARRAY_SIZE:
            kname += "c"
    for d in output_dtypes:
        kname += "_" + type_string(d)
    return kname


def generate(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    body: str,
    header: str,
    inputs: Sequence[ArgInfo],
    output_dtypes: Sequence[mx.Dtype],
    template: Optional[Sequence[tuple[str, Any]]] = None,
    atomic_outputs: bool = False,
) -> GeneratedKernel:
    """Build the source text MLX 0.32 generates for one launch of a custom kernel.

    Args:
        name: the ``name`` given to ``mx.fast.metal_kernel``.
        input_names, output_names: parameter names, as given to ``metal_kernel``.
        body, header: the kernel body and header text.
        inputs: one :class:`ArgInfo` per input (dtype, ndim and element count decide
            the type, address space and reference-ness).
        output_dtypes: dtype of each output.
        template: ``[(name, mx.Dtype | bool | int), ...]`` or None.
        atomic_outputs: write outputs as ``device atomic<T>*``.

    Returns:
        A :class:`GeneratedKernel` whose ``source`` equals MLX's text character for character.

    Raises:
        ValueError: list lengths disagree, or a dtype/template value is unsupported.
    """
    template = list(template or [])
    if not output_names:
        raise ValueError("[metal_kernel] Must specify at least one output.")
    if len(inputs) != len(input_names):
        raise ValueError(f"[metal_kernel] Expected `inputs` to have size {len(input_names)} but got size {len(inputs)}.")
    if len(output_dtypes) != len(output_names):
        raise ValueError(
            f"[metal_kernel] Expected `output_dtypes` to have size {len(output_names)} but got size {len(output_dtypes)}."
        )
    attributes = attributes_in(body)
    kname = kernel_name(name, inputs, output_dtypes, template)

    src = [header]
    header_span = (0, len(header))
    if template:
        src.append("template <" + ", ".join(f"{_template_kind(v)} {n}" for n, v in template) + ">\n")
    src.append(f"[[kernel]] void {kname}(\n")
    params: list[Param] = []
    index = 0
    for i, (pname, a) in enumerate(zip(input_names, inputs)):
        location = "constant" if a.size < MAX_CONSTANT_ARRAY_SIZE else "device"
        ref = "&" if a.ndim == 0 else "*"
        decl = f"const {location} {type_string(a.dtype)}{ref}"
        src.append(f"  {decl} {pname} [[buffer({index})]],\n")
        params.append(Param("input", pname, decl, index, i))
        index += 1
        if a.ndim > 0:
            for kind, ctype, found in (
                ("shape", "const constant int*", pname + "_shape" in body),
                ("strides", "const constant int64_t*", pname + "_strides" in body),
                ("ndim", "const constant int&", pname + "_ndim" in body),
            ):
                if found:
                    src.append(f"  {ctype} {pname}_{kind} [[buffer({index})]],\n")
                    params.append(Param(kind, f"{pname}_{kind}", ctype, index, i))
                    index += 1
    n_outputs = len(output_names)
    for oname, odt in zip(output_names, output_dtypes):
        t = type_string(odt)
        decl = f"device atomic<{t}>*" if atomic_outputs else f"device {t}*"
        src.append(f"  {decl} {oname} [[buffer({index})]]")
        # MLX compares the buffer index (extras included) with the array count, so
        # extras + several outputs + no attribute closes the signature early.
        if index < len(inputs) + n_outputs - 1 or attributes:
            src.append(",\n")
        else:
            src.append(") {\n")
        params.append(Param("output", oname, decl, index))
        index += 1
    for k, (aname, atype) in enumerate(attributes):
        src.append(f"  {atype} {aname} [[{aname}]]")
        src.append(",\n" if k < len(attributes) - 1 else ") {\n")
        params.append(Param("attribute", aname, atype, -1))
    body_start = sum(len(s) for s in src)
    src.append(body)
    body_end = body_start + len(body)
    src.append("\n}\n")
    template_def = ""
    if template:
        template_def = write_template(template)
        full = kname + template_def
        src.append(f'\ntemplate [[host_name("{kname}")]] [[kernel]] decltype({full}) {full};\n')
    return GeneratedKernel(
        kernel_name=kname,
        source="".join(src),
        params=tuple(params),
        template_def=template_def,
        header_span=header_span,
        body_span=(body_start, body_end),
    )


def arg_info(name: str, a: mx.array) -> ArgInfo:
    """:class:`ArgInfo` of an MLX array."""
    return ArgInfo(name=name, dtype=a.dtype, ndim=a.ndim, size=a.size)


def capture_mlx_source(
    name: str,
    input_names: Sequence[str],
    output_names: Sequence[str],
    source: str,
    header: str,
    inputs: Sequence[mx.array],
    output_shapes: Sequence[Sequence[int]],
    output_dtypes: Sequence[mx.Dtype],
    template: Optional[Sequence[tuple[str, Any]]] = None,
    atomic_outputs: bool = False,
) -> tuple[str, str]:
    """MLX's own ``(kernel_name, source)`` for a launch, without a Metal device.

    ``mx.export_function`` traces the function; a kernel traced while exporting is
    recorded as a ``CustomKernel`` primitive whose first two arguments are the host
    name and the generated source (the same text ``verbose=True`` prints).

    Raises:
        RuntimeError: no CustomKernel primitive was recorded (MLX changed).
    """
    kernel = mx.fast.metal_kernel(
        name=name,
        input_names=list(input_names),
        output_names=list(output_names),
        source=source,
        header=header,
        atomic_outputs=atomic_outputs,
    )
    found: list = []

    def fn(*arrays):
        return kernel(
            inputs=list(arrays),
            template=list(template) if template else None,
            grid=(1, 1, 1),
            threadgroup=(1, 1, 1),
            output_shapes=[tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes),
        )

    def callback(info):
        if isinstance(info, dict) and info.get("type") == "primitive" and info.get("name") == "CustomKernel":
            found.append(info["arguments"])

    mx.export_function(callback, fn, *inputs)
    if not found:
        raise RuntimeError("mx.export_function recorded no CustomKernel primitive")
    return found[0][0], found[0][1]
