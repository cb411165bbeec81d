"""``mlx-ferrum serve``: the OpenAI- and Anthropic-compatible HTTP server.

One flag per :class:`~mlx_ferrum.config.RuntimeConfig` field (``--block-size`` ...,
each unset = its ``FERRUM_*`` variable) and one per
:class:`~mlx_ferrum.server.limits.ServerLimits` field; the paged layout by default. The
socket is bound before the model loads, so a taken port fails at once.
"""

from __future__ import annotations

import argparse
import errno
import socket
import sys

from ..config import DISTRIBUTED_BACKENDS, FIELD_HELP, KV_CACHE_DTYPES, RuntimeConfig
from ..errors import ChatTemplateError, ConfigurationError
from .args import (
    DTYPES,
    HelpFormatter,
    add_gguf_arg,
    api_key,
    boolean,
    fraction,
    load_model,
    lora_module,
    non_negative_int,
    port_number,
    positive_int,
    runtime_config,
    unit_interval,
)

#: ``serve``'s default ``max_num_prefill_seqs`` (the Python API has no cap, as vLLM's
#: offline and online entry points differ in their batching defaults): on the chat
#: workload of ``benchmarks/bench_serving.py`` (32 clients whose requests come in waves),
#: median time to first token was 0.25-0.28 s with 4 against 0.39 s uncapped and 0.44 s
#: with 8, for up to 7 % fewer tokens per second (docs/benchmarks.md, "Findings behind the defaults").
SERVE_MAX_NUM_PREFILL_SEQS = 4


def add_parser(sub) -> None:
    """Add ``serve`` and its flags to the subcommands ``sub``."""
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", formatter_class=HelpFormatter)
    s.add_argument("--model", required=True, help="checkpoint folder, .gguf file or Hugging Face repo id")
    add_gguf_arg(s)
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
    add_runtime_args(s)
    # the server's limits: one flag per ServerLimits field, refused requests name the flag
    from dataclasses import fields

    from ..server.limits import ServerLimits, flag_of

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


def _runtime_flag_type(parse, name: str = ""):
    """The argparse type of a RuntimeConfig field's flag (None: argparse ``choices`` check it)."""
    from ..config import _parse_bool, _parse_float, _parse_int

    if parse is _parse_bool:
        return boolean
    if parse is _parse_float:
        return unit_interval if name == "speculative_min_acceptance" else fraction
    if parse is _parse_int:
        return non_negative_int if name == "kv_float_window" else positive_int
    return None


def add_runtime_args(p: argparse.ArgumentParser) -> None:
    """One flag per :class:`RuntimeConfig` field (``--block-size`` ...); unset = its FERRUM_* variable."""
    from dataclasses import fields

    from ..config import _ENV

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
            metavar={boolean: "{1,0}", positive_int: "N", non_negative_int: "N", fraction: "F",
                     unit_interval: "F"}.get(kind)
            if f.name not in choices else None,
            help=f"{FIELD_HELP[f.name]} (default: ${var}, else {default})",
        )


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
    return runtime_config(overrides)


def _serve_sampling_defaults(args, model) -> dict:
    """``serve``'s defaults for request fields left unset, per ``--generation-config``."""
    from ..generation_defaults import generation_defaults

    return generation_defaults(getattr(model, "path", None), args.generation_config)


def cmd_serve(args) -> int:
    """The OpenAI-compatible HTTP server (see ``mlx_ferrum.server``)."""
    import logging
    import os
    from dataclasses import fields

    from ..server import run_server

    config = serve_config(args)
    from ..server.limits import ServerLimits

    limits = ServerLimits(**{f.name: getattr(args, f.name) for f in fields(ServerLimits)})  # checked before the model loads
    template = None
    if args.chat_template is not None:
        try:
            with open(args.chat_template, encoding="utf-8") as fh:
                template = fh.read()
        except OSError as e:
            raise ChatTemplateError(f"cannot read --chat-template {args.chat_template!r}: {e.strerror}: give a readable Jinja file") from None
    from ..distributed import init_group, lockstep_engine

    group = init_group(config)
    if group is not None and not group.is_driver:
        # only rank 0 listens; this rank runs the steps rank 0 broadcasts
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        model, tokenizer = load_model(args, group)
        lockstep_engine(model, tokenizer, config, group).follow()
        code = 0
    else:
        sock = bind_socket(args.host, args.port)
        host, port = args.host, sock.getsockname()[1]
        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        model, tokenizer = load_model(args) if group is None else load_model(args, group)
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
