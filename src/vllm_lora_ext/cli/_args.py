"""argparse helpers the subcommands share (a leaf: the subcommands import it, it imports no subcommand)."""

from __future__ import annotations

import argparse

from typing import TYPE_CHECKING, Any

from vllm_lora_ext.constants import MAX_EXPERTS

if TYPE_CHECKING:
    from vllm_lora_ext.errors import DiskCacheFullError
    from vllm_lora_ext.sources import ResolvedAdapter

__all__ = ["add_base_config", "add_output", "add_source", "one_line", "positive_int", "plural", "resolve_offline",
           "held_sources", "said_beside_own"]


def one_line(err: BaseException) -> str:
    """An error as the one ``error:`` line the CLI prints (whitespace folded, capped)."""
    import re

    from vllm_lora_ext.constants import MAX_MESSAGE_CHARS

    text = re.sub(r"(?<=[^.])\.\.(?=\s|$)", ".", " ".join(str(err).split()))  # "…on.. Check" from nested messages
    return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + " ..."


_HELD: list[object] = []  # this command's disk-tier holds: kept until the process ends, which ends them


def resolve_offline(source: str) -> ResolvedAdapter:
    """`resolve_source` for an offline tool: a pickle weight file gets the fix that works here (re-save it as
    safetensors), not the server's opt-in, which the offline tools do not take.

    An ``hf:`` source is held in the disk tier from before its resolve (the revision named, or with a branch every
    revision of the repo) and, once resolved, its commit until the command ends, so neither another process's
    eviction nor this command's next download (a mix's next component) removes it while the command reads it.
    """
    from vllm_lora_ext.errors import UnsafeFormatError, offline_pickle_error
    from vllm_lora_ext.sources import parse_source, resolve_source

    try:
        src = parse_source(source)
        before = _hold(src.repo_id, src.revision) if src.kind == "hf" and src.repo_id else None
        resolved = resolve_source(source)
        if before is not None and resolved.commit and resolved.commit != src.revision \
                and _hold(src.repo_id, resolved.commit) is not None:  # narrowed to the commit read
            before.release()
            _HELD.remove(before)
        return resolved
    except UnsafeFormatError as err:
        raise offline_pickle_error(source, err.filename) from err


def _hold(repo_id: str | None, revision: str | None) -> Any:
    """Hold ``repo_id@revision`` for this command (``None`` where the cache cannot be written: then nothing here
    evicts from it either)."""
    from vllm_lora_ext.diskholds import hold

    try:
        made = hold(repo_id or "", revision, why="read by a vllm-lora command")
    except Exception:
        return None
    _HELD.append(made)
    return made


def held_sources() -> list[Any]:
    """The disk-tier holds this command took on its sources so far (each kept until the process ends)."""
    return list(_HELD)


def said_beside_own(err: DiskCacheFullError, held: list[Any], *, done: str, fewer: str | None,
                    cache_dir: str | None = None) -> DiskCacheFullError:
    """The disk bound's refusal said for this command, where what fills the bound is only the revisions ``held``
    (the sources it ``done`` before, kept until it ends; the refusal's own advice, to unload adapters, does not
    apply): the sizes, the bound the sources need together, and ``fewer`` (the command's other way out). ``err`` as
    it is where anything else is in use too, the source is larger than the whole bound, or the listing fails."""
    try:
        return _beside_own(err, held, done, fewer, cache_dir) or err
    except Exception:  # the listing failed (a writer past the lock's timeout, ...): the refusal as it is
        return err


def _beside_own(err: DiskCacheFullError, held: list[Any], done: str, fewer: str | None,
                cache_dir: str | None) -> DiskCacheFullError | None:
    from vllm_lora_ext._util import fmt_bytes
    from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES
    from vllm_lora_ext.diskcache import list_cache
    from vllm_lora_ext.errors import DiskCacheFullError

    if not held or err.needed > err.limit:  # larger than the whole bound: its own message says so
        return None
    mine = {(h.repo_id, h.revision) for h in held}
    listed = list_cache(cache_dir=cache_dir)
    own = [r for r in listed if (r.repo_id, r.commit) in mine]
    others = [r for r in listed if (r.repo_id, r.commit) not in mine and (r.held_by or not r.evictable)]
    if not own or others or sum(r.nbytes for r in own) < err.in_use:  # (revisions of one repo share blobs: the sum
        return None  # counts a shared one twice, in_use once; so anything else in use is looked for by name)
    names = ", ".join(f"hf:{r.repo_id}@{r.commit[:12]}" for r in own[:3]) + (", ..." if len(own) > 3 else "")
    return DiskCacheFullError(
        f"Source {err.source!r} needs {fmt_bytes(err.needed)} in the Hugging Face cache, but the disk cache bound "
        f"{ENV_DISK_CACHE_BYTES} is {fmt_bytes(err.limit)} and {fmt_bytes(err.in_use)} of it is taken by the "
        f"{plural(len(own), 'source')} this command {done} before ({names}), which it keeps cached until it ends so "
        f"that none is evicted before it is done with them; nothing else is in use. Raise {ENV_DISK_CACHE_BYTES} to "
        f"fit the sources together: more than {fmt_bytes(err.in_use + err.needed)} (theirs and this file's), plus "
        f"room for this source's other files and for any source after it" + (f"; or {fewer}." if fewer else "."),
        source=err.source, limit=err.limit, in_use=err.in_use, needed=err.needed)


def add_source(parser: argparse.ArgumentParser) -> None:
    """The ``SOURCE`` positional of a subcommand that reads one adapter."""
    parser.add_argument("source", metavar="SOURCE",
                        help="hf:org/repo[@rev][:path], a local adapter folder or .safetensors file")


def add_output(parser: argparse.ArgumentParser, *, folder: str, over: str) -> None:
    """``-o/--output DIR`` (``folder``: what the folder holds) and ``--force`` (``over``: what it may replace)."""
    parser.add_argument("-o", "--output", required=True, metavar="DIR", help=f"{folder}; new or empty")
    parser.add_argument("--force", action="store_true", help=f"replace the adapter in a non-empty folder or {over}")


def add_base_config(parser: argparse.ArgumentParser, *, needed_for: str) -> None:
    """``--base-config CONFIG``: the base model's config, which gives the sizes ``needed_for`` names."""
    parser.add_argument("--base-config", default=None, metavar="CONFIG",
                        help=f"the base model's config.json, its folder, or hf:org/model ({needed_for})")


def positive_int(text: str) -> int:
    """argparse type: an integer from 1 to 65536."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if not 1 <= value <= MAX_EXPERTS:
        raise argparse.ArgumentTypeError(f"{value} is out of range; give an integer from 1 to {MAX_EXPERTS}")
    return value


def plural(n: int, word: str) -> str:
    """``1 adapter``, ``2 adapters``."""
    return f"{n} {word}" if n == 1 else f"{n} {word}s"
