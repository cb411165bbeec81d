"""Serving benchmark: an asyncio load generator for any OpenAI-compatible server, and a
compare mode that runs ``mlx-ferrum serve`` and ``mlx_lm.server`` on the same checkpoint.

Usage::

    # drive a running server
    python benchmarks/bench_serving.py --url http://127.0.0.1:8000 --model-name stories --tokenizer ../shared/models/stories260K

    # start each server in turn (127.0.0.1, a free port), same workloads, ratios at the end
    python benchmarks/bench_serving.py --compare --model ../shared/models/stories260K
    python benchmarks/bench_serving.py --compare --model qwen-0.5b-shape --sides ferrum-pc0,ferrum-pc1
    python benchmarks/bench_serving.py --compare --quick          # a small run of both workloads (< 2 min)

Workloads (both streamed, greedy, so both servers produce the same tokens):

- ``random``: ``--num-clients`` concurrent clients send ``--num-requests`` completions in
  all, each a prompt of a random length in ``[--min-prompt-tokens, --max-prompt-tokens]``
  (seeded, the same prompts for every server) and ``--max-tokens`` output tokens.
- ``chat``: ``--chat-requests`` chat completions from ``--num-clients`` concurrent
  clients, each request one shared system text of about 110 English words (about 300
  tokens of stories260K's tokenizer; the same for every request, as a deployed
  assistant's instructions are) and a short unique question, ``--chat-max-tokens`` output tokens. This is the workload of the
  "defaults against defaults" comparison (``--sides ferrum,mlx_lm-default``).
  ``--chat-system passage --system-words N`` takes the system text from the first ``N``
  words of ``benchmarks/data/public_domain_passages.txt`` instead (real English, about
  1.3 tokens a word with SmolLM2's tokenizer); ``--distinct-system`` gives every request
  its own ``N``-word window of that text (each starting at another word, so no two
  requests share a prefix beyond the template's first tokens), and then measures three
  more requests one at a time, on windows no workload request used, for the time to
  first token of a request alone (``solo TTFT``).
- ``shared-prefix``: ``--num-clients`` chat clients, each holding a ``--turns``-turn
  conversation whose first message is one long system prompt (``--system-tokens``)
  shared by every client; each turn sends the whole history plus a new user message
  and appends the reply, so prefix caching decides how much prompt is recomputed.

Per run: request throughput, output tok/s (``usage.completion_tokens`` over the wall
time of the workload), TTFT and inter-token latency (gaps between streamed chunks that
carry text) p50/p99, end-to-end latency p50/p99, and failed requests (HTTP errors,
dropped connections, timeouts; there are no client retries).

Compare mode runs, per repeat, every side in turn (the order alternates between
repeats, so load from other processes hits all sides). Sides: ``ferrum`` is
``mlx-ferrum serve`` with no flag and no ``FERRUM_*`` variable (its defaults: paged KV,
prefix caching on, max_num_seqs 32); ``ferrum-pc0`` / ``ferrum-pc1`` force prefix
caching off / on and set ``--max-num-seqs`` to the client count; ``mlx_lm-default`` is
``mlx_lm.server`` with no flag (its prompt cache is always on); ``mlx_lm`` sets its
``--decode-concurrency`` to the client count. Each run starts a fresh server,
sends a small untimed warm-up, runs both workloads and stops the server. Figures are
medians over ``--repeats``; each ratio is printed with the min-max of the per-repeat
ratios. Both servers get the same chat template: by default a plain ``role: content``
one, given to mlx-ferrum as ``--chat-template FILE`` and to mlx_lm.server as
``--chat-template``, since the test checkpoints carry none; with ``--chat-template model``
neither gets the flag, so each renders the checkpoint's own template (what a chat
front end meets).

``--model qwen-0.5b-shape`` builds (once, under $TMPDIR) the random-weight checkpoint
with Qwen2.5-0.5B's shapes from ``benchmarks/common.py`` except the vocabulary: a
byte-level BPE trained to 32768 ids (``write_bpe_tokenizer``) whose
``tokenizer_config.json`` names ``PreTrainedTokenizerFast``, so transformers (inside
mlx_lm.server) reads ``tokenizer.json`` as written, as mlx-ferrum does. Before any
server starts, compare mode checks that both tokenizers give the same ids for the
workload's prompts and aborts if not. Every load loop is bounded:
``--num-requests`` and ``--turns`` fix the request count and ``--run-timeout`` the time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import httpx  # noqa: E402

from common import OPENBLAS_PATH, QWEN25_05B_CONFIG, cached_random_checkpoint, openblas_preloaded, print_header  # noqa: E402

PLAIN_TEMPLATE = (
    "{{ bos_token or '' }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


# --------------------------------------------------------------------------- prompts
def _prompt_text(tokenizer, rng: random.Random, n_tokens: int) -> str:
    """About ``n_tokens`` tokens of text: random ordinary ids decoded (byte and special ids skipped)."""
    vocab = tokenizer.backend.get_vocab_size()
    low = 259 if vocab > 259 + 100 else 3  # SentencePiece byte-fallback models keep ids 3..258 for bytes
    ids = [rng.randrange(low, vocab) for _ in range(n_tokens)]
    return tokenizer.decode(ids).strip()


CHAT_SYSTEM_TEXT = (
    "You are a kind helper who tells short stories to children. Every story has a little girl "
    "or a little boy, a friendly animal, and a happy ending. Use simple words and short sentences. "
    "The stories happen in a park, a garden, a forest, a farm or by the sea. Somebody feels sad or "
    "scared at first, and then a friend helps, and everybody learns to share, to be brave or to be "
    "kind. Nobody gets hurt. The sun shines, the birds sing, and the trees are big and green. "
    "Start with once upon a time. End with what everybody learned, and say that they were all very "
    "happy. Answer the question of the child in a story of a few lines."
)
CHAT_ANIMALS = ("dog", "cat", "bird", "fish", "frog", "bunny", "duck", "bear", "lion", "horse", "cow", "mouse")
CHAT_PLACES = ("park", "garden", "forest", "farm", "house", "sea", "school", "shop")


def chat_questions(n: int) -> list[str]:
    """``n`` distinct short questions (deterministic)."""
    return [f"Question {i}: what did the {CHAT_ANIMALS[i % len(CHAT_ANIMALS)]} find in the "
            f"{CHAT_PLACES[(i // len(CHAT_ANIMALS)) % len(CHAT_PLACES)]}?" for i in range(n)]


PASSAGES = Path(__file__).resolve().parent / "data" / "public_domain_passages.txt"


def passage_windows(num_words: int, count: int) -> list[str]:
    """``count`` texts of ``num_words`` words of real English, each starting at a different
    word of ``benchmarks/data/public_domain_passages.txt`` (wrapping around its end), so
    no two share their first words: prompts with no common prefix."""
    words = PASSAGES.read_text().split()
    stride = max(1, len(words) // max(count, 1))
    doubled = words + words
    return [" ".join(doubled[i * stride % len(words):][:num_words]) for i in range(count)]


@dataclass
class Workload:
    name: str
    # random: list of prompts; shared-prefix: system prompt and each client's user turns
    prompts: list[str] = field(default_factory=list)
    system: str = ""
    turns: list[list[str]] = field(default_factory=list)
    max_tokens: int = 32
    num_clients: int = 32
    # chat with --distinct-system: one system text per request, and the solo probes' texts
    systems: list[str] = field(default_factory=list)
    solo_systems: list[str] = field(default_factory=list)


def build_workloads(args, tokenizer) -> list[Workload]:
    rng = random.Random(args.seed)
    out = []
    if args.workload in ("random", "both"):
        prompts = [_prompt_text(tokenizer, rng, rng.randint(args.min_prompt_tokens, args.max_prompt_tokens))
                   for _ in range(args.num_requests)]
        out.append(Workload("random", prompts=prompts, max_tokens=args.max_tokens, num_clients=args.num_clients))
    if args.workload == "chat":
        system, systems, solo = CHAT_SYSTEM_TEXT, [], []
        if args.chat_system == "passage":
            windows = passage_windows(args.system_words, args.chat_requests + SOLO_PROBES)
            system = windows[0]
            if args.distinct_system:
                systems, solo = windows[:args.chat_requests], windows[args.chat_requests:]
        out.append(Workload("chat", prompts=chat_questions(args.chat_requests), system=system, systems=systems,
                            solo_systems=solo, max_tokens=args.chat_max_tokens, num_clients=args.num_clients))
    if args.workload in ("shared-prefix", "both"):
        system = _prompt_text(tokenizer, rng, args.system_tokens)
        turns = [[_prompt_text(tokenizer, rng, args.user_tokens) for _ in range(args.turns)] for _ in range(args.num_clients)]
        out.append(Workload("shared-prefix", system=system, turns=turns, max_tokens=args.max_tokens, num_clients=args.num_clients))
    return out


# ------------------------------------------------------------------------ the client
@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    text: str = ""
    error: str = ""


async def _stream_one(client: httpx.AsyncClient, url: str, body: dict, chat: bool) -> RequestResult:
    start = time.perf_counter()
    last = None
    first = None
    gaps: list[float] = []
    pieces: list[str] = []
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return RequestResult(False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return RequestResult(False, error=str(chunk["error"])[:200])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                for c in chunk.get("choices") or []:
                    piece = (c.get("delta") or {}).get("content") if chat else c.get("text")
                    if piece:
                        now = time.perf_counter()
                        if first is None:
                            first = now
                        else:
                            gaps.append(now - last)
                        last = now
                        pieces.append(piece)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        return RequestResult(False, error=f"{type(e).__name__}: {e}"[:200])
    end = time.perf_counter()
    if first is None:
        return RequestResult(False, error="no text streamed")
    return RequestResult(True, ttft=first - start, e2e=end - start, itl=gaps,
                         output_tokens=usage_tokens if usage_tokens is not None else len(pieces), text="".join(pieces))


async def run_workload(base_url: str, model_name: str, w: Workload, request_timeout: float, run_timeout: float) -> dict:
    """Drive one workload against ``base_url``; returns the summary dict."""
    limits = httpx.Limits(max_connections=w.num_clients + 4, max_keepalive_connections=w.num_clients + 4)
    results: list[RequestResult] = []
    common = {"model": model_name, "max_tokens": w.max_tokens, "temperature": 0.0, "stream": True,
              "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=request_timeout, limits=limits) as client:
        t0 = time.perf_counter()
        if w.name == "chat":
            queue = list(enumerate(w.prompts))

            async def worker():
                while queue:
                    i, question = queue.pop(0)
                    system = w.systems[i] if w.systems else w.system
                    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
                    results.append(await _stream_one(client, base_url + "/v1/chat/completions",
                                                     dict(common, messages=messages), chat=True))

            tasks = [worker() for _ in range(w.num_clients)]
        elif w.name == "random":
            queue = list(enumerate(w.prompts))

            async def worker():
                while queue:
                    _, prompt = queue.pop(0)
                    results.append(await _stream_one(client, base_url + "/v1/completions", dict(common, prompt=prompt), chat=False))

            tasks = [worker() for _ in range(w.num_clients)]
        else:
            async def chat_client(turns: list[str]):
                history = [{"role": "system", "content": w.system}]
                for user in turns:
                    history.append({"role": "user", "content": user})
                    res = await _stream_one(client, base_url + "/v1/chat/completions", dict(common, messages=history), chat=True)
                    results.append(res)
                    if not res.ok:
                        return
                    history.append({"role": "assistant", "content": res.text})

            tasks = [chat_client(t) for t in w.turns]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), timeout=run_timeout)
            timed_out = False
        except asyncio.TimeoutError:
            timed_out = True
        wall = time.perf_counter() - t0
        expected = len(w.prompts) if w.name in ("random", "chat") else sum(len(t) for t in w.turns)
        summary = summarize(results, wall, expected, timed_out)
        if w.solo_systems:  # after the load: one request at a time, prompts nobody sent before
            solo = []
            for system in w.solo_systems:
                messages = [{"role": "system", "content": system}, {"role": "user", "content": w.prompts[0]}]
                res = await _stream_one(client, base_url + "/v1/chat/completions", dict(common, messages=messages), chat=True)
                if res.ok:
                    solo.append(res.ttft)
            summary["solo_ttft"] = statistics.median(solo) if solo else float("nan")
            summary["ttft_p50_over_solo"] = summary["ttft_p50"] / summary["solo_ttft"] if solo else float("nan")
    return summary


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    ys = sorted(xs)
    return ys[min(len(ys) - 1, int(round(q * (len(ys) - 1))))]


def summarize(results: list[RequestResult], wall: float, expected: int, timed_out: bool) -> dict:
    ok = [r for r in results if r.ok]
    itl = [g for r in ok for g in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": expected - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:3] + (["run timeout"] if timed_out else []),
        "wall_s": wall,
        "request_throughput": len(ok) / wall,
        "output_tok_s": out_tokens / wall,
        "output_tokens": out_tokens,
        "ttft_p50": _pct([r.ttft for r in ok], 0.5),
        "ttft_p99": _pct([r.ttft for r in ok], 0.99),
        "itl_p50": _pct(itl, 0.5),
        "itl_p99": _pct(itl, 0.99),
        "e2e_p50": _pct([r.e2e for r in ok], 0.5),
        "e2e_p99": _pct([r.e2e for r in ok], 0.99),
    }


#: Requests sent one at a time after a ``--distinct-system`` workload (solo TTFT).
SOLO_PROBES = 3


# ----------------------------------------------------------------------- the servers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Side:
    label: str
    kind: str  # "ferrum" or "mlx_lm"
    env: dict = field(default_factory=dict)
    defaults: bool = False  # no flag beyond model, address, name and template

    @property
    def model_name(self) -> str:
        # mlx_lm.server loads any other name from the Hub; "default_model" means its --model
        return "default_model" if self.kind == "mlx_lm" else "bench"


def _server_command(side: Side, model: Path, port: int, template_file: Optional[Path], args) -> list[str]:
    if side.kind == "ferrum":
        cmd = [sys.executable, "-m", "mlx_ferrum", "serve", "--model", str(model), "--host", "127.0.0.1",
               "--port", str(port), "--served-model-name", "bench", "--log-level", "warning"]
        if template_file is not None:
            cmd += ["--chat-template", str(template_file)]
        return cmd if side.defaults else cmd + ["--max-num-seqs", str(max(args.num_clients, 1))]
    cmd = [sys.executable, "-m", "mlx_lm", "server", "--model", str(model), "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "WARNING"]
    if template_file is not None:
        cmd += ["--chat-template", template_file.read_text()]
    return cmd if side.defaults else cmd + ["--decode-concurrency", str(max(args.num_clients, 1))]


class ServerRun:
    """One server process on 127.0.0.1, stopped (SIGINT, then SIGKILL) on exit."""

    def __init__(self, side: Side, model: Path, template_file: Optional[Path], args, log_dir: Path):
        self.side, self.port = side, _free_port()
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""), **side.env)
        if side.defaults:  # the product's defaults: no FERRUM_* variable from the caller either
            env = {k: v for k, v in env.items() if not k.startswith("FERRUM_")}
        self.log = log_dir / f"{side.label.replace(' ', '_').replace('=', '')}-{self.port}.log"
        self._fh = open(self.log, "w")
        self.proc = subprocess.Popen(_server_command(side, model, self.port, template_file, args), stdout=self._fh,
                                     stderr=subprocess.STDOUT, env=env, cwd=str(REPO))
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.side.label} exited with {self.proc.returncode}; log: {self.log}")
            try:
                if httpx.get(self.url + "/v1/models", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise RuntimeError(f"{self.side.label} did not start in {timeout} s; log: {self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._fh.close()


def _warmup(url: str, model_name: str, args, prompt: str) -> None:
    body = {"model": model_name, "prompt": prompt, "max_tokens": 4, "temperature": 0.0}
    for _ in range(2):
        httpx.post(url + "/v1/completions", json=body, timeout=args.request_timeout)


def run_side(side: Side, model: Path, template_file: Optional[Path], workloads: list[Workload], args, log_dir: Path,
             warmup_prompt: str) -> dict:
    server = ServerRun(side, model, template_file, args, log_dir)
    try:
        server.wait_ready(args.startup_timeout)
        _warmup(server.url, side.model_name, args, warmup_prompt)
        res = {}
        for w in workloads:
            res[w.name] = asyncio.run(run_workload(server.url, side.model_name, w, args.request_timeout, args.run_timeout))
        return res
    finally:
        server.stop()


# ----------------------------------------------------------------------- reporting
COLUMNS = [("request_throughput", "req/s", "{:.2f}"), ("output_tok_s", "out tok/s", "{:.1f}"),
           ("ttft_p50", "TTFT p50 s", "{:.3f}"), ("ttft_p99", "TTFT p99 s", "{:.3f}"),
           ("itl_p50", "ITL p50 ms", "{:.1f}"), ("itl_p99", "ITL p99 ms", "{:.1f}"),
           ("e2e_p50", "E2E p50 s", "{:.2f}"), ("e2e_p99", "E2E p99 s", "{:.2f}"), ("output_tokens", "out tokens", "{:.0f}"),
           ("failed", "failed", "{}")]


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def print_results(workload: str, per_side: dict[str, list[dict]]) -> None:
    print(f"\n-- workload: {workload} (medians over {len(next(iter(per_side.values())))} runs; failed = total)")
    print("| server | " + " | ".join(c[1] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 1) + "|")
    for label, runs in per_side.items():
        cells = []
        for key, _, fmt in COLUMNS:
            if key == "failed":
                cells.append(str(sum(r["failed"] for r in runs)))
                continue
            v = _median(runs, key)
            cells.append(fmt.format(v * 1000 if key.startswith("itl") else v))
        print(f"| {label} | " + " | ".join(cells) + " |")
    errors = {e for runs in per_side.values() for r in runs for e in r["errors"]}
    if errors:
        print("   errors seen:", "; ".join(sorted(errors))[:600])


def print_ratios(workload: str, per_side: dict[str, list[dict]], baseline: str) -> None:
    base = per_side[baseline]
    for label, runs in per_side.items():
        if label == baseline:
            continue
        for key, name, higher_better in (("output_tok_s", "output tok/s", True), ("ttft_p50", "TTFT p50", False)):
            per_repeat = [a[key] / b[key] for a, b in zip(runs, base) if b[key] > 0]
            denominator = _median(base, key)
            ratio = _median(runs, key) / denominator if denominator > 0 else float("nan")
            spread = f"{min(per_repeat):.2f}-{max(per_repeat):.2f}" if per_repeat else "n/a"
            better = "higher is better" if higher_better else "lower is better"
            print(f"   {workload:<13} {name:<12} {label} / {baseline} = {ratio:.2f}x (per-repeat {spread}; {better})")


# ----------------------------------------------------------------------------- main
#: Vocabulary of the ``qwen-0.5b-shape`` checkpoint: a byte-level BPE trained to 32768 ids
#: (Qwen2.5-0.5B has 151936; training that many merges needs far more text than a benchmark
#: should generate). Every other shape is Qwen2.5-0.5B's.
QWEN_SHAPE_VOCAB = 32768


def _resolve_model(name: str) -> Path:
    if name == "qwen-0.5b-shape":
        # no bos_token_id: transformers keeps tokenizer_config.json's null bos_token, while mlx-ferrum
        # would fall back to generation_config.json's id and render it through `bos_token`
        config = dict(QWEN25_05B_CONFIG, vocab_size=QWEN_SHAPE_VOCAB, bos_token_id=None, eos_token_id=0)
        return cached_random_checkpoint("qwen2.5-0.5b-shape-bpe32k", config, "float32", tokenizer_kind="bpe")
    return Path(name).resolve()


def _chat_ids_transformers(hf_tokenizer, messages: list[dict], template: Optional[str]) -> list[int]:
    out = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, chat_template=template)
    if hasattr(out, "keys"):  # transformers 5 returns a BatchEncoding
        out = out["input_ids"]
    return list(out)


def check_tokenizer_parity(model: Path, tokenizer, workloads: list[Workload], template: Optional[str]) -> None:
    """Abort unless transformers' ``AutoTokenizer`` (what mlx_lm.server loads) and
    mlx-ferrum's tokenizer turn the workload's chats and prompts into the same ids, so
    both servers compute the same prompts.

    Raises:
        SystemExit: on the first mismatch, naming the prompt.
    """
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(model))
    checks: list[tuple[str, list[int], list[int]]] = []
    for w in workloads:
        for i, prompt in enumerate(w.prompts):
            if w.name == "chat":
                system = w.systems[i] if w.systems else w.system
                messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
                checks.append((f"chat request {i}", _chat_ids_transformers(hf, messages, template),
                               tokenizer.apply_chat_template(messages, tokenize=True, chat_template=template)))
            else:
                checks.append((f"random prompt {i}", list(hf.encode(prompt)), tokenizer.encode(prompt)))
        for i, turns in enumerate(w.turns):
            messages = [{"role": "system", "content": w.system}, {"role": "user", "content": turns[0]}]
            if len(turns) > 1:  # a reply in the history, as from the second turn on
                messages += [{"role": "assistant", "content": turns[-1]}, {"role": "user", "content": turns[1]}]
            checks.append((f"chat {i}", _chat_ids_transformers(hf, messages, template),
                           tokenizer.apply_chat_template(messages, tokenize=True, chat_template=template)))
    for name, hf_ids, ferrum_ids in checks:
        if hf_ids != ferrum_ids:
            raise SystemExit(f"tokenizer mismatch on {name}: transformers gives {len(hf_ids)} ids {hf_ids[:12]}..., "
                             f"mlx-ferrum {len(ferrum_ids)} ids {ferrum_ids[:12]}...; the servers would see different "
                             f"prompts: use a checkpoint whose tokenizer_config.json names its tokenizer_class")
    print(f"   tokenizer parity: transformers and mlx-ferrum agree on {len(checks)} prompts")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default=None, help="an OpenAI-compatible server to drive (no --compare)")
    ap.add_argument("--model-name", default="bench", help="'model' sent with --url")
    ap.add_argument("--tokenizer", default=None, help="checkpoint folder whose tokenizer builds the prompts (with --url)")
    ap.add_argument("--compare", action="store_true", help="start mlx-ferrum serve and mlx_lm.server in turn")
    ap.add_argument("--model", default=str(REPO.parent / "shared" / "models" / "stories260K"),
                    help="checkpoint folder for --compare, or 'qwen-0.5b-shape'")
    ap.add_argument("--sides", default="ferrum-pc0,ferrum-pc1,mlx_lm",
                    help="comma list of ferrum (defaults), ferrum-pc0, ferrum-pc1, mlx_lm-default, mlx_lm")
    ap.add_argument("--workload", default="both", choices=["random", "shared-prefix", "both", "chat"])
    ap.add_argument("--chat-requests", type=int, default=96, help="requests of the chat workload")
    ap.add_argument("--chat-max-tokens", type=int, default=64, help="output tokens per chat request")
    ap.add_argument("--chat-system", default="stories", choices=["stories", "passage"],
                    help="chat workload's system text: the ~110-word stories instructions, or --system-words "
                         "words of benchmarks/data/public_domain_passages.txt")
    ap.add_argument("--system-words", type=int, default=750, help="words of the passage system text")
    ap.add_argument("--distinct-system", action="store_true",
                    help="chat workload: every request its own passage window (no shared prefix), then solo TTFT")
    ap.add_argument("--chat-template", default="plain", choices=["plain", "model"],
                    help="plain: the same role: content template for both servers; model: the checkpoint's own")
    ap.add_argument("--num-clients", type=int, default=32)
    ap.add_argument("--num-requests", type=int, default=64, help="requests of the random workload")
    ap.add_argument("--min-prompt-tokens", type=int, default=16)
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--system-tokens", type=int, default=256, help="shared system prompt of the shared-prefix workload")
    ap.add_argument("--user-tokens", type=int, default=16)
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--run-timeout", type=float, default=900.0, help="bound on one workload run (s)")
    ap.add_argument("--startup-timeout", type=float, default=180.0)
    ap.add_argument("--json", default=None, help="also write the raw results here")
    ap.add_argument("--quick", action="store_true", help="8 clients, 16 requests, 2 turns, 1 repeat")
    ap.add_argument("--openblas", default="auto", choices=["auto", "on", "off"],
                    help="auto/on: preload OpenBLAS (servers inherit it) when installed")
    args = ap.parse_args(argv)
    if args.quick:
        args.num_clients, args.num_requests, args.turns, args.repeats = 8, 16, 2, 1
        args.max_prompt_tokens, args.system_tokens, args.max_tokens = 96, 96, 16
        args.chat_requests, args.chat_max_tokens = 16, 16
    return args


def _maybe_reexec_with_openblas(args) -> None:
    want = args.openblas in ("auto", "on") and os.path.exists(OPENBLAS_PATH)
    if want and not openblas_preloaded() and os.environ.get("LD_PRELOAD", "") != OPENBLAS_PATH:
        os.environ["LD_PRELOAD"] = OPENBLAS_PATH
        os.execv(sys.executable, [sys.executable, *sys.argv])
    if args.openblas == "off" and os.environ.get("LD_PRELOAD"):
        os.environ.pop("LD_PRELOAD")


def main(argv=None) -> int:
    args = parse_args(argv)
    _maybe_reexec_with_openblas(args)
    from mlx_ferrum.tokenizer import Tokenizer

    if not args.compare:
        if args.url is None or args.tokenizer is None:
            print("error: give --url and --tokenizer, or --compare", file=sys.stderr)
            return 2
        workloads = build_workloads(args, Tokenizer.from_pretrained(args.tokenizer))
        print_header("bench_serving: " + args.url, {"workloads": [w.name for w in workloads], "clients": args.num_clients})
        for w in workloads:
            res = asyncio.run(run_workload(args.url.rstrip("/"), args.model_name, w, args.request_timeout, args.run_timeout))
            print_results(w.name, {args.url: [res]})
        return 0

    model = _resolve_model(args.model)
    tokenizer = Tokenizer.from_pretrained(model)
    workloads = build_workloads(args, tokenizer)
    # words of the model's own vocabulary: a word-level tokenizer maps others to nothing useful
    warmup_prompt = _prompt_text(tokenizer, random.Random(args.seed + 1), 8)
    all_sides = {"ferrum": Side("mlx-ferrum defaults", "ferrum", defaults=True),
                 "ferrum-pc0": Side("mlx-ferrum prefix-cache=0", "ferrum", {"FERRUM_PREFIX_CACHE": "0"}),
                 "ferrum-pc1": Side("mlx-ferrum prefix-cache=1", "ferrum", {"FERRUM_PREFIX_CACHE": "1"}),
                 "mlx_lm-default": Side("mlx_lm.server defaults", "mlx_lm", defaults=True),
                 "mlx_lm": Side("mlx_lm.server", "mlx_lm")}
    sides = [all_sides[s] for s in args.sides.split(",")]
    template = PLAIN_TEMPLATE if args.chat_template == "plain" else None
    if any(s.kind == "mlx_lm" for s in sides):
        check_tokenizer_parity(model, tokenizer, workloads, template)
    print_header("bench_serving --compare", {
        "model": model, "workloads": [w.name for w in workloads], "clients": args.num_clients,
        "random": f"{args.num_requests} requests, prompts {args.min_prompt_tokens}-{args.max_prompt_tokens} tokens",
        "shared-prefix": f"{args.num_clients} chats x {args.turns} turns, system {args.system_tokens} + user {args.user_tokens} tokens/turn",
        "chat": f"{args.chat_requests} requests from {args.num_clients} clients, "
                + ("one shared ~110-word system text" if args.chat_system == "stories" else
                   f"{'a distinct' if args.distinct_system else 'one shared'} {args.system_words}-word passage system text")
                + f" + a unique question, {args.chat_max_tokens} tokens each",
        "chat template": args.chat_template,
        "max_tokens": args.max_tokens, "repeats": args.repeats, "sides": [s.label for s in sides],
    })
    log_dir = Path(tempfile.mkdtemp(prefix="bench_serving_"))
    template_file = None
    if template is not None:
        template_file = log_dir / "template.jinja"
        template_file.write_text(template)
    raw: dict[str, dict[str, list[dict]]] = {w.name: {s.label: [] for s in sides} for w in workloads}
    for rep in range(args.repeats):
        order = sides if rep % 2 == 0 else list(reversed(sides))
        for side in order:
            t0 = time.perf_counter()
            res = run_side(side, model, template_file, workloads, args, log_dir, warmup_prompt)
            for name, r in res.items():
                raw[name][side.label].append(r)
            summary = ", ".join(f"{n}: {r['output_tok_s']:.0f} tok/s, {r['failed']} failed" for n, r in res.items())
            print(f"   repeat {rep + 1}/{args.repeats} {side.label}: {summary} ({time.perf_counter() - t0:.0f} s)", flush=True)
    baseline = next((s.label for s in sides if s.kind == "mlx_lm"), None)
    for name, per_side in raw.items():
        print_results(name, per_side)
    if baseline:
        print(f"\n-- ratios (mlx-ferrum / {baseline})")
        for name, per_side in raw.items():
            print_ratios(name, per_side, baseline)
    for name, per_side in raw.items():
        for label, runs in per_side.items():
            solo = [r["ttft_p50_over_solo"] for r in runs if "ttft_p50_over_solo" in r]
            if solo:
                print(f"   {name:<13} TTFT p50 under load / solo TTFT, {label}: {statistics.median(solo):.1f}x "
                      f"(per-repeat {min(solo):.1f}-{max(solo):.1f}; solo {statistics.median(r['solo_ttft'] for r in runs):.2f} s)")
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))
    print(f"\n   server logs: {log_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
