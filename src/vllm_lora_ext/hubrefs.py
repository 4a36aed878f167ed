"""A branch's or tag's ref in the Hugging Face cache (``refs/<name>``): how the plugin puts it back after a failed
download, and forward again after a successful one, beside other downloads of this process and of others.

huggingface_hub points ``refs/<branch>`` at the commit the Hub names before it transfers a file, without any lock
(since 1.x by a fresh file renamed over it; older releases write it in place, so a reader may find it empty). Where
the transfer then fails, the branch names a commit with nothing cached, and the revision cached before no longer
serves offline. The plugin's rules, each a read and a write under the cache's state lock ([`diskholds.locked`]),
so that no two ref writes of the plugin, in any process, interleave:

- **Put back** ([`RefMove.put_back`], a compare-and-swap on what the ref names now): the ref goes back to the commit
  it named before the download only while it names another commit whose snapshot holds no file. A commit of
  which any download, of this file or another, in this process or another, completed a file is left named: a
  success is never undone. A ref whose text is no commit (torn by an older huggingface_hub's write in place) is
  left too.
- **Settle** ([`settle_ref`]): a download or resolve that succeeded points the ref at its commit again if a put-back
  moved it away meanwhile (a failure decided before this one's first file was complete): the last success names
  the branch.

The put-back compares what the ref names with what is cached, not with the commit the failed download moved it to:
a ref moved on since, by a download still running (nothing of it cached yet), goes back too, and that download's
success settles it again. Comparing with the commit moved to would leave that ref, and when the running download
failed in turn, its put-back would restore the commit it found, the first download's empty one.
huggingface_hub's own write is outside the lock; one that lands between a put-back's read and its rename is lost,
and harmlessly so, for the same reason. Writes are a fresh file renamed over the ref, never through a link, only
inside the repo's folder (`diskledger.write_ref`); all of it is best effort: the download's own outcome is what
its caller sees.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from vllm_lora_ext.diskholds import locked
from vllm_lora_ext.diskledger import read_ref, write_ref
from vllm_lora_ext.hubguard import COMMIT_SHA

__all__ = ["RefMove", "has_files", "moving", "settle_ref"]

logger = logging.getLogger(__name__)


def has_files(repo: Path, commit: str | None) -> bool:
    """Whether the snapshot of ``commit`` in ``repo`` (the repo's cache folder) holds any file: huggingface_hub makes
    a snapshot's folders before it transfers, and links a file there only once it is complete."""
    if commit is None or not COMMIT_SHA.match(commit):
        return False
    for _, _, files in os.walk(repo / "snapshots" / commit):
        if files:
            return True
    return False


@dataclass
class RefMove:
    """One download by a branch or tag: its ref (``None``: a pinned commit, or the cache only), what the ref named
    before it, the repo's cache folder and the cache's state folder."""

    ref: Path | None
    before: str | None
    repo: Path
    root: Path

    def put_back(self) -> None:
        """After the download failed: point the ref back at ``before`` (remove it if it named none) if it names
        another commit, of which nothing is cached (see the module)."""
        if self.ref is None or (self.before is not None and not COMMIT_SHA.match(self.before)):
            return  # (a ref read torn before the download: what it named is not known)
        ref = self.ref

        def swap() -> None:
            now = read_ref(ref)
            if now is None or now == self.before or not COMMIT_SHA.match(now) or has_files(self.repo, now):
                return  # a file of it is complete (this download's failure is not the ref's): a success stays
            write_ref(ref, self.before, self.repo)

        _under_lock(self.root, swap)

    def settle(self, commit: str | None) -> None:
        """After the download succeeded at ``commit``: see `settle_ref`."""
        if self.ref is not None and commit is not None:
            settle_ref(self.ref, commit, self.repo, self.root)


def settle_ref(ref: Path, commit: str, repo: Path, root: Path) -> None:
    """Point ``ref`` at ``commit``, whose download succeeded, if it names another (a put-back moved it meanwhile)."""
    def swap() -> None:
        if read_ref(ref) != commit:
            write_ref(ref, commit, repo)

    _under_lock(root, swap)


def _under_lock(root: Path, fix: Callable[[], None]) -> None:
    """Run ``fix`` under the cache's state lock; where that lock cannot be taken (a read-only cache, whose refs cannot
    be written either) or ``fix`` fails, log it and go on: a ref fix is best effort."""
    try:
        with locked(root):
            fix()
    except Exception as err:
        logger.debug("could not fix a ref in the Hugging Face cache under %s: %s", root, err)


@contextlib.contextmanager
def moving(ref: Path | None, repo: Path, root: Path) -> Iterator[RefMove]:
    """Within the block, one download by ``ref``'s branch: on an error, put the ref back ([`RefMove.put_back`]); on
    success the caller settles it with the commit it got."""
    move = RefMove(ref, read_ref(ref), repo, root)
    try:
        yield move
    except BaseException:
        move.put_back()
        raise
