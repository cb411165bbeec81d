"""Speculative decoding (n-gram prompt lookup) vs plain decoding, same engine, same requests.

Usage::

    python benchmarks/bench_speculative.py                 # stories260K, 1, 2, 4, 8 and 32 requests, both KV layouts
    python benchmarks/bench_speculative.py --quick         # 1 repeat, 64 tokens, paged only, 1 and 8 requests
    python benchmarks/bench_speculative.py --num-speculative-tokens 6 --layouts paged

What is measured: for each workload, KV layout and request count N, N greedy requests
(EOS ignored, ``--max-tokens`` each) go into an :class:`~mlx_ferrum.engine.Engine` at
once and run to completion, with ``RuntimeConfig.speculative = "ngram"`` (the
speculation policy's defaults) and without. Each side keeps one engine for its warm-up
and timed runs, as a server does (compiled steps traced once; prefix caching off so a
repeat recomputes its prompt). Reported per side: wall time of ``Engine.generate`` (median over
``--repeats`` timed runs after one untimed warm-up; the sides alternate so that load
from other processes hits both), generated tokens, target forward passes
(``Engine.num_steps``), tokens per target forward pass, and with speculation the
acceptance rate and mean accepted length from ``Engine.stats()``. The speedup is
``time without / time with`` from the medians, with the range over the paired repeats.
The same ratio of process CPU time (``time.process_time``) is printed beside it: on a
machine shared with other processes it moves less than wall time, because time spent
waiting for a core is not counted.
"tokens per forward" is all generated tokens over all target forward passes (prefill
steps included), so at N requests without speculation it is about N.
Greedy outputs must agree token for token; the script checks it.

Workloads (stories260K, ``../shared/models/stories260K`` or ``FERRUM_SHARED_MODELS``):

- ``story``: N story openings ("Once upon a time", "One day", ...): ordinary generation.
- ``quote``: repetition-heavy. Each prompt is a story the model wrote itself (its greedy
  continuation of an opening), a BOS, and the opening again, so the model retells the
  text already in its context, and prompt lookup can propose it.

With ``--model`` (a chat model, e.g. a float32 copy of SmolLM2-135M-Instruct), prompts
go through the checkpoint's chat template and the replies end at EOS (both sides produce
the same greedy tokens, so the work is the same), with two workloads:

- ``edit``: the model is asked to repeat a text with one change: half the requests a
  JSON object ("repeat it, but set city to Paris"), half a paragraph of
  ``benchmarks/data/public_domain_passages.txt`` ("copy it, but write X for Y"). What an
  assistant that edits code or documents does, and where prompt lookup should pay.
- ``chat``: ordinary questions, where drafts rarely match: speculation must not cost.

There is no rival side: mlx-lm's speculative decoding takes a draft model only (no
prompt lookup) and runs a single stream, so it has no comparable configuration.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import print_header, print_table  # noqa: E402

import mlx_ferrum as mf  # noqa: E402
from mlx_ferrum.config import RuntimeConfig  # noqa: E402
from mlx_ferrum.engine import Engine, SamplingParams  # noqa: E402

OPENINGS = ["Once upon a time", "One day", "Lily wanted", "Tom and Sue", "The sun was", "A little bird",
            "Mom said", "There was a big",
            # more openings, so that the higher levels run as many distinct requests as they say
            "The little dog", "Sam had a", "It was a sunny day", "Anna and Ben", "The cat saw", "A big truck",
            "Max liked to", "The girl found", "In the park", "The boy ran", "Sara had a red", "The bird sang",
            "Tim was sad", "The sky was", "A small fish", "Dad and Tom", "The ball was", "Lucy loved her",
            "The tree was tall", "Ben wanted to", "The dog barked", "Kitty was a", "The moon was", "Grandma baked"]


PASSAGES = Path(__file__).resolve().parent / "data" / "public_domain_passages.txt"
CITIES = ["Lyon", "Oslo", "Lima", "Pune", "Kyiv", "Cork", "Graz", "Nice"]
QUESTIONS = ["What is the capital of France?", "Why is the sky blue?", "How do plants make food?",
             "What is a prime number?", "Who wrote Hamlet?", "How does a rainbow form?",
             "What is the largest ocean?", "Why do we have seasons?"]


def chat_workloads(tokenizer, n: int) -> dict[str, list[list[int]]]:
    """Token-id prompts (chat template applied) of the ``edit`` and ``chat`` workloads."""
    paragraphs = [p for p in (" ".join(b.split()) for b in PASSAGES.read_text().split("\n\n")) if 40 <= len(p.split()) <= 110]
    edits = []
    for i in range(n):
        if i % 2 == 0:
            record = {"id": 1000 + i, "name": f"Customer {i}", "city": CITIES[i % len(CITIES)], "active": i % 3 == 0,
                      "tags": ["priority", "email", f"region-{i % 5}"], "balance": round(17.5 * (i + 3), 2)}
            edits.append("Repeat this JSON object exactly, but set \"city\" to \"Paris\":\n" + json.dumps(record, indent=2))
        else:
            text = paragraphs[(i // 2) % len(paragraphs)]
            word = next((w for w in text.split() if len(w) >= 6 and w.isalpha()), text.split()[0])
            edits.append(f"Copy the paragraph below exactly, but write \"orange\" instead of \"{word}\".\n\n{text}")
    questions = [QUESTIONS[i % len(QUESTIONS)] + ("" if i < len(QUESTIONS) else f" (question {i})") for i in range(n)]

    def encode(user: str) -> list[int]:
        return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=True)

    return {"edit": [encode(e) for e in edits], "chat": [encode(q) for q in questions]}


def stories_path() -> Path:
    base = Path(os.environ.get("FERRUM_SHARED_MODELS", REPO.parent / "shared" / "models"))
    return base / "stories260K"


def workloads(model, tokenizer, n: int, story_tokens: int) -> dict[str, list[list[int]]]:
    """Token-id prompts for each workload."""
    openings = [tokenizer.encode(t) for t in OPENINGS[:n]]
    eng = Engine(model, tokenizer, RuntimeConfig(kv_layout="paged"))
    stories = eng.generate(openings, SamplingParams(max_tokens=story_tokens, temperature=0.0, ignore_eos=True))
    bos = tokenizer.bos_token_id if getattr(tokenizer, "bos_token_id", None) is not None else 1
    quote = [o + s.token_ids + [bos] + o[1:] for o, s in zip(openings, stories)]
    return {"story": openings, "quote": quote}


_ENGINES: dict = {}


def run_once(model, tokenizer, prompts, layout: str, spec: bool, k: int, max_tokens: int,
             ignore_eos: bool = True) -> dict:
    # one engine per side and batch, built once and reused for the warm-up and every
    # timed run (as a server's is): the compiled decode steps are traced once, not in
    # every timed run; prefix caching off, so a repeat does not skip the prompt it ran
    # before; a pool sized for the work (not the 1 GiB default budget)
    key = (layout, spec, k, len(prompts))
    eng = _ENGINES.get(key)
    if eng is None:
        cfg = dict(kv_layout=layout, max_num_blocks=512, prefix_cache=False)
        if spec:
            cfg.update(speculative="ngram", num_speculative_tokens=k)
        gc.collect()
        eng = _ENGINES[key] = Engine(model, tokenizer, RuntimeConfig(**cfg))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos)
    before = eng.stats()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = eng.generate(prompts, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    st = eng.stats()
    proposed = st["spec_proposed_tokens"] - before["spec_proposed_tokens"]
    accepted = st["spec_accepted_tokens"] - before["spec_accepted_tokens"]
    drafts = st["spec_num_drafts"] - before["spec_num_drafts"]
    return {"time": dt, "cpu": cpu, "tokens": [o.token_ids for o in outs],
            "generated": st["generated_tokens"] - before["generated_tokens"],
            "forwards": st["num_steps"] - before["num_steps"],
            "acceptance": accepted / proposed if proposed else 0.0,
            "mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, 64 tokens, paged layout only, 1 and 8 requests")
    ap.add_argument("--concurrency", default="1,2,4,8,32")
    ap.add_argument("--layouts", default="paged,contiguous")
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--story-tokens", type=int, default=150, help="length of the text the quote prompts repeat")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--model", default=None,
                    help="a chat model folder: run the edit and chat workloads through its template (default: "
                         "stories260K's story and quote workloads)")
    args = ap.parse_args(argv)
    if args.quick:
        args.repeats, args.max_tokens, args.layouts = 1, 64, "paged"
        if args.concurrency == ap.get_default("concurrency"):
            args.concurrency = "1,8"
    path = Path(args.model) if args.model else stories_path()
    if not (path / "config.json").exists():
        print(f"no checkpoint at {path}: give --model, or set FERRUM_SHARED_MODELS for stories260K")
        return {}
    levels = [int(c) for c in args.concurrency.split(",")]
    if args.model is None and max(levels) > len(OPENINGS):
        raise SystemExit(f"--concurrency goes up to {len(OPENINGS)} requests (one per opening of the workload)")
    layouts = args.layouts.split(",")
    info = print_header(f"bench_speculative: n-gram speculative decoding vs none, mlx_ferrum Engine, {path.name}",
                        {"max_tokens": args.max_tokens, "num_speculative_tokens": args.num_speculative_tokens,
                         "repeats": args.repeats, "prompt_lookup": "min 2, max 4 (defaults)"})
    model, tokenizer = mf.load(str(path))
    if args.model:
        prompts = chat_workloads(tokenizer, max(levels))
    else:
        prompts = workloads(model, tokenizer, max(levels), args.story_tokens)
    ignore_eos = args.model is None  # chat replies end where the model ends them, the same on both sides
    rows, results = [], []
    for w, plist in prompts.items():
        for layout in layouts:
            for c in levels:
                batch = plist[:c]
                run_once(model, tokenizer, batch, layout, False, args.num_speculative_tokens, args.max_tokens, ignore_eos)
                run_once(model, tokenizer, batch, layout, True, args.num_speculative_tokens, args.max_tokens, ignore_eos)
                offs, ons = [], []
                for r in range(args.repeats):
                    order = (False, True) if r % 2 == 0 else (True, False)
                    for spec in order:
                        res = run_once(model, tokenizer, batch, layout, spec, args.num_speculative_tokens,
                                       args.max_tokens, ignore_eos)
                        (ons if spec else offs).append(res)
                if any(a["tokens"] != b["tokens"] for a, b in zip(offs, ons)):
                    raise SystemExit(f"greedy outputs differ with speculation ({w}, {layout}, {c} requests)")
                t_off = statistics.median(r["time"] for r in offs)
                t_on = statistics.median(r["time"] for r in ons)
                paired = [a["time"] / b["time"] for a, b in zip(offs, ons)]
                c_off = statistics.median(r["cpu"] for r in offs)
                c_on = statistics.median(r["cpu"] for r in ons)
                cpu_paired = [a["cpu"] / b["cpu"] for a, b in zip(offs, ons)]
                on, off = ons[0], offs[0]
                rows.append([w, layout, c, f"{off['generated'] / off['forwards']:.2f}",
                             f"{on['generated'] / on['forwards']:.2f}", f"{on['acceptance']:.2f}",
                             f"{on['mean_accepted_length']:.2f}", f"{t_off:.3f}", f"{t_on:.3f}",
                             f"{t_off / t_on:.2f}x ({min(paired):.2f}-{max(paired):.2f})",
                             f"{c_off / c_on:.2f}x ({min(cpu_paired):.2f}-{max(cpu_paired):.2f})"])
                results.append({"workload": w, "layout": layout, "requests": c, "time_off": t_off, "time_on": t_on,
                                "speedup": t_off / t_on, "paired_speedups": paired,
                                "cpu_off": c_off, "cpu_on": c_on, "cpu_speedup": c_off / c_on,
                                "paired_cpu_speedups": cpu_paired,
                                "tokens_per_forward_off": off["generated"] / off["forwards"],
                                "tokens_per_forward_on": on["generated"] / on["forwards"],
                                "acceptance_rate": on["acceptance"],
                                "mean_accepted_length": on["mean_accepted_length"]})
                print(f"   {w} {layout} {c} request(s): done", flush=True)
    print()
    print_table(["workload", "layout", "requests", "tok/fwd off", "tok/fwd on", "acceptance", "mean acc. len",
                 "time off (s)", "time on (s)", "speedup (range)", "CPU-time speedup (range)"], rows)
    out = {"machine": info, "settings": vars(args), "results": results}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
