"""The disk tier's ledger: which revisions of the Hugging Face cache the plugin downloaded, and when each was last
used (``<HF cache>/.locks/vllm_lora_ext/ledger.json``), with the cache-layout helpers that read it (a repo's folder,
a file's commit, a branch's ref, huggingface_hub's record of a file the Hub answered 404 for). Call the writers under
[`diskholds.locked`]; [`diskcache`] holds the rules that use it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from vllm_lora_ext.diskholds import read_state_file, write_in_place
from vllm_lora_ext.hubguard import COMMIT_SHA

__all__ = ["LEDGER", "commit_of", "commits_having", "drop_missing_mark", "missing_mark", "read_ledger", "read_ref",
           "record", "repo_folder", "unlist", "write_ledger", "write_ref"]

logger = logging.getLogger(__name__)

LEDGER = "ledger.json"


def read_ledger(root: Path, *, read_only: bool = False) -> dict[str, dict[str, Any]]:
    """The ledger's entries; an unreadable ledger lists nothing and is moved aside (``read_only``: left as it is)."""
    path = root / LEDGER
    if not path.exists():
        return {}
    try:
        data = json.loads(read_state_file(path))
        entries = {str(k): dict(v) for k, v in data["revisions"].items()}
        now = time.time()
        for v in entries.values():
            str(v["repo_id"]), str(v["commit"]), list(v["files"])
            used = float(v["last_use"])  # NaN or negative: evicted first; in the future (a clock ahead): used now
            v["last_use"] = 0.0 if not used >= 0 else min(used, now)  # (a number `cache ls` and JSON can show)
        return entries
    except Exception as err:  # never guess what is ours: an unreadable ledger lists nothing, so nothing is evicted
        if read_only:
            logger.warning("the disk cache ledger %s could not be read (%s); nothing is listed", path, err)
            return {}
        aside = path.with_name(f"{LEDGER}.unreadable")
        os.replace(path, aside)
        logger.warning("the disk cache ledger %s could not be read (%s); it was moved to %s and the plugin now "
                       "counts only what it downloads from here on", path, err, aside.name)
        return {}


def write_ledger(root: Path, entries: dict[str, dict[str, Any]], *, in_place: bool = False) -> None:
    """Write the ledger: by rename (downloads, evictions), or in place for a recency update (the hot path: a
    rename over the file costs ~25x more on ext4; a crash mid-write leaves a ledger `read_ledger` moves aside).
    In place only where the text is no longer than the file, padded with spaces to its length (JSON allows them):
    the write covers its own blocks and nothing is truncated, so on ext4 or xfs a full disk cannot stop it part-way
    and tear the ledger (on a copy-on-write file system it still may: `read_ledger` then sets it aside). A longer
    text goes by rename, whose failure leaves the old ledger whole."""
    text = json.dumps({"version": 1, "revisions": entries}, sort_keys=True)  # (ASCII: characters are bytes)
    path = root / LEDGER
    size = _size(path)
    if in_place and len(text) <= size:
        write_in_place(path, text.ljust(size))
        return
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)  # (a write cut short by a full disk; gone after a rename)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return -1


def repo_folder(cache: Path, repo_id: str) -> Path:
    """A repo's folder in the Hugging Face cache (``models--org--name``)."""
    return cache / ("models--" + repo_id.replace("/", "--"))


def snapshot_blobs(cache: Path, entry: dict[str, Any]) -> dict[str, tuple[str, int]] | None:
    """A listed revision that huggingface_hub's cache scan left out (a repo it calls corrupt, e.g. a ref naming a
    commit it never downloaded, which a 404 on a moved branch leaves): its listed files still in its snapshot, each
    with its blob's real path and size; ``None`` once the snapshot folder is gone (deleted outside the plugin)."""
    repo = repo_folder(cache, str(entry["repo_id"]))
    snap = repo / "snapshots" / str(entry["commit"])
    if not COMMIT_SHA.match(str(entry["commit"])) or not snap.is_dir():
        return None  # (a commit that is no sha names no snapshot: an edited ledger's)
    blobs, found = os.path.realpath(repo / "blobs") + os.sep, {}
    for name in map(str, entry["files"]):
        with contextlib.suppress(OSError):  # a file gone: not counted
            real = os.path.realpath(snap / name)
            if real.startswith(blobs) and not os.path.isabs(name) and ".." not in name.split("/"):
                found[name] = (real, os.stat(real).st_size)  # only the repo's own blobs count
    return found


def commits_having(cache: Path, repo_id: str, filename: str) -> set[str]:
    snapshots = repo_folder(cache, repo_id) / "snapshots"
    if not snapshots.is_dir():
        return set()
    return {s.name for s in snapshots.iterdir() if os.path.lexists(s / filename)}


def commit_of(path: Path) -> str | None:
    """The commit of a file in a repo's snapshot (``models--org--name/snapshots/<sha>/...``), or ``None``: a
    ``snapshots`` folder elsewhere on the path (in the cache's own path, or the repo's) is not taken for it."""
    parts = path.parts
    return next((parts[i + 1] for i in range(1, len(parts) - 1) if parts[i] == "snapshots"
                 and parts[i - 1].startswith("models--") and COMMIT_SHA.match(parts[i + 1])), None)


def record(root: Path, repo_id: str, commit: str, filename: str) -> bool:
    """List ``filename`` of ``repo_id@commit`` as placed by the plugin, used now; whether the revision was not listed
    before. Call under `locked`."""
    entries = read_ledger(root)
    key = f"{repo_id}@{commit}"
    new = key not in entries
    entry = entries.setdefault(key, {"repo_id": repo_id, "commit": commit, "files": [], "downloaded": time.time()})
    if filename not in entry["files"]:
        entry["files"] = sorted([*entry["files"], filename])
    entry["last_use"] = time.time()
    write_ledger(root, entries)
    return new


def unlist(root: Path, repo_id: str, commit: str, filename: str) -> None:
    """Drop ``filename`` of ``repo_id@commit`` from the ledger (and the revision, once it lists no file): the file was
    removed from the cache, so the plugin no longer placed it there. Call under `locked`."""
    entries = read_ledger(root)
    entry = entries.get(f"{repo_id}@{commit}")
    if entry is None or filename not in entry["files"]:
        return
    entry["files"] = [f for f in entry["files"] if f != filename]
    if not entry["files"]:
        del entries[f"{repo_id}@{commit}"]
    write_ledger(root, entries)


def missing_mark(repo: Path, commit: str, filename: str) -> Path:
    """huggingface_hub's record that the Hub answered 404 for ``filename`` at ``commit`` (an empty file in ``repo``,
    the repo's cache folder): its cache lookup (``try_to_load_from_cache``) believes it before a cached file."""
    return repo / ".no_exist" / commit / filename


def drop_missing_mark(repo: Path, commit: str | None, filename: str) -> None:
    """Remove the `missing_mark` of ``filename`` at ``commit``, where there is one: the file is cached at that commit,
    so the record is wrong (huggingface_hub never removes one). Never through a link out of ``repo``; best effort."""
    if commit is None or not COMMIT_SHA.match(commit):
        return
    mark = missing_mark(repo, commit, filename)
    with contextlib.suppress(OSError):
        if os.path.lexists(mark) and os.path.realpath(mark.parent).startswith(os.path.realpath(repo) + os.sep):
            os.unlink(mark)
            logger.info("dropped the cache's record that %s was missing at commit %s: it is cached now", filename,
                        commit)


def read_ref(ref: Path | None) -> str | None:
    """The commit a ref file names (its first 64 bytes), or ``None`` where there is none."""
    try:
        with open(ref, "rb") as f:  # type: ignore[arg-type]
            return f.read(64).decode("ascii", "replace").strip()
    except (OSError, TypeError):
        return None


def write_ref(ref: Path, commit: str | None, repo: Path) -> None:
    """Point ``ref`` at ``commit`` (remove it for ``None``) by a fresh file renamed over it, never through a link, and
    only inside ``repo``'s folder; best effort (the caller's own outcome is what it reports)."""
    try:
        if not os.path.realpath(ref.parent).startswith(os.path.realpath(repo) + os.sep):
            return  # a link out of the cache: not written through
        if commit is None:
            ref.unlink(missing_ok=True)
            return
        fd, tmp = tempfile.mkstemp(dir=ref.parent, prefix=f".{ref.name}.")  # O_EXCL: never an existing link
        try:
            os.write(fd, commit.encode("ascii"))
        finally:
            os.close(fd)
        try:
            os.replace(tmp, ref)
        except OSError:
            os.unlink(tmp)
            raise
    except OSError:
        return
