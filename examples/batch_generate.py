"""Serve a list of prompts at once with the continuous-batching engine and report throughput.

    python examples/batch_generate.py --model ../shared/models/stories260K
"""

import argparse
import time

import mlx_ferrum as mf

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="mlx-community/Qwen2.5-0.5B-Instruct-4bit")
parser.add_argument("--max-tokens", type=int, default=64)
args = parser.parse_args()

prompts = [
    "Once upon a time",
    "The little dog",
    "Lily and Ben went to the park",
    "One day, a big bird",
    "Tom had a red ball",
    "The sun was hot and",
    "Mom said to Lily",
    "There was a tiny cat",
]
model, tokenizer = mf.load(args.model)
engine = mf.Engine(model, tokenizer, mf.RuntimeConfig(kv_layout="paged"))
params = mf.SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=0)

start = time.perf_counter()
outputs = engine.generate(prompts, params)
elapsed = time.perf_counter() - start

for prompt, out in zip(prompts, outputs):
    print(f"--- {prompt!r} -> [{out.finish_reason}] {out.text.strip()[:100]!r}")
generated = sum(len(o.token_ids) for o in outputs)
stats = engine.stats()
print(f"\n{len(prompts)} requests, {generated} tokens in {elapsed:.2f} s = {generated / elapsed:.1f} tok/s")
print(f"TTFT p50 {stats['ttft_p50'] * 1000:.1f} ms, inter-token p50 {stats['itl_p50'] * 1000:.1f} ms, "
      f"peak KV blocks {stats['kv']['peak_blocks']} of {stats['kv_blocks_total']}")
