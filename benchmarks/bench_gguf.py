"""GGUF loading: memory against file size, load time and decode speed against the MLX
folder, and the cost of the 8-bit requantization of Q6_K.

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
- the mean KL per token of the Q4_K_M-like model (Q6_K requantized to 8 bits) against
  the same file dequantized exactly, float32, over the greedy_chat conversations.

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
    if mode == "decode":
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


def kl_q4_k_m(path: Path) -> dict:
    """Mean KL(exact || ours) per token, float32, over the greedy_chat conversations."""
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
    for name in config["gguf"]["requantized_8bit"]:
        tensor = source.tensors[name]
        values = quants.dequantize(np.asarray(tensor.data), GGMLQuantizationType[tensor.type_name]).reshape(tensor.shape)
        role = name.split(".")[-2]
        if role in heads:
            values = unpermute_rows(values, heads[role])
        path_name = hf_name(name).rsplit(".", 1)[0]
        parent_name, _, child = path_name.rpartition(".")
        parent = modules[parent_name] if parent_name else exact
        if isinstance(modules[path_name], nn.QuantizedEmbedding):
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
    return {"requantized_tensors": len(replaced), "tokens": tokens, "mean_kl": float(all_kl.mean()),
            "max_kl": float(all_kl.max())}


def _run(args: list[str]) -> dict:
    out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="/tmp/bench_gguf")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--sections", default="memory,load-time,aligned,decode,kl",
                        help="comma-separated: memory, load-time, aligned, decode, kl")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds of the load-time section")
    parser.add_argument("--measure", nargs=2, metavar=("TARGET", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--kl", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1], args.decode_tokens)))
        return
    if args.kl:
        print(json.dumps(kl_q4_k_m(Path(args.kl))))
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
    if sections & {"memory", "decode", "kl"}:
        _main_sections(out, sections, args.decode_tokens)


def _main_sections(out: Path, sections: set, decode_tokens: int) -> None:
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
    if "kl" in sections:
        for kind in ("Q4_K_M", "Q6_K"):
            kl = _run(["--kl", str(files[kind])])
            print(f"{kind}: {kl['requantized_tensors']} Q6_K tensors requantized to 8 bits; mean KL per token against "
                  f"the exact dequantization {kl['mean_kl']:.2e} (max {kl['max_kl']:.2e}) over {kl['tokens']} tokens")

if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    main()
