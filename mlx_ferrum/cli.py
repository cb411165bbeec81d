"""The ``mlx-ferrum`` command line: ``generate``, ``chat``, ``bench``.

``generate`` writes only the generated text to stdout; statistics (prompt and decode
tokens per second, peak memory) go to stderr, so the output can be piped.
``python -m mlx_ferrum`` runs the same entry point.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .config import RuntimeConfig
from .errors import ChatTemplateError, FerrumError


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint folder or Hugging Face repo id")
    p.add_argument("--dtype", default=None, help="cast weights: float32, float16 or bfloat16")
    p.add_argument("--paged", action="store_true", help="use the paged KV cache (same as FERRUM_METAL_PAGED_KV=1)")


def _add_sampling_args(p: argparse.ArgumentParser, temp: float) -> None:
    p.add_argument("--max-tokens", "-m", type=int, default=256, help="most tokens to generate")
    p.add_argument("--temp", type=float, default=temp, help="temperature; 0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")


def _sampling(args) -> dict:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=list(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _config(args) -> RuntimeConfig:
    return RuntimeConfig(kv_layout="paged") if args.paged else RuntimeConfig()


def _load(args):
    from .api import load

    return load(args.model, dtype=args.dtype)


def cmd_generate(args) -> int:
    """Stream one completion to stdout; stats to stderr."""
    from .api import stream_generate

    model, tokenizer = _load(args)
    prompt = args.prompt
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        prompt = msgs
    last = None
    for chunk in stream_generate(model, tokenizer, prompt, config=_config(args), **_sampling(args)):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        last = chunk
    if last is not None:
        if args.newline:
            sys.stdout.write("\n")
        print(
            f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
            f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s | "
            f"peak memory: {last.peak_memory / 2**30:.3f} GiB | finish: {last.finish_reason}",
            file=sys.stderr,
        )
    return 0


def cmd_chat(args) -> int:
    """A multi-turn REPL with streaming replies; /reset, /exit; Ctrl-C stops a reply."""
    from .api import stream_generate

    model, tokenizer = _load(args)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    use_template = tokenizer.chat_template is not None
    if not use_template:
        print("[this model has no chat template: each turn continues the plain text]", file=sys.stderr)
    print("Type a message; /reset clears the conversation, /exit quits.", file=sys.stderr)
    while True:
        try:
            line = input(">> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        cmd = line.strip()
        if cmd in ("/exit", "/quit"):
            return 0
        if cmd == "/reset":
            messages = list(system)
            print("[conversation cleared]", file=sys.stderr)
            continue
        if not cmd:
            continue
        messages.append({"role": "user", "content": line})
        prompt = messages if use_template else "\n".join(m["content"] for m in messages)
        reply = []
        gen = stream_generate(model, tokenizer, prompt, config=_config(args), **_sampling(args))
        try:
            for chunk in gen:
                reply.append(chunk.text)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            gen.close()  # releases the reply's KV cache
            print("\n[stopped]", file=sys.stderr)
        except ChatTemplateError as e:
            print(f"\nerror: {e}", file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_bench(args) -> int:
    """Concurrent-request benchmark through the engine (see ``mlx_ferrum.bench``)."""
    from .bench import run_bench_cli

    return run_bench_cli(args)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mlx-ferrum``."""
    parser = argparse.ArgumentParser(prog="mlx-ferrum", description="LLM inference on MLX")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_model_args(g)
    g.add_argument("--prompt", "-p", required=True)
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--newline", action="store_true", help="end the output with a newline")
    _add_sampling_args(g, temp=0.0)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat")
    _add_model_args(c)
    c.add_argument("--system", default=None, help="system message")
    _add_sampling_args(c, temp=0.7)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="throughput at several concurrency levels")
    _add_model_args(b)
    b.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts")
    b.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (tokens)")
    b.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    b.add_argument("--compare", default=None, choices=["mlx-lm"], help="also run mlx-lm's BatchGenerator")
    b.set_defaults(func=cmd_bench)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``mlx-ferrum`` / ``python -m mlx_ferrum``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FerrumError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
