"""The disk tier's view of the Hugging Face cache: the revisions the plugin downloaded as found on disk now, their
bytes and what holds them ([`scan_state`]), the least recently used ones to evict for a given need
([`plan_eviction`]) and their eviction ([`evict_revisions`]); ``vllm-lora cache ls`` and ``prune`` over them.

The bytes of a set of revisions are the bytes of the distinct blobs their listed files point at; the total also
counts the partial files no download is writing ([`stale_partial_bytes`]). Call the scan, the plan and the eviction
under [`diskholds.locked`]; [`diskcache`] holds the rules of a download that use them.
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from vllm_lora_ext import metrics
from vllm_lora_ext._util import fmt_bytes
from vllm_lora_ext.diskholds import DiskHold, Hold, cache_path, live_holds, locked, reading, state_root
from vllm_lora_ext.diskledger import LEDGER, read_ledger, snapshot_blobs, write_ledger

__all__ = ["CachedRevision", "PruneReport", "list_cache", "prune_cache"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CachedRevision:
    """A revision the plugin downloaded, as ``vllm-lora cache ls`` shows it.

    Attributes:
        repo_id: ``org/repo``.
        commit: the commit sha.
        nbytes: the bytes of the blobs its listed files point at.
        last_use: when a resolve last used it (seconds since the epoch).
        files: the files the plugin placed in its snapshot.
        held_by: what holds it now (``"pid 123: adapter 'sql' (registered)"``); empty: it may be evicted.
        evictable: ``False`` when its snapshot also holds files the plugin did not place, or its commit is
            shared with another cached repo.
    """

    repo_id: str
    commit: str
    nbytes: int
    last_use: float
    files: tuple[str, ...]
    held_by: tuple[str, ...] = ()
    evictable: bool = True

    def __post_init__(self) -> None:
        if self.nbytes < 0:
            raise ValueError(f"revision {self.repo_id}@{self.commit} has negative size {self.nbytes}")

    @property
    def key(self) -> str:
        return f"{self.repo_id}@{self.commit}"


@dataclass(frozen=True)
class PruneReport:
    """What a prune did: the revisions evicted, the counted bytes before and after (the listed revisions' and the stale
    partial files'), and the target."""

    evicted: tuple[CachedRevision, ...]
    bytes_before: int
    bytes_after: int
    max_bytes: int


# ----------------------------------------------------------------------------------------- sizes and eviction


@dataclass
class DiskState:
    """The listed revisions as found on disk now (built under `locked`), and the bytes of stale partial files."""

    info: Any  # huggingface_hub's HFCacheInfo
    revisions: dict[str, CachedRevision]
    blobs: dict[str, dict[str, int]]  # key -> {blob path: size}
    holds: list[Hold]
    partial: int = 0  # `stale_partial_bytes`: counted in the total, never deleted

    def total(self, keys: Sequence[str] | None = None) -> int:
        """The bytes of the blobs of ``keys``; of every listed revision and the stale partial files by default."""
        sizes: dict[str, int] = {}
        for key in self.revisions if keys is None else keys:
            sizes.update(self.blobs[key])
        return sum(sizes.values()) + (self.partial if keys is None else 0)

    def held(self, rev: CachedRevision, skip: DiskHold | None = None) -> list[Hold]:
        return [h for h in self.holds if h.covers(rev.repo_id, rev.commit)
                and not (skip is not None and h.pid == os.getpid() and h.repo_id == skip.repo_id
                         and h.revision == skip.revision and h.why == skip.why)]


def scan_state(cache: Path, root: Path, *, read_only: bool = False) -> DiskState:
    """Match the ledger against huggingface_hub's scan of the cache; drop entries no longer on disk (``read_only``:
    from the result only, for a listing, which writes nothing: call it under [`reading`] then)."""
    from huggingface_hub import scan_cache_dir

    entries = read_ledger(root, read_only=read_only)
    for attempt in range(3):  # a file gone mid-scan: another download's ref or partial file, renamed meanwhile
        try:
            info = scan_cache_dir(cache)
            break
        except FileNotFoundError:
            if attempt == 2:
                raise
    by_key = {(repo.repo_id, rev.commit_hash): (repo, rev) for repo in info.repos if repo.repo_type == "model"
              for rev in repo.revisions}
    commit_repos = Counter(rev.commit_hash for repo in info.repos for rev in repo.revisions)
    holds = live_holds(root, read_only=read_only)
    revisions: dict[str, CachedRevision] = {}
    blobs: dict[str, dict[str, int]] = {}
    unscanned = {k: snapshot_blobs(cache, e) for k, e in entries.items() if (e["repo_id"], e["commit"]) not in by_key}
    gone = [key for key, found in unscanned.items() if found is None]
    for key in gone:  # deleted outside the plugin (hf cache delete, rm): nothing left to count
        del entries[key]
    for key, entry in entries.items():
        listed, found = set(entry["files"]), unscanned.get(key)
        if found is not None:  # in a repo the scan skipped as corrupt (its warnings): counted, kept, not evicted
            blobs[key], names, evictable = dict(found.values()), set(found), False
        else:
            _, rev = by_key[(entry["repo_id"], entry["commit"])]
            on_disk = {f.file_path.relative_to(rev.snapshot_path).as_posix(): f for f in rev.files}
            blobs[key] = {str(f.blob_path): f.size_on_disk for name, f in on_disk.items() if name in listed}
            names, evictable = set(on_disk), set(on_disk) <= listed and commit_repos[entry["commit"]] == 1
        revisions[key] = CachedRevision(entry["repo_id"], entry["commit"], sum(blobs[key].values()),
                                        float(entry["last_use"]), tuple(sorted(listed & names)), evictable=evictable)
    state = DiskState(info, revisions, blobs, holds, 0 if read_only else stale_partial_bytes(cache))  # (its probe
    # opens huggingface_hub's lock files for writing; a listing shows no partial bytes)
    for key, rev in revisions.items():
        revisions[key] = replace(rev, held_by=tuple(sorted({f"pid {h.pid}: {h.why}" for h in state.held(rev)})))
    if gone and not read_only:
        write_ledger(root, entries)
    return state


def stale_partial_bytes(cache: Path) -> int:
    """The bytes of the partial files in the model repos' ``blobs/`` (``<etag>[.<hex>].incomplete``) that no download
    is writing: what a killed transfer leaves (or, in an older huggingface_hub, a failed one, kept to resume it).
    huggingface_hub writes a blob only under ``.locks/<repo folder>/<etag>.lock``, so one whose lock can be taken now
    is stale. A partial file being written is not counted here: a bounded download counts its bytes in its hold."""
    from filelock import FileLock, Timeout

    total = 0
    for part in cache.glob("models--*/blobs/*.incomplete"):
        lock = cache / ".locks" / part.parent.parent.name / f"{part.name.split('.')[0]}.lock"
        try:
            size = part.stat().st_size
            if lock.exists():
                probe = FileLock(str(lock), thread_local=False)
                probe.acquire(timeout=0)
                probe.release()
        except (Timeout, OSError, NotImplementedError):  # being written now, or gone meanwhile, or no flock here
            continue
        total += size
    return total


def plan_eviction(state: DiskState, need: int, limit: int, *, protect: Sequence[str] = ()) -> list[str] | None:
    """The least recently used revisions to evict so that the counted bytes plus ``need`` fit ``limit``.

    ``None`` when even evicting every revision that may go leaves no room (then nothing may be evicted).
    A blob shared by several listed revisions leaves the count with the last of them.
    """
    refs: dict[str, int] = {}
    for key in state.revisions:
        for blob in state.blobs[key]:
            refs[blob] = refs.get(blob, 0) + 1
    total = state.total()
    if total + need <= limit:
        return []
    candidates = sorted((r for r in state.revisions.values()
                         if r.evictable and r.key not in protect and not state.held(r)),
                        key=lambda r: (r.last_use, r.key))
    chosen: list[str] = []
    for rev in candidates:
        chosen.append(rev.key)
        for blob, size in state.blobs[rev.key].items():
            refs[blob] -= 1
            total -= size if refs[blob] == 0 else 0
        if total + need <= limit:
            return chosen
    return None


def evict_revisions(cache: Path, root: Path, state: DiskState, keys: Sequence[str]) -> None:
    """Delete ``keys`` through huggingface_hub's cache API and drop them from the ledger. Call under `locked`."""
    if not keys:
        return
    commits = [state.revisions[k].commit for k in keys]
    state.info.delete_revisions(*commits).execute()
    entries = read_ledger(root)
    for key in keys:
        entries.pop(key, None)
        rev = state.revisions.pop(key)
        logger.info("disk cache: evicted %s (%s, last used %s)", key, fmt_bytes(rev.nbytes),
                    time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rev.last_use)))
    write_ledger(root, entries)
    metrics.DISK_CACHE_EVICTIONS.inc(len(keys))


def list_cache(*, cache_dir: str | os.PathLike[str] | None = None) -> list[CachedRevision]:
    """Return the revisions the plugin downloaded into the cache, most recently used first. Writes nothing (a
    read-only cache can be listed).

    Example:
        >>> import tempfile
        >>> list_cache(cache_dir=tempfile.mkdtemp())
        []
    """
    cache, root = cache_path(cache_dir), state_root(cache_dir)
    if not (root / LEDGER).exists():
        return []
    with reading(root):
        state = scan_state(cache, root, read_only=True)
    return sorted(state.revisions.values(), key=lambda r: (-r.last_use, r.key))


def prune_cache(max_bytes: int, *, cache_dir: str | os.PathLike[str] | None = None) -> PruneReport:
    """Evict the least recently used revisions the plugin downloaded until they fit ``max_bytes``.

    Revisions in use (held by any live process) or shared with files the plugin did not download stay, and so do
    the stale partial files of interrupted downloads (counted, never deleted); if they alone pass ``max_bytes``,
    every other revision goes and ``bytes_after`` says what is left.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    cache, root = cache_path(cache_dir), state_root(cache_dir)
    if not (root / LEDGER).exists():
        return PruneReport((), 0, 0, max_bytes)
    with locked(root):
        state = scan_state(cache, root)
        before = state.total()
        keys = plan_eviction(state, 0, max_bytes)
        if keys is None:
            keys = [r.key for r in sorted(state.revisions.values(), key=lambda r: (r.last_use, r.key))
                    if r.evictable and not state.held(r)]
        evicted = tuple(state.revisions[k] for k in keys)
        evict_revisions(cache, root, state, keys)
        after = state.total()
    metrics.DISK_CACHE_BYTES.set(after)
    return PruneReport(evicted, before, after, max_bytes)
