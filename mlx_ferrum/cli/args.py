"""What every ``mlx-ferrum`` command shares: the parser classes, the named argparse
type functions (each error says what is accepted), the model flags, and the
:class:`~mlx_ferrum.config.RuntimeConfig` built from flags (an error names the flag).
"""

from __future__ import annotations

import argparse

from ..config import (
    _FALSE,
    _TRUE,
    DISTRIBUTED_BACKENDS,
    FIELD_HELP,
    KV_CACHE_DTYPES,
    RuntimeConfig,
)
from ..errors import ConfigurationError


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


def _whole_number_at_least(raw: str, minimum: int) -> int:
    try:
        value = int(raw.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{raw!r} is not a whole number: give an integer >= {minimum}") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{raw!r} is not valid: give an integer >= {minimum}")
    return value


def positive_int(raw: str) -> int:
    """A whole number >= 1.

    Raises:
        argparse.ArgumentTypeError: not a whole number, or below 1.
    """
    return _whole_number_at_least(raw, 1)


def non_negative_int(raw: str) -> int:
    """A whole number >= 0.

    Raises:
        argparse.ArgumentTypeError: not a whole number, or below 0.
    """
    return _whole_number_at_least(raw, 0)


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


def lora_module(raw: str) -> tuple[str, str]:
    """``--lora-modules`` item ``name=path`` (vLLM's form) -> ``(name, path)``."""
    name, sep, path = raw.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"{raw!r} is not NAME=PATH: give e.g. sql-lora=./adapters/sql")
    return name.strip(), path.strip()


def add_gguf_arg(p: argparse.ArgumentParser) -> None:
    """``--gguf-file`` (the file to pick from a folder or hub repo of GGUF files)."""
    p.add_argument("--gguf-file", default=None, metavar="NAME",
                   help="the .gguf file to load from the --model folder or hub repo (default: none; a .gguf "
                        "path, or a folder holding one GGUF model, needs no flag)")


def add_model_args(p: argparse.ArgumentParser) -> None:
    """``--model`` and the flags that say how to load and lay it out (``generate``,
    ``chat``, ``bench``; ``serve`` has its own list)."""
    p.add_argument("--model", required=True, help="checkpoint folder, .gguf file or Hugging Face repo id")
    add_gguf_arg(p)
    p.add_argument("--dtype", default=None, choices=DTYPES,
                   help="cast the weights to this dtype (default: the checkpoint's own)")
    p.add_argument("--paged", action="store_true", help="use the paged KV cache (same as FERRUM_METAL_PAGED_KV=1)")
    p.add_argument("--kv-cache-dtype", default=None, type=str.lower, choices=KV_CACHE_DTYPES,
                   help=f"{FIELD_HELP['kv_cache_dtype']} (default: $FERRUM_KV_CACHE_DTYPE, else auto)")
    p.add_argument("--kv-float-window", default=None, type=non_negative_int, metavar="N",
                   help=f"{FIELD_HELP['kv_float_window']} (default: $FERRUM_KV_FLOAT_WINDOW, else 64)")
    add_parallel_args(p)


def add_parallel_args(p: argparse.ArgumentParser) -> None:
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



def runtime_config(overrides: dict) -> RuntimeConfig:
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


def load_model(args, parallel=None):
    """``mlx_ferrum.load`` of ``--model`` with ``--dtype`` / ``--gguf-file``; ``parallel``:
    the :class:`~mlx_ferrum.distributed.ParallelGroup` to split it across, or None.

    Raises:
        ModelLoadError: see :func:`mlx_ferrum.load`.
    """
    from ..api import load

    return load(args.model, dtype=args.dtype, parallel=parallel, gguf_file=getattr(args, "gguf_file", None))
