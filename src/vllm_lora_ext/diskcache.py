"""The disk tier: a bound on the bytes of the adapter revisions the plugin downloaded into the Hugging Face cache.

Off unless ``VLLM_LORA_EXT_DISK_CACHE_BYTES`` is set (e.g. ``20GiB``). The rules:

- **What counts.** The ledger ``<HF cache>/.locks/vllm_lora_ext/ledger.json`` lists each revision the plugin
  downloaded (repo, commit, the files it placed, its last use). A revision the plugin only read from the
  cache (the user's own download, another model) is never listed, so never counted and never evicted.
  The bytes of a set of revisions are the bytes of the distinct blobs their files point at.
- **Before a download** the Hub's checked metadata ([`hubguard`]) gives the size; if the listed revisions plus
  the new file could not fit the bound even with every unheld revision evicted, it is refused. Otherwise the least
  recently used revisions nothing holds are evicted, whole (``scan_cache_dir().delete_revisions``), as the bytes
  arrive: room is made ``_STEP`` ahead of them (for a file in Xet storage, whose transfer reports no bytes, for
  the whole size at once), so a size announced far too high evicts for what was sent. **After it**, the bound is
  checked again from the disk.
- **Never evicted:** a revision any live process holds ([`diskholds`]: pinned by the deployment config or
  ``--lora-modules``, a registered adapter or live mix, a resolve downloading it, a build reading it); a
  revision whose snapshot also holds files the plugin did not place; a commit that another cached repo also has.
- **Refusal.** If evicting every revision that may go still leaves no room, nothing is evicted and the
  download is refused with [`DiskCacheFullError`], naming the bound and the bytes in use.
- **Sharing.** One state lock in the cache orders every ledger change, eviction and hold of every process, and is
  held only while the ledger and the holds are read or written, never while a file transfers. With the bound
  on, a download reserves the room it makes in a hold under that lock, and its announced size: until the file
  is listed, every other download evicts around those bytes and counts the announced ones when it checks that
  it can fit, so two downloads, in one process or several, never both count on the same free room, and a slow
  download never keeps another adapter's resolve waiting.
  Recency (``last_use``) is the ledger's, shared by every process and server.

With the bound off, downloads are still listed (best effort: a failure is logged), so ``vllm-lora cache ls``
shows them and a bound set later knows what the plugin may evict.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from vllm_lora_ext import hubguard, metrics
from vllm_lora_ext._util import fmt_bytes
from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES, disk_cache_bytes
from vllm_lora_ext.diskholds import DiskHold, Hold, cache_path, hold, live_holds, locked, reserved_bytes, state_root
from vllm_lora_ext.diskledger import (LEDGER, commit_of, commits_having, read_ledger, record, repo_folder,
                                     snapshot_blobs, write_ledger)
from vllm_lora_ext.errors import DiskCacheFullError

__all__ = ["CachedRevision", "PruneReport", "download_file", "list_cache", "prune_cache", "resolving"]

logger = logging.getLogger(__name__)

# The resolve running in this context: its hold is taken at its first download, and a refused download may look
# past it.
_RESOLVING: contextvars.ContextVar[_Use | None] = contextvars.ContextVar("vllm_lora_ext_resolving", default=None)


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
    """What a prune did: the revisions evicted, the listed bytes before and after, and the target."""

    evicted: tuple[CachedRevision, ...]
    bytes_before: int
    bytes_after: int
    max_bytes: int


# ----------------------------------------------------------------------------------------- sizes and eviction


@dataclass
class _State:
    """The listed revisions as found on disk now (built under `locked`)."""

    info: Any  # huggingface_hub's HFCacheInfo
    revisions: dict[str, CachedRevision]
    blobs: dict[str, dict[str, int]]  # key -> {blob path: size}
    holds: list[Hold]

    def total(self, keys: Sequence[str] | None = None) -> int:
        sizes: dict[str, int] = {}
        for key in self.revisions if keys is None else keys:
            sizes.update(self.blobs[key])
        return sum(sizes.values())

    def held(self, rev: CachedRevision, skip: DiskHold | None = None) -> list[Hold]:
        return [h for h in self.holds if h.covers(rev.repo_id, rev.commit)
                and not (skip is not None and h.pid == os.getpid() and h.repo_id == skip.repo_id
                         and h.revision == skip.revision and h.why == skip.why)]


def _scan(cache: Path, root: Path) -> _State:
    """Match the ledger against huggingface_hub's scan of the cache; drop entries no longer on disk."""
    from huggingface_hub import scan_cache_dir

    entries = read_ledger(root)
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
    holds = live_holds(root)
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
    state = _State(info, revisions, blobs, holds)
    for key, rev in revisions.items():
        revisions[key] = replace(rev, held_by=tuple(sorted({f"pid {h.pid}: {h.why}" for h in state.held(rev)})))
    if gone:
        write_ledger(root, entries)
    return state


def _plan(state: _State, need: int, limit: int, *, protect: Sequence[str] = ()) -> list[str] | None:
    """The least recently used revisions to evict so that the listed bytes plus ``need`` fit ``limit``.

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


def _evict(cache: Path, root: Path, state: _State, keys: Sequence[str]) -> None:
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


def _refusal(source: str, need: int, limit: int, state: _State, *, pending: int = 0,
             stopped_at: int | None = None) -> DiskCacheFullError:
    """The refusal of a download (``stopped_at``: stopped after that many bytes, once held revisions left no room for
    the rest; revisions evicted for the bytes before may be gone)."""
    in_use = state.total([k for k, r in state.revisions.items() if r.held_by or not r.evictable]) + pending
    flight = f" (of which {fmt_bytes(pending)} by other downloads in progress: retry once they finish)" if pending else ""
    done = ("nothing was evicted" if stopped_at is None else f"the transfer was stopped after {fmt_bytes(stopped_at)} "
            f"(revisions held since it began left no room for the rest) and its partial file is not kept")
    return DiskCacheFullError(
        f"Adapter source {source!r} needs {fmt_bytes(need)} in the Hugging Face cache, but the disk cache bound "
        f"{ENV_DISK_CACHE_BYTES} is {fmt_bytes(limit)} and {fmt_bytes(in_use)} of it is held by revisions in use (pinned, "
        f"registered, or being read){flight} or shared with files the plugin did not download; {done}. "
        f"Unload adapters that are no longer needed, or raise {ENV_DISK_CACHE_BYTES}.",
        source=source, limit=limit, in_use=in_use, needed=need)


_STEP = 256 << 20  # a counted download's room is made this far ahead of the bytes that arrived (`_Room.grow`)


@dataclass
class _Room:
    """A download's reservation: ``hold`` reserves ``reserved`` of the ``need`` bytes announced for ``file_key``."""

    hold: DiskHold
    reserved: int
    need: int
    file_key: str
    cache: Path
    limit: int
    source: str
    protect: tuple[str, ...]

    def grow(self, received: int) -> None:
        """Called with the bytes received so far: past half the last ``_STEP``, make room for the next under the
        state lock, or stop the transfer with [`DiskCacheFullError`] (huggingface_hub removes its partial file)."""
        if received + _STEP // 2 <= self.reserved or self.reserved >= max(self.need, received):
            return
        want = max(min(self.need, received + _STEP), received)
        root = self.hold.root
        with locked(root):
            state = _scan(self.cache, root)
            pending = reserved_bytes(state.holds, {self.file_key: want})
            keys = _plan(state, pending, self.limit, protect=self.protect)
            if keys is None:
                raise _refusal(self.source, self.need, self.limit, state, pending=pending - want, stopped_at=received)
            _evict(self.cache, root, state, keys)
            metrics.DISK_CACHE_BYTES.set(state.total())
            self.hold.reserve(want)
            self.reserved = want


def _reserve(cache_dir: str | os.PathLike[str] | None, repo_id: str, filename: str, revision: str | None,
             incoming: tuple[int, str | None], limit: int, *, upfront: bool) -> _Room:
    """Check that a download of ``incoming`` (bytes, commit) can fit, make room for its first ``_STEP`` bytes
    (``upfront``: for all of them, where no byte counter runs) and reserve that, in one turn of the state lock.
    Room for the rest is made as the bytes arrive (`_Room.grow`), so a size announced far too high evicts for what
    was sent, not for what was announced. Releasing the returned room's hold ends the reservation."""
    (need, commit), source = incoming, f"hf:{repo_id}" + (f"@{revision}" if revision else "")
    file_key = f"{repo_id}@{commit or revision or 'main'}:{filename}"
    cache, root = cache_path(cache_dir), state_root(cache_dir)
    first = need if upfront else min(need, _STEP)
    protect = (f"{repo_id}@{commit}",) if commit else ()
    with locked(root):
        state = _scan(cache, root)
        pending = reserved_bytes(state.holds, {file_key: need}, announced=True)
        if _plan(state, pending, limit, protect=protect) is None:
            raise _refusal(source, need, limit, state, pending=pending - need)
        keys = _plan(state, reserved_bytes(state.holds, {file_key: first}), limit, protect=protect) or []
        _evict(cache, root, state, keys)
        metrics.DISK_CACHE_BYTES.set(state.total())
        made = hold(repo_id, commit or revision, why=f"download of {source}:{filename}", cache_dir=cache_dir,
                    reserve=(file_key, first, need))
    return _Room(made, first, need, file_key, cache, limit, source, protect)


def _after_download(cache: Path, root: Path, source: str, key: str, limit: int) -> None:
    """Keep the bound once the file is on disk (the Hub may not have told its size)."""
    state = _scan(cache, root)
    pending = reserved_bytes(state.holds)  # other downloads in progress
    keys = _plan(state, pending, limit, protect=(key,))
    if keys is None:
        new = state.revisions.get(key)
        use = _RESOLVING.get()
        skip = use.hold if use is not None else None
        if new is not None and new.evictable and not state.held(new, skip):
            need = new.nbytes
            _evict(cache, root, state, [key])
        else:
            need = new.nbytes if new is not None else 0
        metrics.DISK_CACHE_BYTES.set(state.total())
        raise _refusal(source, need, limit, state, pending=pending)
    _evict(cache, root, state, keys)
    metrics.DISK_CACHE_BYTES.set(state.total())


def _incoming(cache: Path, repo_id: str, facts: hubguard.HubFacts) -> tuple[int, str | None]:
    """The bytes a download adds, and its commit, from the Hub's checked metadata (0 if it did not tell)."""
    if facts.etag and (repo_folder(cache, repo_id) / "blobs" / facts.etag).exists():
        return 0, facts.commit  # the blob is cached (another revision has it): only a link is added
    return facts.size or 0, facts.commit


def _list_unbounded(root: Path, repo_id: str, commit: str | None, before: set[str], filename: str) -> None:
    """List a file downloaded with the bound off into a commit's snapshot it was not in ``before`` (a convenience,
    so a bound set later knows what the plugin may evict: a failure is logged, never raised)."""
    if commit is None or commit in before:
        return
    try:
        with locked(root):
            record(root, repo_id, commit, filename)
    except Exception as err:
        logger.debug("could not list %s@%s:%s in the disk cache ledger: %s", repo_id, commit, filename, err)


def download_file(repo_id: str, filename: str, *, revision: str | None,
                  cache_dir: str | os.PathLike[str] | None = None, token: str | bool | None = None,
                  local_files_only: bool = False, tqdm_class: Any = None) -> str:
    """Download one file with ``hf_hub_download`` within the disk cache bound, and list it in the ledger.

    Takes ``hf_hub_download``'s arguments, returns its path and raises its errors. The Hub's answers are checked
    and the transfer capped ([`hubguard`]). With ``VLLM_LORA_EXT_DISK_CACHE_BYTES`` set, room is made first (least
    recently used, unheld revisions the plugin downloaded are evicted) from the size the Hub tells, counting the
    downloads in progress, and reserved while it transfers (no lock held); the bound is checked again after.

    Raises:
        [`DiskCacheFullError`]: the file does not fit the bound even with every revision that may go evicted.
        [`HubAnswerError`]: the Hub answered an ETag, commit, size or path the cache must not be written by.
    """
    from huggingface_hub import hf_hub_download

    cache, limit = cache_path(cache_dir), disk_cache_bytes()
    source = f"hf:{repo_id}" + (f"@{revision}" if revision else "")

    pinned = revision if revision is not None and hubguard.COMMIT_SHA.match(revision) else None

    def fetch(cap: int | None = None, local: bool = local_files_only, commit: str | None = pinned,
              told: hubguard.HubFacts | None = None, room: _Room | None = None) -> str:
        bar = tqdm_class if cap is None else hubguard.capped(tqdm_class, cap, source=source, filename=filename,
                                                             on_bytes=None if room is None else room.grow)
        if told is not None and pinned is not None:  # huggingface_hub may read a cached listing instead of asking
            hubguard.check_listing(repo_folder(cache, repo_id), pinned, filename, told, source=source)
        with contextlib.nullcontext() if told is None else hubguard.expecting(
                told, pinned or told.commit, source=source, filename=filename, pinned=pinned is not None):
            path = str(hf_hub_download(repo_id, filename, revision=revision, cache_dir=cache_dir, token=token,
                                       local_files_only=local, tqdm_class=bar))
        return hubguard.contained(path, repo_folder(cache, repo_id), source=source, commit=commit)

    if local_files_only:
        return fetch()
    facts = hubguard.head(repo_id, filename, revision=revision, token=token, source=source)
    if facts.failed is not None:  # busy or unreachable: the cache's copy of that revision at once, if any
        try:
            path = fetch(local=True)
        except Exception:  # none: a busy Hub gets a round of backoff, as hf_hub_download gives it; a silent one not
            if getattr(facts.failed, "response", None) is not None:
                facts = hubguard.head(repo_id, filename, revision=revision, token=token, source=source, backoff=True)
            if facts.failed is not None:
                raise facts.failed from None
        else:
            logger.warning("%s:%s: the Hub did not answer (%s); using the cached copy of %s, which may be older than "
                           "the Hub's", source, filename, facts.failed, revision or "main")  # a pin may be stale
            return path
    named = pinned or facts.commit  # the download must land in this commit's snapshot
    cap = hubguard.transfer_cap(facts, limit, source=source, filename=filename, disk=cache)
    use = _RESOLVING.get()
    if use is not None:
        use.take_hold()
    root = state_root(cache_dir)
    if limit is None:
        before = commits_having(cache, repo_id, filename)
        path = fetch(cap, commit=None, told=facts)  # (its commit checked once the file is listed: evictable)
        _list_unbounded(root, repo_id, commit_of(Path(path)), before, filename)
        return hubguard.contained(path, repo_folder(cache, repo_id), source=source, commit=named)
    root.mkdir(parents=True, exist_ok=True)
    incoming = _incoming(cache, repo_id, facts)
    room = _reserve(cache_dir, repo_id, filename, revision, incoming, limit, upfront=cap is None) if incoming[0] \
        else None
    try:
        before = commits_having(cache, repo_id, filename)
        path = fetch(cap, commit=None, told=facts, room=room)
        commit = commit_of(Path(path))
        with locked(root):
            if room is not None:
                room.hold.release()
            if commit is not None and commit not in before:
                record(root, repo_id, commit, filename)
                _after_download(cache, root, source, f"{repo_id}@{commit}", limit)
    finally:
        if room is not None:
            room.hold.release()  # a failed transfer; idempotent
    return hubguard.contained(path, repo_folder(cache, repo_id), source=source, commit=named)


_T = TypeVar("_T")


class _Use:
    """One resolve: its hold (taken at its first download), and the commit it used (set through `done`)."""

    def __init__(self, repo_id: str, revision: str | None, cache_dir: str | os.PathLike[str] | None) -> None:
        self.repo_id, self.revision, self.cache_dir = repo_id, revision, cache_dir
        self.commit: str | None = None
        self.hold: DiskHold | None = None

    def done(self, resolved: _T) -> _T:
        """Record the resolve's result (its ``commit``) and return it."""
        self.commit = getattr(resolved, "commit", None)
        return resolved

    def take_hold(self) -> None:
        if self.hold is None:
            try:
                self.hold = hold(self.repo_id, self.revision, cache_dir=self.cache_dir,
                                 why=f"resolve of hf:{self.repo_id}@{self.revision or 'main'}")
            except Exception as err:  # a read-only cache: nothing here evicts from it either
                logger.debug("could not mark %s@%s in use in the disk cache: %s", self.repo_id, self.revision, err)


@contextlib.contextmanager
def resolving(repo_id: str, revision: str | None, *, cache_dir: str | os.PathLike[str] | None = None) -> Iterator[_Use]:
    """Run a resolve of ``repo_id@revision``: hold it from its first download on; on success, mark it used now.

    The hold keeps the files already downloaded from eviction while the next ones download (weights, then
    config). A resolve that downloads nothing writes no hold: the caller that reads the files holds them
    itself ([`diskholds.holding`], as a build does), since they may go once the resolve returns.
    """
    use = _Use(repo_id, revision, cache_dir)
    token = _RESOLVING.set(use)
    try:
        yield use
    finally:
        _RESOLVING.reset(token)
        if use.hold is not None:
            use.hold.release()
    if use.commit is not None:
        _touch(state_root(cache_dir), f"{repo_id}@{use.commit}")


def _touch(root: Path, key: str) -> None:
    try:
        with locked(root):
            entries = read_ledger(root)
            if key in entries:
                entries[key]["last_use"] = time.time()
                write_ledger(root, entries, in_place=True)
    except Exception as err:  # recency is advice: a failure costs eviction order, never a request
        logger.debug("could not mark %s used in the disk cache ledger: %s", key, err)


def list_cache(*, cache_dir: str | os.PathLike[str] | None = None) -> list[CachedRevision]:
    """Return the revisions the plugin downloaded into the cache, most recently used first.

    Example:
        >>> import tempfile
        >>> list_cache(cache_dir=tempfile.mkdtemp())
        []
    """
    cache, root = cache_path(cache_dir), state_root(cache_dir)
    if not (root / LEDGER).exists():
        return []
    with locked(root):
        state = _scan(cache, root)
    return sorted(state.revisions.values(), key=lambda r: (-r.last_use, r.key))


def prune_cache(max_bytes: int, *, cache_dir: str | os.PathLike[str] | None = None) -> PruneReport:
    """Evict the least recently used revisions the plugin downloaded until they fit ``max_bytes``.

    Revisions in use (held by any live process) or shared with files the plugin did not download stay; if
    they alone pass ``max_bytes``, every other revision goes and ``bytes_after`` says what is left.
    """
    if max_bytes < 0:
        raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
    cache, root = cache_path(cache_dir), state_root(cache_dir)
    if not (root / LEDGER).exists():
        return PruneReport((), 0, 0, max_bytes)
    with locked(root):
        state = _scan(cache, root)
        before = state.total()
        keys = _plan(state, 0, max_bytes)
        if keys is None:
            keys = [r.key for r in sorted(state.revisions.values(), key=lambda r: (r.last_use, r.key))
                    if r.evictable and not state.held(r)]
        evicted = tuple(state.revisions[k] for k in keys)
        _evict(cache, root, state, keys)
        after = state.total()
    metrics.DISK_CACHE_BYTES.set(after)
    return PruneReport(evicted, before, after, max_bytes)
