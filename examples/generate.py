"""Generate one completion with mlx_ferrum.

    python examples/generate.py --model ../shared/models/stories260K --prompt "Once upon a time"
    FERRUM_METAL_PAGED_KV=1 python examples/generate.py --model mlx-community/Qwen2.5-0.5B-Instruct-4bit
"""

import argparse

import mlx_ferrum as mf

parser = argparse.ArgumentParser()
parser.add_argument("--model", default="mlx-community/Qwen2.5-0.5B-Instruct-4bit")
parser.add_argument("--prompt", default="Once upon a time")
parser.add_argument("--max-tokens", type=int, default=100)
args = parser.parse_args()

model, tokenizer = mf.load(args.model)
for chunk in mf.stream_generate(model, tokenizer, args.prompt, max_tokens=args.max_tokens, temperature=0.0):
    print(chunk.text, end="", flush=True)
print(f"\n[{chunk.generation_tokens} tokens, {chunk.generation_tps:.1f} tok/s, finish: {chunk.finish_reason}]")
