"""Structured output: validity through the server, mask time per token, step overhead.

Four measurements:

1. **Validity** (through ``mlx-ferrum serve`` with stories260K, temperature 1): every
   schema of :mod:`json_schema_suite` (120) sent as ``response_format: json_schema`` to
   ``/v1/completions``, one client at a time; counts outputs that finished (``stop``),
   that validate with ``jsonschema``, and that ran out of ``max_tokens``.
2. **Concurrency**: the same suite with ``--clients`` (32) concurrent clients, each
   request alternating with an unconstrained greedy one; the constrained outputs must
   validate as before, and every unconstrained output must equal its solo run
   (measured first, one at a time).
3. **Mask time per token** at a 32K vocabulary: a byte-level BPE tokenizer of 32,000
   ids (``benchmarks/common.py``), the suite's schemas walked by random allowed tokens
   (seeded), :meth:`GrammarBackend.fill_bitmask` timed per row; p50 / p99 / max in µs.
4. **Engine step time** on stories260K (in process, paged, pipelined): 8 rows decoding
   128 tokens each, all unconstrained vs all constrained (a regex that allows any
   lower-case text, so both runs decode the same number of tokens); median of
   ``--repeats`` wall times divided by the number of steps.

``python benchmarks/bench_structured.py [--model ../shared/models/stories260K] [--quick] [--json FILE]``;
``--step-only`` runs measurement 4 alone; ``--speculative`` compares constrained greedy
requests with and without n-gram speculation (tokens/s, alternating, outputs equal); ``--mc N`` the multiple-choice loglikelihood task
of ``benchmarks/mc_task.py`` (server vs mlx-lm) alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_header, print_table, write_bpe_tokenizer  # noqa: E402
from json_schema_suite import schemas  # noqa: E402
from server_process import Server  # noqa: E402

DEFAULT_MODEL = REPO.parent / "shared" / "models" / "stories260K"
PROMPTS = ["Once upon a time", "Lily and Tom went", "The little dog", "One day, a girl"]


def _constrained_body(i: int, schema: dict, max_tokens: int) -> dict:
    return {"model": "bench", "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "temperature": 1.0,
            "seed": i, "response_format": {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                                    "strict": True}}}


def _free_body(i: int) -> dict:
    return {"model": "bench", "prompt": PROMPTS[i % len(PROMPTS)] + " " * (i % 3), "max_tokens": 48, "temperature": 0.0}


def _check(text: str, finish: str, schema: dict) -> str:
    import jsonschema

    if finish != "stop":
        return "unfinished"
    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


def validity(url: str, suite, max_tokens: int) -> dict:
    counts = {"valid": 0, "invalid": 0, "unfinished": 0}
    failures = []
    with httpx.Client(timeout=300) as client:
        for i, (name, schema) in enumerate(suite):
            r = client.post(url + "/v1/completions", json=_constrained_body(i, schema, max_tokens)).json()
            c = r["choices"][0]
            verdict = _check(c["text"], c["finish_reason"], schema)
            counts[verdict] += 1
            if verdict != "valid":
                failures.append((name, c["finish_reason"], c["text"][:80]))
    return {"counts": counts, "failures": failures}


async def _concurrent(url: str, suite, max_tokens: int, clients: int) -> dict:
    jobs = []
    for i, (name, schema) in enumerate(suite):
        jobs.append(("constrained", i, name, schema))
        jobs.append(("free", i, None, None))
    with httpx.Client(timeout=300) as client:  # the solo runs of the unconstrained requests
        solo = {i: client.post(url + "/v1/completions", json=_free_body(i)).json()["choices"][0]["text"]
                for kind, i, *_ in jobs if kind == "free"}
    queue: asyncio.Queue = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    counts = {"valid": 0, "invalid": 0, "unfinished": 0, "free_equal": 0, "free_different": 0}

    async def worker(client):
        while not queue.empty():
            kind, i, name, schema = queue.get_nowait()
            if kind == "constrained":
                c = (await client.post(url + "/v1/completions", json=_constrained_body(i, schema, max_tokens))).json()["choices"][0]
                counts[_check(c["text"], c["finish_reason"], schema)] += 1
            else:
                c = (await client.post(url + "/v1/completions", json=_free_body(i))).json()["choices"][0]
                counts["free_equal" if c["text"] == solo[i] else "free_different"] += 1

    start = time.perf_counter()
    async with httpx.AsyncClient(timeout=600) as client:
        await asyncio.gather(*(worker(client) for _ in range(clients)))
    counts["seconds"] = round(time.perf_counter() - start, 1)
    return counts


def mask_times(suite, vocab: int, tokens_per_schema: int, seed: int = 0) -> dict:
    from mlx_ferrum.engine.structured import GrammarBackend, StructuredOutputsParams
    from mlx_ferrum.tokenizer import Tokenizer

    folder = Path(tempfile.gettempdir()) / "mlx_ferrum_bench" / f"bpe{vocab}"
    if not (folder / "tokenizer.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_bpe_tokenizer(folder, vocab)
    tok = Tokenizer.from_pretrained(folder)
    backend = GrammarBackend(tok, vocab)
    rng = random.Random(seed)
    import numpy as np

    compile_s = []
    for name, schema in suite:
        start = time.perf_counter()
        m = backend.matcher(StructuredOutputsParams(json=schema))
        compile_s.append(time.perf_counter() - start)
        for _ in range(tokens_per_schema):
            mask = backend.fill_bitmask([m])[0]
            bits = np.unpackbits(mask.view(np.uint8), bitorder="little")[:vocab]
            allowed = np.flatnonzero(bits)
            if m.done or len(allowed) == 0:
                break
            m.accept(int(allowed[rng.randrange(len(allowed))]))
            if m.done:
                break
    times = sorted(backend.mask_seconds)
    q = lambda f: times[min(len(times) - 1, int(f * len(times)))] * 1e6  # noqa: E731
    return {"vocab": vocab, "masks": len(times), "p50_us": round(q(0.5), 1), "p99_us": round(q(0.99), 1),
            "max_us": round(times[-1] * 1e6, 1), "compile_p50_ms": round(statistics.median(compile_s) * 1e3, 2),
            "compile_max_ms": round(max(compile_s) * 1e3, 2)}


def step_times(model_path: Path, repeats: int, max_tokens: int) -> dict:
    from mlx_ferrum import load
    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.engine import Engine, SamplingParams, StructuredOutputsParams

    model, tok = load(str(model_path))
    eng = Engine(model, tok, RuntimeConfig(kv_layout="paged", max_num_seqs=8))
    spec = StructuredOutputsParams(regex=f"[a-z ]{{{max_tokens * 4}}}")

    def run(constrained: bool) -> float:
        params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, ignore_eos=True,
                                 structured_outputs=spec if constrained else None) for s in range(8)]
        steps = eng.num_steps
        start = time.perf_counter()
        outs = eng.generate([PROMPTS[s % len(PROMPTS)] for s in range(8)], params)
        seconds = time.perf_counter() - start
        assert all(len(o.token_ids) == max_tokens for o in outs), [o.finish_reason for o in outs]
        return seconds / (eng.num_steps - steps)

    run(False), run(True)  # warm-up (traces, grammar compile)
    free, constrained = [], []
    for i in range(repeats):  # alternating, each side first every other time
        if i % 2:
            constrained.append(run(True))
            free.append(run(False))
        else:
            free.append(run(False))
            constrained.append(run(True))
    f, c = statistics.median(free), statistics.median(constrained)
    # on a shared machine other processes only ever add time: the fastest run of each side
    # and the median of the paired (back-to-back) ratios are the steadier estimates
    paired = statistics.median(cc / ff for ff, cc in zip(free, constrained))
    return {"rows": 8, "tokens": max_tokens, "free_step_ms": round(f * 1e3, 3), "constrained_step_ms": round(c * 1e3, 3),
            "ratio": round(c / f, 3), "free_min_ms": round(min(free) * 1e3, 3),
            "constrained_min_ms": round(min(constrained) * 1e3, 3), "ratio_of_minimums": round(min(constrained) / min(free), 3),
            "paired_ratio_median": round(paired, 3), "free_all_ms": [round(x * 1e3, 3) for x in free],
            "constrained_all_ms": [round(x * 1e3, 3) for x in constrained]}


def speculative_times(model_path: Path, repeats: int, max_tokens: int) -> dict:
    """Constrained greedy requests, one at a time (where speculation pays), with and
    without n-gram speculation: tokens per second of each side, alternating, and the
    outputs of the two sides compared (they must be token-identical)."""
    from mlx_ferrum import load
    from mlx_ferrum.config import RuntimeConfig
    from mlx_ferrum.engine import Engine, SamplingParams, StructuredOutputsParams

    model, tok = load(str(model_path))
    engines = {name: Engine(model, tok, RuntimeConfig(kv_layout="paged", speculative=spec))
               for name, spec in (("plain", None), ("ngram", "ngram"))}
    story = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 40},
                                              "story": {"type": "string", "maxLength": 4 * max_tokens}},
             "required": ["title", "story"], "additionalProperties": False}
    specs = [StructuredOutputsParams(json=story), StructuredOutputsParams(regex=f"([a-z]+[ ,.]){{8,{max_tokens}}}"),
             StructuredOutputsParams(json_object=True)]
    work = [(PROMPTS[i % len(PROMPTS)], SamplingParams(temperature=0.0, max_tokens=max_tokens,
                                                       structured_outputs=specs[i % len(specs)])) for i in range(6)]

    def run(name: str) -> tuple[float, list]:
        eng = engines[name]
        start, tokens, outs = time.perf_counter(), 0, []
        for prompt, params in work:
            out = eng.generate([prompt], params)[0]
            tokens += len(out.token_ids)
            outs.append(out.token_ids)
        return tokens / (time.perf_counter() - start), outs

    run("plain"), run("ngram")  # warm-up (traces, grammar compile)
    rates: dict[str, list] = {"plain": [], "ngram": []}
    identical = True
    for i in range(repeats):  # alternating, each side first every other time
        order = ("plain", "ngram") if i % 2 == 0 else ("ngram", "plain")
        got = {}
        for name in order:
            rate, got[name] = run(name)
            rates[name].append(rate)
        identical = identical and got["plain"] == got["ngram"]
    ratios = sorted(n / p for p, n in zip(rates["plain"], rates["ngram"]))
    spec = engines["ngram"].stats()
    return {"requests": len(work), "max_tokens": max_tokens, "identical_outputs": identical,
            "plain_tokens_per_s": round(statistics.median(rates["plain"]), 1),
            "ngram_tokens_per_s": round(statistics.median(rates["ngram"]), 1),
            "ratio_median": round(statistics.median(ratios), 3), "ratio_min": round(ratios[0], 3),
            "ratio_max": round(ratios[-1], 3), "spec_acceptance_rate": spec.get("spec_acceptance_rate"),
            "spec_mean_accepted_length": spec.get("spec_mean_accepted_length")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--clients", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--quick", action="store_true", help="a smoke test: 12 schemas, 4 clients, 8K vocabulary")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--step-only", action="store_true", help="only the engine step time (measurement 4)")
    ap.add_argument("--mc", type=int, default=0, metavar="N",
                    help="only the multiple-choice loglikelihood task of N items (benchmarks/mc_task.py)")
    ap.add_argument("--speculative", action="store_true",
                    help="only constrained greedy requests with vs without n-gram speculation")
    args = ap.parse_args(argv)
    if args.speculative:
        print_header("structured output under speculation", {"requests": 6})
        s = speculative_times(args.model, args.repeats, 32 if args.quick else 128)
        print(json.dumps(s, indent=2))
        if args.json:
            args.json.write_text(json.dumps(s, indent=2))
        return 0 if s["identical_outputs"] else 1
    if args.mc:
        from mc_task import run as run_mc

        result = run_mc(args.model, args.mc)
        print(json.dumps(result, indent=2))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return 0 if result["choices_equal"] == result["items"] and result["max_abs_diff"] <= 1e-4 else 1
    if args.step_only:
        s = step_times(args.model, args.repeats, 32 if args.quick else 128)
        print(json.dumps(s, indent=2))
        if args.json:
            args.json.write_text(json.dumps(s, indent=2))
        return 0
    suite = schemas()
    if args.quick:
        suite, args.clients, args.vocab, args.repeats = suite[::10], 4, 8000, 1
    info = print_header("structured output", {"schemas": len(suite), "clients": args.clients})
    result = {"machine": info, "command": " ".join([sys.executable] + sys.argv)}
    with tempfile.TemporaryDirectory() as tmp:
        server = Server(args.model, args.clients, Path(tmp))
        try:
            result["validity"] = validity(server.url, suite, args.max_tokens)
            result["concurrent"] = asyncio.run(_concurrent(server.url, suite, args.max_tokens, args.clients))
        finally:
            server.stop()
    v, c = result["validity"]["counts"], result["concurrent"]
    print_table(["run", "valid", "invalid", "unfinished", "unconstrained = solo"],
                [["1 client", v["valid"], v["invalid"], v["unfinished"], "-"],
                 [f"{args.clients} clients, mixed", c["valid"], c["invalid"], c["unfinished"],
                  f"{c['free_equal']}/{c['free_equal'] + c['free_different']}"]])
    for name, finish, text in result["validity"]["failures"]:
        print(f"  not valid: {name} ({finish}): {text!r}")
    result["mask"] = mask_times(suite, args.vocab, 64)
    m = result["mask"]
    print_table(["vocab", "masks", "p50 µs", "p99 µs", "max µs", "compile p50 ms", "compile max ms"],
                [[m["vocab"], m["masks"], m["p50_us"], m["p99_us"], m["max_us"], m["compile_p50_ms"], m["compile_max_ms"]]])
    result["step"] = step_times(args.model, args.repeats, 32 if args.quick else 128)
    s = result["step"]
    print_table(["rows", "tokens each", "unconstrained ms/step", "8/8 constrained ms/step", "ratio",
                 "fastest runs ms/step", "ratio of fastest", "median paired ratio"],
                [[s["rows"], s["tokens"], s["free_step_ms"], s["constrained_step_ms"], s["ratio"],
                  f"{s['free_min_ms']} / {s['constrained_min_ms']}", s["ratio_of_minimums"], s["paired_ratio_median"]]])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
