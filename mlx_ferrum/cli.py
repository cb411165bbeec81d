"""The ``mlx-ferrum`` command line: ``generate``, ``chat``, ``bench``, ``serve``.

``generate`` writes only the generated text to stdout; statistics (prompt and decode
tokens per second, peak memory) go to stderr, so the output can be piped; ``-p -``
reads the prompt from stdin. ``chat`` keeps the conversation within the context by
dropping its oldest turns (never the system message). No traceback reaches the user:
errors print one ``error: ...`` line (``chat`` then goes on).
``python -m mlx_ferrum`` runs the same entry point.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from .config import RuntimeConfig
from .errors import ChatTemplateError, FerrumError, PromptTooLongError


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


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, metavar="ngram|PATH",
                   help="speculative decoding: 'ngram' (prompt lookup) or a draft checkpoint sharing the "
                        "tokenizer (same as FERRUM_SPECULATIVE)")
    p.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   help="tokens proposed per step (same as FERRUM_NUM_SPECULATIVE_TOKENS; default 4)")


def _config(args) -> RuntimeConfig:
    overrides = {}
    if args.paged:
        overrides["kv_layout"] = "paged"
    if getattr(args, "speculative", None):
        overrides["speculative"] = args.speculative
    if getattr(args, "num_speculative_tokens", None) is not None:
        overrides["num_speculative_tokens"] = args.num_speculative_tokens
    return RuntimeConfig(**overrides)


class _Streamer:
    """``stream_generate`` for one prompt at a time; through the engine when speculation
    is on (the engine is where speculative decoding runs), else the plain api loop."""

    def __init__(self, model, tokenizer, config: RuntimeConfig):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.engine = None
        if config.speculative is not None:
            from .engine import Engine

            self.engine = Engine(model, tokenizer, config)

    def __call__(self, prompt, sampling: dict):
        from .api import stream_generate

        if self.engine is None:
            return stream_generate(self.model, self.tokenizer, prompt, config=self.config, **sampling)
        return self._engine_stream(prompt, sampling)

    def _engine_stream(self, prompt, sampling: dict):
        from .api import GenerationChunk, _peak_memory
        from .engine.sampling import SamplingParams

        for out in self.engine.stream(prompt, SamplingParams(**sampling)):
            m = out.metrics
            prefill_s = (m.first_token_time or 0.0) - (m.first_scheduled_time or 0.0)
            decode_s = (m.token_times[-1] - m.first_token_time) if m.token_times else 0.0
            n = len(out.token_ids)
            yield GenerationChunk(
                out.delta,
                out.new_token_ids[-1] if out.new_token_ids else None,
                out.finish_reason if out.finished else None,
                prompt_tokens=len(out.prompt_token_ids),
                generation_tokens=n,
                prompt_tps=len(out.prompt_token_ids) / prefill_s if prefill_s > 0 else 0.0,
                generation_tps=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
                peak_memory=_peak_memory(),
            )


def _load(args):
    from .api import load

    return load(args.model, dtype=args.dtype)


def _encode_chat(tokenizer, messages: list, use_template: bool) -> list:
    if use_template:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True))
    return tokenizer.encode("\n".join(m["content"] for m in messages))


def fit_history(tokenizer, messages: list, capacity: int, reserve: int, use_template: bool) -> tuple[list, int]:
    """Drop the oldest turns until the prompt leaves ``reserve`` tokens of ``capacity`` free.

    The system message (if first) and the newest user message are always kept.

    Returns:
        ``(messages, dropped)``: the kept messages and how many were dropped. The prompt
        may still not fit when the newest message alone is too long; the caller says so.
    """
    system = messages[:1] if messages and messages[0]["role"] == "system" else []
    turns = messages[len(system):]
    dropped = 0
    while len(turns) > 1 and len(_encode_chat(tokenizer, system + turns, use_template)) + reserve > capacity:
        # drop a whole exchange (user + assistant) when possible, so roles keep alternating
        n = 2 if len(turns) > 2 and turns[0]["role"] == "user" and turns[1]["role"] == "assistant" else 1
        turns = turns[n:]
        dropped += n
    return system + turns, dropped


def cmd_generate(args) -> int:
    """Stream one completion to stdout; stats to stderr."""
    model, tokenizer = _load(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat:
        msgs = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        prompt = msgs
    last = None
    text_end = ""
    for chunk in _Streamer(model, tokenizer, _config(args))(prompt, _sampling(args)):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        text_end = (text_end + chunk.text)[-1:]
        last = chunk
    if last is not None:
        if args.newline:
            sys.stdout.write("\n")
            sys.stdout.flush()
        elif text_end != "\n":
            # end the text's line before the stats (stdout itself stays exactly the text)
            sys.stderr.write("\n")
        print(
            f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tok/s | "
            f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s | "
            f"peak memory: {last.peak_memory / 2**30:.3f} GiB | finish: {last.finish_reason}",
            file=sys.stderr,
        )
    return 0


def cmd_chat(args) -> int:
    """A multi-turn REPL with streaming replies; /reset, /exit; Ctrl-C stops a reply.

    History is trimmed to the context (oldest turns first, the system message kept);
    ``--seed S`` seeds turn ``i`` with ``S + i``, so turns differ yet a session replays.
    """
    from .config import resolve_kv_capacity

    model, tokenizer = _load(args)
    config = _config(args)
    streamer = _Streamer(model, tokenizer, config)
    capacity = resolve_kv_capacity(config, model.args.max_position_embeddings)
    reserve = min(args.max_tokens, capacity // 2)  # room left for the reply
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    use_template = tokenizer.chat_template is not None
    if not use_template:
        print("[this model has no chat template: each turn continues the plain text]", file=sys.stderr)
    print("Type a message; /reset clears the conversation, /exit quits.", file=sys.stderr)
    turn = 0
    while True:
        try:
            line = input(">> ")
        except EOFError:
            print(file=sys.stderr)
            return 0
        except KeyboardInterrupt:
            print(file=sys.stderr)
            continue
        except UnicodeDecodeError as e:
            print(f"error: the input is not valid UTF-8 ({e.reason}): type it again", file=sys.stderr)
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
        reply = []
        sampling = _sampling(args)
        if args.seed is not None:
            sampling["seed"] = (args.seed + turn) % 2**64
        turn += 1
        gen = None
        try:
            messages, dropped = fit_history(tokenizer, messages, capacity, reserve, use_template)
            if dropped:
                print(f"[dropped the {dropped} oldest message(s) to fit the context of {capacity} tokens]",
                      file=sys.stderr)
            prompt = messages if use_template else "\n".join(m["content"] for m in messages)
            gen = streamer(prompt, sampling)
            for chunk in gen:
                reply.append(chunk.text)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
        except KeyboardInterrupt:
            if gen is not None:
                gen.close()  # releases the reply's KV cache
            print("\n[stopped]", file=sys.stderr)
        except PromptTooLongError as e:
            print(f"\nerror: {e}. This message alone is too long for the context; it was not sent.",
                  file=sys.stderr)
            messages.pop()
            continue
        except Exception as e:  # noqa: BLE001 - one failed turn never ends the session
            print(f"\nerror: {type(e).__name__}: {e}" if not isinstance(e, FerrumError) else f"\nerror: {e}",
                  file=sys.stderr)
            messages.pop()
            continue
        print()
        messages.append({"role": "assistant", "content": "".join(reply)})


def cmd_bench(args) -> int:
    """Concurrent-request benchmark through the engine (see ``mlx_ferrum.bench``)."""
    from .bench import run_bench_cli

    return run_bench_cli(args)


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`RuntimeConfig` field (``--block-size`` ...); unset = its FERRUM_* variable."""
    from dataclasses import fields

    from .config import _ENV

    for f in fields(RuntimeConfig):
        var, parse, default = _ENV[f.name]
        p.add_argument(
            "--" + f.name.replace("_", "-"), dest=f.name, default=None,
            type=(lambda raw, var=var, parse=parse: parse(var, raw)),
            help=f"default: ${var}, else {'paged' if f.name == 'kv_layout' else default}",
        )


def cmd_serve(args) -> int:
    """The OpenAI-compatible HTTP server (see ``mlx_ferrum.server``)."""
    import logging
    import os
    from dataclasses import fields

    from .server import run_server

    overrides = {f.name: getattr(args, f.name) for f in fields(RuntimeConfig) if getattr(args, f.name) is not None}
    if args.enable_prefix_caching:
        overrides["prefix_cache"] = True
    if "kv_layout" not in overrides and "FERRUM_METAL_PAGED_KV" not in os.environ:
        overrides["kv_layout"] = "paged"  # a server batches many requests: paged is the layout for it
    config = RuntimeConfig(**overrides)
    from .server.limits import ServerLimits

    limits = ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})  # checked before the model loads
    template = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as fh:
                template = fh.read()
        except OSError as e:
            raise ChatTemplateError(f"cannot read --chat-template {args.chat_template!r}: {e.strerror}: give a readable Jinja file") from None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    model, tokenizer = _load(args)
    names = args.served_model_name or [args.model]
    print(f"mlx-ferrum serve: {names[0]} on http://{args.host}:{args.port}/v1 ({config.kv_layout} KV, "
          f"prefix cache {'on' if config.prefix_cache else 'off'}, max_num_seqs {config.max_num_seqs})", file=sys.stderr)
    code = run_server(
        model, tokenizer, config, host=args.host, port=args.port, served_model_names=names,
        api_key=args.api_key, chat_template=template, log_level=args.log_level, limits=limits,
    )
    # The server has shut down cleanly. Leave without interpreter teardown: on MLX's CPU
    # backend, destroying MLX state after the paged engine ran in a worker thread aborts
    # the process ("terminate called without an active exception"), which would turn a
    # graceful exit 0 into 134.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mlx-ferrum``."""
    from . import __version__

    parser = argparse.ArgumentParser(prog="mlx-ferrum", description="LLM inference on MLX")
    parser.add_argument("--version", action="version", version=f"mlx-ferrum {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt")
    _add_model_args(g)
    g.add_argument("--prompt", "-p", required=True, help="the prompt; '-' reads it from stdin")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--newline", action="store_true", help="end the output with a newline")
    _add_sampling_args(g, temp=0.0)
    _add_speculative_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat")
    _add_model_args(c)
    c.add_argument("--system", default=None, help="system message")
    _add_sampling_args(c, temp=0.7)
    _add_speculative_args(c)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="engine throughput at several concurrency levels (the mlx-lm comparison is benchmarks/bench_engine.py)")
    _add_model_args(b)
    b.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts")
    b.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (tokens)")
    b.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    s.add_argument("--model", required=True, help="checkpoint folder or Hugging Face repo id")
    s.add_argument("--dtype", default=None, help="cast weights: float32, float16 or bfloat16")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (loopback by default)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", nargs="+", default=None, help="names accepted in 'model' (default: --model)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--chat-template", default=None, help="Jinja chat template file (overrides the checkpoint's)")
    s.add_argument("--enable-prefix-caching", action="store_true", help="same as --prefix-cache 1 / FERRUM_PREFIX_CACHE=1")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    _add_runtime_args(s)
    # the server's limits: one flag per ServerLimits field, refused requests name the flag
    from dataclasses import fields

    from .server.limits import ServerLimits, flag_of

    limit_help = {
        "max_request_body_bytes": "largest HTTP request body in bytes (larger: 413)",
        "max_request_json_containers": "most JSON arrays and objects in one request body (more: 413)",
        "max_n": "largest n (choices per prompt)",
        "max_prompts_per_request": "largest number of prompts in one /v1/completions request",
        "max_choices_per_request": "largest prompts x n in one request",
        "max_prompt_tokens_per_request": "largest total of prompt tokens in one request",
        "max_queued_tokens": "largest total of prompt tokens the server holds at once (over it: 429)",
    }
    for f in fields(ServerLimits):
        s.add_argument(flag_of(f.name), type=int, default=f.default, help=f"{limit_help[f.name]} (default: {f.default})")
    s.set_defaults(func=cmd_serve)
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
        print(file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - no traceback reaches the user
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
