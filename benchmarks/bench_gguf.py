"""GGUF loading: memory against file size, load time and decode speed against the MLX
folder, and the exactness of the 16-weight-group types (Q6_K).

From the SmolLM2-135M-Instruct Q4_1 GGUF in ../shared/models it writes SmolLM2-sized
files in Q8_0, Q4_0, Q5_0, Q5_1 (quantized from the file's exact values with the
``gguf`` package), a ``Q4_K_M``-like file (Q4_K everywhere, Q6_K for the embedding /
output matrix and for attn_v and ffn_down in the first, last and every third layer, as
llama.cpp's Q4_K_M recipe does; quantized with benchmarks/gguf_quantizers.py) and a
``Q6_K`` file. SmolLM2's hidden size, 576, is not a multiple of the K-quants' 256, so
as llama.cpp does for such rows, those tensors fall back to Q5_0 (for Q4_K) and Q8_0
(for Q6_K): only the ffn_down matrices (1536 inputs) are K-quants. Then,
each in a fresh process so peaks do not mix:

- mlx_ferrum's load: seconds, MLX peak memory and active memory after load;
- MLX's own reader (``mx.load(file)``), which keeps Q4_0/Q4_1/Q8_0 and casts every other
  type to float16: its peak memory;
- the MLX folder of the same bits (Q4_1 only): seconds and memory;
- decode tokens/s of the Q4_1 GGUF and the MLX folder (same bits);
- decode tokens/s of the Q4_K_M-like and Q6_K files as loaded (each Q6_K tensor: two MLX
  6-bit group-32 products, see mlx_ferrum/layers/quantized16.py) and of the same files
  with each Q6_K tensor as one 6-bit group-32 product (the even scales only: wrong
  values, but the cost an MLX folder of those bits has), alternated;
- the time of one token's product with a Q6_K matrix (ffn_down) in four forms: one MLX
  8-bit / 6-bit product, the two 6-bit products that keep it exact, and an exact pure-MLX
  dequantization of the blocks followed by a matmul (what a block-reading kernel's
  reference costs at every forward off the GPU); and of a single-token forward of the
  Q4_K_M-like and Q6_K models, exact against one product per Q6_K tensor (alternated in
  one process, min and median);
- the mean KL per token of the Q4_K_M-like and Q6_K models as loaded against the same
  files dequantized exactly (``gguf.quants.dequantize``, float32 ``nn.Linear``), over
  the greedy_chat conversations.

Two further sections:

- ``load-time``: ``mf.load`` of the Q4_1 GGUF against the MLX folder of the same bits,
  alternating the two sides for ``--rounds`` rounds, each load in a fresh process (the
  package is imported before the clock starts, so both sides time their own work:
  reading, converting, building the model and the tokenizer); medians, spreads and the
  ratio per round (both sides of a round see the same machine load).
- ``aligned``: the same comparison of memory on a model whose rows are all multiples of
  the K-quants' 256 (SmolLM2's layout with hidden size 512: 30 layers, FFN 1536, 49,152
  tokens, 8 heads, 2 KV heads; random weights, SmolLM2's tokenizer), so a ``Q4_K_M``-like
  file is Q4_K/Q6_K throughout, as llama.cpp writes real ones. MLX's ``mx.load`` keeps
  only Q4_0/Q4_1/Q8_0 quantized and casts Q4_K/Q6_K (and Q2_K) to float16; Q5_0, Q5_1,
  Q5_K and Q3_K it refuses (``gguf_tensor_to_f16 failed``: the gguflib it embeds does
  not dequantize them).

Usage: python benchmarks/bench_gguf.py [--out /tmp/bench_gguf] [--decode-tokens 32]
       [--sections memory,load-time,aligned,decode,kl] [--rounds 9]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SHARED = Path(os.environ.get("FERRUM_SHARED_MODELS", HERE.parent.parent / "shared" / "models"))
SMOL = SHARED / "SmolLM2-135M-Instruct"
SOURCE = SMOL / "source" / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _exact_values(source: Path) -> tuple[dict, dict]:
    from gguf import GGMLQuantizationType, quants

    from mlx_ferrum.models.gguf.reader import read_gguf

    model = read_gguf(source)
    values = {}
    for name, tensor in model.tensors.items():
        if tensor.type_name == "F32":
            values[name] = np.asarray(tensor.data, dtype=np.float32)
        else:
            raw = np.asarray(tensor.data)
            values[name] = quants.dequantize(raw, GGMLQuantizationType[tensor.type_name]).reshape(tensor.shape)
    return model.metadata, values


def _q4_k_m_type(name: str, layers: int) -> str:
    if name == "token_embd.weight" or name == "output.weight":
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        more_bits = layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2
        return "Q6_K" if more_bits else "Q4_K"
    return "Q4_K"


#: llama.cpp's replacement when a row is not a multiple of the K-quants' 256 (SmolLM2's 576)
FALLBACK = {"Q4_K": "Q5_0", "Q6_K": "Q8_0"}


def write_file(path: Path, metadata: dict, values: dict, kind: str) -> None:
    """Write ``values`` in type ``kind`` (``"Q4_K_M"``: the mixed recipe) with ``metadata``."""
    from gguf import GGMLQuantizationType, GGUFWriter, quants

    from gguf_quantizers import quantize_q4_k, quantize_q6_k

    writer = GGUFWriter(str(path), metadata["general.architecture"])
    for key, value in metadata.items():
        if key in ("general.architecture", "general.alignment", "general.file_type"):
            continue
        _add_value(writer, key, value)
    layers = metadata["llama.block_count"]
    for name, array in values.items():
        if array.ndim == 1:
            writer.add_tensor(name, array.astype(np.float32))
            continue
        type_name = _q4_k_m_type(name, layers) if kind == "Q4_K_M" else kind
        if type_name in FALLBACK and array.shape[-1] % 256:
            type_name = FALLBACK[type_name]
        if type_name == "Q4_K":
            raw = quantize_q4_k(array)
        elif type_name == "Q6_K":
            raw = quantize_q6_k(array)
        else:
            raw = quants.quantize(array.astype(np.float32), GGMLQuantizationType[type_name])
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[type_name])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_value(writer, key, value):
    if isinstance(value, bool):
        writer.add_bool(key, value)
    elif isinstance(value, int):
        writer.add_uint32(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, str):
        writer.add_string(key, value)
    elif isinstance(value, list) and value:
        if isinstance(value[0], float):
            writer.add_array(key, [float(v) for v in value])
        else:
            writer.add_array(key, value)


#: the 256-aligned SmolLM2-like shape of the ``aligned`` section
ALIGNED = {"hidden": 512, "layers": 30, "ffn": 1536, "heads": 8, "kv_heads": 2}


def write_aligned(path: Path, kind: str, metadata: dict) -> None:
    """A SmolLM2-like model with 256-aligned rows (:data:`ALIGNED`), random weights
    (normal, std 0.02) in ``kind`` (``Q4_K_M``: the mixed recipe; ``Q4_K``: Q4_K for every
    matrix), with SmolLM2's tokenizer metadata from ``metadata``."""
    from gguf import GGMLQuantizationType, GGUFWriter

    from gguf_quantizers import quantize_q4_k, quantize_q6_k

    hidden, layers, ffn = ALIGNED["hidden"], ALIGNED["layers"], ALIGNED["ffn"]
    heads, kv_heads = ALIGNED["heads"], ALIGNED["kv_heads"]
    head_dim = hidden // heads
    vocab = len(metadata["tokenizer.ggml.tokens"])
    writer = GGUFWriter(str(path), "llama")
    for key, value in metadata.items():
        if key.startswith("tokenizer.") or key in ("general.name",):
            _add_value(writer, key, value)
    writer.add_block_count(layers)
    writer.add_context_length(metadata["llama.context_length"])
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(metadata["llama.rope.freq_base"])
    writer.add_layer_norm_rms_eps(metadata["llama.attention.layer_norm_rms_epsilon"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(vocab)
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, hidden)}
    for i in range(layers):
        shapes.update({
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden), f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (ffn, hidden), f"blk.{i}.ffn_up.weight": (ffn, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, ffn),
        })
    for name, shape in shapes.items():
        type_name = _q4_k_m_type(name, layers) if kind == "Q4_K_M" else kind
        values = rng.normal(0.0, 0.02, shape).astype(np.float32)
        raw = quantize_q4_k(values) if type_name == "Q4_K" else quantize_q6_k(values)
        writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=GGMLQuantizationType[type_name])
    for i in range(layers):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", np.ones(hidden, np.float32))
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def load_time_rounds(gguf: Path, folder: Path, rounds: int) -> dict:
    """``rounds`` alternating fresh-process loads of ``gguf`` and ``folder`` (which side
    goes first alternates too): seconds of each, and the ratio within each round."""
    gguf_s, folder_s, ratios, cpu_ratios = [], [], [], []
    for i in range(rounds):
        order = [("gguf", gguf), ("folder", folder)] if i % 2 == 0 else [("folder", folder), ("gguf", gguf)]
        runs = {side: _run(["--measure", str(target), "load_time"]) for side, target in order}
        gguf_s.append(runs["gguf"]["load_s"])
        folder_s.append(runs["folder"]["load_s"])
        ratios.append(runs["gguf"]["load_s"] / runs["folder"]["load_s"])
        cpu_ratios.append(runs["gguf"]["cpu_s"] / runs["folder"]["cpu_s"])
    return {"gguf_s": gguf_s, "folder_s": folder_s, "ratios": ratios, "cpu_ratios": cpu_ratios}


def _spread(values: list) -> str:
    return f"{np.median(values):.3f} (min {min(values):.3f}, max {max(values):.3f})"


# -- one measurement per process ----------------------------------------------------


def _one_product(model) -> int:
    """Replace each 16-group layer by an MLX 6-bit group-32 layer over the same codes and
    the even scales (the speed of one product; the values are not the file's)."""
    import mlx.nn as nn
    from mlx.utils import tree_unflatten

    from mlx_ferrum.layers.quantized16 import QuantizedEmbedding16, QuantizedLinear16

    swaps = []
    for path, module in model.named_modules():
        if isinstance(module, (QuantizedLinear16, QuantizedEmbedding16)):
            rows, packed = module.weight.shape
            width = packed * 32 // module.bits
            if isinstance(module, QuantizedEmbedding16):
                layer = nn.QuantizedEmbedding(rows, width, group_size=32, bits=module.bits)
            else:
                layer = nn.QuantizedLinear(width, rows, bias=False, group_size=32, bits=module.bits)
            layer.weight, layer.scales, layer.biases = module.weight, module.scales[0], module.biases[0]
            swaps.append((path, layer))
    model.update_modules(tree_unflatten(swaps))
    return len(swaps)


def measure(target: str, mode: str, decode_tokens: int) -> dict:
    import mlx.core as mx

    mx.reset_peak_memory()
    start = time.perf_counter()
    if mode == "mlx_load":
        try:
            arrays = mx.load(target)
        except RuntimeError as exc:  # MLX's reader refuses some types (Q5_0/Q5_1 here)
            return {"error": " ".join(str(exc).split())}
        mx.eval(list(arrays.values()))
        result = {"load_s": time.perf_counter() - start}
    else:
        import mlx_ferrum as mf

        if mode == "load_time":  # the package's modules, common to both sides, outside the clock
            import mlx_ferrum.api

            mx.reset_peak_memory()
            start = time.perf_counter()
        cpu_start = time.process_time()
        model, tokenizer = mf.load(target)
        result = {"load_s": time.perf_counter() - start, "cpu_s": time.process_time() - cpu_start}
    result["peak_bytes"] = int(mx.get_peak_memory())
    result["active_bytes"] = int(mx.get_active_memory())
    if mode == "decode_one_product":
        result["swapped"] = _one_product(model)
    if mode.startswith("decode"):
        import mlx_ferrum as mf

        prompt = [{"role": "user", "content": "Tell me a short story about the sea."}]
        runs = []
        for _ in range(2):  # the first run warms up
            last = None
            for chunk in mf.stream_generate(model, tokenizer, prompt, max_tokens=decode_tokens, temperature=0.0,
                                            ignore_eos=True):
                last = chunk
            runs.append(last.generation_tps)
        result["decode_tok_s"] = runs[-1]
    return result


def step_times(path: Path, repeats: int) -> dict:
    """Milliseconds of one single-token forward (no cache: the weights' matmuls dominate)
    of the model as loaded and of the one-product variant (:func:`_one_product`), in one
    process, alternated ``repeats`` times each; min and median (the min is the least
    disturbed by other processes on a shared machine)."""
    import mlx.core as mx

    from mlx_ferrum.models import load_model

    exact, _, _ = load_model(path)
    one, _, _ = load_model(path)
    swapped = _one_product(one)
    ids = mx.array([[1]])
    times = {"two products": [], "one product": []}
    for _ in range(5):
        mx.eval(exact(ids), one(ids))
    for _ in range(repeats):
        for label, model in (("two products", exact), ("one product", one)):
            start = time.perf_counter()
            mx.eval(model(ids))
            times[label].append((time.perf_counter() - start) * 1e3)
    return {"swapped": swapped, **{f"{k} {stat}": float(f(v)) for k, v in times.items()
                                   for stat, f in (("min", np.min), ("median", np.median))}}


def _dequantize_q6_k_blocks(raw, rows: int, cols: int):
    """A pure-MLX exact dequantization of Q6_K blocks ``uint8 [rows, cols / 256, 210]``
    (the layout of mlx_ferrum/models/gguf/tensors16.py): what a block-reading kernel's
    reference would run at every forward off the GPU."""
    import mlx.core as mx

    nb = cols // 256
    ql = raw[..., :128].astype(mx.uint32).reshape(rows, nb, 2, 2, 32)
    qh = raw[..., 128:192].astype(mx.uint32).reshape(rows, nb, 2, 1, 32)
    low = mx.concatenate([ql & 15, ql >> 4], axis=3)
    high = mx.concatenate([(qh >> s) & 3 for s in (0, 2, 4, 6)], axis=3)
    codes = (low | (high << 4)).astype(mx.float32).reshape(rows, nb, 16, 16) - 32.0
    sc = raw[..., 192:208].view(mx.int8).astype(mx.float32)
    d = raw[..., 208:210].view(mx.float16).astype(mx.float32)
    return ((d * sc)[..., None] * codes).reshape(rows, cols)


def matvec_times(path: Path, repeats: int) -> dict:
    """Microseconds of ``x @ W.T`` for one token over the first Q6_K matrix of ``path``
    (SmolLM2's ffn_down: 576 x 1536), alternated, min and median: one MLX 8-bit and one
    6-bit group-32 product (the costs of requantizing, and of an MLX folder of 6 bits), the
    two 6-bit products that keep it exact, and an exact dequantization of the blocks in
    MLX followed by a float matmul (a block-reading kernel's reference, off the GPU)."""
    import mlx.core as mx

    from mlx_ferrum.kernels.quantized16 import matmul16_reference
    from mlx_ferrum.layers.quantized16 import dequantize16, pair_groups
    from mlx_ferrum.models.gguf.reader import read_gguf
    from mlx_ferrum.models.gguf.tensors import convert_tensor

    source = read_gguf(path)
    name, tensor = next((n, t) for n, t in source.tensors.items() if t.type_name == "Q6_K")
    rows, cols = tensor.shape
    raw_np = np.asarray(tensor.data, dtype=np.uint8).reshape(rows, cols // 256, 210)
    raw = mx.array(raw_np)
    converted = convert_tensor("Q6_K", raw_np.reshape(rows, -1), (rows, cols))
    w6, s6, b6 = converted.weight, pair_groups(converted.scales), pair_groups(converted.biases)
    exact = _dequantize_q6_k_blocks(raw, rows, cols)
    assert mx.array_equal(exact, dequantize16(w6, s6, b6, 6)).item(), "the block dequantization is not exact"
    q8 = mx.quantize(exact, group_size=32, bits=8)
    q6 = (w6, s6[0], b6[0])
    x = mx.array(np.random.default_rng(0).normal(size=(1, cols)).astype(np.float32))
    mx.eval(exact, *q8, *q6, s6, b6, x)
    variants = {
        "one 8-bit product": lambda: mx.quantized_matmul(x, *q8, transpose=True, group_size=32, bits=8),
        "one 6-bit product": lambda: mx.quantized_matmul(x, *q6, transpose=True, group_size=32, bits=6),
        "two 6-bit products (exact)": lambda: matmul16_reference(x, w6, s6, b6, 6),
        "dequantize blocks + matmul (exact)": lambda: x @ _dequantize_q6_k_blocks(raw, rows, cols).T,
    }
    times: dict = {k: [] for k in variants}
    for _ in range(5):
        mx.eval([f() for f in variants.values()])
    for _ in range(repeats):
        for label, f in variants.items():
            start = time.perf_counter()
            mx.eval(f())
            times[label].append((time.perf_counter() - start) * 1e6)
    return {"tensor": name, "shape": [rows, cols],
            **{k: {"min_us": float(np.min(v)), "median_us": float(np.median(v))} for k, v in times.items()}}


def kl_exact(path: Path) -> dict:
    """Mean KL(exact || ours) per token, float32, over the greedy_chat conversations:
    every 16-weight-group tensor of ``path`` replaced by a float32 layer of its exact
    dequantization in the reference."""
    import mlx.core as mx
    import mlx.nn as nn
    from gguf import GGMLQuantizationType, quants

    from mlx_ferrum.models import load_model
    from mlx_ferrum.models.gguf.config import hf_name, unpermute_rows
    from mlx_ferrum.models.gguf.reader import read_gguf

    ours, config, _ = load_model(path, dtype="float32")
    exact, _, _ = load_model(path, dtype="float32")
    source = read_gguf(path)
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    modules = dict(exact.named_modules())
    replaced = []
    by_module = {hf_name(n).rsplit(".", 1)[0]: n for n in source.tensors if hf_name(n) is not None}
    for name in (by_module[m] for m in config["gguf"]["groups16"]):
        tensor = source.tensors[name]
        values = quants.dequantize(np.asarray(tensor.data), GGMLQuantizationType[tensor.type_name]).reshape(tensor.shape)
        role = name.split(".")[-2]
        if role in heads:
            values = unpermute_rows(values, heads[role])
        path_name = hf_name(name).rsplit(".", 1)[0]
        parent_name, _, child = path_name.rpartition(".")
        parent = modules[parent_name] if parent_name else exact
        if isinstance(modules[path_name], (nn.QuantizedEmbedding, nn.Embedding)) or path_name.endswith("embed_tokens"):
            layer = nn.Embedding(*values.shape)
        else:
            layer = nn.Linear(values.shape[1], values.shape[0], bias=False)
        layer.weight = mx.array(values.astype(np.float32))
        setattr(parent, child, layer)
        replaced.append(name)
    recording = json.loads((SMOL / "greedy_chat.json").read_text())
    kls, tokens = [], 0
    for case in recording["cases"]:
        ids = mx.array([case["prompt_ids"] + case["greedy_transformers"]])
        p = nn.log_softmax(exact(ids)[0].astype(mx.float32), axis=-1)
        q = nn.log_softmax(ours(ids)[0].astype(mx.float32), axis=-1)
        kl = mx.sum(mx.exp(p) * (p - q), axis=-1)
        kls.append(np.array(kl))
        tokens += kl.shape[0]
    all_kl = np.concatenate(kls)
    return {"groups16_tensors": len(replaced), "tokens": tokens, "mean_kl": float(all_kl.mean()),
            "max_kl": float(all_kl.max())}


def _run(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/bench_gguf")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--sections", default="memory,load-time,aligned,decode,groups16,kl",
                        help="comma-separated: memory, load-time, aligned, decode, groups16, kl")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds of the load-time section")
    parser.add_argument("--repeats", type=int, default=3, help="alternated decode runs per 16-group file and mode")
    parser.add_argument("--step-repeats", type=int, default=200, help="alternated single-token forwards per variant")
    parser.add_argument("--measure", nargs=2, metavar=("TARGET", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--kl", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--step", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--matvec", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1], args.decode_tokens)))
        return
    if args.kl:
        print(json.dumps(kl_exact(Path(args.kl))))
        return
    if args.matvec:
        print(json.dumps(matvec_times(Path(args.matvec), args.step_repeats)))
        return
    if args.step:
        print(json.dumps(step_times(Path(args.step), args.step_repeats)))
        return
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = set(args.sections.split(","))
    if "load-time" in sections:
        timing = load_time_rounds(SOURCE, SMOL, args.rounds)
        print(f"load time, {args.rounds} alternating rounds, fresh process each (median, min, max):")
        print(f"  Q4_1 GGUF   {_spread(timing['gguf_s'])} s")
        print(f"  MLX folder  {_spread(timing['folder_s'])} s")
        print(f"  GGUF / folder per round: {_spread(timing['ratios'])}  "
              f"(all: {', '.join(f'{r:.2f}' for r in timing['ratios'])})")
        print(f"  CPU time (process, all threads) GGUF / folder per round: {_spread(timing['cpu_ratios'])}\n")
    if "aligned" in sections:
        source_metadata = None
        print("| 256-aligned model | size (MB) | mf.load active / file | mf.load peak / file | "
              "mx.load active / file | mx.load peak / file |")
        print("|---|---|---|---|---|---|")
        for kind in ("Q4_K_M", "Q4_K"):
            path = out / f"aligned-512.{kind}.gguf"
            if not path.is_file():
                if source_metadata is None:
                    from mlx_ferrum.models.gguf.reader import read_gguf

                    source_metadata = read_gguf(SOURCE).metadata
                start = time.perf_counter()
                write_aligned(path, kind, source_metadata)
                print(f"wrote {path.name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
            size = path.stat().st_size
            ours = _run(["--measure", str(path), "load"])
            theirs = _run(["--measure", str(path), "mlx_load"])
            mlx_cells = (f"{theirs['active_bytes'] / size:.3f} | {theirs['peak_bytes'] / size:.3f}"
                         if "peak_bytes" in theirs else f"fails: {theirs['error']} |")
            print(f"| {kind} | {size / 2**20:.1f} | {ours['active_bytes'] / size:.3f} | "
                  f"{ours['peak_bytes'] / size:.3f} | {mlx_cells} |")
        print()
    if sections & {"memory", "decode", "groups16", "kl"}:
        _main_sections(out, sections, args)


def _main_sections(out: Path, sections: set, args) -> None:
    decode_tokens = args.decode_tokens
    files = {"Q4_1": SOURCE}
    metadata = values = None
    for kind in ("Q8_0", "Q4_0", "Q5_0", "Q5_1", "Q4_K_M", "Q6_K"):
        path = out / f"smollm2-135m.{kind}.gguf"
        if not path.is_file():
            if values is None:
                metadata, values = _exact_values(SOURCE)
            start = time.perf_counter()
            write_file(path, metadata, values, kind)
            print(f"wrote {path.name} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
        files[kind] = path
    if "memory" in sections:
        rows = []
        for kind, path in files.items():
            ours = _run(["--measure", str(path), "load"])
            theirs = _run(["--measure", str(path), "mlx_load"])
            size = path.stat().st_size
            rows.append({"type": kind, "file_mb": size / 2**20, "load_s": ours["load_s"],
                         "active_x_file": ours["active_bytes"] / size, "peak_x_file": ours["peak_bytes"] / size,
                         "mx_load_peak_x_file": theirs["peak_bytes"] / size if "peak_bytes" in theirs else None,
                         "mx_load_error": theirs.get("error")})
        folder = _run(["--measure", str(SMOL), "load"])
        print("| file | size (MB) | load (s) | active / file | peak / file | mx.load peak / file |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['type']} | {r['file_mb']:.1f} | {r['load_s']:.2f} | {r['active_x_file']:.3f} | "
                  f"{r['peak_x_file']:.3f} | "
                  + (f"{r['mx_load_peak_x_file']:.3f} |" if r["mx_load_peak_x_file"] is not None
                     else f"fails: {r['mx_load_error']} |"))
        print(f"\nMLX folder (Q4_1 bits): load {folder['load_s']:.2f} s, active {folder['active_bytes'] / 2**20:.1f} MB, "
              f"peak {folder['peak_bytes'] / 2**20:.1f} MB")
    if "decode" in sections:
        decode_gguf = _run(["--measure", str(SOURCE), "decode", "--decode-tokens", str(decode_tokens)])
        decode_folder = _run(["--measure", str(SMOL), "decode", "--decode-tokens", str(decode_tokens)])
        print(f"decode ({decode_tokens} tokens, greedy): Q4_1 GGUF {decode_gguf['decode_tok_s']:.2f} tok/s, "
              f"MLX folder {decode_folder['decode_tok_s']:.2f} tok/s")
    if "groups16" in sections:
        decode16 = {}
        for kind in ("Q4_K_M", "Q6_K"):
            runs = {"two products": [], "one product": []}
            for _ in range(args.repeats):  # alternated, so a busy moment hits both
                for label, mode in (("two products", "decode"), ("one product", "decode_one_product")):
                    runs[label].append(_run(["--measure", str(files[kind]), mode, "--decode-tokens",
                                             str(decode_tokens)])["decode_tok_s"])
            decode16[kind] = runs
        matvec = _run(["--matvec", str(files["Q6_K"]), "--step-repeats", str(args.step_repeats)])
        steps = {kind: _run(["--step", str(files[kind]), "--step-repeats", str(args.step_repeats)])
                 for kind in ("Q4_K_M", "Q6_K")}
        for kind, runs in decode16.items():
            two, one = np.median(runs["two products"]), np.median(runs["one product"])
            print(f"decode {kind} ({decode_tokens} tokens, median of {args.repeats}): exact (two products per "
                  f"Q6_K tensor) {two:.2f} tok/s {runs['two products']}, one 6-bit product {one:.2f} tok/s "
                  f"{runs['one product']}: {two / one:.3f}x")
        print(f"one token x {matvec['tensor']} {matvec['shape']}, {args.step_repeats} alternated runs (us, min / median):")
        for label, t in matvec.items():
            if isinstance(t, dict):
                print(f"  {label}: {t['min_us']:.0f} / {t['median_us']:.0f}")
        for kind, st in steps.items():
            print(f"single-token forward {kind} ({args.step_repeats} alternated): exact {st['two products min']:.2f} ms "
                  f"min / {st['two products median']:.2f} median, one 6-bit product {st['one product min']:.2f} / "
                  f"{st['one product median']:.2f} ms: {st['two products min'] / st['one product min']:.3f}x (min), "
                  f"{st['two products median'] / st['one product median']:.3f}x (median)")
    if "kl" in sections:
        for kind in ("Q4_K_M", "Q6_K"):
            kl = _run(["--kl", str(files[kind])])
            print(f"{kind}: {kl['groups16_tensors']} Q6_K tensors; mean KL per token against the exact "
                  f"dequantization {kl['mean_kl']:.2e} (max {kl['max_kl']:.2e}) over {kl['tokens']} tokens")

if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
