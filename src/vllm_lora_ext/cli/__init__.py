"""The ``vllm-lora`` command: ``inspect``, ``fetch``, ``convert`` and ``mix`` (no GPU, no vLLM needed).

Exit codes: 0 ok, 1 the adapter or source failed (message on stderr), 2 usage error.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from vllm_lora_ext.errors import VllmLoraExtError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    from vllm_lora_ext.cli import convert, fetch, inspect, mix

    p = argparse.ArgumentParser(prog="vllm-lora", description="Inspect and fetch LoRA adapters for vLLM.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)")
    p.add_argument("-q", "--quiet", action="store_true", help="errors only")
    sub = p.add_subparsers(dest="command", required=True)
    inspect.add_parser(sub)
    fetch.add_parser(sub)
    convert.add_parser(sub)
    mix.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the CLI and return its exit code."""
    parser = _parser()
    args = parser.parse_args(argv)
    level = logging.ERROR if args.quiet else (logging.DEBUG if args.verbose > 1 else
                                              logging.INFO if args.verbose else logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("vllm_lora_ext").setLevel(level)
    try:
        return int(args.func(args))
    except VllmLoraExtError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
