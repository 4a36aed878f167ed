"""A build copied to the GPU while it is built: an image of the build process's arena file, filled block by block.

GPU staging (``integration.staging.stage``) used to start once the build was answered: 0.10 s for a 1.6 GB adapter
on an H200 host with 32 requests decoding, after a build of 0.33 s (``bench/results/no_stall_h200_r30.json``). The
build process reads MoE blocks into its arena file four at a time, and tells the worker where the file is and then,
block by block, which spans of it are final (``building.Progress``). A [`Prestage`] maps the file (privately, for
reading) and copies each span to the same offset of one GPU buffer, the image, on a thread of its own and through
staging's pinned chunks, while the next blocks are read. Once the build is answered, ``integration.staging.stage``
takes the image ([`Prestage.take`]): each tensor of the hand-over's mapping becomes a view of the image at its
offset, and only what was not copied yet (the dense factors the hand-over appends, a B that vLLM's ``optimize()``
scales afterwards) is copied then.

Everything here is a hint: a span never reported is copied by staging, a file that cannot be mapped or a GPU
without room leaves the whole copy to staging, and the image is freed if staging does not take it. Nothing here
imports vLLM; where this sits in an adapter's life is in the package docstring (steps 3 and 5).
"""

from __future__ import annotations

import bisect
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from vllm_lora_ext.transport.cuda import stream_for
from vllm_lora_ext.transport.staging import _copy_through_pinned

logger = logging.getLogger(__name__)

__all__ = ["Prestage", "Spans", "prestaged_bytes"]

_LOCK = threading.Lock()
_LIVE: weakref.WeakSet[Prestage] = weakref.WeakSet()


def prestaged_bytes() -> int:
    """GPU bytes this process holds in images of builds still in flight (not yet taken by staging)."""
    with _LOCK:
        return sum(p.image.nbytes for p in list(_LIVE) if p.image is not None)


class Spans:
    """Byte spans ``[start, end)`` of a buffer, kept merged: what is on the GPU already."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []

    def add(self, start: int, end: int) -> None:
        if end <= start:
            return
        i = bisect.bisect_left(self._ends, start)  # the first span that ends at or after start: it may merge
        j = bisect.bisect_right(self._starts, end)  # spans from i to j-1 touch [start, end)
        if i < j:
            start, end = min(start, self._starts[i]), max(end, self._ends[j - 1])
        self._starts[i:j], self._ends[i:j] = [start], [end]

    def covers(self, start: int, end: int) -> bool:
        """Whether ``[start, end)`` lies wholly in one span (an empty range always does)."""
        if end <= start:
            return True
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= end

    def items(self) -> list[tuple[int, int]]:
        return list(zip(self._starts, self._ends))

    @property
    def total(self) -> int:
        return sum(e - s for s, e in zip(self._starts, self._ends))


class Prestage:
    """One build's GPU image, filled from its arena file as the build process reports spans final.

    ``room(nbytes)`` says whether that many bytes may be staged now (the budget and the GPU's free memory). The build
    process's reader thread calls [`hear`] for each progress event (it never blocks); the caller of the build calls
    [`finish`] once it is answered (the copies queued are done then, and the file is no longer mapped here), then
    [`take`] hands the image to staging, or [`close`] frees it.
    """

    def __init__(self, device: Any, room: Callable[[int], bool]) -> None:
        self.device = torch.device(device)
        self._room = room
        self._events: queue.SimpleQueue[tuple[Any, ...] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self.image: torch.Tensor | None = None  # uint8 on the GPU, the arena file's bytes at the same offsets
        self.spans = Spans()  # what of the image holds the file's final bytes
        self._source: torch.Tensor | None = None  # this process's private mapping of the file, while copying
        self.refused: str | None = None  # why nothing (more) is copied here
        self.seconds = 0.0  # spent copying, on the prestage thread

    def hear(self, event: tuple[Any, ...]) -> None:
        """Queue one progress event (``("arena", path, mapped, whole)`` or ``("spans", [(offset, bytes), ...])``);
        never raises (it runs on the thread that reads every build's answer)."""
        try:
            if self._thread is None and self.refused is None:
                thread = threading.Thread(target=self._run, name="vllm-lora-ext-prestage", daemon=True)
                thread.start()
                self._thread = thread
            self._events.put(event)
        except Exception as err:  # no thread to be had: staging copies it all after the build
            self.refused = f"{type(err).__name__}: {err}"

    def finish(self) -> None:
        """Wait for the copies queued so far and drop this process's mapping of the file."""
        thread, self._thread = self._thread, None
        if thread is not None:
            self._events.put(None)
            thread.join()

    def take(self) -> tuple[torch.Tensor, Spans] | None:
        """The image and what of it is copied, handed to its new owner (``None`` if there is none)."""
        self.finish()
        with _LOCK:
            image, self.image = self.image, None
        return None if image is None or self.refused is not None else (image, self.spans)

    def close(self) -> None:
        """Free the image (a failed build, or staging did not take it)."""
        self.finish()
        with _LOCK:
            self.image = None

    def _run(self) -> None:
        try:
            with torch.cuda.device(self.device):
                while (event := self._events.get()) is not None:
                    if self.refused is None:
                        self._handle(event)
        except Exception as err:  # a hint that failed: staging copies what it needs
            self.refused = f"{type(err).__name__}: {err}"
            logger.info("a build's copy to the GPU while it was built stopped (%s); staging copies it after",
                        self.refused)
            with _LOCK:
                self.image = None
        finally:
            self._source = None

    def _handle(self, event: tuple[Any, ...]) -> None:
        if event[0] == "arena":
            _, path, mapped, whole = event
            if self.image is not None or not self._room(int(whole)):
                self.refused = "a second arena" if self.image is not None else "no room on the GPU"
                return
            with torch.cuda.stream(stream_for(self.device, "staging")):
                image = torch.empty(int(whole), dtype=torch.uint8, device=self.device)
            self._source = torch.from_file(str(path), shared=False, size=int(mapped), dtype=torch.uint8)
            with _LOCK:
                self.image = image
                _LIVE.add(self)
        elif event[0] == "spans" and self.image is not None and self._source is not None:
            limit = min(self.image.numel(), self._source.numel())
            spans = sorted((int(off), int(off) + int(n)) for off, n in event[1] if 0 <= off and off + n <= limit)
            t0 = time.perf_counter()
            _copy_through_pinned(self.image, [(s, self._source[s:e]) for s, e in spans if e > s],
                                 stream_for(self.device, "staging"), exact=True)  # other blocks' bytes lie between
            self.seconds += time.perf_counter() - t0
            for s, e in spans:
                self.spans.add(s, e)
