"""``mlx-ferrum generate``: one completion streamed to stdout, statistics to stderr.

stdout carries exactly the generated text (``--newline`` ends it with one), so it can
be piped; ``-p -`` reads the prompt from stdin.
"""

from __future__ import annotations

import sys

from ..config import RuntimeConfig
from ..errors import ConfigurationError
from .args import HelpFormatter, add_model_args
from .generation import (Streamer, add_adapter_args, add_sampling_args, add_speculative_args,
                         apply_generation_defaults, parallel_summary, run_with_parallelism, sampling_fields,
                         speculative_summary)


def add_parser(sub) -> None:
    """Add ``generate`` and its flags to the subcommands ``sub``."""
    g = sub.add_parser("generate", help="generate a completion for one prompt", formatter_class=HelpFormatter)
    add_model_args(g)
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
    add_sampling_args(g, temp=0.0)
    add_speculative_args(g)
    add_adapter_args(g)
    g.set_defaults(func=cmd_generate)


def cmd_generate(args) -> int:
    """Stream one completion to stdout; stats to stderr (rank 0 of a parallel run; the
    other ranks run its steps)."""
    check_generate_flags(args)
    return run_with_parallelism(args, _generate)


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
    streamer = Streamer(model, tokenizer, config, args.adapter_path, engine=engine)
    for chunk in streamer(prompt, sampling_fields(args)):
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
        if config.speculative is not None:
            print(speculative_summary(streamer.engine.stats()), file=sys.stderr)
        if engine is not None:
            print(parallel_summary(engine.stats()), file=sys.stderr)
    return 0
