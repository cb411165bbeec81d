"""Child process that executes launches of one compiled kernel.

Run as ``python worker.py KERNEL.so`` (by path, so it imports nothing but the
standard library). It reads length-prefixed pickled requests on stdin and writes
replies on the original stdout; anything the kernel or runtime prints goes to
stderr. A crash (an out-of-bounds access hits a guard page) kills only this
process; the parent turns its stderr into a test failure.

Request: ``{"buffers": [{"name", "data" (bytes or None), "nbytes", "fill" (bytes
or None), "readonly", "output", "itemsize", optional "chunks" ([(byte offset,
bytes)] of a sparse buffer)}], "grid", "threadgroup", "schedules": [(schedule,
seed), ...], "counting" (bool: a counting build), "check_writes" (bool: fail unless
each output element is written exactly once; counting builds only)}`` where
schedule is 0 serial, 1 reversed, 2 random. Reply: ``{"ok": True, "outputs":
[bytes, ...], "counts": {name: int}}`` (counts of the first schedule, see
``COUNT_NAMES``) or ``{"ok": False, "error": str}``.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import struct
import sys

SCHEDULE_NAMES = {0: "serial", 1: "reversed", 2: "random"}


def _read_exact(f, n: int) -> bytes:
    chunks = []
    while n:
        c = f.read(n)
        if not c:
            raise EOFError
        chunks.append(c)
        n -= len(c)
    return b"".join(chunks)


def _load(path: str):
    lib = ctypes.CDLL(path)
    lib.msl_alloc.restype = ctypes.c_void_p
    lib.msl_alloc.argtypes = [ctypes.c_size_t, ctypes.c_char_p]
    lib.msl_protect_readonly.argtypes = [ctypes.c_void_p]
    lib.msl_check_canary.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int]
    lib.msl_free.argtypes = [ctypes.c_void_p]
    lib.msl_launch.argtypes = [
        ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_int),
        ctypes.POINTER(ctypes.c_int),
        ctypes.c_int,
        ctypes.c_uint64,
        ctypes.c_char_p,
        ctypes.c_int,
    ]
    lib.msl_track_writes.argtypes = [ctypes.c_void_p]
    lib.msl_check_writes.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int]
    lib.msl_last_counts.argtypes = [ctypes.POINTER(ctypes.c_uint64)]
    lib.msl_alloc_sparse.restype = ctypes.c_void_p
    lib.msl_alloc_sparse.argtypes = [ctypes.c_size_t, ctypes.c_char_p]
    lib.msl_install_handlers()
    return lib


COUNT_NAMES = ("simd_ops", "simdgroup_barriers", "threadgroup_barriers", "device_bytes_read", "device_bytes_written")


def _schedule_name(sched: int, seed: int) -> str:
    name = SCHEDULE_NAMES.get(sched, str(sched))
    return f"{name}(seed={seed})" if sched == 2 else name


def _run_once(lib, req: dict, sched: int, seed: int):
    descs = req["buffers"]
    ptrs = []
    try:
        for d in descs:
            sparse = d.get("chunks") is not None
            alloc = lib.msl_alloc_sparse if sparse else lib.msl_alloc
            p = alloc(max(d["nbytes"], 0), d["name"].encode())
            if not p:
                return None, f"cannot allocate {d['nbytes']} bytes for buffer {d['name']}"
            ptrs.append(p)
            if sparse:
                # Only the given byte ranges are touched; the rest of the mapping stays
                # unbacked (reads as zeros), so a pool of many GiB costs what it holds.
                for offset, chunk in d["chunks"]:
                    ctypes.memmove(p + offset, chunk, len(chunk))
            elif d["data"] is not None:
                ctypes.memmove(p, d["data"], d["nbytes"])
            elif d["fill"] is not None and d["nbytes"]:
                pat = d["fill"]
                reps = -(-d["nbytes"] // len(pat))
                ctypes.memmove(p, (pat * reps)[: d["nbytes"]], d["nbytes"])
            if d["readonly"]:
                lib.msl_protect_readonly(p)
            if d["output"] and req.get("check_writes"):
                lib.msl_track_writes(p)
        arr = (ctypes.c_void_p * max(len(ptrs), 1))(*ptrs)
        grid = (ctypes.c_int * 3)(*req["grid"])
        tg = (ctypes.c_int * 3)(*req["threadgroup"])
        err = ctypes.create_string_buffer(4096)
        if lib.msl_launch(arr, grid, tg, sched, seed, err, len(err)):
            return None, err.value.decode(errors="replace")
        for d, p in zip(descs, ptrs):
            if lib.msl_check_canary(p, err, len(err)):
                return None, "out-of-bounds write detected by canary: " + err.value.decode(errors="replace")
            if d["output"] and lib.msl_check_writes(p, d["itemsize"], err, len(err)):
                return None, "write-set check: " + err.value.decode(errors="replace")
        raw = (ctypes.c_uint64 * len(COUNT_NAMES))()
        lib.msl_last_counts(raw)
        counts = dict(zip(COUNT_NAMES, (int(v) for v in raw)))
        outs = [ctypes.string_at(p, d["nbytes"]) for d, p in zip(descs, ptrs) if d["output"]]
        return (outs, counts), None
    finally:
        for p in ptrs:
            lib.msl_free(p)


def _first_difference(a: bytes, b: bytes, itemsize: int) -> int:
    for i in range(0, len(a), itemsize):
        if a[i : i + itemsize] != b[i : i + itemsize]:
            return i // itemsize
    return -1


def handle(lib, req: dict) -> dict:
    """Run the request under each schedule; fail when results differ between schedules."""
    first = None
    first_name = ""
    counts: dict = {}
    out_descs = [d for d in req["buffers"] if d["output"]]
    for sched, seed in req["schedules"]:
        name = _schedule_name(sched, seed)
        result, error = _run_once(lib, req, sched, seed)
        if error is not None:
            return {"ok": False, "error": f"[schedule {name}] {error}"}
        outs, run_counts = result
        if first is None:
            first, first_name, counts = outs, name, run_counts
            continue
        for d, a, b in zip(out_descs, first, outs):
            if a != b:
                idx = _first_difference(a, b, d["itemsize"])
                return {
                    "ok": False,
                    "error": (
                        f"output '{d['name']}' differs between schedules {first_name} and {name} "
                        f"(first at element {idx}): a data race, e.g. a missing threadgroup_barrier"
                    ),
                }
    return {"ok": True, "outputs": first, "counts": counts}


def main() -> None:
    """Serve requests until stdin closes."""
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # stray prints from the kernel side must not corrupt replies
    inp = sys.stdin.buffer
    lib = _load(sys.argv[1])
    while True:
        try:
            n = struct.unpack("<Q", _read_exact(inp, 8))[0]
            req = pickle.loads(_read_exact(inp, n))
        except EOFError:
            return
        reply = pickle.dumps(handle(lib, req), protocol=pickle.HIGHEST_PROTOCOL)
        out.write(struct.pack("<Q", len(reply)))
        out.write(reply)
        out.flush()


if __name__ == "__main__":
    main()
