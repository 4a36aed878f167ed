"""Residency: which replica should take a multiplexed adapter id, and what one engine holds (pure, no Ray, no vLLM).

A fleet of replicas each builds the adapters and mixes it receives. Sending an id to the replica that already
holds it (built or building) saves a build, a copy of host memory and a cold first request. Replicas report the
multiplexed ids (``<base>:<adapter>``, Ray Serve LLM's convention) they hold; `rank_replicas` orders replicas
for one id from those reports. The ranks, most preferred first:

| rank | replicas | why |
|---|---|---|
| holders | those that hold the id, or the same mix written alike (``a=0.70+b=0.3`` is ``a=0.7+b=0.3``) | nothing to build |
| component holders | for a mix not held anywhere: those holding any of its components, most first, home order within a count | its parts are hot there |
| home order | the others, one rank each, in the order of the id's rendezvous hash over the replicas | the same pick everywhere |

An id no replica reports yet goes to its **home**: the replica with the highest hash of (home key, replica id),
where the home key is the id itself, or a mix's first component (so a new mix lands where that component lands).
The pick depends on nothing but the id and the set of replicas, so a burst of first requests for one id, sent
before any replica has reported it, lands on one replica, and two routers (one per node's proxy) agree; replicas
joining or leaving move only the ids homed on them. Reports arrive every 0.1 s or so.

A router tries the ranks in order and takes the first replica in a rank whose queue is not full; when every
preferred replica is saturated (its queue at ``max_ongoing_requests``), the next rank takes the request. That
rule is Serve's own (``RequestRouter`` in ``ray.serve``); this module only orders the replicas, and
`vllm_lora_ext.integration.ray_routing` feeds the order to Serve's router.

`adapter_levels` is the engine side, for routers outside Ray: each adapter an engine holds, at its highest
level (``gpu``: in a LoRA slot; ``cpu``: in the CPU cache; ``building``: a background build in flight), the
sample set of the ``vllm_lora_ext_adapter_resident`` gauge. Its labels are the adapters held now, so the
series count stays bounded by the engine's caches (``max_loras``, ``max_cpu_loras``, the build table).
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from vllm_lora_ext.constants import MAX_MODEL_FIELD_CHARS
from vllm_lora_ext.multiplex import looks_like_source, split_model_id

__all__ = ["LEVELS", "AdapterId", "adapter_id", "home_order", "rank_replicas", "adapter_levels"]

R = TypeVar("R", bound=Hashable)

# The gauge's ``level`` label, highest first. vLLM's proposed ``vllm:lora_adapter_loaded`` (PR #54830) names
# the same split ``gpu`` / ``cpu``; ``building`` is the plugin's own (background builds).
LEVELS = ("gpu", "cpu", "building")


@dataclass(frozen=True)
class AdapterId:
    """One multiplexed id as routing sees it: ``key`` compares equal for equal mixes; ``components`` are the
    ids of a mix's adapters (empty for anything but a mix); ``home`` is what its home replica is hashed from
    (a mix's first component, else the key)."""

    key: str
    components: frozenset[str]
    home: str = ""

    @property
    def home_key(self) -> str:
        return self.home or self.key


def adapter_id(model_id: str) -> AdapterId:
    """Return the routing key and mix components of a multiplexed id ``<base>:<adapter>``.

    A mix (``a=0.7+b``) has a key with its weights written one way (``0.70`` and ``0.7`` match) and the ids
    ``<base>:a``, ``<base>:b`` as components; any other id (a name, a source, a malformed mix, which its replica
    refuses anyway) is its own key.

    Example:
        >>> adapter_id("qwen:style=0.70+domain").key
        'qwen:style=0.7+domain'
        >>> sorted(adapter_id("qwen:style=0.70+domain").components)
        ['qwen:domain', 'qwen:style']

    An id whose adapter part is longer than a replica takes (`MAX_MODEL_FIELD_CHARS`: `multiplex` refuses it), or
    whose base is, is its own key, not parsed and not kept: a router ranks the ids clients send before any replica
    sees them.
    """
    if max(map(len, split_model_id(model_id))) > MAX_MODEL_FIELD_CHARS:
        return AdapterId(model_id, frozenset())
    return _adapter_id(model_id)


@functools.lru_cache(maxsize=4096)  # a router ranks every reported id on every request
def _adapter_id(model_id: str) -> AdapterId:
    """`adapter_id` of an id of a ``model`` field's length at most."""
    base, adapter = split_model_id(model_id)
    if not adapter or looks_like_source(adapter) or ("+" not in adapter and "=" not in adapter):
        return AdapterId(model_id, frozenset())
    from vllm_lora_ext.mixing import parse_mix_expression  # the one mix grammar

    try:
        parts = parse_mix_expression(adapter)
    except ValueError:
        return AdapterId(model_id, frozenset())
    written = "+".join(name if weight is None else f"{name}={weight!r}" for name, weight in parts)
    return AdapterId(f"{base}:{written}", frozenset(f"{base}:{name}" for name, _ in parts), f"{base}:{parts[0][0]}")


def home_order(key: str, replicas: Sequence[R]) -> list[R]:
    """``replicas`` in rendezvous-hash order for ``key`` (highest random weight first): the same order in every
    process, and a replica leaving moves only the keys whose first pick it was.

    Example:
        >>> home_order("q:a", ["r1", "r2", "r3"]) == home_order("q:a", ["r3", "r1", "r2"])
        True
    """
    def weight(replica: R) -> bytes:
        # surrogatepass: a client-chosen id may hold a lone surrogate (valid JSON), which must rank, not raise
        return hashlib.blake2b(f"{key}\0{replica}".encode("utf-8", "surrogatepass"), digest_size=8).digest()

    return sorted(replicas, key=weight, reverse=True)


def rank_replicas(model_id: str, holdings: Mapping[R, Collection[str]], *,
                  replicas: Sequence[R] | None = None) -> list[list[R]]:
    """Order replicas for ``model_id`` from what each holds: holders, component holders, then home order.

    Args:
        model_id: the multiplexed id, ``<base>:<adapter>``.
        holdings: for each replica, the ids it reports (built or building).
        replicas: the candidates (default: ``holdings``' keys), in the order to keep inside the holders' rank. A
            candidate missing from ``holdings`` holds nothing. Replicas are hashed by ``str()``, which must be
            the same in every process (Serve's replica ids are).

    Returns:
        Non-empty ranks, most preferred first; every candidate appears exactly once. Holders share one rank
        (the router takes the least loaded); every other replica is a rank of its own.

    Example:
        >>> rank_replicas("q:a", {"r1": ["q:b"], "r2": ["q:a"], "r3": []})[0]
        ['r2']
    """
    candidates = list(holdings) if replicas is None else list(dict.fromkeys(replicas))
    if not candidates:
        return []
    wanted = adapter_id(model_id)
    held = {r: {adapter_id(i).key for i in holdings.get(r, ())} for r in candidates}
    holders = [r for r in candidates if wanted.key in held[r]]
    ranks: list[list[R]] = [holders]
    others = home_order(wanted.home_key, [r for r in candidates if r not in holders])
    if not holders and wanted.components:
        counts = {r: len(wanted.components & held[r]) for r in others}
        others = sorted(others, key=lambda r: -counts[r])  # stable: home order within a count
    ranks.extend([r] for r in others)
    return [rank for rank in ranks if rank]


def adapter_levels(*, gpu: Iterable[str] = (), cpu: Iterable[str] = (),
                   building: Iterable[str] = ()) -> dict[str, str]:
    """Each adapter an engine holds at its highest level (``gpu`` over ``cpu`` over ``building``).

    Example:
        >>> adapter_levels(gpu=["a"], cpu=["a", "b"], building=["c"])
        {'a': 'gpu', 'b': 'cpu', 'c': 'building'}
    """
    levels: dict[str, str] = {}
    for level, names in zip(LEVELS, (gpu, cpu, building)):
        for name in names:
            levels.setdefault(str(name), level)
    return levels
