"""Where shared files go and whose they are: the folder for a new one, its owned name, and the sweep of dead owners'.

A shared file is named for its owner's lock ([`sharedfiles.claim_owner`]), so that a server that starts after
one died mid-hand-over can tell which files nobody will ever read ([`sweep_stale`]).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid

from vllm_lora_ext.constants import build_dir
from vllm_lora_ext.sharedfiles import claim_owner, sweep_dead_owners

__all__ = ["owned_name", "shared_dir", "sweep_stale"]

SHARED_PREFIX = "vllm-lora-ext-"


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
