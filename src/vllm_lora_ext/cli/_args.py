"""argparse helpers the subcommands share (a leaf: the subcommands import it, it imports no subcommand)."""

from __future__ import annotations

import argparse

from vllm_lora_ext.constants import MAX_EXPERTS

__all__ = ["positive_int", "plural"]


def positive_int(text: str) -> int:
    """argparse type: an integer from 1 to 65536."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= MAX_EXPERTS:
        raise argparse.ArgumentTypeError(f"{value} is out of range; give an integer from 1 to {MAX_EXPERTS}")
    return value


def plural(n: int, word: str) -> str:
    """``1 adapter``, ``2 adapters``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
