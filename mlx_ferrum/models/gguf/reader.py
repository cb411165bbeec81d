"""Open GGUF files (one, or the parts of a split model) and check them before use.

Reading is the ``gguf`` package's ``GGUFReader`` (the reader llama.cpp maintains): it
memory-maps the file, so tensor bytes are read only when converted. This module adds
what the loader needs on top: damaged files refused with a named error before any
tensor is converted (magic, version, truncation, tensor data past the end of the
file), and the parts of a split model (``NAME-00001-of-00003.gguf``) merged.

Format: llama.cpp's ``docs/gguf.md`` (magic ``GGUF``, versions 2 and 3, little-endian).
"""

from __future__ import annotations

import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


def _field_value(field_obj: Any) -> Any:
    value = field_obj.contents()
    return value


def _read_one(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    from gguf import GGML_QUANT_SIZES, GGUFReader

    _check_header(path)
    size = os.path.getsize(path)
    try:
        reader = GGUFReader(path, "r")
    except Exception as exc:  # the reader raises ValueError/IndexError/struct errors on damage
        raise GGUFFormatError(
            f"{path} cannot be parsed as GGUF ({type(exc).__name__}: {exc}); the file is truncated or "
            "damaged: download it again"
        ) from None
    metadata: dict[str, Any] = {}
    for key, field_obj in reader.fields.items():
        try:
            metadata[key] = _field_value(field_obj)
        except Exception as exc:  # a field whose bytes do not decode
            raise GGUFFormatError(f"{path}: metadata key {key!r} cannot be decoded ({exc})") from None
    tensors = []
    for tensor in reader.tensors:
        type_name = tensor.tensor_type.name
        shape = tuple(int(n) for n in reversed([int(x) for x in tensor.shape]))
        count = int(np.prod(shape)) if shape else 1
        block, type_size = GGML_QUANT_SIZES[tensor.tensor_type]
        expected = count // block * type_size
        if count % block or tensor.data_offset + expected > size or tensor.data.nbytes != expected:
            raise GGUFFormatError(
                f"{path}: tensor {tensor.name!r} ({type_name}, shape {list(shape)}) needs {expected} bytes at "
                f"offset {tensor.data_offset}, beyond the file's {size} bytes or not a whole number of blocks: "
                "the file is truncated or damaged; download it again"
            )
        tensors.append(GGUFTensor(tensor.name, type_name, shape, tensor.data, path))
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
