"""The ``mlx-ferrum`` command line: ``generate``, ``chat``, ``bench``, ``serve``.

``generate`` writes only the generated text to stdout; statistics (prompt and decode
tokens per second, peak memory) go to stderr, so the output can be piped; ``-p -``
reads the prompt from stdin. ``chat`` keeps the conversation within the context by
dropping its oldest turns (never the system message). No traceback reaches the user:
errors print one ``error: ...`` line (``chat`` then goes on); a malformed flag exits 2
with argparse's usage line, a refused setting or input exits 2, an unexpected error 1,
and Ctrl-C 130.
``python -m mlx_ferrum`` runs the same entry point.

One module per command (:mod:`.generate`, :mod:`.chat`, :mod:`.bench`, :mod:`.serve`),
each adding its subparser; :mod:`.generation` holds what ``generate`` and ``chat``
share, :mod:`.args` what every command shares. Nothing here imports MLX: the heavy
imports happen inside the commands, under :func:`main`'s Ctrl-C handler.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ..errors import FerrumError
from . import bench, chat, generate, serve
from .args import ArgumentParser, HelpFormatter


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``mlx-ferrum``."""
    from .. import __version__

    parser = ArgumentParser(prog="mlx-ferrum", description="LLM inference on MLX", formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"mlx-ferrum {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    generate.add_parser(sub)
    chat.add_parser(sub)
    bench.add_parser(sub)
    serve.add_parser(sub)
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
