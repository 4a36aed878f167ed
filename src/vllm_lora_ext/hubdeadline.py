"""The time each file of an adapter fetch may spend downloading from the Hub: a deadline that grows with its bytes.

huggingface_hub's timeouts (``HF_HUB_ETAG_TIMEOUT``, ``HF_HUB_DOWNLOAD_TIMEOUT``) bound each read, not a transfer:
a Hub or mirror (``HF_ENDPOINT``) that sends a byte every few seconds, or that stalls past a read's timeout and
answers each resume with the same 10 MiB again (huggingface_hub resumes for ever while 10 MiB come each time),
would keep the fetch, and the request and worker waiting on it, busy for ever. Within [`timed`] (one file of an
adapter fetch), the file must have received, ``t`` seconds after the Hub's first answer for it, at least
``(t - VLLM_LORA_EXT_DOWNLOAD_GRACE_S) * VLLM_LORA_EXT_DOWNLOAD_MIN_RATE`` bytes (defaults 60 s and 1 MiB/s; a
rate of 0 turns the deadline off). So a file of ``n`` bytes has ``grace + n / rate`` seconds, and a Hub that
trickles is given up at about ``grace``. A byte counts once: received again (a resume answered from the start, or
from an offset past the bytes got) it is no progress. The window opens at the first answer, so time spent waiting
for another download of the same file (huggingface_hub's lock) never counts against this one, and each file has a
window of its own (a file another download completed, or one hf_xet moved, took no HTTP bytes here).

It is checked on each answer huggingface_hub's HTTP client receives within the block (hubguard's event hook), on
each chunk of its body as it arrives, and after each read of the client's connections (below), so a fetch overruns
its deadline by at most one read's timeout. The reads matter for an answer whose headers trickle in: no answer
exists until they end, and huggingface_hub's timeouts bound each read, so a Hub that sends a byte of headers
every few seconds would hold a request for days (the HTTP parser stops at 100 KiB of headers: with the default
10 s read timeout, about 12 days per request). The first bytes of the file's first answer open its window too.
The read check wraps httpcore's synchronous stream class (``httpcore2`` under huggingface_hub 2, ``httpcore``
under 1.x), once per process, and does nothing outside a [`timed`] block; huggingface_hub 0.x (requests) has
only the answer and chunk checks. Not checked: a file in Xet storage, which hf_xet transfers outside the client.
"""

from __future__ import annotations

import contextlib
import functools
import re
import sys
import threading
import time
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from vllm_lora_ext._util import fmt_bytes
from vllm_lora_ext.constants import ENV_DOWNLOAD_GRACE, ENV_DOWNLOAD_MIN_RATE, download_grace_seconds, download_min_rate
from vllm_lora_ext.errors import HubTooSlowError

__all__ = ["DownloadClock", "on_answer", "timed"]


@dataclass
class DownloadClock:
    """One file's deadline within an adapter fetch: its window opens at the Hub's first answer (see the module)."""

    source: str
    filename: str
    rate: float = field(default_factory=download_min_rate)
    grace: float = field(default_factory=download_grace_seconds)
    started: float | None = None  # the Hub's first answer for the file
    reached: int = 0  # how far into the file its bytes have arrived

    def check(self, offset: int = 0) -> None:
        """Note that the file's bytes have arrived up to ``offset``, then raise [`HubTooSlowError`] if the file is
        past its deadline."""
        now = time.monotonic()
        self.started = now if self.started is None else self.started
        self.reached = max(self.reached, offset)
        spent = now - self.started
        if self.rate <= 0 or spent <= self.grace + self.reached / self.rate:
            return
        from huggingface_hub import constants

        got = f"{fmt_bytes(self.reached)} ({self.reached} bytes)"
        said = (f"Downloading {self.filename!r} of {self.source!r} was stopped after {spent:.0f} s, "
                f"having received {got} of it: slower than the {fmt_bytes(self.rate)}/s after "
                f"{self.grace:g} s that a file must average; its partial file is not kept.")
        raise HubTooSlowError(
            f"{said} The Hub at {str(constants.ENDPOINT)!r} (HF_ENDPOINT) sends too slowly. Retry, point HF_ENDPOINT "
            f"at a faster Hub or mirror, or lower {ENV_DOWNLOAD_MIN_RATE} (0: no deadline) or raise "
            f"{ENV_DOWNLOAD_GRACE}.",
            source=self.source, received=self.reached, seconds=spent,
            public_message=f"{said} The server's Hub sends too slowly; retry later, or tell the server's operator.")


_CLOCK: ContextVar[DownloadClock | None] = ContextVar("vllm_lora_ext_download_clock", default=None)


@contextlib.contextmanager
def timed(clock: DownloadClock) -> Iterator[None]:
    """Within the block, hold huggingface_hub's answers in this thread (or task) to ``clock`` (one file's); the caller
    must have put `on_answer` on huggingface_hub's client (`hubguard.watch_clients`)."""
    _watch_reads()
    token = _CLOCK.set(clock)
    try:
        yield
    finally:
        _CLOCK.reset(token)


_WATCH_LOCK = threading.Lock()


def _watch_reads() -> None:
    """Check the deadline after every read of the synchronous HTTP connections of the httpcore modules loaded (see
    the module); once per class."""
    with _WATCH_LOCK:
        for name in ("httpcore2._backends.sync", "httpcore._backends.sync"):
            module = sys.modules.get(name)
            for cls in (getattr(module, "SyncStream", None), getattr(module, "TLSinTLSStream", None)):
                read = getattr(cls, "read", None)
                if read is not None and getattr(read, "_vllm_lora_ext_timed", False) is not True:
                    cls.read = _timed_read(read)


def _timed_read(read: Any) -> Any:
    """``read`` (a stream's), checking the deadline of the file being fetched in this context, if any, after each read
    that returns (outside httpcore's mapping of socket errors, which would take the deadline's ``TimeoutError`` for a
    read timeout and retry)."""
    @functools.wraps(read)
    def timed_read(self: Any, max_bytes: int, timeout: float | None = None) -> bytes:
        data: bytes = read(self, max_bytes, timeout)
        clock = _CLOCK.get()
        if clock is not None:
            clock.check()
        return data

    timed_read._vllm_lora_ext_timed = True  # type: ignore[attr-defined]
    return timed_read


def on_answer(response: Any) -> None:
    """The event hook: check the deadline as an answer arrives, and on each chunk of its body as it is read."""
    clock = _CLOCK.get()
    if clock is None:
        return
    clock.check()
    library = sys.modules.get(type(response).__module__.split(".")[0])
    base = getattr(library, "SyncByteStream", None)
    if base is not None and isinstance(response.stream, base):  # (an async client's answer is left alone)
        start = re.match(r"bytes (\d+)-", response.headers.get("Content-Range", "")) if response.status_code == 206 \
            else None  # a resume, from no further than the bytes got (a Content-Range further on is no progress)
        response.stream = _timed_stream(base, response.stream, clock, min(int(start.group(1)), clock.reached)
                                        if start else 0)


def _timed_stream(base: type, stream: Any, clock: DownloadClock, offset: int) -> Any:
    """``stream`` (the body from ``offset`` on), whose chunks are counted against ``clock`` as they arrive (before
    any buffering)."""

    class _Timed(base):  # type: ignore[misc,valid-type]
        def __iter__(self) -> Iterator[bytes]:
            at = offset
            for chunk in stream:
                at += len(chunk)
                clock.check(at)
                yield chunk

        def close(self) -> None:
            stream.close()

        def __getattr__(self, name: str) -> Any:  # e.g. the ``elapsed`` httpx reads after the body
            return getattr(stream, name)

    return _Timed()
