"""The ``vllm-lora`` command: ``inspect``, ``fetch``, ``convert`` and ``mix`` (no GPU, no vLLM needed).

Exit codes: 0 ok, 1 the adapter, source or output failed (one ``error:`` line on stderr, never a
traceback; ``-vv`` adds it), 2 usage error, 130 interrupted.
"""

from __future__ import annotations

import argparse
import logging
import sys
import traceback
from collections.abc import Sequence

from vllm_lora_ext.constants import MAX_EXPERTS
from vllm_lora_ext.errors import VllmLoraExtError

__all__ = ["main", "positive_int"]


def positive_int(text: str) -> int:
    """argparse type: an integer from 1 to 65536."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= MAX_EXPERTS:
        raise argparse.ArgumentTypeError(f"{value} is out of range; give an integer from 1 to {MAX_EXPERTS}")
    return value


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
    from vllm_lora_ext.cli import verify
    verify.add_parser(sub)

    from vllm_lora_ext.cli import cache as cache_cli  # issue 41: the disk tier

    cache_cli.add_parser(sub)
    return p


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return text if len(text) <= 2000 else text[:2000] + " ..."


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
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except (VllmLoraExtError, OSError) as err:
        if args.verbose > 1:
            traceback.print_exc()
        print(f"error: {_one_line(err)}", file=sys.stderr)
        return 1
    except Exception as err:  # never a bare traceback: name the failure, keep the traceback for -vv
        if args.verbose > 1:
            traceback.print_exc()
        print(f"error: unexpected {type(err).__name__}: {_one_line(err)} (run with -vv for details)", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
