"""Who owns a file left in a shared folder (``/dev/shm``, the temp dir), and when it may be removed.

Build processes hand adapters over in files in ``/dev/shm``, and every top-level process keeps its
metrics in a folder of the temp dir. A process killed at the wrong moment leaves them behind, so the
next process sweeps what dead owners left. A pid cannot tell whether an owner is dead: a server in
another PID namespace that shares ``/dev/shm`` (``docker --ipc=host``) sees no process of that pid,
and pids are reused. Instead each owner holds a lock (``flock``) on a lock file beside its files, for
as long as it (or a process that inherited the descriptor) lives. The kernel drops the lock when the
last such process exits, in any namespace, and a reboot drops every lock. A sweeper that can take the
lock knows the owner is gone; one that cannot leaves the files alone.

Names: an owner's tag is ``<pid>.<random hex>``; its lock file is ``<stem><tag>.lock`` and its files
start with ``<stem><tag>-``. Files named with a bare pid (``<stem><pid>-...``, no dot in the tag)
have no lock and are never swept.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
import threading
import uuid

__all__ = ["claim_owner", "dead_owner_lock", "folder_problem", "release_owner", "reserve_when_tight",
           "sweep_dead_owners"]

_LOCK_SUFFIX = ".lock"
_GUARD = threading.Lock()
_HELD: dict[tuple[int, str, str], tuple[str, int]] = {}  # (pid, folder, stem) -> (tag, descriptor holding the lock)


def claim_owner(folder: str, stem: str) -> str:
    """Return this process's owner tag in ``folder``, creating and locking its lock file on first use.

    The lock file is created under a temporary name, locked, then renamed into place, so no sweeper
    ever sees it unlocked while its owner lives.

    Raises:
        OSError: the lock file cannot be created in ``folder``.
    """
    key = (os.getpid(), os.path.realpath(folder), stem)
    with _GUARD:
        held = _HELD.get(key)
        if held is not None and _still_locked(os.path.join(folder, f"{stem}{held[0]}{_LOCK_SUFFIX}"), held[1]):
            return held[0]
        # A lock file that went (the folder was cleaned) is made again under the same tag: the files named for
        # the tag stay this process's while it lives, and a sweep after it dies removes them. Its descriptor is
        # closed once, here, and forgotten (closed twice, a number reused meanwhile would be another file's).
        if held is not None:
            del _HELD[key]
            os.close(held[1])
        tag = held[0] if held is not None else f"{os.getpid()}.{uuid.uuid4().hex[:12]}"
        final = os.path.join(folder, f"{stem}{tag}{_LOCK_SUFFIX}")
        temporary = final + ".new"
        fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.rename(temporary, final)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(temporary)
            except OSError:
                pass
            raise
        _HELD[key] = (tag, fd)
        return tag


def _still_locked(path: str, fd: int) -> bool:
    """Whether the lock file at ``path`` is the one ``fd`` holds locked."""
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except OSError:
        return False


def release_owner(folder: str, stem: str) -> None:
    """Remove this process's lock file in ``folder`` and drop its lock (its files are gone: a clean exit)."""
    key = (os.getpid(), os.path.realpath(folder), stem)
    with _GUARD:
        held = _HELD.pop(key, None)
    if held is not None:
        try:
            os.unlink(os.path.join(folder, f"{stem}{held[0]}{_LOCK_SUFFIX}"))
        except OSError:
            pass
        os.close(held[1])


def dead_owner_lock(lock_path: str) -> int | None:
    """Take the lock of ``lock_path`` if its owner is gone and return the descriptor holding it; ``None`` if the
    owner lives (or the file cannot be opened)."""
    try:
        fd = os.open(lock_path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def sweep_dead_owners(folder: str, stem: str, *, suffix: str = "") -> list[str]:
    """Remove every entry of ``folder`` named ``<stem><tag>-...<suffix>`` whose owner's lock can be taken, then the
    lock file itself; return the names removed. Entries of live owners, and entries without a tag, stay.

    An entry that is a folder is removed with its contents.
    """
    try:
        names = os.listdir(folder)
    except OSError:
        return []
    owners: dict[str, list[str]] = {}
    for name in names:
        if name.startswith(stem) and name.endswith(_LOCK_SUFFIX):
            owners.setdefault(name[len(stem):-len(_LOCK_SUFFIX)], [])
    for name in names:
        if name.startswith(stem) and name.endswith(suffix) and not name.endswith((_LOCK_SUFFIX, ".new")):
            tag = name[len(stem):].split("-", 1)[0]
            if tag in owners:
                owners[tag].append(name)
    removed: list[str] = []
    for tag, entries in owners.items():
        lock_path = os.path.join(folder, f"{stem}{tag}{_LOCK_SUFFIX}")
        fd = dead_owner_lock(lock_path)
        if fd is None:
            continue
        try:
            for name in entries:
                if _remove(os.path.join(folder, name)):
                    removed.append(name)
            os.unlink(lock_path)  # last: an interrupted sweep is finished by the next one
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


def _remove(path: str) -> bool:
    import shutil

    try:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except OSError:
        return False
    return True


def reserve_when_tight(fd: int, folder: str, size: int, *, prefix: str) -> None:
    """Allocate the first ``size`` bytes of the file ``fd`` now when ``folder`` has less than ``size`` + 64 MiB free,
    counting as taken the pages the other sparse files named ``prefix…`` there may still take.

    A sparse file written through a mapping takes its pages as they are written, and a page that a full
    ``/dev/shm`` cannot give kills the writer (SIGBUS). With plenty of room the file stays sparse (its
    unwritten pages cost nothing); when room is tight, running out is an ``OSError`` here instead. Each sparse
    file's holes are counted (every process's, in the folder), so two that fit alone but not together do not
    both stay sparse.

    Raises:
        OSError: ``size`` bytes do not fit (``ENOSPC``).
    """
    import shutil

    try:
        free = shutil.disk_usage(folder).free - _holes(folder, prefix, skip=os.fstat(fd).st_ino)
    except OSError:
        free = 0
    if free < size:  # even allocated now, it would take pages another sparse file was counting on
        raise OSError(errno.ENOSPC, f"{size} bytes do not fit in {folder!r} beside the shared files already there "
                                    f"({max(free, 0)} bytes left)")
    if free < size + (64 << 20):
        os.posix_fallocate(fd, 0, size)


def _holes(folder: str, prefix: str, *, skip: int) -> int:
    """The bytes the sparse files named ``prefix…`` in ``folder`` (but inode ``skip``) have yet to take."""
    total = 0
    with os.scandir(folder) as entries:
        for entry in entries:
            if entry.name.startswith(prefix) and entry.is_file(follow_symlinks=False):
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # removed meanwhile
                    continue
                if st.st_ino != skip:
                    total += max(0, st.st_size - st.st_blocks * 512)
    return total


def folder_problem(folder: str) -> str | None:
    """Return why files cannot be created in ``folder`` (missing, not a folder, read-only, full), or ``None``.

    Tries: a file is created and removed, which also catches a read-only mount that ``os.access`` misses for root.
    """
    if not os.path.exists(folder):
        return "does not exist"
    if not os.path.isdir(folder):
        return "is not a folder"
    try:
        fd, probe = tempfile.mkstemp(prefix=".vllm-lora-ext-probe-", dir=folder)
    except OSError as err:
        return f"cannot be written ({err.strerror or err})"
    os.close(fd)
    os.unlink(probe)
    return None
