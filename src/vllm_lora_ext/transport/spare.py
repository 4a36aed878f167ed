"""The one spare policy: at most one piece of memory kept ready for the next arena that fits it.

Fresh memory costs an arena page faults (a page allocated and zeroed per 4 KiB written) and, on a GPU worker, a
registration; memory kept from before costs neither. Both kinds of arena keep one spare this way
(``arena``): the process's anonymous mapping, and a build process's shared file.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

__all__ = ["Spare"]


class _Sized(Protocol):
    @property
    def capacity(self) -> int: ...


K = TypeVar("K", bound=_Sized)


class Spare(Generic[K]):
    """At most one piece of memory (``K``, with a ``capacity``) kept for the next arena that fits it.

    It is made ahead, its pages taken, on a background thread ([`start`]), or kept once an arena is done with
    it ([`keep`]). It is handed out once ([`take`]), to an arena that needs at most its capacity and, given
    ``slack``, at least its capacity less ``slack(needed)`` (a small arena then does not hold on to a large
    spare). A newer one replaces it, and the older is let go (``let_go``); [`clear`] lets it go, and with
    ``close`` nothing is kept afterwards (one still being made is let go when it is done). ``taken`` counts the
    arenas it served. Thread-safe.
    """

    def __init__(self, *, slack: Callable[[int], int] | None, let_go: Callable[[K], object]) -> None:
        self._slack = slack
        self._let_go = let_go
        self._lock = threading.RLock()  # re-entrant: a host arena's memory may come back (the GC) under it
        self._kept: K | None = None
        self._preparing = False
        self._closed = False
        self.taken = 0

    def fits(self, needed: int, kept: _Sized) -> bool:
        """Whether ``kept`` may serve an arena of ``needed`` bytes."""
        return needed <= kept.capacity and (self._slack is None or kept.capacity <= needed + self._slack(needed))

    def take(self, needed: int) -> K | None:
        """The kept spare, if it [`fits`] ``needed`` (it is no longer kept then)."""
        with self._lock:
            kept = self._kept
            if kept is None or not self.fits(needed, kept):
                return None
            self._kept = None
            self.taken += 1
            return kept

    def keep(self, item: K) -> None:
        """Keep ``item`` as the spare, letting the one kept before go (or ``item`` itself, once closed)."""
        with self._lock:
            if self._closed:
                old: K | None = item
            else:
                old, self._kept = self._kept, item
        if old is not None:
            self._let_go(old)  # outside the lock

    def start(self, size: int, make: Callable[[int], K | None], *, wait: bool = False, name: str) -> bool:
        """Run ``make(size)`` on a thread named ``name`` (here with ``wait``) and keep what it returns, unless a spare
        that fits ``size`` is kept or one is being made, or the spare is closed. Returns whether it started."""
        with self._lock:
            kept = self._kept
            if self._closed or self._preparing or (kept is not None and self.fits(size, kept)):
                return False
            self._preparing = True
        if wait:
            self._make(size, make)
        else:
            threading.Thread(target=self._make, args=(size, make), name=name, daemon=True).start()
        return True

    def _make(self, size: int, make: Callable[[int], K | None]) -> None:
        try:
            item = make(size)
            if item is not None:
                self.keep(item)
        finally:
            with self._lock:
                self._preparing = False

    def clear(self, *, close: bool = False) -> None:
        """Let the kept spare go; with ``close``, keep none from now on."""
        with self._lock:
            old, self._kept = self._kept, None
            self._closed = self._closed or close
        if old is not None:
            self._let_go(old)

    def forget(self) -> K | None:
        """After a fork, in the child: keep nothing and make nothing (the parent's thread making one does not exist
        here), and return what was kept, unreleased, for the caller to disown."""
        kept, self._kept = self._kept, None
        self._preparing = False
        self._lock = threading.RLock()
        return kept
