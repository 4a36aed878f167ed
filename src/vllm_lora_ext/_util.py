"""Small helpers shared by the core (no vLLM, no torch)."""

from __future__ import annotations

import os
import reprlib
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxstring = 80
_REPR.maxother = 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 3


def read_capped(path: str | os.PathLike[str], limit: int) -> tuple[bytes, bool]:
    """Read at most ``limit + 1`` bytes of a file; return them and whether the file is larger than ``limit``."""
    with open(path, "rb") as f:
        data = f.read(limit + 1)
    return data, len(data) > limit


def short_repr(value: Any) -> str:
    """Return a bounded ``repr`` for error messages (a hostile value is never echoed whole).

    Example:
        >>> short_repr("x" * 1000)[:12]
        "'xxxxxxxxxxx"
        >>> len(short_repr(list(range(10**6)))) < 100
        True
    """
    return _REPR.repr(value)
