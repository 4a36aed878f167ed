"""MixRegistry: canonical mix key -> one collision-free adapter id and name, bounded, with leases.

Why a registry and not a hash: vLLM identifies an adapter by ``lora_int_id`` alone, and a worker
that already holds an id skips loading it. Ids derived from a digest collide (30 bits: the first
collision after ~4,000 mixes), and a colliding mix is then served another mix's tensors. Here
every id is handed out by one allocator that checks each candidate against every id in use (live
mixes and, through ``taken``, the user's own adapters), so two different specs never share an id.

Ids are allocated in order inside a block of the id space (``MIX_ID_BLOCK`` ids from ``MIX_ID_BASE``), so an
id freed by eviction is not handed out again until the whole block has been used once; a request
still running on an evicted mix keeps a unique id. Several API-server processes sharing one
engine each take their own block (``block=`` their index).

The registry is bounded: at most ``capacity`` mixes. Registering one more evicts the least
recently used mix that no request holds; when every mix is held, [`MixCapacityError`] is raised
(the server waits, then answers 503). A hold is a [`MixLease`]: ``lease(entry)`` (a request being
routed, until its handler returns) or ``claim(id)`` (a generation, until it ends); ``release()`` ends
it. Nothing expires: whoever takes a lease releases it, so a request that never generates holds its
mix only while it is being handled.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from vllm_lora_ext.errors import MixCapacityError
from vllm_lora_ext.mixing import MixSpec

__all__ = ["MixEntry", "MixLease", "MixRegistry", "MIX_ID_BASE", "MIX_ID_BLOCK"]

MIX_ID_BASE = 1 << 30  # clear of vLLM's own counter ids (1, 2, 3, ...); ids stay below 2**31
MIX_ID_BLOCK = 1 << 24  # ids per API-server process: 64 processes fit below 2**31


@dataclass
class MixEntry:
    """One registered mix: its spec, id and name, and how many leases pin it."""

    spec: MixSpec
    lora_int_id: int
    active: int = 0

    @property
    def key(self) -> str:
        return self.spec.key

    @property
    def lora_name(self) -> str:
        return self.spec.lora_name

    def in_use(self) -> bool:
        """Whether a request holds this mix."""
        return self.active > 0


class MixLease:
    """A request's hold on a mix; ``release()`` is idempotent."""

    def __init__(self, registry: MixRegistry, entry: MixEntry) -> None:
        self._registry = registry
        self.entry = entry
        self._held = True

    @property
    def held(self) -> bool:
        """Whether this lease still holds its mix (not released yet)."""
        return self._held

    def release(self) -> None:
        """Let the mix be evicted again (once no other request holds it)."""
        if self._held:
            self._held = False
            self._registry._release(self.entry)


class MixRegistry:
    """A bounded map from canonical mix keys to unique adapter ids (see the module docstring).

    Example:
        >>> from vllm_lora_ext.mixing import MixComponent, MixSpec
        >>> reg = MixRegistry(capacity=2)
        >>> spec = MixSpec((MixComponent("a", "/a", 0.5),))
        >>> entry, evicted = reg.register(spec)
        >>> entry.lora_int_id, evicted
        (1073741824, [])
        >>> reg.register(spec)[0] is entry
        True
    """

    def __init__(self, capacity: int, *, block: int = 0, span: int = MIX_ID_BLOCK) -> None:
        if capacity < 1:
            raise ValueError("MixRegistry capacity must be >= 1")
        if not 0 <= block or MIX_ID_BASE + (block + 1) * span > (1 << 31):
            raise ValueError(f"id block {block} of {span} ids does not fit below 2**31")
        self.capacity = capacity
        self._lo = MIX_ID_BASE + block * span
        self._span = span
        self._next = 0
        self._lock = threading.Lock()
        self._by_key: OrderedDict[str, MixEntry] = OrderedDict()  # LRU order: oldest first
        self._by_id: dict[int, MixEntry] = {}

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, spec: MixSpec) -> MixEntry | None:
        """Return the live entry of ``spec`` (marking it recently used), or ``None``."""
        with self._lock:
            entry = self._by_key.get(spec.key)
            if entry is not None:
                self._by_key.move_to_end(spec.key)
            return entry

    def by_id(self, lora_int_id: int) -> MixEntry | None:
        """Return the live entry holding ``lora_int_id``, or ``None``."""
        with self._lock:
            return self._by_id.get(lora_int_id)

    def register(self, spec: MixSpec, *, taken: Callable[[int], bool] = lambda _id: False
                 ) -> tuple[MixEntry, list[MixEntry]]:
        """Return ``(entry, evicted)``: the live entry for ``spec``, registering it if new.

        A new mix gets the next id of this registry's block that no live mix holds and ``taken``
        does not report (the user's adapters). When the registry is full, least recently used mixes
        that no request holds are evicted to make room; the caller unloads them.

        Raises:
            [`MixCapacityError`]: every registered mix is held by a request in flight.
        """
        with self._lock:
            hit = self._by_key.get(spec.key)
            if hit is not None:
                self._by_key.move_to_end(spec.key)
                return hit, []
            evicted: list[MixEntry] = []
            if len(self._by_key) >= self.capacity:
                victim = next((e for e in self._by_key.values() if not e.in_use()), None)
                if victim is None:
                    raise MixCapacityError(
                        f"All {self.capacity} mix slots are held by requests in flight, so mix {spec.lora_name!r} "
                        f"cannot be registered now. Retry, or raise VLLM_LORA_EXT_MAX_MIXES.")
                self._drop(victim)
                evicted.append(victim)
            entry = MixEntry(spec, self._allocate(taken))
            self._by_key[spec.key] = entry
            self._by_id[entry.lora_int_id] = entry
            return entry, evicted

    def _allocate(self, taken: Callable[[int], bool]) -> int:
        for _ in range(self._span):
            candidate = self._lo + self._next
            self._next = (self._next + 1) % self._span
            if candidate not in self._by_id and not taken(candidate):
                return candidate
        raise MixCapacityError(f"No free adapter id left in {self._lo}-{self._lo + self._span - 1}.")

    def _drop(self, entry: MixEntry) -> None:
        del self._by_key[entry.key]
        del self._by_id[entry.lora_int_id]

    def remove(self, spec: MixSpec) -> MixEntry | None:
        """Forget ``spec`` (e.g. its load failed); return the entry that was removed."""
        with self._lock:
            entry = self._by_key.get(spec.key)
            if entry is not None:
                self._drop(entry)
            return entry

    def discard(self, entry: MixEntry) -> bool:
        """Forget ``entry`` if it is still the live entry of its mix (not one made anew since); whether it was."""
        with self._lock:
            if self._by_key.get(entry.key) is not entry:
                return False
            self._drop(entry)
            return True

    def using(self, name: str) -> list[MixEntry]:
        """Return the live entries whose mix has a component named ``name``."""
        with self._lock:
            return [e for e in self._by_key.values() if any(c.name == name for c in e.spec.components)]

    def lease(self, entry: MixEntry) -> MixLease:
        """Hold ``entry`` (it is not evicted) until the returned lease is released."""
        with self._lock:
            entry.active += 1
            return MixLease(self, entry)

    def claim(self, lora_int_id: int) -> MixLease | None:
        """Hold the live mix with id ``lora_int_id`` (a generation starts); ``None`` if no live mix has this id."""
        with self._lock:
            entry = self._by_id.get(lora_int_id)
            if entry is None:
                return None
            entry.active += 1
            return MixLease(self, entry)

    @property
    def first_id(self) -> int:
        """The first id of this registry's block."""
        return self._lo

    def _release(self, entry: MixEntry) -> None:
        with self._lock:
            entry.active = max(0, entry.active - 1)

    def in_use(self) -> int:
        """Return how many live mixes a request holds."""
        with self._lock:
            return sum(e.in_use() for e in self._by_key.values())
