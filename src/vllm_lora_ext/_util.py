"""Small helpers shared by the core (no vLLM, no torch)."""

from __future__ import annotations

import contextlib
import gc
import os
import reprlib
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
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


_POOLS: dict[tuple[str, int], tuple[int, ThreadPoolExecutor]] = {}
_POOLS_LOCK = threading.Lock()


def shared_pool(name: str, workers: int) -> ThreadPoolExecutor:
    """A process-wide pool of ``workers`` threads named ``name``: made on first use and kept, so that its threads
    start once per process rather than once per adapter load (on the 2-core dev VM, starting a read pool's
    threads took 6-12 ms of a 50 ms expert-parallel read).

    A forked child gets a new pool (the parent's threads do not exist there). Work given to a shared pool
    must never wait for other work of the same pool: concurrent callers share its threads, and a task
    that waited on the pool could wait forever.
    """
    key = (name, workers)
    pid = os.getpid()
    with _POOLS_LOCK:
        got = _POOLS.get(key)
        if got is None or got[0] != pid:
            got = _POOLS[key] = (pid, ThreadPoolExecutor(workers, thread_name_prefix=name))
        return got[1]
