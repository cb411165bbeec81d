"""Where a GGUF model is (a file, a folder holding one, a hub repo + file name) and
its conversion to the loader's ``(config, weights)``.

The weights come out under the Hugging Face parameter names with MLX's quantized
layout (``p.weight`` packed ``uint32``, ``p.scales``, ``p.biases``), and the config
carries mlx-lm's per-module ``quantization`` entries, so the loader builds the model
exactly as it builds an MLX-quantized folder (:mod:`mlx_ferrum.models.loader`).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Union

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten

from ...errors import AmbiguousCheckpointError, GGUFFormatError, ModelLoadError
from .config import (NORM_SHIFTED_ARCHITECTURES, PERMUTED_ARCHITECTURES, config_from_metadata, fused_parts, hf_name,
                     unpermute_rows)
from .reader import SPLIT_PATTERN, GGUFModelFile, read_gguf
from ...layers.quantized16 import pair_groups, quantized16_like
from .tensors import GROUP_SIZE, ConvertedTensor, check_types_supported, convert_numpy, packed_shape, to_mlx
from .tokenizer import prebuild as prebuild_tokenizer

SUFFIX = ".gguf"
#: GGUF types with one scale and bias per 16 weights (:mod:`.tensors16`)
GROUP16_TYPES = frozenset({"Q6_K", "Q3_K", "Q2_K"})
#: threads converting tensors at load (numpy work on every byte of the file)
_CONVERT_THREADS = max(1, min(4, os.cpu_count() or 1))


def _model_files(folder: Path) -> list[Path]:
    """The ``.gguf`` files of ``folder`` that start a model (a split model counts once)."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.name.endswith(SUFFIX))
    starts = []
    for f in files:
        match = SPLIT_PATTERN.match(f.name)
        if match is None or int(match["index"]) == 1:
            starts.append(f)
    return starts


def find_gguf(path_or_repo_id: Union[str, os.PathLike], gguf_file: Optional[str] = None,
              revision: Optional[str] = None) -> Optional[Path]:
    """The GGUF file a model source names, or None when it is not a GGUF source.

    A GGUF source is: a ``.gguf`` file; a folder without ``config.json`` holding
    ``.gguf`` files (exactly one model, or the one ``gguf_file`` names); or a hub repo
    id with ``gguf_file`` (downloaded once with ``huggingface_hub.hf_hub_download`` into
    the Hugging Face cache, with every part of a split model).

    Args:
        path_or_repo_id: a file, a folder, or a hub repo id.
        gguf_file: the file name inside the folder or repo (``--gguf-file``).
        revision: hub revision, for hub ids.

    Returns:
        The local path of the (first part of the) GGUF file, or None.

    Raises:
        AmbiguousCheckpointError: a folder holds several GGUF models and ``gguf_file``
            names none (the message lists them).
        ModelLoadError: ``gguf_file`` is not in the folder, or the download failed.
    """
    name = os.fspath(path_or_repo_id)
    local = Path(name).expanduser()
    if local.is_file():
        return local if local.name.endswith(SUFFIX) else None
    if local.is_dir():
        if gguf_file is not None:
            chosen = local / gguf_file
            if not chosen.is_file():
                raise ModelLoadError(
                    f"{gguf_file!r} is not in {local}; GGUF files there: "
                    f"{', '.join(p.name for p in _model_files(local)) or 'none'}"
                )
            return chosen
        if (local / "config.json").is_file():
            return None
        models = _model_files(local)
        if len(models) > 1:
            raise AmbiguousCheckpointError(
                f"{local} holds {len(models)} GGUF models ({', '.join(p.name for p in models)}); pick one with "
                "--gguf-file NAME (or gguf_file=NAME), or pass the file's path"
            )
        return models[0] if models else None
    if gguf_file is None:
        return None
    from ..loader import _looks_like_local_path, hub_error_message

    if _looks_like_local_path(name):
        raise ModelLoadError(f"no folder at {name!r} to find {gguf_file!r} in")
    try:
        from huggingface_hub import hf_hub_download

        first = Path(hf_hub_download(repo_id=name, filename=gguf_file, revision=revision))
        match = SPLIT_PATTERN.match(Path(gguf_file).name)
        if match is not None:
            folder = str(Path(gguf_file).parent) if Path(gguf_file).parent != Path(".") else None
            for i in range(2, int(match["count"]) + 1):
                part = f"{match['stem']}-{i:05d}-of-{match['count']}.gguf"
                hf_hub_download(repo_id=name, filename=part if folder is None else f"{folder}/{part}",
                                revision=revision)
        return first
    except Exception as exc:  # hub errors have many types
        raise ModelLoadError(hub_error_message(name, exc).replace(
            f"`hf download {name}`", f"`hf download {name} {gguf_file}`")) from exc


def _add_converted(weights: dict[str, mx.array], quantization: dict[str, Any], groups16: dict[str, int], path: Path,
                   name: str, tensor: Any, converted: Any, permute: bool, heads: dict[str, int],
                   config: dict[str, Any], arch: str) -> None:
    """Store one converted tensor under its Hugging Face name(s), q/k rows un-permuted,
    fused tensors split (:func:`~mlx_ferrum.models.gguf.config.fused_parts`), stacked
    expert codes shaped ``[experts, rows, ...]`` as MLX's quantized ``SwitchLinear``
    keeps them, names by ``arch`` (``general.architecture``), with its module's
    quantization entry; a 16-weight-group tensor's module goes into ``groups16``
    (module path -> bits), its scales and biases paired into two MLX group-32 sets
    (:func:`~mlx_ferrum.layers.quantized16.pair_groups`)."""
    parts = {"weight": converted.weight, "scales": converted.scales, "biases": converted.biases}
    role = name.split(".")[-2]
    if permute and role in heads and name.endswith((".weight", ".bias")):
        parts = {k: None if v is None else unpermute_rows(v, heads[role]) for k, v in parts.items()}
    if converted.bits is not None and len(tensor.shape) == 3:  # stacked experts [E, out, in]
        experts, rows = int(tensor.shape[0]), int(tensor.shape[1])
        parts = {k: v.reshape(experts, rows, -1) for k, v in parts.items()}
    pieces = fused_parts(name, config, arch)
    if pieces is None:
        _store(weights, quantization, groups16, path, name, tensor, converted,
               hf_name(name, arch), parts)
        return
    total = sum(rows for _, rows in pieces)
    if parts["weight"].shape[0] != total:
        raise GGUFFormatError(
            f"{path.name}: fused tensor {name!r} has {parts['weight'].shape[0]} rows; the metadata's head counts / "
            f"feed-forward length give {total}")
    start = 0
    for target, rows in pieces:
        piece = {k: None if v is None else v[start:start + rows] for k, v in parts.items()}
        _store(weights, quantization, groups16, path, name, tensor, converted, target, piece)
        start += rows


def _store(weights: dict[str, mx.array], quantization: dict[str, Any], groups16: dict[str, int], path: Path,
           name: str, tensor: Any, converted: Any, target: str, parts: dict[str, Any]) -> None:
    """Store one tensor's (or one fused piece's) arrays under ``target``."""
    module = target.rpartition(".")[0]
    if converted.bits is None:
        weights[target] = parts["weight"]
        return
    if not target.endswith(".weight"):
        raise GGUFFormatError(f"{path.name}: tensor {name!r} is quantized ({tensor.type_name}) but is not a weight")
    if converted.group_size == 16:  # two MLX group-32 sets of scales and biases over one array of codes
        parts["scales"], parts["biases"] = pair_groups(parts["scales"]), pair_groups(parts["biases"])
        groups16[module] = converted.bits
    weights[target] = parts["weight"]
    weights[f"{module}.scales"] = parts["scales"]
    weights[f"{module}.biases"] = parts["biases"]
    quantization[module] = {"group_size": GROUP_SIZE, "bits": converted.bits, "mode": "affine"}


def _weight_buffers(wanted: list) -> tuple[dict[str, mx.array], dict[str, np.ndarray]]:
    """An evaluated MLX ``uint32`` array per tensor whose packed codes the converter can
    write in place (:func:`~mlx_ferrum.models.gguf.tensors.packed_shape`), and a
    writable numpy view of each (MLX arrays expose their memory through the buffer
    protocol; writing the view writes the array, MLX's "Conversion to NumPy" docs).

    Writing there saves a copy of every converted byte (numpy's result, then
    ``mx.array`` of it) and the page faults of a second buffer. A view that would not
    share the array's memory is left out: that tensor is converted into numpy and copied.
    """
    buffers = {}
    for name, tensor in wanted:
        shape = packed_shape(tensor.type_name, tensor.shape)
        if shape is not None:
            buffers[name] = mx.zeros(shape, dtype=mx.uint32)
    mx.eval(list(buffers.values()))
    views = {}
    for name, buffer in list(buffers.items()):
        view = np.asarray(buffer)
        if view.flags.owndata or not view.flags.writeable or not view.flags.c_contiguous:
            del buffers[name]
        else:
            views[name] = view
    return buffers, views


#: GGUF types MLX's own reader (``mx.load`` of a ``.gguf``) keeps in MLX's layout with
#: the values :func:`~mlx_ferrum.models.gguf.tensors.convert_numpy` gives, bit for bit
#: (it repacks Q4_0 / Q4_1 / Q8_0 to 4 / 8-bit group-32 codes with scale ``d`` and bias
#: ``m`` or ``-8 d`` / ``-128 d`` in float16; checked tensor by tensor in the tests); it
#: dequantizes every other quantized type, so a file holding one is converted here
MLX_READER_TYPES = frozenset({"F32", "F16", "Q4_0", "Q4_1", "Q8_0"})


def _mlx_load(files: list[Path]) -> Optional[dict[str, mx.array]]:
    """``mx.load`` of every part (MLX's C++ GGUF reader, which releases the GIL), or None
    when it fails (a type or layout this MLX version refuses). Safe on a worker thread:
    the arrays it returns are already read, no lazy operation is queued."""
    try:
        arrays: dict[str, mx.array] = {}
        for part in files:
            arrays.update(mx.load(str(part)))
        return arrays
    except (RuntimeError, ValueError, OSError):
        return None


def _mlx_reader_tensors(arrays: Optional[dict[str, mx.array]], wanted: list) -> dict[str, Any]:
    """``{name: ConvertedTensor}`` of the tensors ``mx.load`` (:func:`_mlx_load`; C++,
    a quarter of the time the numpy repacking takes) read exactly: ``{}`` for None.

    A tensor is taken only when MLX returned exactly the shapes and dtypes the numpy
    converter would (2-D codes, float16 scales and biases); a Q4_0 / Q8_0 bias ``-8 d``
    / ``-128 d`` that overflows float16 (the numpy converter then widens to float32) is
    left to the numpy converter too. Call it on the thread that uses the arrays.
    """
    if arrays is None:
        return {}
    taken: dict[str, Any] = {}
    checks = []
    for name, tensor in wanted:
        bits = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8}.get(tensor.type_name)
        weight = arrays.get(name)
        if weight is None:
            continue
        if bits is None:
            if tuple(weight.shape) == tuple(tensor.shape) and weight.dtype == (
                    mx.float32 if tensor.type_name == "F32" else mx.float16):
                taken[name] = ConvertedTensor(weight)
            continue
        stem = name[:-len(".weight")] if name.endswith(".weight") else None
        scales, biases = (None, None) if stem is None else (arrays.get(f"{stem}.scales"), arrays.get(f"{stem}.biases"))
        rows = packed_shape(tensor.type_name, tensor.shape)[0]
        if (len(tensor.shape) != 2 or scales is None or biases is None or weight.dtype != mx.uint32
                or tuple(weight.shape) != packed_shape(tensor.type_name, tensor.shape)
                or tuple(scales.shape) != (rows, tensor.shape[-1] // GROUP_SIZE) or scales.shape != biases.shape
                or scales.dtype != mx.float16 or biases.dtype != mx.float16):
            continue
        taken[name] = ConvertedTensor(weight, scales, biases, bits)
        if tensor.type_name != "Q4_1":
            checks.append((name, mx.all(mx.isfinite(biases)) | mx.logical_not(mx.all(mx.isfinite(scales)))))
    mx.eval([flag for _, flag in checks])
    for name, flag in checks:
        if not flag.item():
            del taken[name]
    return taken


def _dequantize(tensor: Any) -> np.ndarray:
    """A tensor's float32 values, as ``gguf.quants.dequantize`` gives them (its shape)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    return dequantize(tensor.data, GGMLQuantizationType[tensor.type_name]).reshape(tensor.shape)


def load_gguf_checkpoint(path: Path) -> tuple[dict[str, Any], dict[str, mx.array], GGUFModelFile]:
    """Convert a GGUF model to the loader's ``(config, weights)``.

    Args:
        path: the ``.gguf`` file (or first part).

    Returns:
        ``(config, weights, file)``: the config dict (with a per-module
        ``quantization`` entry for every quantized tensor: bits from its type, group
        32, affine; and ``config["gguf"]["groups16"]``: ``{module path: bits}`` of the
        Q6_K / Q3_K / Q2_K modules, whose ``scales`` / ``biases`` are the two group-32
        sets ``[2, rows, cols / 32]`` of :mod:`mlx_ferrum.layers.quantized16`),
        ``{parameter name: array}`` (quantized tensors as packed ``weight`` +
        ``scales`` + ``biases``, q/k rows un-permuted for llama), and the opened file
        (metadata for the tokenizer).

    Raises:
        GGUFFormatError: see :func:`~mlx_ferrum.models.gguf.reader.read_gguf`; a
            tensor name the architecture does not have.
        UnsupportedArchitectureError: see
            :func:`~mlx_ferrum.models.gguf.config.config_from_metadata`.
        UnsupportedTensorTypeError: a tensor type not in
            :data:`~mlx_ferrum.models.gguf.tensors.SUPPORTED_TYPES` (all are listed).
    """
    model_file = read_gguf(path)
    tensors = model_file.tensors
    rope_freqs = tensors.get("rope_freqs.weight")
    config = config_from_metadata(model_file.metadata, set(tensors), rope_freqs=None if rope_freqs is None else
                                  np.asarray(rope_freqs.data, dtype=np.float32).reshape(-1).tolist())
    check_types_supported({t.name: t.type_name for t in tensors.values()})
    arch = model_file.metadata["general.architecture"]
    unknown = sorted(n for n in tensors if hf_name(n, arch) is None and n != "rope_freqs.weight")
    if unknown:
        raise GGUFFormatError(
            f"{path.name}: tensors this loader does not know for architecture "
            f"{model_file.metadata.get('general.architecture')!r}: {', '.join(unknown[:8])}"
        )
    permute = arch in PERMUTED_ARCHITECTURES
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    quantization: dict[str, Any] = {}
    weights: dict[str, mx.array] = {}
    groups16: dict[str, int] = {}
    wanted = [(name, tensor) for name, tensor in tensors.items() if hf_name(name, arch) is not None]
    # a file of the types MLX's reader keeps exactly is read by it (the tensors it does not
    # take are converted here); numpy releases the GIL in its array loops, so the others'
    # tensors convert in parallel, writing the packed codes straight into their MLX arrays
    # (allocated on this thread); scales, biases and the other types become MLX arrays
    # here as each result arrives, and their numpy arrays are dropped at once, so freed
    # memory is reused by the next conversions. Results come in file order: the outcome
    # does not depend on the threads. The tokenizer is built while either runs (see prebuild)
    by_mlx = all(t.type_name in MLX_READER_TYPES for t in tensors.values())
    # stacked expert tensors of 16-weight-group types: the 16-group layers are 2-D only, so
    # these load as float32 (exact, 32 bits per weight instead of 6.6 / 3.4 / 2.6)
    dequantized = {name for name, tensor in wanted if len(tensor.shape) == 3 and tensor.type_name in GROUP16_TYPES}
    with ThreadPoolExecutor(max_workers=_CONVERT_THREADS) as pool:
        read_by_mlx = {}
        if by_mlx:
            arrays = pool.submit(_mlx_load, model_file.files)
            prebuild_tokenizer(model_file.metadata)
            read_by_mlx = _mlx_reader_tensors(arrays.result(), wanted)
            del arrays
        rest = [(name, tensor) for name, tensor in wanted if name not in read_by_mlx and name not in dequantized]
        buffers, views = _weight_buffers(rest)
        results = iter(pool.map(
            lambda item: convert_numpy(item[1].type_name, item[1].data, item[1].shape, out=views.get(item[0])), rest))
        if not by_mlx:
            prebuild_tokenizer(model_file.metadata)
        for name, tensor in wanted:
            converted = read_by_mlx.get(name)
            if name in dequantized:
                converted = ConvertedTensor(mx.array(_dequantize(tensor)))
            elif converted is None:  # MLX arrays made on this thread
                converted = to_mlx(next(results), weight=buffers.get(name))
            _add_converted(weights, quantization, groups16, path, name, tensor, converted, permute, heads, config, arch)
    if quantization:
        first = next(iter(quantization.values()))
        config["quantization"] = {"group_size": GROUP_SIZE, "bits": first["bits"], "mode": "affine", **quantization}
    if arch in NORM_SHIFTED_ARCHITECTURES:
        for name in list(weights):
            if name.endswith("norm.weight"):  # llama.cpp stored 1 + w; the model's norm adds the 1
                weights[name] = (weights[name].astype(mx.float32) - 1.0).astype(weights[name].dtype)
    config["gguf"] = {"file": str(path), "architecture": arch, "groups16": groups16}
    return config, weights, model_file


def use_group16_modules(model, config: dict[str, Any]) -> None:
    """Put a 16-group layer (:mod:`mlx_ferrum.layers.quantized16`) in place of each float
    module ``config["gguf"]["groups16"]`` names, before the loader quantizes the others
    (the 16-group layers have no ``to_quantized``, so MLX's quantization passes them by).

    Args:
        model: the float model, before its weights are loaded (modified in place).
        config: the config :func:`load_gguf_checkpoint` returned.

    Raises:
        GGUFFormatError: a named module is missing or is neither a linear layer nor an
            embedding.
    """
    groups16 = config.get("gguf", {}).get("groups16", {})
    modules = dict(model.named_modules())
    replacements = []
    for path, bits in groups16.items():
        module = modules.get(path)
        replacement = None if module is None else quantized16_like(module, bits)
        if replacement is None:
            raise GGUFFormatError(
                f"{config['gguf']['file']}: {path} holds a 16-weight-group quantized tensor, but the model's module "
                f"there is {type(module).__name__ if module is not None else 'missing'} (a linear layer or an "
                "embedding is needed)")
        replacements.append((path, replacement))
    if replacements:
        model.update_modules(tree_unflatten(replacements))


__all__ = ["find_gguf", "load_gguf_checkpoint", "use_group16_modules"]
