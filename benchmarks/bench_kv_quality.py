"""Quality of a quantized KV cache against ``kv_cache_dtype="auto"``: teacher-forced KL
divergence and perplexity on shipped English text, and greedy agreement.

For each model (stories260K, fp32, the real checkpoint; and the Qwen2.5-0.5B shape with
fp32 random weights, ``N(0, 0.02)`` as ``benchmarks/common.py`` builds them), the text
``benchmarks/data/kv_quality_text.txt`` (original prose written for this repository) is
tokenized with the stories260K tokenizer and fed teacher-forced, in chunks of
``--chunk`` tokens, to one runner per KV format. Every chunk after the first attends to
the K/V stored by the chunks before it, so the next-token distributions depend on the
stored (quantized) cache the way decoding does. Per format:

- mean KL divergence ``KL(p_auto || p_format)`` of the next-token distributions, in nats,
  over every predicted position (float64 log-softmax of the returned logits);
- perplexity of the text's own next tokens and its change against ``auto``.

Formats: ``int8`` and ``int4`` (Walsh-Hadamard-rotated keys, the default) and ``int4``
without rotation (``rotate_keys=False``), to show what the rotation buys. ``--extra`` adds
int8 without rotation, and a yardstick that keeps the model dtype but rounds every stored
K/V value to bfloat16 (what an 8-bit-mantissa store costs; contiguous caches).
Also per format: the share of positions whose greedy choice (argmax) equals ``auto``'s
on the same teacher-forced inputs ("top-1 agreement").

Greedy agreement (``--greedy``): 32 requests x 128 greedy tokens from prompts cut out of
the text, through :class:`mlx_ferrum.engine.Engine` with the ``auto`` and the ``int8``
cache; the share of generated positions whose token is the same, and the mean length
of the identical prefix.

Every format runs through the public configuration,
``RuntimeConfig(kv_layout=..., kv_cache_dtype=...)``, in the layout ``--layout`` names
(paged by default, or contiguous); int4 without rotation is the int4 runner with its
storage's and backend's ``rotate_keys`` switched off before anything is stored.

stories260K's context is 512 tokens, so its text runs in windows of 512 tokens (each
starting with BOS); the Qwen shape runs one window of ``--qwen-tokens`` tokens.

Run (from the repository root):

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 OPENBLAS_NUM_THREADS=1 \\
        PYTHONPATH=. python benchmarks/bench_kv_quality.py --greedy
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import QWEN25_05B_CONFIG, cached_random_checkpoint, print_header, print_table, scaled_config  # noqa: E402

import mlx_ferrum as mf  # noqa: E402
from mlx_ferrum.config import RuntimeConfig  # noqa: E402
from mlx_ferrum.kv_cache.contiguous import ContiguousKvCache  # noqa: E402
from mlx_ferrum.kv_cache.quantized import QuantizedContiguousKvCache, QuantizedPagedKvPool  # noqa: E402
from mlx_ferrum.executor import LlmExecutor  # noqa: E402
from mlx_ferrum.runner import LlmRunner, SeqWork  # noqa: E402

HERE = Path(__file__).resolve().parent
TEXT = HERE / "data" / "kv_quality_text.txt"
#: the real checkpoint, where the tests find it (``FERRUM_SHARED_MODELS``, else ../shared/models)
STORIES = Path(os.environ.get("FERRUM_SHARED_MODELS", HERE.parent.parent / "shared" / "models")) / "stories260K"

#: (name, kv_cache_dtype, rotate_keys)
FORMATS = [("int8", "int8", True), ("int4", "int4", True), ("int4-norot", "int4", False)]
#: extra rows of ``--extra``: int8 without rotated keys, and a yardstick that stores K/V
#: rounded to bfloat16
EXTRA_FORMATS = [("int8-norot", "int8", False)]


# ------------------------------------------------------------------------------------ runners


class _RoundedCache(ContiguousKvCache):
    """The model-dtype cache, but every stored value rounded through ``store_dtype`` first."""

    store_dtype = mx.bfloat16

    def append(self, k, v):
        return super().append(k.astype(self.store_dtype).astype(k.dtype), v.astype(self.store_dtype).astype(v.dtype))


def rounded_runner(model) -> LlmRunner:
    """A contiguous runner whose caches hold K/V rounded to bfloat16 (a yardstick, not a format)."""
    runner = LlmRunner(model, RuntimeConfig(kv_layout="contiguous", kv_cache_dtype="auto"))
    args = model.args
    runner.store.make_caches = lambda: [_RoundedCache(args.num_key_value_heads, args.head_dim, runner.dtype,
                                                      runner.max_seq_len, 256) for _ in range(args.num_hidden_layers)]
    return runner


def set_key_rotation(runner: LlmRunner, rotate_keys: bool) -> None:
    """Switch the rotation of int4 keys on or off in a freshly built runner (before anything
    is stored): the store's pool and attention backend, and every cache its contiguous
    store will make. The config has no such knob: the rotation is part of the int4 format,
    and only this benchmark measures int4 without it."""
    store = runner.store
    for obj in (getattr(store, "backend", None), getattr(store, "pool", None)):
        if obj is not None and hasattr(obj, "rotate_keys"):
            obj.rotate_keys = rotate_keys
    make = getattr(store, "make_caches", None)
    if make is not None:
        def make_caches():
            caches = make()
            for cache in caches:
                cache.rotate_keys = rotate_keys
            return caches

        store.make_caches = make_caches


def quantized_storage(runner: LlmRunner) -> bool:
    """True when the runner stores K/V quantized (a quantized pool, or quantized contiguous caches)."""
    store = runner.store
    if isinstance(getattr(store, "pool", None), QuantizedPagedKvPool):
        return True
    make = getattr(store, "make_caches", None)
    return make is not None and isinstance(make()[0], QuantizedContiguousKvCache)


def make_runner(model, layout: str, kv_cache_dtype: str, rotate_keys: bool, max_num_blocks: int) -> LlmRunner:
    """A runner built from ``RuntimeConfig(kv_layout=layout, kv_cache_dtype=...)``.

    Raises:
        RuntimeError: the runner ignored a quantized ``kv_cache_dtype``.
    """
    config = RuntimeConfig(kv_layout=layout, kv_cache_dtype=kv_cache_dtype, prefix_cache=False,
                           max_num_blocks=max_num_blocks if layout == "paged" else None)
    runner = LlmExecutor(model, config)  # paged passes need a block owner: the executor adapter
    if kv_cache_dtype != "auto":
        if not quantized_storage(runner):
            raise RuntimeError(f"RuntimeConfig(kv_cache_dtype={kv_cache_dtype!r}) built unquantized storage")
        set_key_rotation(runner, rotate_keys)
    return runner


def build_runners(model, layout: str, window: int, extra: bool = False) -> dict:
    blocks = -(-window // 16) + 4
    runners = {"auto": make_runner(model, layout, "auto", False, blocks)}
    for name, dtype, rot in FORMATS + (EXTRA_FORMATS if extra else []):
        runners[name] = make_runner(model, layout, dtype, rot, blocks)
    if extra:
        runners["bf16-store"] = rounded_runner(model)
    return runners


# ------------------------------------------------------------------------------- measurement


def log_softmax64(logits: mx.array) -> np.ndarray:
    x = np.array(logits.astype(mx.float32), dtype=np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def teacher_forced(runners: dict, windows: list[list[int]], chunk: int) -> dict:
    """Sums over every predicted position: KL vs auto and NLL of the true next token."""
    names = list(runners)
    kl = {n: 0.0 for n in names}
    kl_max = {n: 0.0 for n in names}
    nll = {n: 0.0 for n in names}
    top1 = {n: 0 for n in names}
    count = 0
    for w, ids in enumerate(windows):
        cid = f"window-{w}"
        for start in range(0, len(ids) - 1, chunk):
            piece = ids[start : min(start + chunk, len(ids) - 1)]
            targets = np.array(ids[start + 1 : start + 1 + len(piece)])
            logp = {}
            for n in names:
                logits = runners[n].run([SeqWork(cid, piece, all_logits=True)])[0]
                logp[n] = log_softmax64(logits)
            ref = logp["auto"]
            p_ref = np.exp(ref)
            choice = ref.argmax(axis=-1)
            for n in names:
                per_pos = (p_ref * (ref - logp[n])).sum(axis=-1)
                kl[n] += float(per_pos.sum())
                kl_max[n] = max(kl_max[n], float(per_pos.max()))
                nll[n] -= float(logp[n][np.arange(len(piece)), targets].sum())
                top1[n] += int((logp[n].argmax(axis=-1) == choice).sum())
            count += len(piece)
        for n in names:
            runners[n].release_cache(cid)
    out = {}
    for n in names:
        ppl = float(np.exp(nll[n] / count))
        out[n] = {"mean_kl": kl[n] / count, "max_kl": kl_max[n], "perplexity": ppl, "positions": count,
                  "top1_agreement": top1[n] / count}
    for n in names:
        out[n]["ppl_change_pct"] = 100.0 * (out[n]["perplexity"] / out["auto"]["perplexity"] - 1.0)
    return out


def greedy_agreement(model, tokenizer, layout: str, text_ids: list[int], requests: int, new_tokens: int,
                     prompt_len: int, extra: bool = False) -> dict:
    """``requests`` greedy generations of ``new_tokens`` with auto and int8 KV (and with
    ``extra`` the bfloat16-rounded yardstick); token agreement with auto."""
    from mlx_ferrum.engine import Engine
    from mlx_ferrum.engine.sampling import SamplingParams

    stride = max(1, (len(text_ids) - prompt_len) // requests)
    prompts = [[1] + text_ids[i * stride : i * stride + prompt_len - 1] for i in range(requests)]
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    total = prompt_len + new_tokens
    outs = {}
    for dtype in ("auto", "int8") + (("bf16-store",) if extra else ()):
        # the yardstick's rounding cache exists in the contiguous layout only
        config = RuntimeConfig(kv_layout="contiguous" if dtype == "bf16-store" else layout,
                               kv_cache_dtype="auto" if dtype == "bf16-store" else dtype,
                               max_num_seqs=requests, prefix_cache=False,
                               max_num_blocks=(requests * (-(-total // 16)) + 8
                                               if layout == "paged" and dtype != "bf16-store" else None))
        runner = rounded_runner(model) if dtype == "bf16-store" else None
        engine = Engine(model, tokenizer, config, executor=runner)
        if dtype == "int8" and not quantized_storage(engine.runner):
            raise RuntimeError("RuntimeConfig(kv_cache_dtype='int8') built unquantized storage")
        results = engine.generate(prompts, params)
        outs[dtype] = [list(r.token_ids) for r in results]
    res = {}
    for name in outs:
        if name == "auto":
            continue
        same = total_tokens = 0
        prefixes = []
        for a, b in zip(outs["auto"], outs[name]):
            n = min(len(a), len(b))
            same += sum(x == y for x, y in zip(a[:n], b[:n]))
            total_tokens += max(len(a), len(b))
            k = 0
            while k < n and a[k] == b[k]:
                k += 1
            prefixes.append(k)
        res[name] = {"requests": requests, "new_tokens": new_tokens, "agreement": same / total_tokens,
                     "mean_identical_prefix": float(np.mean(prefixes)),
                     "all_identical": sum(p == new_tokens for p in prefixes)}
    return res


# ------------------------------------------------------------------------------------- main


def text_ids(tokenizer) -> list[int]:
    return list(tokenizer.encode(TEXT.read_text(encoding="utf-8"), add_special_tokens=False))


def stories_path() -> Path:
    if not (STORIES / "config.json").is_file():
        raise SystemExit(f"stories260K not found at {STORIES}: set FERRUM_SHARED_MODELS to the folder holding it")
    return STORIES


def report(title: str, res: dict) -> None:
    print(f"\n{title}")
    rows = []
    for n, r in res.items():
        rows.append([n, f"{r['mean_kl']:.6f}", f"{r['max_kl']:.5f}", f"{r['perplexity']:.4f}",
                     f"{r['ppl_change_pct']:+.3f}%", f"{r['top1_agreement'] * 100:.2f}%", r["positions"]])
    print_table(["kv_cache_dtype", "mean KL (nats)", "max KL", "perplexity", "ppl change", "top-1 agreement",
                 "positions"], rows)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=["paged", "contiguous"], default="paged")
    p.add_argument("--models", default="stories,qwen", help="comma-separated: stories, qwen")
    p.add_argument("--chunk", type=int, default=32, help="tokens per teacher-forced pass")
    p.add_argument("--qwen-layers", type=int, default=24, help="layers of the Qwen2.5-0.5B shape")
    p.add_argument("--qwen-tokens", type=int, default=4096, help="tokens of the text the Qwen shape reads")
    p.add_argument("--greedy", action="store_true", help="also measure greedy agreement (int8 vs auto)")
    p.add_argument("--greedy-requests", type=int, default=32)
    p.add_argument("--greedy-tokens", type=int, default=128)
    p.add_argument("--greedy-models", default="stories", help="models for the greedy agreement")
    p.add_argument("--extra", action="store_true",
                   help="also int8 without rotated keys, and a yardstick storing K/V rounded to bfloat16")
    p.add_argument("--json", default=None, help="write the figures here")
    p.add_argument("--quick", action="store_true",
                   help="a smoke run: stories260K on its first two windows, greedy 4 requests x 16 tokens")
    args = p.parse_args(argv)
    if args.quick:
        args.models, args.greedy, args.greedy_requests, args.greedy_tokens = "stories", True, 4, 16

    tokenizer = mf.load(str(stories_path()))[1]
    ids = text_ids(tokenizer)
    info = print_header("KV cache quantization quality (teacher-forced)", {
        "text": f"{TEXT.name}: {len(ids)} tokens (stories260K tokenizer)", "chunk": args.chunk})
    results = {"machine": info, "text_tokens": len(ids), "models": {}}
    for name in args.models.split(","):
        t0 = time.perf_counter()
        if name == "stories":
            model, tok = mf.load(str(stories_path()))
            window = model.args.max_position_embeddings
            windows = [[1] + ids[i : i + window - 1] for i in range(0, len(ids), window - 1)]
            if args.quick:
                windows = windows[:2]
            label = "stories260K (fp32, 5 layers, head_dim 8, 4 KV heads)"
        elif name == "qwen":
            cfg = scaled_config(QWEN25_05B_CONFIG, num_hidden_layers=args.qwen_layers)
            folder = cached_random_checkpoint(f"qwen25-05b-L{args.qwen_layers}", cfg, "float32")
            model, tok = mf.load(str(folder))
            windows = [[1] + ids[: args.qwen_tokens - 1]]
            window = args.qwen_tokens
            label = (f"Qwen2.5-0.5B shape (fp32 random N(0, 0.02) weights, {args.qwen_layers} layers, "
                     "head_dim 64, 2 KV heads)")
        else:
            raise SystemExit(f"unknown model {name!r}: use stories or qwen")
        runners = build_runners(model, args.layout, window, args.extra)
        res = teacher_forced(runners, windows, args.chunk)
        entry = {"label": label, "layout": args.layout, "teacher_forced": res,
                 "seconds": round(time.perf_counter() - t0, 1)}
        report(f"{label} - {args.layout} layout - {time.perf_counter() - t0:.0f} s", res)
        if args.greedy and name in args.greedy_models.split(","):
            greedy = greedy_agreement(model, tok if name == "stories" else None, args.layout, ids, args.greedy_requests,
                                      args.greedy_tokens, prompt_len=32, extra=args.extra)
            entry["greedy"] = greedy
            for fmt, g in greedy.items():
                print(f"greedy {fmt} vs auto: {g['agreement'] * 100:.2f}% of tokens agree over {g['requests']} "
                      f"requests x {g['new_tokens']} tokens; mean identical prefix {g['mean_identical_prefix']:.1f}; "
                      f"{g['all_identical']} requests identical")
        results["models"][name] = entry
        del runners, model
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
