"""Find clang-19 and compile translated kernels into cached shared objects.

Objects are cached by a hash of everything that affects them (translated source,
the compatibility header, the runtime, flags, compiler path), in a directory under
the system temp dir (``$FERRUM_HARNESS_CACHE`` overrides it), never in the repo.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Optional

from mlx_ferrum.errors import KernelError

HERE = Path(__file__).resolve().parent
SUPPORT_FILES = ("msl_abi.h", "msl_compat.h", "msl_runtime.cpp")
#: -O1 keeps compiles short (many template instantiations per test run) while
#: removing most of the cost of the per-element helper calls. -fno-finite-loops:
#: C++ may delete a side-effect-free infinite loop, but a hang on the GPU must stay
#: a hang here.
CXXFLAGS = ("-std=c++20", "-O1", "-fPIC", "-gline-tables-only", "-fno-strict-aliasing", "-fno-finite-loops", "-w")

#: Extra flags of each build variant (see :data:`VARIANTS`).
VARIANT_FLAGS = {
    "default": (),
    # Loads and stores call back into the runtime, which counts device bytes and
    # checks that each output element is written exactly once (no ASan runtime).
    "counting": (
        "-DMSL_FLAT_ADDRESS_SPACES", "-fsanitize=address", "-fsanitize-address-use-after-return=never",
        "-mllvm", "-asan-instrumentation-with-call-threshold=0",
        "-mllvm", "-asan-stack=0", "-mllvm", "-asan-globals=0",
    ),
    # Undefined behaviour Metal would not report: each check calls a handler of the
    # runtime, which names the check and the .metal line (no ubsan runtime linked).
    # -O0: the optimiser merges the handler calls and loses their lines.
    "ubsan": ("-DMSL_FLAT_ADDRESS_SPACES", "-fsanitize=signed-integer-overflow,alignment,bounds",
              "-fsanitize-minimal-runtime", "-fno-sanitize-recover=all", "-O0"),
    # MSL before 3.2 is C++14: the kernel text must compile as C++14, warning-free.
    "cxx14": ("-std=c++14", "-Wall", "-Wextra", "-Wno-unused-parameter"),
}
VARIANTS = tuple(VARIANT_FLAGS)
#: Added when a kernel is built in Metal's fast or relaxed math mode, where the
#: compiler may assume no infinity and no NaN occurs.
FINITE_MATH_FLAGS = ("-ffinite-math-only",)

#: Where the compiler is looked for, first hit wins.
CLANG_CANDIDATES = ("clang++-19", "/usr/lib/llvm-19/bin/clang++")


@lru_cache(maxsize=None)
def find_clang() -> Optional[str]:
    """Path of clang++ 19 (``$FERRUM_HARNESS_CLANG`` overrides), or None when absent."""
    env = os.environ.get("FERRUM_HARNESS_CLANG")
    if env:
        return env if shutil.which(env) or Path(env).exists() else None
    for c in CLANG_CANDIDATES:
        p = shutil.which(c) or (c if Path(c).exists() else None)
        if p:
            return p
    return None


def cache_dir() -> Path:
    """Directory of compiled objects (created on demand)."""
    env = os.environ.get("FERRUM_HARNESS_CACHE")
    d = Path(env) if env else Path(tempfile.gettempdir()) / f"mlx_ferrum_metal_harness_{os.getuid()}"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _support_hash(clang: str) -> str:
    h = hashlib.sha256()
    for name in SUPPORT_FILES:
        h.update((HERE / name).read_bytes())
    h.update(" ".join(CXXFLAGS).encode())
    h.update(clang.encode())
    return h.hexdigest()[:16]


def _run(cmd: list[str], what: str, fail_on_kernel_warnings: bool = False) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stderr.strip().splitlines()
    if proc.returncode != 0:
        msg = "\n".join(lines[:60]) + ("\n..." if len(lines) > 60 else "")
        raise KernelError(f"clang could not compile {what}:\n{msg}")
    if fail_on_kernel_warnings:
        # Warnings inside the .metal text are errors; the compatibility header's own
        # C++17/20 constructs are the harness's business, not the kernel's.
        bad = [ln for ln in lines if re.search(r"\.metal:\d+:\d+: warning", ln)]
        if bad:
            raise KernelError(f"warnings in {what} (C++14 build):\n" + "\n".join(bad[:30]))


def _atomic_build(target: Path, build) -> Path:
    if target.exists():
        return target
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        build(tmp)
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()
    return target


def runtime_object(clang: str) -> Path:
    """The compiled fiber runtime, built once per cache directory."""
    target = cache_dir() / f"msl_runtime_{_support_hash(clang)}.o"
    return _atomic_build(
        target,
        lambda out: _run(
            [clang, *CXXFLAGS, "-O2", "-c", str(HERE / "msl_runtime.cpp"), "-o", str(out)],
            "the harness runtime",
        ),
    )


def compile_kernel(cpp_source: str, what: str, variant: str = "default", finite_math: bool = False) -> Path:
    """Compile a translated kernel (see :mod:`translate`) into a shared object.

    Args:
        cpp_source: the C++ translation unit.
        what: a description for error messages (the kernel's name).
        variant: a key of :data:`VARIANT_FLAGS` (``default``, ``counting``, ``ubsan``,
            ``cxx14``).
        finite_math: add :data:`FINITE_MATH_FLAGS` (Metal fast/relaxed math).

    Returns:
        Path of the cached ``.so``.

    Raises:
        KernelError: clang is absent, the variant is unknown, or the source does not
            compile (or, for ``cxx14``, warns inside the ``.metal`` text); the message
            carries clang's diagnostics, which name the ``.metal`` file and line.
    """
    clang = find_clang()
    if clang is None:
        raise KernelError("clang++-19 not found: install it (apt-get install -y clang-19) to run the Metal harness")
    if variant not in VARIANT_FLAGS:
        raise KernelError(f"unknown harness build variant {variant!r}: use one of {', '.join(VARIANTS)}")
    flags = [f for f in CXXFLAGS if not (variant == "cxx14" and (f == "-w" or f.startswith("-std=")))]
    flags += VARIANT_FLAGS[variant]
    if finite_math:
        flags += FINITE_MATH_FLAGS
    rt = runtime_object(clang)
    h = hashlib.sha256(cpp_source.encode())
    h.update(_support_hash(clang).encode())
    h.update(" ".join(flags).encode())
    key = h.hexdigest()[:24]
    d = cache_dir()
    so = d / f"kernel_{key}.so"
    if so.exists():
        return so
    cpp = d / f"kernel_{key}.cpp"
    if not cpp.exists():
        tmp = cpp.with_name(f"{cpp.name}.{os.getpid()}.tmp")
        tmp.write_text(cpp_source)
        os.replace(tmp, cpp)  # another process may compile the same kernel concurrently
    return _atomic_build(
        so,
        lambda out: _run(
            [clang, *flags, "-shared", f"-I{HERE}", str(cpp), str(rt), "-o", str(out), "-lm", "-ldl"],
            f"kernel {what} ({cpp})",
            fail_on_kernel_warnings=variant == "cxx14",
        ),
    )
