"""Turn the source MLX generates into a C++ translation unit for the CPU harness.

The text that reaches clang is MLX's own, changed only where C++ needs it, and
never by moving a line:

- ``#include "msl_compat.h"`` stands in for ``metal::utils()``;
- the Metal attributes MLX writes (``[[kernel]]``, ``[[buffer(i)]]``,
  ``[[host_name("...")]]``, ``[[thread_position_in_grid]]``, ...) are removed;
- ``threadgroup T name[N];`` becomes ``static threadgroup T name[N];`` followed,
  on the same line, by a call that NaN-fills it once per threadgroup: one group runs
  at a time, so static storage is shared by exactly that group's threads;
- ``#line`` directives before the header and the body point compiler messages and
  ``__builtin_LINE`` at the ``.metal`` file and line they came from;
- an ``extern "C" msl_kernel_invoke`` casts the runtime's buffers to the parameter
  types and passes each thread's attribute values.

The algorithm follows the harness design (a feasibility prototype that
compiled MSL kernel bodies as C++ with clang address spaces and fibers).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from .source import METAL_ATTRIBUTES, GeneratedKernel


@dataclass(frozen=True)
class Origin:
    """Where a piece of kernel text comes from: a file and the line of its first character."""

    path: str
    line: int


_ATTR_NAMES = "|".join(n for n, _ in METAL_ATTRIBUTES)
_METAL_ATTR = re.compile(r"\[\[\s*(?:kernel|buffer\(\s*\d+\s*\)|host_name\(\s*\"[^\"]*\"\s*\)|" + _ATTR_NAMES + r")\s*\]\]")
_TG_DECL = re.compile(
    r"^(?P<indent>[ \t]*)threadgroup\s+(?P<type>[A-Za-z_][\w:<>, ]*?)\s+(?P<name>[A-Za-z_]\w*)"
    r"(?P<dims>(?:\s*\[[^\]\n]+\])*)\s*;",
    re.MULTILINE,
)


def strip_metal_attributes(text: str) -> str:
    """Remove the Metal-only ``[[...]]`` attributes MLX writes into a signature."""
    return _METAL_ATTR.sub("", text)


def make_threadgroup_static(text: str) -> str:
    """Rewrite each ``threadgroup`` variable declaration to static, NaN-filled storage."""

    def repl(m: re.Match) -> str:
        name = m.group("name")
        return (
            f"{m.group('indent')}static threadgroup {m.group('type')} {name}{m.group('dims')}; "
            f"msl_rt_tg_register((void*)&{name}, sizeof({name}), __builtin_FILE(), __builtin_LINE());"
        )

    return _TG_DECL.sub(repl, text)


def _line_of(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _quote(path: str) -> str:
    return '"' + path.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _invoke(gen: GeneratedKernel) -> str:
    args = []
    for p in gen.params:
        if p.kind == "attribute":
            args.append(f"a->{p.name}")
        elif p.decl.endswith("&"):
            args.append(f"*({p.decl[:-1]}*)b[{p.buffer}]")
        else:
            args.append(f"({p.decl})b[{p.buffer}]")
    call = gen.kernel_name + gen.template_def
    return (
        'extern "C" void msl_kernel_invoke(void** b, const msl_thread_attrs* a) {\n'
        "  (void)a;\n"
        f"  {call}(\n    " + ",\n    ".join(args) + ");\n}\n"
    )


def to_cpp(
    gen: GeneratedKernel,
    header_origin: Optional[Origin] = None,
    body_origin: Optional[Origin] = None,
) -> str:
    """The C++ translation unit for ``gen`` (see the module docstring).

    Args:
        gen: the MLX-identical source and its spans, from :func:`source.generate`.
        header_origin, body_origin: file and first line of the header and body, for
            ``#line``; None leaves those lines numbered as in the generated source.

    Returns:
        C++20 source to compile with ``-I`` pointing at this package's directory.
    """
    src = gen.source
    generated = _quote(f"<mlx-generated {gen.kernel_name}>")
    hs, he = gen.header_span
    bs, be = gen.body_span
    parts = ['#include "msl_compat.h"\n']

    def directive(offset: int, origin: Optional[Origin]) -> str:
        if origin is not None:
            return f"#line {origin.line} {_quote(origin.path)}\n"
        return f"#line {_line_of(src, offset)} {generated}\n"

    def emit(start: int, end: int, origin: Optional[Origin], user: bool) -> None:
        text = src[start:end]
        if not text:
            return
        if user:
            text = make_threadgroup_static(strip_metal_attributes(text))
        else:
            text = strip_metal_attributes(text)
        if start == 0 or src[start - 1] == "\n":
            parts.append(directive(start, origin))
            parts.append(text)
            return
        # A piece that starts mid-line (a header without a final newline) keeps
        # that line's numbering; the directive goes before its next line.
        cut = text.find("\n") + 1
        if cut == 0 or origin is not None:
            parts.append(text)
            return
        parts.append(text[:cut])
        parts.append(directive(start + src[start:end].find("\n") + 1, None))
        parts.append(text[cut:])

    emit(hs, he, header_origin, True)
    emit(he, bs, None, False)
    emit(bs, be, body_origin, True)
    emit(be, len(src), None, False)
    if not parts[-1].endswith("\n"):
        parts.append("\n")
    parts.append(f"#line 1 {_quote('<harness entry point>')}\n")
    parts.append(_invoke(gen))
    return "".join(parts)
