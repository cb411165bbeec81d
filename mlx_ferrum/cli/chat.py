"""``mlx-ferrum chat``: a multi-turn conversation in the terminal, replies streamed.

The history is kept within the context by dropping its oldest turns (never the system
message); an error prints one ``error: ...`` line and the session goes on.
"""

from __future__ import annotations

import sys
from typing import Optional

from ..config import RuntimeConfig
from ..errors import FerrumError, PromptTooLongError
from .args import HelpFormatter, add_model_args
from .generation import (Streamer, add_adapter_args, add_sampling_args, add_speculative_args,
                         apply_generation_defaults, run_with_parallelism, sampling_fields)

#: Tokens the chat's history trimming keeps free for a reply when ``--max-tokens`` is unset.
DEFAULT_CHAT_RESERVE = 256


def add_parser(sub) -> None:
    """Add ``chat`` and its flags to the subcommands ``sub``."""
    c = sub.add_parser("chat", help="interactive multi-turn chat", formatter_class=HelpFormatter)
    add_model_args(c)
    c.add_argument("--system", default=None, help="system message (default: none)")
    add_sampling_args(c, temp=0.7, max_tokens=None)
    add_speculative_args(c)
    add_adapter_args(c)
    c.set_defaults(func=cmd_chat)


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


def cmd_chat(args) -> int:
    """A multi-turn REPL with streaming replies; /reset, /exit; Ctrl-C stops a reply.

    History is trimmed to the context (oldest turns first, the system message kept);
    ``--seed S`` seeds turn ``i`` with ``S + i``, so turns differ yet a session replays.
    A reply may use the rest of the context unless ``--max-tokens`` is given; a reply
    that ends for lack of room (either limit) gets a marker on stderr saying so.
    """
    return run_with_parallelism(args, _chat)


def _chat(args, model, tokenizer, config: RuntimeConfig, engine) -> int:
    from ..config import resolve_kv_capacity

    from_model = apply_generation_defaults(args, model)
    streamer = Streamer(model, tokenizer, config, args.adapter_path, engine=engine)
    capacity = resolve_kv_capacity(config, model.args.max_position_embeddings)
    # room the history trimming leaves for the reply (a reply may still run on to the context's end)
    reserve = min(args.max_tokens or DEFAULT_CHAT_RESERVE, capacity // 2)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    use_template = tokenizer.chat_template is not None
    if not use_template:
        print("[this model has no chat template: each turn continues the plain text]", file=sys.stderr)
    if from_model:
        flags = ", ".join(f"--{name.replace('_', '-')} {value}" for name, value in from_model.items())
        print(f"[sampling defaults from the model's generation_config.json: {flags}]", file=sys.stderr)
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
        sampling = sampling_fields(args)
        if args.max_tokens is None:
            sampling["max_tokens"] = capacity  # the engine ends the reply where the context ends
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
            last = None
            for chunk in gen:
                reply.append(chunk.text)
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                last = chunk
            if last is not None and last.finish_reason == "length":
                print(file=sys.stderr)
                print(cut_marker(last.generation_tokens, args.max_tokens, capacity), file=sys.stderr, end="")
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


def cut_marker(generated: int, max_tokens: Optional[int], capacity: int) -> str:
    """The stderr line after a chat reply that ended with ``finish_reason="length"``:
    ``generated`` tokens, cut by ``max_tokens`` (when given and reached) or else by the
    context of ``capacity`` tokens."""
    if max_tokens is not None and generated >= max_tokens:
        return f"[reply cut at {generated} tokens; --max-tokens to change]"
    return f"[reply cut at {generated} tokens: the context of {capacity} tokens is full; /reset to start over]"
