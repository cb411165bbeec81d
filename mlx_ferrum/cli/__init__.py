"""The ``mlx-ferrum`` command line: ``generate``, ``chat``, ``bench``, ``serve``.

``generate`` writes only the generated text to stdout; statistics (prompt and decode
tokens per second, peak memory) go to stderr, so the output can be piped; ``-p -``
reads the prompt from stdin. ``chat`` keeps the conversation within the context by
dropping its oldest turns (never the system message). No traceback reaches the user:
errors print one ``error: ...`` line (``chat`` then goes on); a malformed flag exits 2
with argparse's usage line, a refused setting or input exits 2, an unexpected error 1,
and Ctrl-C 130.
``python -m mlx_ferrum`` runs the same entry point.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys
from typing import Optional, Sequence

from .config import _FALSE, _TRUE, DISTRIBUTED_BACKENDS, FIELD_HELP, KV_CACHE_DTYPES, RuntimeConfig
from .errors import ChatTemplateError, ConfigurationError, FerrumError, PromptTooLongError


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's defaults formatter, except where the help text already states its
    default (every option whose default is ``None`` says in words what unset means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default is None or action.default is argparse.SUPPRESS:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return text + " (default: off)"
        return super()._get_help_string(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser, but a usage error is one line (the program, the error, and
    where to look) instead of the whole usage block, which for ``serve`` is long."""

    def error(self, message: str):
        """Print ``PROG: error: MESSAGE (see PROG --help)`` to stderr and exit 2."""
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


# Named type functions: argparse names the function in "invalid <name> value" and shows
# an ArgumentTypeError's message as is, so each says what is accepted.


def boolean(raw: str) -> bool:
    """``1/true/yes/on`` or ``0/false/no/off`` (any case) as a bool.

    Raises:
        argparse.ArgumentTypeError: anything else; the message lists the accepted values.
    """
    value = raw.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE and value:
        return False
    raise argparse.ArgumentTypeError(f"invalid choice: {raw!r} (choose from 1, 0, true, false, yes, no, on, off)")


def positive_int(raw: str) -> int:
    """A whole number >= 1.

    Raises:
        argparse.ArgumentTypeError: not a whole number, or below 1.
    """
    try:
        value = int(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number: give an integer >= 1") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{raw!r} is not valid: give an integer >= 1")
    return value


def _unit_number(raw: str, zero_allowed: bool, example: str) -> float:
    """``raw`` as a float in [0, 1] (or (0, 1] unless ``zero_allowed``)."""
    interval = "[0, 1]" if zero_allowed else "(0, 1]"
    try:
        value = float(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a number: give a number in {interval}, e.g. {example}") from None
    if not (0.0 <= value <= 1.0) or (value == 0.0 and not zero_allowed):
        raise argparse.ArgumentTypeError(f"{raw!r} is not valid: give a number in {interval}, e.g. {example}")
    return value


def fraction(raw: str) -> float:
    """A number in (0, 1].

    Raises:
        argparse.ArgumentTypeError: not a number, or outside (0, 1].
    """
    return _unit_number(raw, False, "0.5")


def unit_interval(raw: str) -> float:
    """A number in [0, 1].

    Raises:
        argparse.ArgumentTypeError: not a number, or outside [0, 1].
    """
    return _unit_number(raw, True, "0.3")


def port_number(raw: str) -> int:
    """A TCP port: 1 to 65535, or 0 for any free port.

    Raises:
        argparse.ArgumentTypeError: not a whole number, or outside [0, 65535].
    """
    try:
        value = int(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a port number: give 1 to 65535 (0 picks a free port)") from None
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a port number: give 1 to 65535 (0 picks a free port)")
    return value


def api_key(raw: str) -> str:
    """A non-empty API key.

    Raises:
        argparse.ArgumentTypeError: the key is empty or only spaces (no client could
            ever send it, so the server would refuse everyone).
    """
    if not raw.strip():
        raise argparse.ArgumentTypeError(
            "the key is empty, so no client could authenticate: give a non-empty key, or leave --api-key out "
            "to serve without one"
        )
    return raw


DTYPES = ("float32", "float16", "bfloat16")
#: ``serve``'s default ``max_num_prefill_seqs`` (the Python API has no cap, as vLLM's
#: offline and online entry points differ in their batching defaults): on the chat
#: workload of ``benchmarks/bench_serving.py`` (32 clients whose requests come in waves),
#: median time to first token was 0.25-0.28 s with 4 against 0.39 s uncapped and 0.44 s
#: with 8, for up to 7 % fewer tokens per second (docs/benchmarks.md, section 19).
SERVE_MAX_NUM_PREFILL_SEQS = 4


def lora_module(raw: str) -> tuple[str, str]:
    """``--lora-modules`` item ``name=path`` (vLLM's form) -> ``(name, path)``."""
    name, sep, path = raw.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"{raw!r} is not NAME=PATH: give e.g. sql-lora=./adapters/sql")
    return name.strip(), path.strip()


def _add_gguf_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--gguf-file", default=None, metavar="NAME",
                   help="the .gguf file to load from the --model folder or hub repo (default: none; a .gguf "
                        "path, or a folder holding one GGUF model, needs no flag)")


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint folder, .gguf file or Hugging Face repo id")
    _add_gguf_arg(p)
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="cast the weights to this dtype (default: the checkpoint's own)")
    p.add_argument("--paged", action="store_true", help="use the paged KV cache (same as FERRUM_METAL_PAGED_KV=1)")
    p.add_argument("--kv-cache-dtype", default=None, type=str.lower, choices=KV_CACHE_DTYPES,
                   help=f"{FIELD_HELP['kv_cache_dtype']} (default: $FERRUM_KV_CACHE_DTYPE, else auto)")
    _add_parallel_args(p)


def _add_parallel_args(p: argparse.ArgumentParser) -> None:
    """``--tensor-parallel-size`` / ``--pipeline-parallel-size`` / ``--distributed-backend``
    (``serve`` gets them from its one-flag-per-RuntimeConfig-field list)."""
    p.add_argument("--tensor-parallel-size", type=positive_int, default=None, metavar="N",
                   help=f"{FIELD_HELP['tensor_parallel_size']} (default: $FERRUM_TENSOR_PARALLEL_SIZE, else 1)")
    p.add_argument("--pipeline-parallel-size", type=positive_int, default=None, metavar="N",
                   help=f"{FIELD_HELP['pipeline_parallel_size']} (default: $FERRUM_PIPELINE_PARALLEL_SIZE, else 1)")
    p.add_argument("--pipeline-split", default=None, metavar="N,N,...",
                   help=f"{FIELD_HELP['pipeline_split']} (default: $FERRUM_PIPELINE_SPLIT, else an even split)")
    p.add_argument("--distributed-backend", default=None, choices=DISTRIBUTED_BACKENDS,
                   help=f"{FIELD_HELP['distributed_backend']} (default: $FERRUM_DISTRIBUTED_BACKEND, else any)")


#: The flags a model's ``generation_config.json`` may set a default for (vLLM's keys), as
#: ``(args attribute, SamplingParams field)``.
_MODEL_DEFAULT_FLAGS = (("temp", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                        ("repetition_penalty", "repetition_penalty"), ("max_tokens", "max_tokens"))


def _add_sampling_args(p: argparse.ArgumentParser, temp: float, max_tokens: Optional[int] = 256) -> None:
    """The sampling flags of ``generate`` / ``chat``. Those a ``generation_config.json`` can
    set default to None here; :func:`apply_generation_defaults` fills them after loading
    (the flag, else the model's file, else the command's own default kept in
    ``args.own_defaults``)."""
    model = "the model's generation_config.json, else"
    if max_tokens is None:
        max_tokens_help = (f"most tokens per reply (default: {model} the rest of the context; a reply cut by this "
                           "limit ends with a marker on stderr)")
    else:
        max_tokens_help = f"most tokens to generate (default: {model} {max_tokens})"
    p.add_argument("--max-tokens", "-m", type=positive_int, default=None, help=max_tokens_help)
    p.add_argument("--temp", type=float, default=None, help=f"temperature; 0 = greedy (default: {model} {temp:g})")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling: keep the smallest set of tokens "
                   f"whose probability reaches this (1 = off; default: {model} 1)")
    p.add_argument("--top-k", type=int, default=None, help=f"keep the k most likely tokens (0 = off; default: {model} 0)")
    p.add_argument("--min-p", type=float, default=None,
                   help=f"drop tokens less likely than this times the most likely one (0 = off; default: {model} 0)")
    p.add_argument("--repetition-penalty", type=float, default=None,
                   help="penalise tokens already seen, prompt included (CTRL; > 1 discourages repeats, 1 = off; "
                        f"default: {model} 1)")
    p.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract this from the logit of every token already generated, in [-2, 2] (0 = off)")
    p.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract this once per earlier occurrence of a generated token, in [-2, 2] (0 = off)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable; default: none)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating after EOS")
    p.add_argument("--generation-config", default="auto", metavar="auto|none|FOLDER",
                   help="where the sampling defaults above come from (vLLM's flag): 'auto' reads the model's "
                        "generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens), 'none' keeps this command's own defaults, a FOLDER reads its "
                        "generation_config.json; a flag given always wins (default: auto)")
    p.set_defaults(own_defaults=dict(temp=temp, top_p=1.0, top_k=0, min_p=0.0, repetition_penalty=1.0,
                                     max_tokens=max_tokens))


def apply_generation_defaults(args, model) -> dict:
    """Fill the sampling flags left unset from the model's ``generation_config.json``
    (per ``--generation-config``), else from the command's own defaults.

    Returns:
        ``{flag attribute: value}`` of the defaults taken from the model's file (for the
        note ``chat`` prints).

    Raises:
        ConfigurationError: the file or a value in it is refused (see
            :func:`~mlx_ferrum.generation_defaults.generation_defaults`).
    """
    from .generation_defaults import generation_defaults

    from_model = generation_defaults(getattr(model, "path", None), args.generation_config)
    taken = {}
    for attr, field in _MODEL_DEFAULT_FLAGS:
        if getattr(args, attr) is not None:
            continue  # the user's flag wins
        if field in from_model:
            taken[attr] = from_model[field]
            setattr(args, attr, from_model[field])
        else:
            setattr(args, attr, args.own_defaults[attr])
    return taken


def _sampling(args) -> dict:
    return dict(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
        stop=list(args.stop),
        ignore_eos=args.ignore_eos,
    )


def _add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative", default=None, metavar="ngram|PATH",
                   help="speculative decoding: 'ngram' (prompt lookup) or a draft checkpoint sharing the "
                        "tokenizer (default: $FERRUM_SPECULATIVE, else off)")
    p.add_argument("--num-speculative-tokens", type=positive_int, default=None, metavar="K",
                   help="tokens proposed per step (default: $FERRUM_NUM_SPECULATIVE_TOKENS, else 4)")
    p.add_argument("--speculative-disable-by-batch-size", type=positive_int, default=None, metavar="N",
                   help="no speculation while at least N requests run; 2 speculates only for a request "
                        "running alone (default: $FERRUM_SPECULATIVE_DISABLE_BY_BATCH_SIZE, else 2)")
    p.add_argument("--speculative-min-acceptance", type=unit_interval, default=None, metavar="F",
                   help="a request whose drafts are accepted less often than F, or find nothing while others "
                        "run, backs off from speculating for a growing number of steps; 0 never backs off (default: "
                        "$FERRUM_SPECULATIVE_MIN_ACCEPTANCE, else 0.2)")


def _add_adapter_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter-path", default=None, metavar="PATH",
                   help="a LoRA adapter to run with: a PEFT or mlx-lm adapter folder, or a hub repo id "
                        "(mlx-lm's flag; default: none)")


def _config(args) -> RuntimeConfig:
    overrides = {}
    if getattr(args, "adapter_path", None):
        overrides["enable_lora"] = True
    if args.paged:
        overrides["kv_layout"] = "paged"
    if getattr(args, "kv_cache_dtype", None) is not None:
        overrides["kv_cache_dtype"] = args.kv_cache_dtype
    if getattr(args, "speculative", None):
        overrides["speculative"] = args.speculative
    for name in ("num_speculative_tokens", "speculative_disable_by_batch_size", "speculative_min_acceptance",
                 "tensor_parallel_size", "pipeline_parallel_size", "distributed_backend", "pipeline_split"):
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    return _runtime_config(overrides)


class _Streamer:
    """``stream_generate`` for one prompt at a time; through the engine when speculation
    is on (the engine is where speculative decoding runs), else the plain api loop."""

    def __init__(self, model, tokenizer, config: RuntimeConfig, adapter_path: Optional[str] = None, engine=None):
        self.model, self.tokenizer, self.config = model, tokenizer, config
        self.lora = adapter_path or None
        self.engine = engine  # a parallel run's lockstep engine
        if engine is not None:
            return
        if config.speculative is not None:
            from .engine import Engine

            self.engine = Engine(model, tokenizer, config)
            if self.lora:
                self.engine.add_lora(self.lora, self.lora)
        elif self.lora:
            from .api import _lora_config

            _lora_config(model, config, self.lora)  # a bad adapter fails at start-up, not at the first prompt

    def __call__(self, prompt, sampling: dict):
        from .api import stream_generate

        if self.engine is None:
            return stream_generate(self.model, self.tokenizer, prompt, config=self.config, lora=self.lora, **sampling)
        return self._engine_stream(prompt, sampling)

    def _engine_stream(self, prompt, sampling: dict):
        from .api import GenerationChunk, _peak_memory
        from .engine.sampling import SamplingParams

        for out in self.engine.stream(prompt, SamplingParams(**sampling), lora=self.lora):
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


def _load(args, parallel=None):
    from .api import load

    return load(args.model, dtype=args.dtype, parallel=parallel, gguf_file=getattr(args, "gguf_file", None))


class _Parallel:
    """A parallel run of a one-shot command (``generate``, ``chat``): the group, this
    rank's model and the lockstep engine; ranks other than 0 follow rank 0's steps.

    Use as a context manager on rank 0: leaving it (normally, on an error or Ctrl-C)
    tells the other ranks to stop, so no rank is left waiting.
    """

    def __init__(self, args, config: RuntimeConfig):
        from .distributed import init_group, lockstep_engine

        if config.parallel != "none" and getattr(args, "adapter_path", None):
            from .distributed.lockstep import check_lockstep_config

            check_lockstep_config(config)
        self.group = init_group(config)
        self.model, self.tokenizer = _load(args) if self.group is None else _load(args, self.group)
        self.engine = (lockstep_engine(self.model, self.tokenizer, config, self.group)
                       if self.group is not None else None)

    @property
    def follower(self) -> bool:
        return self.group is not None and not self.group.is_driver

    def follow(self) -> int:
        """Run rank 0's steps until it stops; exit status 0."""
        self.engine.follow()
        return 0

    def __enter__(self) -> "_Parallel":
        return self

    def __exit__(self, *exc) -> None:
        if self.engine is not None:
            self.engine.close()


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
    """Stream one completion to stdout; stats to stderr (rank 0 of a parallel run; the
    other ranks run its steps)."""
    check_generate_flags(args)
    return _run_with_parallelism(args, _generate)


def check_generate_flags(args) -> None:
    """Refuse ``generate`` flags that contradict each other, before the model loads.

    Raises:
        ConfigurationError: ``--system`` with ``--ignore-chat-template`` (a raw prompt has
            no place for a system message).
    """
    if args.system is not None and args.ignore_chat_template:
        raise ConfigurationError("--system needs the chat template, but --ignore-chat-template sends the prompt "
                                 "raw: drop one of them (or write the system text into --prompt)")


def generate_prompt(args, tokenizer, prompt: str):
    """What ``generate`` sends: ``[system?, user]`` messages through the chat template when
    the tokenizer has one (as mlx_lm.generate does), unless ``--ignore-chat-template``;
    else the raw text.

    Raises:
        ConfigurationError: ``--system`` for a raw prompt (the model has no template).
        ChatTemplateError: ``--chat`` for a model without a template.
    """
    use_template = args.chat or (tokenizer.chat_template is not None and not args.ignore_chat_template)
    if not use_template:
        if args.system is not None:
            raise ConfigurationError("--system needs a chat template, and this model has none (its prompt is sent "
                                     "raw): drop --system, or give a model whose tokenizer has a chat template")
        return prompt
    return ([{"role": "system", "content": args.system}] if args.system is not None else []) + [
        {"role": "user", "content": prompt}
    ]


def _generate(args, model, tokenizer, config: RuntimeConfig, engine) -> int:
    prompt = generate_prompt(args, tokenizer, sys.stdin.read() if args.prompt == "-" else args.prompt)
    apply_generation_defaults(args, model)
    last = None
    text_end = ""
    streamer = _Streamer(model, tokenizer, config, args.adapter_path, engine=engine)
    for chunk in streamer(prompt, _sampling(args)):
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
        if streamer.engine is not None and config.speculative is not None:
            print(speculative_summary(streamer.engine.stats()), file=sys.stderr)
        if engine is not None:
            print(parallel_summary(engine.stats()), file=sys.stderr)
    return 0


def parallel_summary(stats: dict) -> str:
    """One stderr line about a parallel run: the mode, sizes and lockstep traffic."""
    return (f"parallel: {stats['parallel']} over {stats['world_size']} ranks | "
            f"{stats['lockstep_broadcasts']} step broadcasts ({stats['lockstep_collectives']} collectives) "
            f"for {stats['lockstep_steps']} engine steps")


def speculative_summary(stats: dict) -> str:
    """One stderr line from ``Engine.stats()``'s speculative-decoding counters."""
    return (
        f"speculative: {stats['spec_accepted_tokens']} of {stats['spec_proposed_tokens']} proposed tokens accepted "
        f"({100 * stats['spec_acceptance_rate']:.1f}%) over {stats['spec_num_drafts']} drafts | "
        f"mean accepted length: {stats['spec_mean_accepted_length']:.2f} tokens per step"
    )


def cmd_chat(args) -> int:
    """A multi-turn REPL with streaming replies; /reset, /exit; Ctrl-C stops a reply.

    History is trimmed to the context (oldest turns first, the system message kept);
    ``--seed S`` seeds turn ``i`` with ``S + i``, so turns differ yet a session replays.
    A reply may use the rest of the context unless ``--max-tokens`` is given; a reply
    that ends for lack of room (either limit) gets a marker on stderr saying so.
    """
    return _run_with_parallelism(args, _chat)


def _run_with_parallelism(args, body) -> int:
    """Load per ``args`` (a parallel group when asked) and run ``body(args, model,
    tokenizer, config, engine)`` on rank 0; the other ranks follow its steps."""
    config = _config(args)
    run = _Parallel(args, config)
    if run.follower:
        return run.follow()
    with run:
        return body(args, run.model, run.tokenizer, config, run.engine)


def _chat(args, model, tokenizer, config: RuntimeConfig, engine) -> int:
    from .config import resolve_kv_capacity

    from_model = apply_generation_defaults(args, model)
    streamer = _Streamer(model, tokenizer, config, args.adapter_path, engine=engine)
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
        sampling = _sampling(args)
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


#: Tokens the chat's history trimming keeps free for a reply when ``--max-tokens`` is unset.
DEFAULT_CHAT_RESERVE = 256


def cut_marker(generated: int, max_tokens: Optional[int], capacity: int) -> str:
    """The stderr line after a chat reply that ended with ``finish_reason="length"``:
    ``generated`` tokens, cut by ``max_tokens`` (when given and reached) or else by the
    context of ``capacity`` tokens."""
    if max_tokens is not None and generated >= max_tokens:
        return f"[reply cut at {generated} tokens; --max-tokens to change]"
    return f"[reply cut at {generated} tokens: the context of {capacity} tokens is full; /reset to start over]"


def cmd_bench(args) -> int:
    """Concurrent-request benchmark through the engine (see ``mlx_ferrum.bench``)."""
    from .bench import run_bench_cli

    return run_bench_cli(args)


def _runtime_flag_type(parse, name: str = ""):
    """The argparse type of a RuntimeConfig field's flag (None: argparse ``choices`` check it)."""
    from .config import _parse_bool, _parse_float, _parse_int

    if parse is _parse_bool:
        return boolean
    if parse is _parse_float:
        return unit_interval if name == "speculative_min_acceptance" else fraction
    if parse is _parse_int:
        return positive_int
    return None


def _add_runtime_args(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`RuntimeConfig` field (``--block-size`` ...); unset = its FERRUM_* variable."""
    from dataclasses import fields

    from .config import _ENV

    choices = {"kv_layout": ("contiguous", "paged"), "block_size": (8, 16, 32, 64, 128),
               "kv_cache_dtype": KV_CACHE_DTYPES, "distributed_backend": DISTRIBUTED_BACKENDS}
    for f in fields(RuntimeConfig):
        var, parse, default = _ENV[f.name]
        if f.name == "kv_layout":
            default = "paged"  # serve's own default (cmd_serve); the library's is contiguous
        if f.name == "max_num_prefill_seqs":
            default = f"{SERVE_MAX_NUM_PREFILL_SEQS} for serve, no cap for the Python API"
        if f.name in ("max_num_blocks",):
            default = "sized from --max-num-seqs and free memory"
        elif f.name == "kv_capacity":
            default = "the model's max_position_embeddings"
        elif f.name == "speculative":
            default = "off"
        elif f.name == "max_cpu_loras":
            default = "--max-loras"
        elif f.name == "pipeline_split":
            default = "an even split"
        elif isinstance(default, bool):
            default = int(default)
        kind = _runtime_flag_type(parse, f.name)
        # vLLM's --enable-lora is a bare switch: accept it alone as well as with 1/0
        bare = dict(nargs="?", const=True) if f.name == "enable_lora" else {}
        p.add_argument(
            "--" + f.name.replace("_", "-"), dest=f.name, default=None, **bare,
            type=int if f.name == "block_size" else (str.lower if f.name in ("kv_layout", "kv_cache_dtype") else kind),
            choices=choices.get(f.name),
            metavar={boolean: "{1,0}", positive_int: "N", fraction: "F", unit_interval: "F"}.get(kind)
            if f.name not in choices else None,
            help=f"{FIELD_HELP[f.name]} (default: ${var}, else {default})",
        )


def _runtime_config(overrides: dict) -> RuntimeConfig:
    """``RuntimeConfig(**overrides)`` for values that came from flags; an error names the
    flag (``--block-size``), not the dataclass field.

    Raises:
        ConfigurationError: a value, or a ``FERRUM_*`` variable, is malformed.
    """
    try:
        return RuntimeConfig(**overrides)
    except ConfigurationError as e:
        message = str(e)
        for name in [*overrides, "pipeline_parallel_size", "tensor_parallel_size"]:
            message = message.replace(f"RuntimeConfig.{name}", "--" + name.replace("_", "-"))
        # a flag the message asks for by its field name
        message = message.replace("pipeline_parallel_size (FERRUM_PIPELINE_PARALLEL_SIZE)",
                                  "--pipeline-parallel-size (FERRUM_PIPELINE_PARALLEL_SIZE)")
        raise ConfigurationError(message) from None


def bind_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (not yet listening), for uvicorn to serve on.

    Binding before the model loads makes a taken port fail at once, and makes the
    start-up line that names the address true.

    Raises:
        ConfigurationError: the host does not resolve, or the address cannot be bound
            (in use, not permitted, not local); the message names the address and the fix.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise ConfigurationError(
            f"--host {host!r} does not resolve ({e.strerror}): give an address such as 127.0.0.1 or 0.0.0.0"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    # as uvicorn does: a restarted server may rebind while old connections sit in TIME_WAIT
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        fixes = {
            errno.EADDRINUSE: f"port {port} is already in use: stop the other server or give another --port "
                              "(0 picks a free one)",
            errno.EACCES: f"port {port} needs privileges: give a --port from 1024 to 65535",
            errno.EADDRNOTAVAIL: f"{host} is not an address of this machine: give 127.0.0.1, 0.0.0.0 or one of "
                                 "its own addresses as --host",
        }
        fix = fixes.get(e.errno, f"{e.strerror}: check --host and --port")
        raise ConfigurationError(f"cannot listen on {host}:{port}: {fix}") from None
    return sock


def serve_config(args) -> RuntimeConfig:
    """The engine configuration of ``serve``: its flags over the ``FERRUM_*`` variables over
    the defaults, with the paged layout unless a flag or variable says otherwise.

    Raises:
        ConfigurationError: a malformed value (the message names the flag).
    """
    import os
    from dataclasses import fields

    overrides = {f.name: getattr(args, f.name) for f in fields(RuntimeConfig) if getattr(args, f.name) is not None}
    if args.enable_prefix_caching is not None:
        overrides["prefix_cache"] = args.enable_prefix_caching
    if getattr(args, "lora_modules", None):
        overrides["enable_lora"] = True  # serving adapters implies LoRA on (as in vLLM)
    if "kv_layout" not in overrides and "FERRUM_METAL_PAGED_KV" not in os.environ:
        overrides["kv_layout"] = "paged"  # a server batches many requests: paged is the layout for it
    if "max_num_prefill_seqs" not in overrides and "FERRUM_MAX_NUM_PREFILL_SEQS" not in os.environ:
        # clients arrive in bursts: prefilled a few at a time, the first start sooner
        overrides["max_num_prefill_seqs"] = SERVE_MAX_NUM_PREFILL_SEQS
    return _runtime_config(overrides)


def _serve_sampling_defaults(args, model) -> dict:
    """``serve``'s defaults for request fields left unset, per ``--generation-config``."""
    from .generation_defaults import generation_defaults

    return generation_defaults(getattr(model, "path", None), args.generation_config)


def cmd_serve(args) -> int:
    """The OpenAI-compatible HTTP server (see ``mlx_ferrum.server``)."""
    import logging
    import os
    from dataclasses import fields

    from .server import run_server

    config = serve_config(args)
    from .server.limits import ServerLimits

    limits = ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})  # checked before the model loads
    template = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as fh:
                template = fh.read()
        except OSError as e:
            raise ChatTemplateError(f"cannot read --chat-template {args.chat_template!r}: {e.strerror}: give a readable Jinja file") from None
    from .distributed import init_group, lockstep_engine

    group = init_group(config)
    if group is not None and not group.is_driver:
        # only rank 0 listens; this rank runs the steps rank 0 broadcasts
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        model, tokenizer = _load(args, group)
        lockstep_engine(model, tokenizer, config, group).follow()
        code = 0
    else:
        sock = bind_socket(args.host, args.port)
        host, port = args.host, sock.getsockname()[1]
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        model, tokenizer = _load(args) if group is None else _load(args, group)
        names = args.served_model_name or [args.model]
        engine = lockstep_engine(model, tokenizer, config, group) if group is not None else None
        where = f", {group.mode} parallel over {group.size} ranks" if group is not None else ""

        def banner() -> None:
            print(f"mlx-ferrum serve: {names[0]} on http://{host}:{port}/v1 ({config.kv_layout} KV, "
                  f"prefix cache {'on' if config.prefix_cache else 'off'}, max_num_seqs {config.max_num_seqs}{where})",
                  file=sys.stderr, flush=True)

        code = run_server(
            model, tokenizer, config, host=args.host, port=port, served_model_names=names,
            api_key=args.api_key, chat_template=template, log_level=args.log_level, limits=limits,
            sockets=[sock], on_ready=banner, tool_call_parser=args.tool_call_parser,
            lora_modules=dict(args.lora_modules or []), engine=engine, web_ui=args.web_ui,
            sampling_defaults=_serve_sampling_defaults(args, model),
            reasoning_parser=args.reasoning_parser, pooling=args.pooling,
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

    parser = ArgumentParser(prog="mlx-ferrum", description="LLM inference on MLX", formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"mlx-ferrum {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate a completion for one prompt", formatter_class=HelpFormatter)
    _add_model_args(g)
    g.add_argument("--prompt", "-p", required=True, help="the prompt; '-' reads it from stdin")
    template = g.add_mutually_exclusive_group()
    template.add_argument("--ignore-chat-template", action="store_true",
                          help="send the prompt raw, without the chat template (mlx-lm's flag); by default the "
                               "prompt goes through the model's chat template as a user message when the tokenizer "
                               "has one, and raw when it has none")
    template.add_argument("--chat", action="store_true",
                          help="require the chat template: an error for a model without one (the template is "
                               "applied by default anyway)")
    g.add_argument("--system", default=None,
                   help="system message, sent through the chat template: refused when the prompt is sent raw "
                        "(default: none, i.e. the template's own)")
    g.add_argument("--newline", action="store_true", help="end the output with a newline")
    _add_sampling_args(g, temp=0.0)
    _add_speculative_args(g)
    _add_adapter_args(g)
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("chat", help="interactive multi-turn chat", formatter_class=HelpFormatter)
    _add_model_args(c)
    c.add_argument("--system", default=None, help="system message (default: none)")
    _add_sampling_args(c, temp=0.7, max_tokens=None)
    _add_speculative_args(c)
    _add_adapter_args(c)
    c.set_defaults(func=cmd_chat)

    b = sub.add_parser("bench", help="engine throughput at several concurrency levels (the mlx-lm comparison "
                       "is benchmarks/bench_engine.py)", formatter_class=HelpFormatter)
    _add_model_args(b)
    b.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts")
    b.add_argument("--prompt-tokens", type=positive_int, default=64, help="prompt length (tokens)")
    b.add_argument("--max-tokens", type=positive_int, default=64, help="tokens generated per request")
    b.set_defaults(func=cmd_bench)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter)
    s.add_argument("--model", required=True, help="checkpoint folder, .gguf file or Hugging Face repo id")
    _add_gguf_arg(s)
    s.add_argument("--dtype", default=None, choices=DTYPES,
                   help="cast the weights to this dtype (default: the checkpoint's own)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)")
    s.add_argument("--port", type=port_number, default=8000, help="TCP port to listen on (0 picks a free one)")
    s.add_argument("--served-model-name", nargs="+", default=None, help="names accepted in 'model' (default: --model)")
    s.add_argument("--api-key", type=api_key, default=None,
                   help="require 'Authorization: Bearer KEY' (default: no key needed)")
    s.add_argument("--no-web-ui", dest="web_ui", action="store_false",
                   help="do not serve the chat page at GET / (default: served)")
    s.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json", "mistral"],
                   help="how the model writes tool calls (vLLM's flag): hermes (<tool_call>{...}</tool_call>, Qwen2.5/3), "
                        "llama3_json, mistral ([TOOL_CALLS]); default: detected from the chat template, else hermes")
    s.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1", "gpt_oss"],
                   help="keep a reasoning model's thinking apart from its answer (vLLM's flag): qwen3 / deepseek_r1 "
                        "(<think>...</think>), gpt_oss (Harmony channels); returned as reasoning_content, Responses "
                        "reasoning items and Messages thinking blocks (default: none, the text stays as written)")
    s.add_argument("--pooling", default="last", choices=["last", "mean"],
                   help="how /v1/embeddings pools the last hidden states: the last token's, or the mean over the "
                        "tokens (L2-normalized either way; default: last)")
    s.add_argument("--chat-template", default=None,
                   help="Jinja chat template file (default: the checkpoint's own)")
    s.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="share full prompt blocks across requests (vLLM's flag; the same as --prefix-cache 1/0; "
                        "default: $FERRUM_PREFIX_CACHE, else on)")
    s.add_argument("--lora-modules", nargs="+", type=lora_module, default=None, metavar="NAME=PATH",
                   help="LoRA adapters to serve (PEFT or mlx-lm folders, or hub ids); a request whose 'model' is "
                        "NAME uses it; implies --enable-lora (default: none)")
    s.add_argument("--generation-config", default="auto", metavar="auto|none|FOLDER",
                   help="defaults for the sampling fields a request leaves unset (vLLM's flag): 'auto' reads the "
                        "model's generation_config.json (temperature, top_p, top_k, min_p, repetition_penalty, "
                        "max_new_tokens as max_tokens), 'none' keeps OpenAI's defaults (temperature 1 ...), a FOLDER "
                        "reads its generation_config.json; request fields always win (default: auto)")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's and mlx_ferrum's log level")
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
    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except FerrumError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    except MemoryError as e:
        # MLX and Python raise it with an empty message; say what to lower
        detail = f" ({e})" if str(e) else ""
        print(f"error: out of memory{detail}: use a smaller model or --dtype, lower --max-num-seqs / "
              "FERRUM_PAGED_MAX_SEQS, or set FERRUM_KV_MAX_BLOCKS / FERRUM_KV_CAPACITY smaller", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - no traceback reaches the user
        print(f"error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
