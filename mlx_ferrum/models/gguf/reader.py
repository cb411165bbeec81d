"""Open GGUF files (one, or the parts of a split model) and check them before use.

Reading is the ``gguf`` package's ``GGUFReader`` (the reader llama.cpp maintains): it
memory-maps the file, so tensor bytes are read only when converted. This module adds
what the loader needs on top: damaged files refused with a named error before any
tensor is converted (magic, version, truncation, tensor data past the end of the
file), and the parts of a split model (``NAME-00001-of-00003.gguf``) merged.

Format: llama.cpp's ``docs/gguf.md`` (magic ``GGUF``, versions 2 and 3, little-endian).
"""

from __future__ import annotations

import functools
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

from ...errors import GGUFFormatError

MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
SPLIT_PATTERN = re.compile(r"^(?P<stem>.*)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


@dataclass
class GGUFTensor:
    """One tensor of a GGUF file.

    Attributes:
        name: the llama.cpp name (``blk.0.attn_q.weight``).
        type_name: the GGUF type (``Q4_K``...).
        shape: logical shape in numpy order (``[rows, cols]``; GGUF stores it reversed).
        data: the memory-mapped values (float types) or ``uint8`` blocks.
        file: the file holding it.
    """

    name: str
    type_name: str
    shape: tuple[int, ...]
    data: Any
    file: Path


@dataclass
class GGUFModelFile:
    """The metadata and tensors of a GGUF model (all parts of a split model).

    Attributes:
        metadata: ``{key: python value}`` of the first part (strings, numbers, lists).
        tensors: ``{name: GGUFTensor}`` of every part.
        files: the parts, in order.
    """

    metadata: dict[str, Any]
    tensors: dict[str, GGUFTensor] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)

    @property
    def size_bytes(self) -> int:
        """Bytes on disk of all parts."""
        return sum(os.path.getsize(f) for f in self.files)


def split_parts(path: Path) -> list[Path]:
    """The files of the model ``path`` belongs to: every ``-0000i-of-0000n`` part
    beside it when its name has that form, else ``[path]``.

    Raises:
        GGUFFormatError: a part of a split model is missing (named).
    """
    match = SPLIT_PATTERN.match(path.name)
    if match is None:
        return [path]
    count = int(match["count"])
    parts = [path.with_name(f"{match['stem']}-{i:05d}-of-{count:05d}.gguf") for i in range(1, count + 1)]
    missing = [p.name for p in parts if not p.is_file()]
    if missing:
        raise GGUFFormatError(
            f"split GGUF model {path.name}: parts {', '.join(missing)} are missing from {path.parent}; "
            "download every part"
        )
    return parts


def _check_header(path: Path) -> None:
    try:
        with open(path, "rb") as handle:
            head = handle.read(8)
    except OSError as exc:
        raise GGUFFormatError(f"cannot read {path}: {exc}") from exc
    if len(head) < 8:
        raise GGUFFormatError(f"{path} is truncated ({len(head)} bytes): not a GGUF file; download it again")
    if head[:4] != MAGIC:
        raise GGUFFormatError(
            f"{path} does not start with the GGUF magic (found {head[:4]!r}, expected {MAGIC!r}): "
            "it is not a GGUF file, or it is damaged"
        )
    version = struct.unpack("<I", head[4:8])[0]
    if version not in SUPPORTED_VERSIONS:
        raise GGUFFormatError(
            f"{path} is GGUF version {version}; supported versions: "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))} (re-convert it with a current llama.cpp)"
        )


# GGUF value type ids (docs/gguf.md, "gguf_metadata_value_type") -> struct format
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9


class _Cursor:
    """Reads GGUF's little-endian values from a byte buffer; running past its end
    raises ``EOFError``."""

    def __init__(self, buffer: Any):
        self.buffer, self.pos = buffer, 0

    def take(self, n: int) -> Any:
        """The next ``n`` bytes (a view); ``EOFError`` past the end."""
        if n < 0 or self.pos + n > len(self.buffer):
            raise EOFError(f"needs {n} bytes at offset {self.pos}, past the end ({len(self.buffer)} bytes)")
        view = self.buffer[self.pos:self.pos + n]
        self.pos += n
        return view

    def scalar(self, fmt: str) -> Any:
        """One little-endian value of the ``struct`` format ``fmt``."""
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        """A GGUF string: a uint64 byte length, then UTF-8 bytes."""
        return bytes(self.take(self.scalar("<Q"))).decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """``count`` consecutive strings (a vocabulary: most of the header).

        :meth:`_joined_strings` reads a vocabulary of short, valid UTF-8 strings with no
        NUL in them (every real one) in one decode; any other list is read string by
        string by :meth:`_each_string`, with undecodable bytes replaced."""
        joined = self._joined_strings(count)
        return joined if joined is not None else self._each_string(count)

    def _joined_strings(self, count: int) -> Optional[list[str]]:
        """The fast path of :meth:`strings`, or None (nothing consumed) where it does not apply.

        A Python loop only finds where each string starts (its length prefix); then the
        length prefixes' two low bytes are zeroed (lengths under 65,536 have zero upper
        bytes), so every string ends in eight NUL bytes, the region is decoded once and
        split on them. A string holding a NUL or invalid UTF-8 shows up as a wrong count
        of NULs or pieces, or a decode error, and sends the list to the slow path."""
        buffer, pos, end = self.buffer, self.pos, len(self.buffer)
        window = bytes(buffer[pos:min(end, pos + 64 * count + 8)])
        size, offset = len(window), 0
        unpack = struct.Struct("<Q").unpack_from
        starts = [0] * count
        for i in range(count):
            if offset + 8 > size:
                return None
            starts[i] = offset
            offset += 8 + unpack(window, offset)[0]
        if offset > size:
            return None
        at = np.asarray(starts, dtype=np.int64)
        if count and int(np.diff(np.append(at, offset)).max()) - 8 >= 1 << 16:
            return None
        region = np.frombuffer(window, dtype=np.uint8, count=offset).copy()
        region[at] = 0
        region[at + 1] = 0
        try:
            text = region.tobytes().decode("utf-8")
        except UnicodeDecodeError:
            return None
        if text.count("\x00") != 8 * count:
            return None
        pieces = text.split("\x00" * 8)
        if len(pieces) != count + 1:
            return None
        self.pos = pos + offset
        return pieces[1:]

    def _each_string(self, count: int) -> list[str]:
        """``count`` consecutive strings, one at a time (the slow path of :meth:`strings`).

        The loop slices a ``bytes`` copy of the region (a quarter faster than slicing the
        memory map); the copy covers 64 bytes per string, and what does not fit in it
        (a vocabulary of longer strings) is read from the memory map."""
        buffer, pos, end, out = self.buffer, self.pos, len(self.buffer), []
        unpack = struct.Struct("<Q").unpack_from
        window = bytes(buffer[pos:min(end, pos + 64 * count + 8)])
        size, offset, append = len(window), 0, out.append
        for _ in range(count):
            if offset + 8 > size:
                break
            (n,) = unpack(window, offset)
            if offset + 8 + n > size:
                break
            append(window[offset + 8:offset + 8 + n].decode("utf-8", "replace"))
            offset += 8 + n
        pos += offset
        for _ in range(count - len(out)):
            if pos + 8 > end:
                raise EOFError(f"a string length at offset {pos} is past the end ({end} bytes)")
            (n,) = unpack(buffer, pos)
            pos += 8
            if pos + n > end:
                raise EOFError(f"a string of {n} bytes at offset {pos} runs past the end ({end} bytes)")
            append(str(buffer[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, kind: int) -> Any:
        """One metadata value of GGUF type ``kind`` (a scalar, a string or an array)."""
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.scalar("<I"), self.scalar("<Q")
            if item in _NUMPY:
                dtype = np.dtype(_NUMPY[item])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            if item == _STRING:
                return self.strings(count)
            return [self.value(item) for _ in range(count)]
        raise ValueError(f"unknown metadata value type {kind}")


@functools.lru_cache(maxsize=2)
def _parse_header(path: Path, size: int, mtime_ns: int) -> tuple[dict[str, Any], list, int]:
    """Parse one file's header, metadata and tensor table (the layout of llama.cpp's
    ``docs/gguf.md``): ``(metadata, [(name, dims, type id, offset)], end of the table)``.

    The ``gguf`` package's ``GGUFReader`` reads the same, but builds one memory-mapped
    view per vocabulary string (2 s for a 49k-token vocabulary, six times the whole load
    of the same model from an MLX folder), so the header is parsed here and only the
    tensor bytes are memory-mapped. Cached per file version (the model and the tokenizer
    both read it)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(memoryview(data))
    try:
        cursor.take(8)
        tensor_count, kv_count = cursor.scalar("<Q"), cursor.scalar("<Q")
        metadata: dict[str, Any] = {}
        for _ in range(kv_count):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("<I"))
        infos = []
        for _ in range(tensor_count):
            name = cursor.string()
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            infos.append((name, dims, cursor.scalar("<I"), cursor.scalar("<Q")))
    except (EOFError, ValueError, struct.error, UnicodeDecodeError, MemoryError, OverflowError) as exc:
        raise GGUFFormatError(
            f"{path} cannot be parsed as GGUF ({exc}); the file is truncated or damaged: download it again"
        ) from None
    return metadata, infos, cursor.pos


#: GGUF tensor type id -> (name, weights per block, bytes per block) of the types the
#: loader converts (llama.cpp's ``ggml_type`` and ``GGML_QUANT_SIZES``); other ids are
#: looked up in the ``gguf`` package, whose import costs as much as converting a small
#: model, so a file of these types never pays it
_COMMON_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22), 7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210),
}


def _type_layout(type_id: int) -> tuple[str, int, int]:
    """``(name, weights per block, bytes per block)`` of a GGUF tensor type id; an id
    the ``gguf`` package does not know gets a name saying so and no size."""
    if type_id in _COMMON_TYPES:
        return _COMMON_TYPES[type_id]
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        tensor_type = GGMLQuantizationType(type_id)
        return (tensor_type.name, *GGML_QUANT_SIZES[tensor_type])
    except (ValueError, KeyError):
        return f"unknown type id {type_id}", 1, 0


def _read_one(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    _check_header(path)
    stat = os.stat(path)
    size = stat.st_size
    metadata, infos, table_end = _parse_header(path.resolve(), size, stat.st_mtime_ns)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        raise GGUFFormatError(f"{path}: general.alignment = {alignment!r} is not a positive integer")
    start = -(-table_end // alignment) * alignment
    tensors = []
    for name, dims, type_id, offset in infos:
        type_name, block, type_size = _type_layout(type_id)
        shape = tuple(int(n) for n in reversed(dims))
        count = int(np.prod(shape)) if shape else 1
        expected = count // block * type_size
        at = start + offset
        if count % block or at + expected > size:
            raise GGUFFormatError(
                f"{path}: tensor {name!r} ({type_name}, shape {list(shape)}) needs {expected} bytes at "
                f"offset {at}, beyond the file's {size} bytes or not a whole number of blocks: "
                "the file is truncated or damaged; download it again"
            )
        raw = data[at:at + expected]
        if type_name in ("F32", "F16"):
            values = raw.view(np.float32 if type_name == "F32" else np.float16).reshape(shape)
        else:
            values = raw.reshape(-1, expected // max(1, count // shape[-1])) if shape and type_size else raw
        tensors.append(GGUFTensor(name, type_name, shape, values, path))
    return metadata, tensors


def read_gguf(path: os.PathLike) -> GGUFModelFile:
    """Open a GGUF model: ``path``, plus the other parts when it is one part of a split model.

    Args:
        path: a ``.gguf`` file.

    Returns:
        A :class:`GGUFModelFile` (tensor bytes memory-mapped, not read yet).

    Raises:
        GGUFFormatError: bad magic, unsupported version, truncated file, tensor data
            past the end of the file, a missing part, or a tensor name in two parts
            (the message names the file and the tensor).
    """
    first = Path(path)
    parts = split_parts(first)
    model = GGUFModelFile(metadata={}, files=parts)
    for index, part in enumerate(parts):
        metadata, tensors = _read_one(part)
        if index == 0:
            model.metadata = metadata
        for tensor in tensors:
            if tensor.name in model.tensors:
                raise GGUFFormatError(f"tensor {tensor.name!r} appears in two parts of {first.name}")
            model.tensors[tensor.name] = tensor
    return model


__all__ = ["GGUFModelFile", "GGUFTensor", "SPLIT_PATTERN", "read_gguf", "split_parts"]
