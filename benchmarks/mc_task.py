"""A multiple-choice loglikelihood task (lm-eval's ``loglikelihood`` request type), scored
two ways: through ``mlx-ferrum serve`` (``/v1/completions`` with ``echo: true``,
``logprobs`` and ``max_tokens: 0``) and with mlx-lm's own forward of the same checkpoint.

Items are built by a seeded generator from TinyStories-like sentence parts: a context and
four continuations, one coherent (the gold answer), one with a single word swapped for
another of its kind when the template has one (a close call), and the rest its words
shuffled with others. Each choice is scored lm-eval's way: context and continuation are tokenized
separately (the context with BOS, the continuation without special tokens) and joined,
and the choice's loglikelihood is the sum of the log-probabilities of the continuation's
tokens given everything before them (teacher forcing); the answer is the argmax.

``python benchmarks/mc_task.py [--model ../shared/models/stories260K] [--items 200] [--json FILE]``
prints the agreement of the two scorings (choices equal, largest loglikelihood gap).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = REPO.parent / "shared" / "models" / "stories260K"

NAMES = ["Lily", "Tom", "Sue", "Ben", "Mia", "Max", "Anna", "Sam", "Tim", "Lucy", "Jack", "Emma"]
PLACES = ["park", "garden", "beach", "forest", "house", "school", "river", "farm"]
ANIMALS = ["dog", "cat", "bird", "bunny", "duck", "frog", "fish", "bear"]
THINGS = ["ball", "toy", "box", "hat", "kite", "book", "cake", "car"]
COLOURS = ["red", "blue", "big", "little", "shiny", "happy", "green", "soft"]
FEELINGS = ["happy", "sad", "scared", "excited", "tired", "angry"]

#: (context, gold continuation) templates; ``{...}`` are filled from the lists above
TEMPLATES = [
    ("Once upon a time, there was a little girl named {name}. She loved to", " play in the {place} with her {animal}."),
    ("One day, {name} went to the {place}. There, {name} saw a", " {colour} {animal} that wanted to play."),
    ("{name} had a {colour} {thing}. Every day, {name} would", " play with the {thing} and smile."),
    ("The {animal} was very {feeling}. It ran to its mom and", " said, \"I am {feeling}, mom.\""),
    ("{name} and {friend} were best friends. They liked to", " go to the {place} and play together."),
    ("It was a sunny day. {name} wanted to go outside, so", " {name} put on a hat and went to the {place}."),
    ("{name} found a {thing} in the {place}. {name} was", " very {feeling} and showed it to mom."),
    ("Mom said, \"{name}, do not touch the {thing}.\" But {name}", " did not listen and touched the {thing}."),
]


def build_items(n: int = 200, seed: int = 0) -> list[dict]:
    """``n`` items, each ``{"context": str, "choices": [4 str], "gold": int}``, the same for
    the same ``n`` and ``seed`` (the first ``k`` items do not depend on ``n``)."""
    rng = random.Random(seed)
    items = []
    for i in range(n):
        context, gold = TEMPLATES[i % len(TEMPLATES)]
        name, friend = rng.sample(NAMES, 2)
        fill = dict(name=name, friend=friend, place=rng.choice(PLACES), animal=rng.choice(ANIMALS),
                    thing=rng.choice(THINGS), colour=rng.choice(COLOURS), feeling=rng.choice(FEELINGS))
        right = gold.format(**fill)
        words = right.split()
        # one close distractor: a single word of the same kind swapped (a small margin), and
        # two of the words shuffled with others (a large one)
        lists = dict(place=PLACES, animal=ANIMALS, thing=THINGS, colour=COLOURS, feeling=FEELINGS, name=NAMES)
        key = rng.choice([k for k in lists if "{" + k + "}" in gold])
        swapped = gold.format(**{**fill, key: rng.choice([w for w in lists[key] if w != fill[key]])})
        wrong = {swapped} if swapped != right else set()
        while len(wrong) < 3:
            pool = words + rng.sample(PLACES + ANIMALS + THINGS + COLOURS, 3)
            cand = " " + " ".join(rng.sample(pool, len(words)))
            if cand != right:
                wrong.add(cand)
        choices = [right] + sorted(wrong)
        order = list(range(4))
        rng.shuffle(order)
        items.append({"context": context.format(**fill), "choices": [choices[j] for j in order],
                      "gold": order.index(0)})
    return items


def token_ids(tokenizer, items: list[dict]) -> list[tuple[list[int], list[list[int]]]]:
    """Per item, ``(context ids, [continuation ids per choice])`` (lm-eval: encoded apart)."""
    return [(tokenizer.encode(it["context"]),
             [tokenizer.encode(c, add_special_tokens=False) for c in it["choices"]]) for it in items]


def score_server(url: str, model_name: str, encoded, clients: int = 4) -> list[list[float]]:
    """Per item, per choice, the continuation's summed loglikelihood from
    ``/v1/completions`` (one request per item: its four choices as token-id prompts,
    ``echo: true``, ``logprobs: 0``, ``max_tokens: 0``)."""
    import httpx

    def one(item):
        ctx, conts = item
        body = {"model": model_name, "prompt": [ctx + c for c in conts], "max_tokens": 0, "echo": True,
                "logprobs": 0, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=300)
        r.raise_for_status()
        choices = sorted(r.json()["choices"], key=lambda c: c["index"])
        return [sum(ch["logprobs"]["token_logprobs"][len(ctx):]) for ch in choices]

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, encoded))


def score_mlx_lm(model_path: Path, encoded) -> list[list[float]]:
    """The same loglikelihoods from mlx-lm's forward of the checkpoint (float32 log-softmax
    of the logits at each position, one sequence at a time)."""
    import mlx.core as mx
    from mlx_lm.utils import load_model

    model, _ = load_model(Path(model_path))
    out = []
    for ctx, conts in encoded:
        row = []
        for c in conts:
            ids = ctx + c
            logits = model(mx.array([ids]))[0].astype(mx.float32)
            logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            picked = logp[mx.arange(len(ctx) - 1, len(ids) - 1), mx.array(ids[len(ctx):])]
            row.append(mx.sum(picked).item())
        out.append(row)
    return out


def compare(ours: list[list[float]], theirs: list[list[float]], items: list[dict]) -> dict:
    """Agreement of two scorings: argmax choices equal, the largest per-choice gap, accuracy."""
    pick = lambda row: max(range(len(row)), key=row.__getitem__)  # noqa: E731
    a, b = [pick(r) for r in ours], [pick(r) for r in theirs]
    gap = max(abs(x - y) for r, s in zip(ours, theirs) for x, y in zip(r, s))
    margin = min(sorted(r)[-1] - sorted(r)[-2] for r in theirs)  # the closest call between the top two
    return {"items": len(items), "choices_equal": sum(x == y for x, y in zip(a, b)), "max_abs_diff": gap,
            "smallest_top_two_margin": margin,
            "accuracy_server": sum(x == it["gold"] for x, it in zip(a, items)) / len(items),
            "accuracy_mlx_lm": sum(y == it["gold"] for y, it in zip(b, items)) / len(items)}


def run(model_path: Path, n: int, url: str | None = None, clients: int = 4) -> dict:
    """Build ``n`` items, score them through a server (``url``, or one started here) and
    with mlx-lm; returns :func:`compare`'s dict plus both timings (seconds)."""
    sys.path.insert(0, str(REPO))
    from mlx_ferrum.tokenizer import Tokenizer

    items = build_items(n)
    encoded = token_ids(Tokenizer.from_pretrained(model_path), items)
    start = time.perf_counter()
    if url is None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from server_process import Server

        with tempfile.TemporaryDirectory() as tmp:
            server = Server(model_path, clients, Path(tmp))
            try:
                start = time.perf_counter()
                ours = score_server(server.url, "bench", encoded, clients)
            finally:
                server.stop()
    else:
        ours = score_server(url, "bench", encoded, clients)
    server_s = time.perf_counter() - start
    start = time.perf_counter()
    theirs = score_mlx_lm(model_path, encoded)
    result = compare(ours, theirs, items)
    result.update(server_s=round(server_s, 2), mlx_lm_s=round(time.perf_counter() - start, 2))
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--items", type=int, default=200)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    result = run(args.model, args.items, clients=args.clients)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    ok = result["choices_equal"] == result["items"] and result["max_abs_diff"] <= 1e-4
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
