"""Adapters built ahead of use, off the engine loop: one build per adapter, bounded work and memory.

vLLM builds an adapter inside the engine step that first needs it, so every request in flight
stops producing tokens for the whole load. The plugin instead asks each worker to build the
adapter in the background ([`PrebuildTable.poll`]) while the engine keeps stepping; the request is
admitted once every worker has it ready, and the engine then only takes the finished model
([`PrebuildTable.take`]) and copies it into a LoRA slot.

The table is pure bookkeeping (no vLLM): the build function, the size function and the clock are
given to it.

* **One build per key.** Polls and takes of a key that is building share that build.
* **Bounded work.** At most ``max_builds`` builds run at once; more wait their turn.
* **Bounded memory.** Finished, not yet taken results are kept within ``budget_bytes``; the
  oldest are dropped first (a dropped one is simply built again when asked for). A result larger
  than the whole budget is still kept, alone, because a request is waiting for it. A result
  nobody takes within ``ttl_s`` (default 300 s) is dropped.
* **Errors.** A failed build raises its error to the next poll or take of that key, once; the
  key can then be built again.
"""

from __future__ import annotations

import functools
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, TypeVar

__all__ = ["PrebuildTable", "RecentlyUsed"]

T = TypeVar("T")


class PrebuildTable(Generic[T]):
    """Background builds keyed by adapter, with the rules in the module docstring.

    Example:
        >>> table = PrebuildTable(lambda key: f"built {key}", size_of=len, max_builds=1, budget_bytes=1 << 20)
        >>> while not table.poll("a"):  # starts the build, then reports when it is ready
        ...     time.sleep(0.01)
        >>> table.take("a")
        'built a'
        >>> table.take("a") is None  # taken once
        True
    """

    def __init__(self, build: Callable[[Any], T], *, size_of: Callable[[T], int], max_builds: int,
                 budget_bytes: int, ttl_s: float = 300.0, clock: Callable[[], float] = time.monotonic) -> None:
        if max_builds < 1 or budget_bytes < 0:
            raise ValueError(f"max_builds must be >= 1 and budget_bytes >= 0, got {max_builds}, {budget_bytes}")
        self._build = build
        self._size_of = size_of
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._pool = ThreadPoolExecutor(max_workers=max_builds, thread_name_prefix="vllm-lora-ext-build")
        self._lock = threading.RLock()  # a build that finishes at once runs its callback inside _start
        self._building: dict[Hashable, Future[T]] = {}
        self._ready: OrderedDict[Hashable, tuple[T, int, float]] = OrderedDict()  # value, bytes, finished at
        # untaken failures, oldest first: the error and when it came
        self._failed: OrderedDict[Hashable, tuple[BaseException, float]] = OrderedDict()
        self.builds_started = 0
        self.dropped = 0

    # -------------------------------------------------------------------------------------- queries

    @property
    def ready_bytes(self) -> int:
        """Bytes held by finished, untaken results."""
        with self._lock:
            return sum(entry[1] for entry in self._ready.values())

    def state(self, key: Hashable) -> str:
        """Return ``"ready"``, ``"building"``, ``"failed"`` or ``"absent"`` for ``key``."""
        with self._lock:
            if key in self._ready:
                return "ready"
            if key in self._building:
                return "building"
            return "failed" if key in self._failed else "absent"

    def pending(self) -> list[Hashable]:
        """Keys building now or built and not yet taken (what a residency report calls ``building``)."""
        with self._lock:
            return [*self._building, *self._ready]

    # -------------------------------------------------------------------------------------- actions

    def poll(self, key: Hashable) -> bool:
        """Return ``True`` if ``key`` is built; otherwise start its build (once) and return ``False``.

        Raises:
            The error of a failed build of ``key``, once.
        """
        with self._lock:
            self._expire()
            if key in self._ready:
                self._ready.move_to_end(key)
                return True
            failed = self._failed.pop(key, None)
            if failed is not None:
                raise failed[0]
            if key not in self._building:
                self._start(key)
        return False

    def take(self, key: Hashable) -> T | None:
        """Remove and return the result for ``key``, waiting for its build if one is running; ``None`` if none.

        Raises:
            The error of a failed build of ``key``, once.
        """
        with self._lock:
            self._expire()
            hit = self._ready.pop(key, None)
            if hit is not None:
                return hit[0]
            failed = self._failed.pop(key, None)
            if failed is not None:
                raise failed[0]
            future = self._building.get(key)
        if future is None:
            return None
        try:
            value = future.result()
        except BaseException:
            with self._lock:  # reported here: the done-callback (which may not have run yet) keeps nothing
                self._failed.pop(key, None)
                if self._building.get(key) is future:
                    del self._building[key]
            raise
        with self._lock:  # handed out once: the first taker claims it, the callback keeps nothing
            if self._building.get(key) is future:
                del self._building[key]
                self._ready.pop(key, None)
                return value
            hit = self._ready.get(key)
            if hit is not None and hit[0] is value:  # the callback ran first and kept it: claim it from there
                del self._ready[key]
                return value
        return None

    def discard(self, key: Hashable) -> None:
        """Forget ``key``: drop a finished result, and do not keep the result of a build still running."""
        with self._lock:
            self._ready.pop(key, None)
            self._failed.pop(key, None)
            future = self._building.pop(key, None)
        if future is not None:
            future.cancel()  # if it has not started; a running build finishes and its result is not kept

    def shutdown(self) -> None:
        """Stop taking builds; running ones finish."""
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------------------------- internals

    def _expire(self) -> None:  # under the lock: drop results and failures nobody took within ttl_s
        now = self._clock()
        for key in [k for k, entry in self._ready.items() if now - entry[2] > self.ttl_s]:
            del self._ready[key]
            self.dropped += 1
        for key in [k for k, (_, at) in self._failed.items() if now - at > self.ttl_s]:
            del self._failed[key]
        while len(self._failed) > _MAX_FAILED:  # a failure holds only its error (frames cleared), but not forever
            self._failed.popitem(last=False)

    def _start(self, key: Hashable) -> None:  # under the lock
        future = self._pool.submit(self._build, key)
        self._building[key] = future
        self.builds_started += 1
        future.add_done_callback(functools.partial(self._finished, key))

    def _finished(self, key: Hashable, future: Future[T]) -> None:
        if future.cancelled():
            return
        err = future.exception()
        size = 0
        if err is None:
            try:
                size = int(self._size_of(future.result()))
            except BaseException as size_err:  # pragma: no cover - a size function that fails
                err = size_err
        with self._lock:
            if self._building.get(key) is not future:
                return  # discarded while building
            del self._building[key]
            if err is not None:
                _clear_frames(err)  # the build's locals (its tensors) go with its frames; the stack stays readable
                self._failed[key] = (err, self._clock())
                self._expire()
                return
            self._ready[key] = (future.result(), size, self._clock())
            self._ready.move_to_end(key)
            self._expire()
            total = sum(entry[1] for entry in self._ready.values())
            while total > self.budget_bytes and len(self._ready) > 1:
                oldest = next(iter(self._ready))
                if oldest == key:
                    break
                total -= self._ready.pop(oldest)[1]
                self.dropped += 1


_MAX_FAILED = 256  # untaken failures kept (each only its error): keys a client polls once are bounded


def _clear_frames(err: BaseException) -> None:
    """Free the locals of every frame in ``err``'s traceback and its causes' (their file and line stay)."""
    import traceback

    seen: set[int] = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if err.__traceback__ is not None:
            traceback.clear_frames(err.__traceback__)
        err = err.__cause__ or err.__context__  # type: ignore[assignment]


class RecentlyUsed:
    """The last ``capacity`` distinct keys used, most recent last: a guess at what a worker's LRU cache holds.

    Example:
        >>> seen = RecentlyUsed(2)
        >>> seen.touch("a"), seen.touch("b"), seen.touch("c")
        (False, False, False)
        >>> "a" in seen, "c" in seen
        (False, True)
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, int(capacity))
        self._keys: OrderedDict[Hashable, None] = OrderedDict()

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    def touch(self, key: Hashable) -> bool:
        """Mark ``key`` used; return whether it was among the recent keys before."""
        was = key in self._keys
        self.add(key)
        return was

    def add(self, key: Hashable) -> list[Hashable]:
        """Mark ``key`` used; return the least recently used keys dropped to stay within ``capacity``.

        Example:
            >>> seen = RecentlyUsed(1)
            >>> seen.add("a"), seen.add("b")
            ([], ['a'])
        """
        self._keys[key] = None
        self._keys.move_to_end(key)
        dropped = []
        while len(self._keys) > self.capacity:
            dropped.append(self._keys.popitem(last=False)[0])
        return dropped

    def forget(self, key: Hashable) -> None:
        """Drop ``key`` (its adapter was removed)."""
        self._keys.pop(key, None)
