"""Where a quantized KV cache loses on a real model: teacher-forced KL of quantize-dequantize
variants of the stored K and V, one change at a time.

Each variant is a "fake-quantized" cache: an mlx-lm ``KVCache`` whose
``update_and_fetch`` stores every new key and value after a quantize-dequantize round
trip (in the stored basis: keys rotated by the Walsh-Hadamard matrix first, values too
where the variant says, rotated back afterwards). Per-token group quantization gives the
same numbers as the runtime's int8/int4 storage (the groups are per token, so when a
token is rounded does not matter). The KIVI-style rows quantize keys per channel over
groups of tokens (Liu et al., 2024, "KIVI"), which is not a storable format here (it
would need the last group's tokens in float until the group is full): they show what
that layout would buy.

The rows with a *float window* keep the ``window`` most recent keys and values of each
query (and the first ``sinks`` tokens) in float: scores and value products use the float
K/V for those positions and the round-tripped ones for the rest, one softmax over both
(KIVI's full-precision residual of recent tokens; attention sinks as in Xiao et al., 2023,
"Efficient Streaming Language Models with Attention Sinks"). The rule is per query and key
position, so it does not depend on how the text is split into passes. For these rows the
script swaps mlx-lm's attention function in ``mlx_lm.models.llama`` for the run.

Each variant reads ``--text`` (default ``benchmarks/data/public_domain_passages.txt``)
teacher-forced in chunks of 512 tokens, and its next-token log-probabilities are
compared with the float KV run's: mean ``KL(p_float || p_variant)`` in nats per token
and top-1 agreement. ``--stats`` prints the keys' per-channel statistics (|mean| / std
and RMS max / median per layer, KV head 0).

Run (from the repository root; ``/tmp/smollm2-f32`` as ``../shared/models/README.md`` makes it)::

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        PYTHONPATH=. python benchmarks/diagnose_kv_quant.py --model /tmp/smollm2-f32 --tokens 2048
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mlx_ferrum.kernels.quantized_reference import hadamard_matrix  # noqa: E402

HERE = Path(__file__).resolve().parent


def fake_quantize(x: mx.array, bits: int, group: int, symmetric: bool = False, clip: float = 1.0) -> mx.array:
    """Round trip ``x`` ``[..., D]`` through ``bits``-bit group quantization along its last axis:
    symmetric (``scale = max|x| / (2**(bits-1) - 1)``, the int8 format) or affine
    (``scale = (max - min) / (2**bits - 1)``, ``bias = min``, the int4 format); scales and
    biases rounded to float16 as stored. ``clip`` < 1 shrinks the range about its middle."""
    *lead, d = x.shape
    xg = x.reshape(*lead, d // group, group)
    if symmetric:
        qmax = 2 ** (bits - 1) - 1
        s = (mx.abs(xg).max(-1, keepdims=True) * clip / qmax).astype(mx.float16).astype(mx.float32)
        s = mx.where(s > 0, s, 1.0)
        return (mx.clip(mx.round(xg / s), -qmax, qmax) * s).reshape(x.shape)
    levels = 2**bits - 1
    lo, hi = xg.min(-1, keepdims=True), xg.max(-1, keepdims=True)
    if clip != 1.0:
        mid, half = (lo + hi) / 2, (hi - lo) / 2 * clip
        lo, hi = mid - half, mid + half
    s = ((hi - lo) / levels).astype(mx.float16).astype(mx.float32)
    b = lo.astype(mx.float16).astype(mx.float32)
    return (mx.clip(mx.round((xg - b) / mx.where(s > 0, s, 1.0)), 0, levels) * s + b).reshape(x.shape)


INT8 = dict(bits=8, group=64, symmetric=True)


def int4(group: int = 64, **kw) -> dict:
    return dict(bits=4, group=group, **kw)


#: name -> variant: "k"/"v" (fake_quantize arguments, absent: kept float), "k_rotate"
#: (default True), "v_rotate" (default False), "k_tokens" (KIVI: per channel over this many
#: tokens), "int8_layers" (layers stored int8 instead), "only_layers" (quantize just these),
#: "window" / "sinks" (positions kept in float, see the module docstring)
VARIANTS = {
    "int8 (today: rotated K, groups of 64)": {"k": INT8, "v": INT8},
    "int8, values rotated too": {"k": INT8, "v": INT8, "v_rotate": True},
    "int4 (today: rotated K, groups of 64)": {"k": int4(), "v": int4()},
    "int4, values rotated too": {"k": int4(), "v": int4(), "v_rotate": True},
    "int4 keys only": {"k": int4()},
    "int4 values only": {"v": int4()},
    "int4 keys only, no rotation": {"k": int4(), "k_rotate": False},
    "int4 keys only, groups of 32": {"k": int4(32)},
    "int4 keys only, groups of 16": {"k": int4(16)},
    "int4 keys only, range clipped to 90 %": {"k": int4(clip=0.9)},
    "int4 keys only, symmetric, groups of 32": {"k": int4(32, symmetric=True)},
    "int4 keys only, layer 0 only": {"k": int4(), "only_layers": (0,)},
    "int4 keys only, layer 1 only": {"k": int4(), "only_layers": (1,)},
    "int4, layers 0-1 in int8": {"k": int4(), "v": int4(), "int8_layers": (0, 1)},
    "int4 keys only, KIVI per channel over 64 tokens": {"k_tokens": 64},
    "int4 keys only, KIVI per channel over 16 tokens": {"k_tokens": 16},
    "int4 keys only, KIVI per channel over 32 tokens": {"k_tokens": 32},
    "int4, keys KIVI over 32 tokens, values rotated (0.297x)": {"k_tokens": 32, "v": int4(), "v_rotate": True},
    "int4, keys KIVI over 16 tokens, values rotated in groups of 32 (0.344x)":
        {"k_tokens": 16, "v": int4(32), "v_rotate": True},
    "int4 values only, rotated": {"v": int4(), "v_rotate": True},
    "int4 values only, groups of 32": {"v": int4(32)},
    "int4 values only, rotated, groups of 32": {"v": int4(32), "v_rotate": True},
    "int4 values only, range clipped to 90 %": {"v": int4(clip=0.9)},
    "int4, values rotated, first 4 tokens float": {"k": int4(), "v": int4(), "v_rotate": True, "sinks": 4},
    "int4, values rotated, last 16 tokens float": {"k": int4(), "v": int4(), "v_rotate": True, "window": 16},
    "int4, values rotated, last 32 tokens float": {"k": int4(), "v": int4(), "v_rotate": True, "window": 32},
    "int4, values rotated, last 64 tokens float": {"k": int4(), "v": int4(), "v_rotate": True, "window": 64},
    "int4, values rotated, last 128 tokens float": {"k": int4(), "v": int4(), "v_rotate": True, "window": 128},
    "int4, values rotated, first 4 and last 64 tokens float":
        {"k": int4(), "v": int4(), "v_rotate": True, "sinks": 4, "window": 64},
    "int4, values not rotated, last 64 tokens float": {"k": int4(), "v": int4(), "window": 64},
    "int4, values rotated, first 4 and last 32 tokens float":
        {"k": int4(), "v": int4(), "v_rotate": True, "sinks": 4, "window": 32},
    "int4 keys only, last 64 tokens float": {"k": int4(), "window": 64},
    "int4 values only (rotated), last 64 tokens float": {"v": int4(), "v_rotate": True, "window": 64},
}


def make_cache_class():
    from mlx_lm.models.cache import KVCache

    class FakeQuantizedCache(KVCache):
        """mlx-lm's cache, storing each new K/V after the variant's round trip."""

        def __init__(self, variant: dict, layer: int, head_dim: int):
            super().__init__()
            self.variant, self.layer = variant, layer
            self.h = hadamard_matrix(head_dim)
            self.float_cache = KVCache()

        def update_and_fetch(self, k, v):
            if "window" in self.variant or "sinks" in self.variant:
                # the float K/V the window's positions attend to (read by windowed_attention)
                self.float_kv = self.float_cache.update_and_fetch(k, v)
            var = self.variant
            if self.layer in var.get("int8_layers", ()):
                var = {"k": INT8, "v": INT8}
            if "only_layers" in var and self.layer not in var["only_layers"]:
                return super().update_and_fetch(k, v)
            if "k" in var:
                rot = var.get("k_rotate", True)
                kk = fake_quantize(k @ self.h if rot else k, **var["k"])
                k = kk @ self.h if rot else kk
            if "k_tokens" in var:  # per channel over groups of tokens (chunks are multiples of it)
                b, heads, n, d = k.shape
                t = var["k_tokens"]
                kg = k.reshape(b, heads, n // t, t, d).swapaxes(-1, -2)
                k = fake_quantize(kg, bits=4, group=t).swapaxes(-1, -2).reshape(b, heads, n, d)
            if "v" in var:
                rot = var.get("v_rotate", False)
                vv = fake_quantize(v @ self.h if rot else v, **var["v"])
                v = vv @ self.h if rot else vv
            return super().update_and_fetch(k, v)

    return FakeQuantizedCache


def windowed_attention(original):
    """An attention function for ``mlx_lm.models.llama``: for a cache with a float window
    (see the module docstring), keys within ``window`` positions of the query or among the
    first ``sinks`` positions use the float K/V, the others the round-tripped ones."""

    def attention(q, k, v, cache, scale, mask):
        variant = getattr(cache, "variant", None) or {}
        if "window" not in variant and "sinks" not in variant:
            return original(q, k, v, cache=cache, scale=scale, mask=mask)
        float_k, float_v = cache.float_kv
        num_queries, num_keys = q.shape[2], k.shape[2]
        repeats = q.shape[1] // k.shape[1]
        query_pos = mx.arange(num_keys - num_queries, num_keys)[:, None]
        key_pos = mx.arange(num_keys)[None]
        use_float = ((query_pos - key_pos) < variant.get("window", 0)) | (key_pos < variant.get("sinks", 0))

        def by_query_head(x):
            return mx.repeat(x, repeats, axis=1)

        scores = mx.where(use_float, (q * scale) @ by_query_head(float_k).swapaxes(-1, -2),
                          (q * scale) @ by_query_head(k).swapaxes(-1, -2))
        scores = mx.where(key_pos <= query_pos, scores, -mx.inf)
        probs = mx.softmax(scores.astype(mx.float32), axis=-1)
        float_probs = mx.where(use_float, probs, 0)
        return (float_probs @ by_query_head(float_v) + (probs - float_probs) @ by_query_head(v)).astype(q.dtype)

    return attention


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="/tmp/smollm2-f32", help="an mlx-lm checkpoint folder (float32 weights)")
    p.add_argument("--text", default=str(HERE / "data" / "public_domain_passages.txt"))
    p.add_argument("--tokens", type=int, default=2048, help="tokens of the text read (0: all)")
    p.add_argument("--variants", default=None, help="';'-separated names (default: all)")
    p.add_argument("--stats", action="store_true", help="print the keys' per-channel statistics")
    args = p.parse_args(argv)

    from mlx_lm import load
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache

    llama.scaled_dot_product_attention = windowed_attention(llama.scaled_dot_product_attention)

    model, tokenizer = load(args.model)
    ids = tokenizer.encode(Path(args.text).read_text(encoding="utf-8"))
    ids = ids[: args.tokens] if args.tokens else ids
    head_dim = model.layers[0].self_attn.head_dim if hasattr(model.layers[0].self_attn, "head_dim") else 64
    cache_class = make_cache_class()
    chunk = 512

    def run(variant):
        caches = [cache_class(variant, i, head_dim) if variant is not None else KVCache()
                  for i in range(len(model.layers))]
        out = []
        for s in range(0, len(ids), chunk):
            logits = model(mx.array(ids[s : s + chunk])[None], cache=caches)[0].astype(mx.float32)
            lp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            mx.eval(lp)
            out.append(lp)
        return mx.concatenate(out, 0), caches

    ref, caches = run(None)
    p_ref = mx.exp(ref)
    print(f"{len(ids)} tokens of {args.text}")
    if args.stats:
        for layer in (0, 1, 5, 15, len(caches) - 1):
            k = np.array(caches[layer].keys[0, 0, : len(ids)])  # KV head 0, [tokens, head_dim]
            mean, std, rms = k.mean(0), k.std(0), np.sqrt((k * k).mean(0))
            print(f"layer {layer:2d}: |mean|/std, top 4 channels {np.round(np.sort(np.abs(mean) / std)[-4:], 2)}; "
                  f"channel RMS max/median {rms.max() / np.median(rms):.1f}")
    names = args.variants.split(";") if args.variants else list(VARIANTS)
    print("| variant | mean KL | top-1 agreement |\n|---|---:|---:|")
    for name in names:
        t0 = time.perf_counter()
        lp, _ = run(VARIANTS[name])
        kl = float((p_ref * (ref - lp)).sum(-1).mean())
        top1 = float((ref.argmax(-1) == lp.argmax(-1)).astype(mx.float32).mean())
        print(f"| {name} | {kl:.4f} | {100 * top1:.1f} % |  ({time.perf_counter() - t0:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
