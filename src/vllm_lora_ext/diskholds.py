"""In-use marks ("holds") on cached adapter revisions, shared by every process that uses one Hugging Face cache.

A hold says: do not evict this revision. It is ``(repo_id, revision, why)``. A commit sha holds that one
revision; a branch, a tag or no revision holds every revision of the repo, because an evictor cannot tell
which commit the name meant when the hold was made (a build of ``hf:acme/sql@main`` is safe from eviction
before it knows its commit).

Layout, under ``<HF cache>/.locks/vllm_lora_ext/`` (huggingface_hub's cache scan skips ``.locks``)::

    state.lock                one lock (``filelock``) for the ledger and every holds file; held briefly (a reader
                              that writes nothing, ``vllm-lora cache ls``, takes it shared: [`reading`])
    holds/<pid>-<hex>.json    one process's holds, rewritten whole (write, then rename) under ``state.lock``
    holds/<pid>-<hex>.lock    held by that process for as long as it lives

A hold may also reserve bytes: a download in progress into the revision holds it, with the bytes it is about to
add (the room made so far, grown as its bytes arrive) and the size its Hub announced (once per file, however many
processes fetch that file), until it is listed in the ledger. An evictor making room evicts around the reserved
bytes; a new download checks that it fits beside the announced ones, so two downloads never count on the same
room. No cache-wide lock is held while a file transfers.

A process takes its ``.lock`` before it writes its first hold and never lets it go; the OS drops it when
the process dies. An evictor (under ``state.lock``) tries each ``.lock``: if it can take it, the owner is
dead and its holds are void, so it removes both files. Holds are therefore kept per process, survive
nothing but their process, and two servers sharing one cache see each other's.

This module keeps per-process state (the holds this process made and its owner lock), reset in a forked child.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import fcntl
import json
import logging
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from vllm_lora_ext.constants import MAX_STATE_FILE_BYTES
from vllm_lora_ext.hubguard import COMMIT_SHA

__all__ = ["DiskHold", "HeldSources", "Hold", "cache_path", "hold", "holding", "live_holds", "locked",
           "read_state_file", "reading", "reserved_bytes", "state_root", "write_in_place"]

logger = logging.getLogger(__name__)

_LOCK_TIMEOUT_S = 120.0
_ANY_REPO = "*"  # a live process whose holds file cannot be read holds every revision


def cache_path(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the Hugging Face hub cache folder (``cache_dir``, else huggingface_hub's, read now)."""
    if cache_dir is not None:
        return Path(os.path.expanduser(cache_dir))
    from huggingface_hub import constants

    return Path(os.path.expanduser(constants.HF_HUB_CACHE))


def state_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Return the folder of the plugin's bookkeeping inside the hub cache."""
    return cache_path(cache_dir) / ".locks" / "vllm_lora_ext"


@dataclass(frozen=True)
class Hold:
    """One live hold, as an evictor sees it.

    Attributes:
        repo_id: ``org/repo`` (``"*"``: every repo, for a live process whose holds cannot be read).
        revision: a commit sha (that revision), or a branch, tag or ``None`` (every revision of the repo).
        why: what holds it, e.g. ``"adapter 'sql' (registered)"``.
        pid: the holding process.
        reserve_key: the file a download in progress fetches (``repo@commit:file``), or ``None``.
        reserved: the bytes that download is about to add (evicted for; counted as used until it ends).
        announced: the bytes its Hub announced, at least ``reserved`` (counted when a new download checks that it
            can fit, so two downloads never both count on the same room).
    """

    repo_id: str
    revision: str | None
    why: str
    pid: int
    reserve_key: str | None = None
    reserved: int = 0
    announced: int = 0

    def covers(self, repo_id: str, commit: str) -> bool:
        """Whether this hold keeps revision ``commit`` of ``repo_id`` from eviction."""
        if self.repo_id == _ANY_REPO:
            return True
        if self.repo_id != repo_id:
            return False
        return self.revision is None or not COMMIT_SHA.match(self.revision) or self.revision == commit


class _Root:
    """This process's state for one cache: the state lock, the owner lock and the holds it made."""

    def __init__(self, root: Path) -> None:
        from filelock import FileLock

        self.root = root
        self.tlock = threading.RLock()  # one thread at a time; a thread may nest `locked`
        self.state_lock = FileLock(str(root / "state.lock"), thread_local=False)
        self.depth = 0
        self.name = f"{os.getpid()}-{secrets.token_hex(6)}"
        self.owner: Any = None
        self.holds: dict[str, dict[str, Any]] = {}

    def take_owner(self) -> None:
        if self.owner is not None and not os.path.exists(self.owner.lock_file):  # an operator removed .locks
            with contextlib.suppress(Exception):
                self.owner.release(force=True)
            self.owner = None
        if self.owner is None:
            from filelock import FileLock

            (self.root / "holds").mkdir(parents=True, exist_ok=True)
            owner = FileLock(str(self.root / "holds" / f"{self.name}.lock"), thread_local=False)
            owner.acquire(timeout=_LOCK_TIMEOUT_S)
            self.owner = owner

    def write(self) -> None:
        if not self.holds:  # nothing held (or never anything): no files left behind for an evictor to sweep
            self.drop_files()
            return
        self.take_owner()  # again if the folder went: other processes must see these holds
        write_in_place(self.root / "holds" / f"{self.name}.json",
                       json.dumps({"pid": os.getpid(), "holds": list(self.holds.values())}))

    def drop_files(self) -> None:
        """Remove this process's holds file and owner lock (call under the state lock)."""
        if self.owner is None:
            return
        with contextlib.suppress(OSError):
            (self.root / "holds" / f"{self.name}.json").unlink(missing_ok=True)
            Path(self.owner.lock_file).unlink(missing_ok=True)
        with contextlib.suppress(Exception):
            self.owner.release(force=True)
        self.owner = None


def _drop_all_at_exit() -> None:
    """At interpreter exit: this process's holds end with it, and its files go (a crash leaves them to the next
    evictor, which finds their owner lock free)."""
    with _STATE_LOCK:
        roots = list(_STATE["roots"].values()) if _STATE["pid"] == os.getpid() else []
    for state in roots:  # without waiting: where another thread or process holds the state lock, the files stay
        if state.owner is None:
            continue
        with contextlib.suppress(Exception), locked(state.root, wait=False):
            state.holds.clear()
            state.drop_files()


def read_state_file(path: Path) -> str:
    """The text of a ledger or holds file: a regular file of at most ``MAX_STATE_FILE_BYTES``, opened without
    waiting (a FIFO put in its place would hang every process that reads it under the cache's lock).

    Raises:
        OSError: it cannot be opened or read. ValueError: it is no regular file, or larger than the cap.
    """
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        if st.st_size > MAX_STATE_FILE_BYTES:
            raise ValueError(f"larger than {MAX_STATE_FILE_BYTES} bytes")
        return f.read(MAX_STATE_FILE_BYTES + 1).decode()


def write_in_place(path: Path, text: str) -> None:
    """Rewrite a small file without a rename. Call under [`locked`]: every reader reads under the same lock, so
    none sees it half-written (a holds file torn by its owner's crash is void anyway: its owner is dead)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    with os.fdopen(fd, "r+") as f:
        f.write(text)
        f.truncate()


_STATE_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"pid": None, "roots": {}}


def _root_state(root: Path) -> _Root:
    with _STATE_LOCK:
        if _STATE["pid"] != os.getpid():  # first use, or a forked child: never share the parent's holds file
            if _STATE["pid"] is None:
                atexit.register(_drop_all_at_exit)
            _STATE.update(pid=os.getpid(), roots={})
        roots: dict[str, _Root] = _STATE["roots"]
        key = os.path.abspath(root)
        if key not in roots:
            root.mkdir(parents=True, exist_ok=True)
            roots[key] = _Root(root)
        return roots[key]


@contextlib.contextmanager
def locked(root: Path, *, wait: bool = True) -> Iterator[None]:
    """Hold the cache's state lock (re-entrant within a thread; other threads and processes wait, or with
    ``wait=False`` it raises at once where one holds it: ``TimeoutError``, or filelock's ``Timeout``)."""
    state = _root_state(root)
    if not state.tlock.acquire(blocking=wait):
        raise TimeoutError(f"another thread holds the disk cache state of {root}")
    try:
        if state.depth == 0:
            state.state_lock.acquire(timeout=_LOCK_TIMEOUT_S if wait else 0)
        state.depth += 1
        try:
            yield
        finally:
            state.depth -= 1
            if state.depth == 0:
                state.state_lock.release()
    finally:
        state.tlock.release()


@contextlib.contextmanager
def reading(root: Path) -> Iterator[None]:
    """Hold the cache's state still for a reader that writes nothing (``vllm-lora cache ls``): a shared lock on the
    existing ``state.lock``, opened read-only, so writers wait and a read-only cache can be read; no file or folder
    is made (without a ``state.lock`` no writer has run yet: nothing is locked). Within a thread that holds
    [`locked`] already, nothing more is taken."""
    with _STATE_LOCK:
        state = _STATE["roots"].get(os.path.abspath(root)) if _STATE["pid"] == os.getpid() else None
    with state.tlock if state is not None else contextlib.nullcontext():  # (another thread's `locked` waits)
        if state is not None and state.depth:
            yield
            return
        try:
            fd = os.open(root / "state.lock", _PROBE_FLAGS)
        except OSError:  # (a symlink there too: writers' filelock opens it O_NOFOLLOW, so it locks nothing)
            yield
            return
        try:
            deadline = time.monotonic() + _LOCK_TIMEOUT_S
            while True:
                try:
                    if _try_flock(fd, fcntl.LOCK_SH):
                        break
                except OSError as err:  # no flock on this file system (ENOSYS, ...): filelock's soft lock guards
                    logger.debug("vllm_lora_ext: %s cannot be locked shared (%s); read as it is", root, err)
                    break  # the writers there; the listing reads without a lock, as where no state.lock exists
                if time.monotonic() > deadline:
                    raise TimeoutError(f"another process holds the disk cache state of {root}")
                time.sleep(0.01)
            yield
        finally:
            os.close(fd)  # (drops the lock)


# A lock file opened to probe it: never waiting (a FIFO), never through a symlink (filelock opens lock files
# O_NOFOLLOW, so a link planted there is no lock, and opening what it names may have side effects: a device).
_PROBE_FLAGS = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NOFOLLOW", 0)
# What flock answers for a lock another holds: EAGAIN, and EACCES on some file systems (as filelock counts them).
_CONTENTION = frozenset({errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES})


def _try_flock(fd: int, kind: int) -> bool:
    """Whether a non-blocking ``flock`` of ``kind`` was taken (False: another holds it; other failures raise)."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in _CONTENTION:
            return False
        raise
    return True


class DiskHold:
    """A hold this process made; [`release`](DiskHold.release) ends it (idempotent). Usable as a context manager."""

    def __init__(self, root: Path, token: str, entry: dict[str, Any]) -> None:
        self.root = root
        self.token = token
        self.repo_id: str = entry["repo_id"]
        self.revision: str | None = entry["revision"]
        self.why: str = entry["why"]

    def release(self) -> None:
        """End the hold (nothing happens if it already ended, or in a forked child that did not make it)."""
        try:
            state = _root_state(self.root)
            with locked(self.root):
                if state.holds.pop(self.token, None) is not None:
                    state.write()
        except Exception as err:  # a release must never fail a request; the hold then ends with the process
            logger.warning("could not release the disk cache hold on %s (%s): %s", self.repo_id, self.why, err)

    def reserve(self, nbytes: int) -> None:
        """Set the bytes this hold reserves for its download (made with ``reserve``). Call under [`locked`]."""
        state = _root_state(self.root)
        entry = state.holds.get(self.token)
        if entry is not None and "reserve_key" in entry:
            entry["reserved"] = int(nbytes)
            entry["announced"] = max(int(entry.get("announced", 0)), int(nbytes))
            state.write()

    def __enter__(self) -> DiskHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def hold(repo_id: str, revision: str | None, *, why: str, cache_dir: str | os.PathLike[str] | None = None,
         reserve: tuple[str, int, int] | None = None) -> DiskHold:
    """Keep ``repo_id`` at ``revision`` from eviction until the hold is released or this process ends.

    Args:
        repo_id (`str`): ``org/repo``.
        revision (`str`, *optional*): a commit sha (that revision) or a branch/tag/``None`` (every revision).
        why (`str`): what holds it, shown by ``vllm-lora cache ls``.
        cache_dir (`str` or `os.PathLike`, *optional*): the hub cache (default: huggingface_hub's).
        reserve (`tuple[str, int, int]`, *optional*): ``(file key, bytes, bytes announced)`` of a download in
            progress: until the hold ends, every evictor counts these bytes as used ([`reserved_bytes`]).

    Returns:
        [`DiskHold`]: the hold; once this returns, no eviction in any process removes the revision.

    Raises:
        OSError, filelock.Timeout: the cache's bookkeeping folder cannot be written or its lock not taken.
    """
    root = state_root(cache_dir)
    state = _root_state(root)
    token = secrets.token_hex(8)
    entry: dict[str, Any] = {"repo_id": repo_id, "revision": revision, "why": why}
    if reserve is not None:
        entry.update(reserve_key=reserve[0], reserved=int(reserve[1]), announced=max(int(reserve[2]), int(reserve[1])))
    with locked(root):
        state.take_owner()
        state.holds[token] = entry
        try:
            state.write()
        except BaseException:
            state.holds.pop(token, None)
            raise
    return DiskHold(root, token, entry)


class HeldSources:
    """One server's holds on the revisions its registered adapters and live mixes point at.

    [`sync`](HeldSources.sync) makes this object's holds exactly ``wanted``, in one write: new entries are
    held, entries no longer wanted (an unloaded adapter, an evicted mix) are released. Thread-safe.
    """

    def __init__(self, *, cache_dir: str | os.PathLike[str] | None = None) -> None:
        self.cache_dir = cache_dir
        self._lock = threading.Lock()
        self._tokens: dict[tuple[str, str | None], str] = {}

    def sync(self, wanted: Mapping[tuple[str, str | None], str]) -> None:
        """Hold every ``(repo_id, revision) -> why`` of ``wanted`` and release every other hold this object made.

        A failure (a read-only cache) is logged, never raised: it must not fail an adapter's registration.
        """
        root = state_root(self.cache_dir)
        with self._lock:
            try:
                state = _root_state(root)
                with locked(root):
                    for key, token in list(self._tokens.items()):
                        if state.holds.get(token, {}).get("why") != wanted.get(key):
                            state.holds.pop(token, None)
                            del self._tokens[key]
                    for (repo_id, revision), why in wanted.items():
                        if (repo_id, revision) not in self._tokens:
                            state.take_owner()
                            token = secrets.token_hex(8)
                            state.holds[token] = {"repo_id": repo_id, "revision": revision, "why": why}
                            self._tokens[(repo_id, revision)] = token
                    state.write()
            except Exception as err:
                logger.warning("could not update the disk cache holds of this server's adapters: %s", err)

    def held(self) -> list[tuple[str, str | None]]:
        """Return the ``(repo_id, revision)`` pairs held now."""
        with self._lock:
            return sorted(self._tokens, key=lambda k: (k[0], k[1] or ""))


class _SourceLike(Protocol):
    kind: str
    repo_id: str | None
    revision: str | None


@contextlib.contextmanager
def holding(source: _SourceLike, *, why: str, cache_dir: str | os.PathLike[str] | None = None) -> Iterator[None]:
    """Hold a hub source's revision for the ``with`` block (a local source holds nothing).

    A hold that cannot be written (a read-only cache) is logged and the block runs anyway: nothing in this
    process can evict from such a cache either.
    """
    if source.kind != "hf" or not source.repo_id:
        yield
        return
    try:
        made: DiskHold | None = hold(source.repo_id, source.revision, why=why, cache_dir=cache_dir)
    except Exception as err:  # warned once per process (an offline server often mounts the cache read-only)
        level = logging.DEBUG if _STATE.setdefault("warned", False) else logging.WARNING
        _STATE["warned"] = True
        logger.log(level, "could not mark %s@%s in use in the disk cache (%s): %s; an eviction by another "
                   "process could remove it meanwhile", source.repo_id, source.revision or "main", why, err)
        made = None
    try:
        yield
    finally:
        if made is not None:
            made.release()


def reserved_bytes(holds: Sequence[Hold], also: Mapping[str, int] | None = None, *, announced: bool = False) -> int:
    """Return the bytes the downloads in progress among ``holds`` (and ``also``: file key -> bytes) are about to
    add (``announced``: will add, by their Hubs' word), each file once (the largest any process counts for it)."""
    files: dict[str, int] = dict(also or {})
    for h in holds:
        if h.reserve_key is not None:
            files[h.reserve_key] = max(files.get(h.reserve_key, 0), h.announced if announced else h.reserved)
    return sum(files.values())


def live_holds(root: Path, *, read_only: bool = False) -> list[Hold]:
    """Return every live process's holds on this cache, removing dead processes' files (``read_only``: leaving
    them, for a reader under [`reading`]). Call under [`locked`].

    A live process whose holds file cannot be read holds every revision (an evictor then evicts nothing).
    """
    folder = root / "holds"
    if not folder.is_dir():
        return []
    from filelock import FileLock, Timeout

    out: list[Hold] = []
    for lock_path in sorted(folder.glob("*.lock")):
        name = lock_path.name[: -len(".lock")]
        data_path = folder / f"{name}.json"
        if read_only:
            out.extend(_read_holds(data_path) if _owner_lives(lock_path) else [])
            continue
        probe = FileLock(str(lock_path), thread_local=False)
        try:
            probe.acquire(timeout=0)
        except Timeout:  # its owner lives
            out.extend(_read_holds(data_path))
            continue
        try:  # its owner is gone: its holds are void
            data_path.unlink(missing_ok=True)
            lock_path.unlink(missing_ok=True)
            logger.debug("removed the disk cache holds of a process that ended (%s)", name)
        finally:
            probe.release()
    return out


def _owner_lives(lock_path: Path) -> bool:
    """Whether a process holds its owner lock ``lock_path`` (probed through a read-only descriptor)."""
    try:
        fd = os.open(lock_path, _PROBE_FLAGS)
    except FileNotFoundError:  # gone meanwhile: its owner ended
        return False
    except OSError:  # not ours to open: its holds are listed, as a live process's would be
        return True
    try:
        return not _try_flock(fd, fcntl.LOCK_SH)
    except OSError:  # no flock here (filelock's soft lock: a marker file, there while its owner holds it): live
        return True
    finally:
        os.close(fd)


def _read_holds(path: Path) -> list[Hold]:
    try:
        if not path.exists():
            return []  # the owner took its lock and has not written a hold yet
        data = json.loads(read_state_file(path))
        pid = int(data["pid"])
        return [Hold(str(h["repo_id"]), None if h["revision"] is None else str(h["revision"]), str(h["why"]), pid,
                     None if h.get("reserve_key") is None else str(h["reserve_key"]), int(h.get("reserved", 0)),
                     int(h.get("announced", h.get("reserved", 0))))
                for h in data["holds"]]
    except Exception as err:
        logger.warning("disk cache holds file %s of a live process cannot be read (%s); evicting nothing", path, err)
        return [Hold(_ANY_REPO, None, f"unreadable holds file {path.name}", -1)]
