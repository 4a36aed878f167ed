"""The disk tier: a bound on the bytes of the adapter revisions the plugin downloaded into the Hugging Face cache.

Off unless ``VLLM_LORA_EXT_DISK_CACHE_BYTES`` is set (e.g. ``20GiB``). The rules:

- **What counts.** The ledger ``<HF cache>/.locks/vllm_lora_ext/ledger.json`` lists each revision the plugin
  downloaded (repo, commit, the files it placed, its last use). A revision the plugin only read from the
  cache (the user's own download, another model) is never listed, so never counted and never evicted.
  The bytes of a set of revisions are the bytes of the distinct blobs their files point at. The partial files
  that no download is writing (a killed one's) count too: they are nobody's to evict, and never deleted. A file
  refused after its download ([`check_download`]: bytes other than its ETag names) leaves the cache and the ledger.
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
  download is refused with [`DiskCacheFullError`], naming the bound and the bytes in use; or, for an adapter
  larger than the whole bound (the file plus its revision's files already listed), its size and the bound.
- **A failed resolve** puts back the branch's ref its downloads moved, so the revision cached before still serves
  offline; one the bound refused also evicts the revisions its downloads listed first (unless shared or another
  hold keeps them): nothing half fetched stays listed. Other failures keep whole files for a retry ([`resolving`]).
- **Sharing.** One state lock in the cache orders every ledger change, eviction and hold of every process, and is
  held only while the ledger and the holds are read or written, never while a file transfers. With the bound
  on, a download reserves the room it makes in a hold under that lock, and its announced size: until the file
  is listed, every other download evicts around those bytes and counts the announced ones when it checks that
  it can fit, so two downloads, in one process or several, never both count on the same free room, and a slow
  download never keeps another adapter's resolve waiting.
  Recency (``last_use``) is the ledger's, shared by every process and server.

With the bound off, downloads are still listed (best effort: a failure is logged), so ``vllm-lora cache ls``
shows them and a bound set later knows what the plugin may evict.

This module holds the download path; [`diskstate`] the scan of what is listed, the eviction plan and the eviction.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from vllm_lora_ext import hubguard, hubrefs, metrics
from vllm_lora_ext._util import fmt_bytes
from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES, disk_cache_bytes
from vllm_lora_ext.diskholds import DiskHold, cache_path, hold, locked, reserved_bytes, state_root
from vllm_lora_ext.diskledger import (LEDGER, commit_of, commits_having, read_ledger, read_ref, record, repo_folder,
                                     unlist, write_ledger, write_ref)
from vllm_lora_ext.diskstate import (CachedRevision, DiskState, PruneReport, evict_revisions, list_cache,
                                    plan_eviction, prune_cache, scan_state)
from vllm_lora_ext.errors import DiskCacheFullError, HubAnswerError

__all__ = ["CachedRevision", "PruneReport", "check_download", "download_file", "list_cache", "prune_cache", "resolving"]

logger = logging.getLogger(__name__)

# The resolve running in this context: its hold is taken at its first download, and a refused download may look
# past it.
_RESOLVING: contextvars.ContextVar[_Use | None] = contextvars.ContextVar("vllm_lora_ext_resolving", default=None)


def _refusal(source: str, need: int, limit: int, state: DiskState, *, key: str | None = None, pending: int = 0,
             stopped_at: int | None = None) -> DiskCacheFullError:
    """The refusal of a download of ``need`` bytes into revision ``key``, whose files already listed are the adapter's
    too (``stopped_at``: stopped after that many bytes, once held revisions left no room for the rest; revisions
    evicted for the bytes before may be gone). An adapter larger than the whole bound is told so: no unload helps."""
    own = need + (state.revisions[key].nbytes if key in state.revisions else 0)
    in_use = state.total([k for k, r in state.revisions.items() if r.held_by or not r.evictable]) + pending
    in_use += state.partial
    if own > limit:
        text = _too_large(source, own, limit)
        return DiskCacheFullError(text, source=source, limit=limit, in_use=in_use, needed=own)
    flight = f" (of which {fmt_bytes(pending)} by other downloads in progress: retry once they finish)" if pending else ""
    stale = (f", or taken by the partial files of interrupted downloads ({fmt_bytes(state.partial)}: the "
             f"'*.incomplete' files in the repos' 'blobs' folders, which no download is writing and may be deleted)"
             if state.partial else "")
    done = ("nothing was evicted" if stopped_at is None else f"the transfer was stopped after {fmt_bytes(stopped_at)} "
            f"(revisions held since it began left no room for the rest) and its partial file is not kept")
    return DiskCacheFullError(
        f"Adapter source {source!r} needs {fmt_bytes(need)} in the Hugging Face cache, but the disk cache bound "
        f"{ENV_DISK_CACHE_BYTES} is {fmt_bytes(limit)} and {fmt_bytes(in_use)} of it is held by revisions in use "
        f"(pinned, registered, or being read){flight} or shared with files the plugin did not download{stale}; "
        f"{done}. Unload adapters that are no longer needed, or raise {ENV_DISK_CACHE_BYTES}.",
        source=source, limit=limit, in_use=in_use, needed=need)


def _too_large(source: str, size: int, limit: int) -> str:
    return (f"Adapter source {source!r} needs {fmt_bytes(size)} in the Hugging Face cache, more than the whole disk "
            f"cache bound {ENV_DISK_CACHE_BYTES} ({fmt_bytes(limit)}): it cannot fit even with every other revision "
            f"evicted. Raise {ENV_DISK_CACHE_BYTES} above {fmt_bytes(size)}, or download the adapter yourself (e.g. "
            f"with 'hf download') and give its local folder as the source.")


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
            state = scan_state(self.cache, root)
            pending = reserved_bytes(state.holds, {self.file_key: want})
            keys = plan_eviction(state, pending, self.limit, protect=self.protect)
            if keys is None:
                raise _refusal(self.source, self.need, self.limit, state, key=next(iter(self.protect), None),
                               pending=pending - want, stopped_at=received)
            evict_revisions(self.cache, root, state, keys)
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
        state = scan_state(cache, root)
        pending = reserved_bytes(state.holds, {file_key: need}, announced=True)
        if plan_eviction(state, pending, limit, protect=protect) is None:
            raise _refusal(source, need, limit, state, key=next(iter(protect), None), pending=pending - need)
        keys = plan_eviction(state, reserved_bytes(state.holds, {file_key: first}), limit, protect=protect) or []
        evict_revisions(cache, root, state, keys)
        metrics.DISK_CACHE_BYTES.set(state.total())
        made = hold(repo_id, commit or revision, why=f"download of {source}:{filename}", cache_dir=cache_dir,
                    reserve=(file_key, first, need))
    return _Room(made, first, need, file_key, cache, limit, source, protect)


def _after_download(cache: Path, root: Path, source: str, key: str, limit: int) -> None:
    """Keep the bound once the file is on disk (the Hub may not have told its size)."""
    state = scan_state(cache, root)
    pending = reserved_bytes(state.holds)  # other downloads in progress
    keys = plan_eviction(state, pending, limit, protect=(key,))
    if keys is None:
        new = state.revisions.get(key)
        use = _RESOLVING.get()
        skip = use.hold if use is not None else None
        if new is not None and new.evictable and not state.held(new, skip):
            need = new.nbytes
            evict_revisions(cache, root, state, [key])
        else:
            need = new.nbytes if new is not None else 0
        metrics.DISK_CACHE_BYTES.set(state.total())
        raise _refusal(source, need, limit, state, pending=pending)
    evict_revisions(cache, root, state, keys)
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
            if record(root, repo_id, commit, filename):
                _listed_first(f"{repo_id}@{commit}")
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
    _starting(named, by_branch=pinned is None)
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
                if record(root, repo_id, commit, filename):
                    _listed_first(f"{repo_id}@{commit}")
                _after_download(cache, root, source, f"{repo_id}@{commit}", limit)
    finally:
        if room is not None:
            room.hold.release()  # a failed transfer; idempotent
    return hubguard.contained(path, repo_folder(cache, repo_id), source=source, commit=named)


def check_download(path: str | os.PathLike[str], repo_id: str, filename: str, *, source: str,
                   cache_dir: str | os.PathLike[str] | None = None) -> None:
    """Check a file `download_file` just got against its ETag ([`hubguard.check_content`]); a refused file, which
    that removes from the cache, leaves the ledger too, so that the bound and ``vllm-lora cache ls`` count only what
    is there, and a file someone else puts there later is not taken for the plugin's.

    Raises:
        [`HubAnswerError`]: the bytes are not those the ETag names; the file was removed.
    """
    try:
        hubguard.check_content(path, source=source, filename=filename)
    except HubAnswerError:
        commit, root = commit_of(Path(path)), state_root(cache_dir)
        if commit is not None and (root / LEDGER).exists():
            try:
                with locked(root):
                    unlist(root, repo_id, commit, filename)
            except Exception as err:  # the scan counts the bytes on disk; the refusal is what the caller sees
                logger.warning("could not drop %s@%s:%s, refused and removed, from the disk cache ledger: %s",
                               repo_id, commit, filename, err)
        raise


def _starting(named: str | None, *, by_branch: bool) -> None:
    """Before a download of commit ``named``: take the running resolve's hold and, for a download by a branch or tag
    (whose ref huggingface_hub points at ``named``), note that it moves the ref there."""
    use = _RESOLVING.get()
    if use is not None:
        use.take_hold()
        if by_branch and named is not None:
            use.moved.add(named)


_T = TypeVar("_T")


class _Use:
    """One resolve: its hold (taken at its first download), the commit it used (set through `done`), the revisions
    its downloads listed first, the commits its downloads by branch named (where huggingface_hub pointed the
    branch's ref), and the commit that ref named before (what a failure puts back)."""

    def __init__(self, repo_id: str, revision: str | None, cache_dir: str | os.PathLike[str] | None) -> None:
        self.repo_id, self.revision, self.cache_dir = repo_id, revision, cache_dir
        self.commit: str | None = None
        self.hold: DiskHold | None = None
        self.listed: dict[str, float] = {}  # the revisions its downloads listed first, and when
        self.moved: set[str] = set()  # the commits its downloads by branch moved the ref to
        self.started = time.time()
        pinned = revision is not None and hubguard.COMMIT_SHA.match(revision)
        self.ref = None if pinned else repo_folder(cache_path(cache_dir), repo_id) / "refs" / (revision or "main")
        self.ref_before = read_ref(self.ref)

    def done(self, resolved: _T) -> _T:
        """Record the resolve's result (its ``commit``) and return it."""
        self.commit = getattr(resolved, "commit", None)
        return resolved

    def put_ref_back(self, repo: Path, state: DiskState) -> None:
        """After the resolve, whose downloads moved the branch's ref, failed: point the ref back at the commit it
        named before (or remove it, if that has no file cached), if it now names a commit with no file cached, or
        a half revision this resolve moved it to that no one has used since this resolve began (listed in the
        ledger, its ``last_use`` unchanged: this resolve's own weights without their config, or those an earlier
        failed resolve left for a retry). A revision another resolve used or completed since, or one this resolve
        did not move the ref to, is left named (a compare-and-swap on what the ref names, as [`hubrefs`]
        explains). Call under the state lock, which orders every ref write of the plugin."""
        now, before = read_ref(self.ref), self.ref_before
        if self.ref is None or not self.moved or now is None or now == before or not hubguard.COMMIT_SHA.match(now) \
                or (before is not None and not hubguard.COMMIT_SHA.match(before)):
            return  # (a ref read torn, by an older huggingface_hub's write in place: left as it is)
        rev = state.revisions.get(f"{self.repo_id}@{now}")
        half = now in self.moved and rev is not None and rev.last_use <= self.listed.get(rev.key, self.started)
        if half or not hubrefs.has_files(repo, now):
            write_ref(self.ref, before if hubrefs.has_files(repo, before) else None, repo)

    def take_hold(self) -> None:
        if self.hold is None:
            try:
                self.hold = hold(self.repo_id, self.revision, cache_dir=self.cache_dir,
                                 why=f"resolve of hf:{self.repo_id}@{self.revision or 'main'}")
            except Exception as err:  # a read-only cache: nothing here evicts from it either
                logger.debug("could not mark %s@%s in use in the disk cache: %s", self.repo_id, self.revision, err)


@contextlib.contextmanager
def resolving(repo_id: str, revision: str | None, *, cache_dir: str | os.PathLike[str] | None = None) -> Iterator[_Use]:
    """Run a resolve of ``repo_id@revision``: hold it from its first download on; on success, mark it used now and
    point the branch's ref at its commit again if a failure put it back meanwhile; on failure, put the ref back,
    and after a refusal by the bound evict what it listed first (`_undo`).

    The hold keeps the files already downloaded from eviction while the next ones download (weights, then
    config). A resolve that downloads nothing writes no hold: the caller that reads the files holds them
    itself ([`diskholds.holding`], as a build does), since they may go once the resolve returns.
    """
    use = _Use(repo_id, revision, cache_dir)
    token = _RESOLVING.set(use)
    try:
        yield use
    except BaseException as exc:
        if use.listed or use.moved:
            _undo(use, evict=isinstance(exc, DiskCacheFullError))
        raise
    finally:
        _RESOLVING.reset(token)
        if use.hold is not None:
            use.hold.release()
    if use.commit is not None:
        _touch(state_root(cache_dir), f"{repo_id}@{use.commit}", use)


def _listed_first(key: str) -> None:
    """Note that a download of the resolve running in this context listed revision ``key`` first."""
    use = _RESOLVING.get()
    if use is not None:
        use.listed.setdefault(key, time.time())


def _undo(use: _Use, *, evict: bool) -> None:
    """After a failed resolve, point the ref its downloads moved back at the commit it named before, so the revision
    cached before still serves offline (`_Use.put_ref_back`); where ``evict`` (the bound refused it: a retry cannot
    succeed as it is), also evict the revisions its downloads listed first (weights without their config). Only
    revisions no one has used since they were listed (their ledger ``last_use`` unchanged: another resolve that
    reused them, or completed them, marked them) and that no other hold keeps; a build's own hold on the repo keeps
    them too, so a refusal inside a worker build leaves them listed, for the bound's LRU. Other failures keep the
    files already downloaded, whole and checked, for a retry to reuse. Best effort: the resolve's own error is what
    its caller sees."""
    cache, root = cache_path(use.cache_dir), state_root(use.cache_dir)
    try:
        with locked(root):
            state = scan_state(cache, root)
            untouched = {k for k, at in use.listed.items() if k in state.revisions
                         and state.revisions[k].last_use <= at}
            mine = 0 if use.hold is None else 1  # (this resolve's hold covers them; any other keeps them)
            keys = [k for k in untouched if evict and state.revisions[k].evictable
                    and len(state.held(state.revisions[k])) <= mine]
            evict_revisions(cache, root, state, keys)
            metrics.DISK_CACHE_BYTES.set(state.total())
            use.put_ref_back(repo_folder(cache, use.repo_id), state)
    except Exception as err:
        logger.warning("could not undo what a failed resolve of hf:%s left half downloaded (%s): %s", use.repo_id,
                       ", ".join(use.listed), err)


def _touch(root: Path, key: str, use: _Use) -> None:
    """Mark revision ``key`` used now, and point the branch's ref at it if this resolve's downloads moved the ref
    there and a failure put it back since ([`hubrefs`]), in one turn of the state lock."""
    try:
        with locked(root):
            if use.ref is not None and use.commit in use.moved:
                hubrefs.settle_ref(use.ref, use.commit, repo_folder(cache_path(use.cache_dir), use.repo_id), root)
            entries = read_ledger(root)
            if key in entries:
                entries[key]["last_use"] = time.time()
                write_ledger(root, entries, in_place=True)
    except Exception as err:  # recency is advice: a failure costs eviction order, never a request
        logger.debug("could not mark %s used in the disk cache ledger: %s", key, err)
