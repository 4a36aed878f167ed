"""``vllm-lora cache ls`` and ``vllm-lora cache prune --max-bytes N``: the adapters the plugin downloaded.

``ls`` lists each revision the plugin downloaded into the Hugging Face cache: its size, last use and what
holds it now (a live server's registered adapter, pin or build); it writes nothing, so a read-only cache can be
listed. ``prune`` evicts the least recently used
revisions that nothing holds until the rest fit ``--max-bytes``, as a server does under
``VLLM_LORA_EXT_DISK_CACHE_BYTES`` (exit code 1 if the revisions in use alone pass it).
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from vllm_lora_ext.constants import parse_size
from vllm_lora_ext.diskcache import CachedRevision, list_cache, prune_cache
from vllm_lora_ext.errors import DiskCacheAccessError


def _size(text: str) -> int:
    try:
        return parse_size(text, name="--max-bytes")
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).removeprefix("--max-bytes=")) from None  # (argparse names it)


def add_parser(sub: Any) -> None:
    p = sub.add_parser("cache", help="list or prune the adapters the plugin downloaded into the HF cache")
    verbs = p.add_subparsers(dest="cache_command", required=True, metavar="{ls,prune}")
    ls = verbs.add_parser("ls", help="list downloaded adapter revisions: size, last use, held by")
    prune = verbs.add_parser("prune", help="evict least recently used, unused revisions down to --max-bytes")
    prune.add_argument("--max-bytes", required=True, type=_size, help="target size, e.g. 20GiB, 20GB or bytes")
    for q in (ls, prune):
        q.add_argument("--cache-dir", default=None, help="HF cache folder (default: huggingface_hub's)")
        q.add_argument("--json", action="store_true", help="print JSON lines")
    ls.set_defaults(func=run_ls)
    prune.set_defaults(func=run_prune)


def _record(rev: CachedRevision) -> dict[str, Any]:
    return {"repo_id": rev.repo_id, "commit": rev.commit, "bytes": rev.nbytes, "last_use": rev.last_use,
            "files": list(rev.files), "held_by": list(rev.held_by), "evictable": rev.evictable}


def _line(rev: CachedRevision, width: int = 0) -> str:
    """One revision's line, its name padded to ``width`` (the longest listed) so the columns line up."""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(rev.last_use))
    kept = "nothing, but never evicted: its snapshot holds files the plugin did not download, or another repo shares it"
    held = "; ".join(rev.held_by) if rev.held_by else ("-" if rev.evictable else kept)
    return f"{_name(rev):<{width}}  {rev.nbytes:>12d} B  last use {when}  held by: {held}"


def _name(rev: CachedRevision) -> str:
    return f"{rev.repo_id}@{rev.commit[:12]}"


def _warn_missing(cache_dir: str | None) -> str:
    """The cache folder; a warning first if it is not a folder (a mistyped --cache-dir or HF_HUB_CACHE would
    otherwise look like an empty cache)."""
    from vllm_lora_ext.diskcache import cache_path

    folder = cache_path(cache_dir)
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        print(f"warning: the Hugging Face cache folder {str(folder)!r} {what}; check --cache-dir, HF_HUB_CACHE or "
              f"HF_HOME", file=sys.stderr)
    return str(folder)


@contextlib.contextmanager
def _cache_access(folder: str, *, prune: bool) -> Iterator[None]:
    """Say a listing or prune the cache refused (a read-only file system, a permission) with the folder and what to
    do instead; any other failure passes as it is."""
    from vllm_lora_ext.diskholds import state_root

    try:
        yield
    except OSError as err:
        if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        verb, may, access = ("prune", "change", "write") if prune else ("list", "read", "read")
        if err.errno == errno.EROFS:  # (only a prune writes)
            why, fix = "it is on a read-only file system", "Remount it read-write, or prune it where it is writable"
        else:
            why = f"permission denied: this user may not {may} it"
            fix = (f"Run 'vllm-lora cache {'prune' if prune else 'ls'}' as the user that owns the cache, or give this "
                   f"user {access} access to it")
        at = f" (at {err.filename!r})" if err.filename else ""
        at_lock = prune and err.filename is not None and Path(err.filename) == state_root(folder) / "state.lock"
        done = "; nothing was evicted" if at_lock else ""  # (refused at its lock, before anything)
        ls = " 'vllm-lora cache ls' lists it without writing." if err.errno == errno.EROFS else ""
        raise DiskCacheAccessError(
            f"Cannot {verb} the Hugging Face cache {folder!r}: {why}{at}{done}. {fix}; for another cache pass "
            f"--cache-dir DIR (or set HF_HUB_CACHE or HF_HOME).{ls}", folder=folder) from err


def run_ls(args: argparse.Namespace) -> int:
    folder = _warn_missing(args.cache_dir)
    with _cache_access(folder, prune=False):
        revisions = list_cache(cache_dir=args.cache_dir)
    width = max((len(_name(r)) for r in revisions), default=0)
    for rev in revisions:
        print(json.dumps(_record(rev)) if args.json else _line(rev, width))
    if not args.json:
        print(f"{len(revisions)} revisions, {sum(r.nbytes for r in revisions)} bytes listed in {folder!r} "
              f"(only the revisions the plugin downloaded)")
    return 0


def run_prune(args: argparse.Namespace) -> int:
    folder = _warn_missing(args.cache_dir)
    with _cache_access(folder, prune=True):
        report = prune_cache(args.max_bytes, cache_dir=args.cache_dir)
    for rev in report.evicted:
        print(json.dumps({"evicted": _record(rev)}) if args.json else f"evicted {_line(rev)}")
    summary = {"bytes_before": report.bytes_before, "bytes_after": report.bytes_after, "max_bytes": report.max_bytes}
    print(json.dumps(summary) if args.json else f"{len(report.evicted)} evicted; {report.bytes_before} -> "
                                                f"{report.bytes_after} bytes (target {report.max_bytes})")
    if report.bytes_after > report.max_bytes:
        print(f"error: {report.bytes_after} bytes stay in use (held by a live process, or shared with files the "
              f"plugin did not download, or partial files of interrupted downloads: '*.incomplete' in the repos' "
              f"'blobs' folders), above --max-bytes {report.max_bytes}; see 'vllm-lora cache ls'.", file=sys.stderr)
        return 1
    return 0
