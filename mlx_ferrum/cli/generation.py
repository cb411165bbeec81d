"""What ``generate`` and ``chat`` share: the sampling flags and the model's defaults for
them, the speculative and adapter flags, the engine a prompt streams through, and the
parallel run (rank 0 drives, the other ranks follow its steps).
"""

from __future__ import annotations

import argparse
from typing import Optional

from ..config import RuntimeConfig
from .args import load_model, positive_int, runtime_config, unit_interval

#: The flags a model's ``generation_config.json`` may set a default for (vLLM's keys), as
#: ``(args attribute, SamplingParams field)``.
_MODEL_DEFAULT_FLAGS = (("temp", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"), ("min_p", "min_p"),
                        ("repetition_penalty", "repetition_penalty"), ("max_tokens", "max_tokens"))


def add_sampling_args(p: argparse.ArgumentParser, temp: float, max_tokens: Optional[int] = 256) -> None:
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
    from ..generation_defaults import generation_defaults

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


def sampling_fields(args) -> dict:
    """The sampling flags of ``generate`` / ``chat`` as :class:`~mlx_ferrum.engine.SamplingParams`
    keyword arguments (``max_tokens`` in tokens, ``temperature`` from ``--temp``, ``stop`` as a
    list of strings); the model's generation defaults were applied to ``args`` before
    (:func:`apply_generation_defaults`). Raises nothing: the flags were checked by the parser."""
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


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    """``--speculative`` and the flags of its policy (each unset = its ``FERRUM_*`` variable)."""
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


def add_adapter_args(p: argparse.ArgumentParser) -> None:
    """``--adapter-path`` (mlx-lm's flag for one LoRA adapter)."""
    p.add_argument("--adapter-path", default=None, metavar="PATH",
                   help="a LoRA adapter to run with: a PEFT or mlx-lm adapter folder, or a hub repo id "
                        "(mlx-lm's flag; default: none)")


def command_config(args) -> RuntimeConfig:
    """The engine configuration of ``generate`` / ``chat``: their flags over the
    ``FERRUM_*`` variables over the defaults (LoRA on with ``--adapter-path``).

    Raises:
        ConfigurationError: a malformed value (the message names the flag).
    """
    overrides = {}
    if getattr(args, "adapter_path", None):
        overrides["enable_lora"] = True
    if args.paged:
        overrides["kv_layout"] = "paged"
    if getattr(args, "kv_cache_dtype", None) is not None:
        overrides["kv_cache_dtype"] = args.kv_cache_dtype
    if getattr(args, "kv_float_window", None) is not None:
        overrides["kv_float_window"] = args.kv_float_window
    if getattr(args, "speculative", None):
        overrides["speculative"] = args.speculative
    for name in ("num_speculative_tokens", "speculative_disable_by_batch_size", "speculative_min_acceptance",
                 "tensor_parallel_size", "pipeline_parallel_size", "distributed_backend", "pipeline_split"):
        if getattr(args, name, None) is not None:
            overrides[name] = getattr(args, name)
    return runtime_config(overrides)


class Streamer:
    """Streams one prompt at a time through one engine: a parallel run's lockstep engine,
    else the engine cached on the model for ``config``
    (:func:`~mlx_ferrum.api.engine_for`, which also runs speculative decoding).

    Args:
        model, tokenizer: from :func:`mlx_ferrum.load`.
        config: the run's settings (:func:`command_config`).
        adapter_path: a LoRA adapter (folder or hub id), registered now, so a bad adapter
            fails at start-up rather than at the first prompt; None runs the base model.
        engine: rank 0's lockstep engine of a parallel run, or None.

    Raises:
        LoraError: the adapter cannot be read or does not fit the model.
    """

    def __init__(self, model, tokenizer, config: RuntimeConfig, adapter_path: Optional[str] = None, engine=None):
        from ..api import _lora_config, engine_for

        self.lora = adapter_path or None
        if engine is None:
            if self.lora:
                config, self.lora = _lora_config(model, config, self.lora)
            engine = engine_for(model, tokenizer, config)
        self.engine = engine

    def __call__(self, prompt, sampling: dict):
        """:class:`~mlx_ferrum.api.GenerationChunk` s of ``prompt`` (text or messages) under
        the :class:`~mlx_ferrum.engine.sampling.SamplingParams` fields ``sampling``; see
        :func:`~mlx_ferrum.api.stream_request` for the errors raised."""
        from ..api import stream_request
        from ..engine.sampling import SamplingParams

        return stream_request(self.engine, prompt, SamplingParams(**sampling), lora=self.lora)


class ParallelRun:
    """A parallel run of a one-shot command (``generate``, ``chat``): the group, this
    rank's model and the lockstep engine; ranks other than 0 follow rank 0's steps.

    Use as a context manager on rank 0: leaving it (normally, on an error or Ctrl-C)
    tells the other ranks to stop, so no rank is left waiting.
    """

    def __init__(self, args, config: RuntimeConfig):
        from ..distributed import init_group, lockstep_engine

        if config.parallel != "none" and getattr(args, "adapter_path", None):
            from ..distributed.lockstep import check_lockstep_config

            check_lockstep_config(config)
        self.group = init_group(config)
        self.model, self.tokenizer = load_model(args) if self.group is None else load_model(args, self.group)
        self.engine = (lockstep_engine(self.model, self.tokenizer, config, self.group)
                       if self.group is not None else None)

    @property
    def follower(self) -> bool:
        return self.group is not None and not self.group.is_driver

    def follow(self) -> int:
        """Run rank 0's steps until it stops; exit status 0."""
        self.engine.follow()
        return 0

    def __enter__(self) -> "ParallelRun":
        return self

    def __exit__(self, *exc) -> None:
        if self.engine is not None:
            self.engine.close()


def run_with_parallelism(args, body) -> int:
    """Load per ``args`` (a parallel group when asked) and run ``body(args, model,
    tokenizer, config, engine)`` on rank 0; the other ranks follow its steps."""
    config = command_config(args)
    run = ParallelRun(args, config)
    if run.follower:
        return run.follow()
    with run:
        return body(args, run.model, run.tokenizer, config, run.engine)


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
