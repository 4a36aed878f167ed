"""Where shared files go and whose they are: the folder for a new one, its owned name, and the sweep of dead owners';
and a new ``/dev/shm`` file's mapping made ready for writing ([`map_for_writing`]).

A shared file is named for its owner's lock ([`sharedfiles.claim_owner`]), so that a server that starts after
one died mid-hand-over can tell which files nobody will ever read ([`sweep_stale`]).
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import sys
import tempfile
import uuid
from functools import lru_cache
from typing import Any

import torch

from vllm_lora_ext.constants import build_dir
from vllm_lora_ext.sharedfiles import claim_owner, sweep_dead_owners

__all__ = ["map_for_writing", "on_tmpfs", "owned_name", "shared_dir", "sweep_stale"]

logger = logging.getLogger(__name__)

SHARED_PREFIX = "vllm-lora-ext-"
_MADV_POPULATE_WRITE = 23  # Linux 5.14+: fault a range in, writable, without changing its bytes
_POPULATE_CHUNK = 64 << 20  # a call holds the process's memory-map lock over its whole range: other threads wait
_PAGE = 4096


def sweep_stale(directory: str) -> list[str]:
    """Remove shared files whose owner (a build process) is gone: a worker that died mid-hand-over left them.

    Owners are told apart by a lock they hold, not by pid ([`sharedfiles`]), so a live server in another PID
    namespace that shares ``/dev/shm`` keeps its files. Returns the names removed.
    """
    return sweep_dead_owners(directory, SHARED_PREFIX, suffix=".bin")


def owned_name(directory: str, tag: str = "") -> str:
    """A new shared file's path in ``directory``, named for this process's owner lock there."""
    owner = claim_owner(directory, SHARED_PREFIX)
    return os.path.join(directory, f"{SHARED_PREFIX}{owner}-{tag}{uuid.uuid4().hex}.bin")


def shared_dir(size: int) -> str:
    """Return where a ``size``-byte shared file goes: ``VLLM_LORA_EXT_BUILD_DIR``, else ``/dev/shm`` if it has room,
    else the temp dir (page cache)."""
    configured = build_dir()
    if configured:
        return configured
    try:
        if shutil.disk_usage("/dev/shm").free > size + (256 << 20):
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


@lru_cache(maxsize=64)
def on_tmpfs(directory: str) -> bool:
    """Whether ``directory`` lies on a tmpfs (``/proc/self/mounts``: the deepest mount point above it)."""
    try:
        real = os.path.realpath(directory)
        with open("/proc/self/mounts") as f:
            mounts = [fields[1:3] for fields in map(str.split, f) if len(fields) > 2]
    except OSError:
        return False
    best = ("", "")
    for point, kind in mounts:
        point = point.replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, kind)
    return best[1] == "tmpfs"


@lru_cache(maxsize=1)
def _madvise() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
    return fn


def map_for_writing(buffer: torch.Tensor, path: str) -> None:
    """Map every page of a new tmpfs file (pages allocated) writable in this process, 64 MiB a call: writes into a
    shared mapping get no fault-around, which made a 1.6 GB read into an allocated ``/dev/shm`` file 3.3x slower
    than into touched memory (H200 host, ``bench/results/probe_build_h200_r26.json``). Where the kernel refuses
    ``MADV_POPULATE_WRITE``, a write per page that keeps its byte. Not on disk, where it would dirty every page."""
    madvise = _madvise()
    if madvise is None or not on_tmpfs(os.path.dirname(path)):
        return
    base, n = buffer.data_ptr(), buffer.numel()
    for at in range(0, n, _POPULATE_CHUNK):
        size = min(_POPULATE_CHUNK, n - at)
        if madvise is not None and madvise(base + at, size, _MADV_POPULATE_WRITE) != 0:
            logger.debug("MADV_POPULATE_WRITE refused (errno %d): touching each page", ctypes.get_errno())
            madvise = None  # the rest by writes too
        if madvise is None:
            part = buffer[at:at + size:_PAGE]
            part.copy_(part.clone())
