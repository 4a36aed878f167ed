"""Small helpers shared by the core (no vLLM, no torch)."""

from __future__ import annotations

import contextlib
import errno
import gc
import os
import reprlib
import stat
from collections.abc import Iterator
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxstring = 80
_REPR.maxother = 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 3


def read_capped(path: str | os.PathLike[str], limit: int) -> tuple[bytes, bool]:
    """Read at most ``limit + 1`` bytes of a file; return them and whether the file is larger than ``limit``.

    Raises:
        OSError: also when ``path`` is not a regular file (a FIFO, a device, a folder); the open never waits.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting for a writer
    with open(fd, "rb", closefd=True) as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else "not a regular file"
            raise OSError(errno.EINVAL, f"is {kind}; a regular file is needed", os.fspath(path))
        os.set_blocking(fd, True)
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


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a block builds many objects, e.g. a 37k-entry header.

    Such a block triggers collections that walk the whole heap and multiply its time, unpredictably
    (measured: a 9,216-key header parse took 33-140 ms with the collector on, 42-54 ms with it paused).
    Nested uses are fine; the collector is re-enabled only by the use that paused it.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
