"""Offline (``LLM``) helpers: a weighted mix, a deployment name or a source -> a pre-loaded ``LoRARequest``.

    from vllm_lora_ext.integration.offline import lora_request
    req = lora_request({"style": 0.7, "domain": 0.3}, deployment="deploy.yaml", llm=llm)
    llm.generate(prompts, params, lora_request=req)

Names are looked up in the deployment config (``deployment=`` or ``VLLM_LORA_EXT_CONFIG``); without
one, each name is itself a source (``hf:...`` or a path). Sources are resolved and pinned here, and
with ``llm=`` the composite is loaded at once through ``add_lora``: a bad mix raises at this call,
never inside the engine step.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from vllm_lora_ext.constants import deployment_config_path
from vllm_lora_ext.deployment import DeploymentConfig, read_deployment_config
from vllm_lora_ext.mixing import MixComponent, MixSpec, check_weight, resolve_mix
from vllm_lora_ext.registry import MixRegistry
from vllm_lora_ext.resolve import resolve_and_check

__all__ = ["lora_request", "prefetch"]

# Offline mixes take ids from one registry per process, in a block apart from every API server's.
_OFFLINE_BLOCK = 63
_REGISTRY = MixRegistry(capacity=4096, block=_OFFLINE_BLOCK)


def _deployment(deployment: DeploymentConfig | str | os.PathLike[str] | None) -> DeploymentConfig | None:
    if isinstance(deployment, DeploymentConfig):
        return deployment
    path = deployment if deployment is not None else deployment_config_path()
    return read_deployment_config(path) if path else None


def lora_request(adapters: Mapping[str, float] | Sequence[str] | str | None = None, *,
                 weights: Sequence[float] | None = None, deployment: DeploymentConfig | str | None = None,
                 llm: Any = None) -> Any:
    """Return the ``LoRARequest`` for a mix (or one adapter, or the deployment default), or ``None`` for the base model.

    ``adapters``: ``{name: weight}``; names (or sources) with ``weights=`` or the deployment's weights; or one name.

    Raises:
        [`MixError`]: unknown names, length mismatch, non-finite weights.
        [`AdapterSourceError`], [`AdapterNotFoundError`], [`AdapterFormatError`]: a source is bad.
        Exception from ``add_lora`` (with ``llm=``): the engine refused the composite (e.g. rank too big).
    """
    from vllm.lora.request import LoRARequest

    dep = _deployment(deployment)
    names: list[str] | None
    if isinstance(adapters, Mapping):
        if weights is not None:
            raise ValueError("Give weights either in the mapping or as weights=, not both.")
        names, weights = list(adapters), [check_weight(w, name=str(n)) for n, w in adapters.items()]
    elif isinstance(adapters, str):  # one adapter by name (or source), not its letters
        names = [adapters]
    else:
        names = list(adapters) if adapters is not None else None
    if dep is not None:
        sources = {n: a.source.canonical() for n, a in dep.adapters.items()}
        defaults = {n: a.weight for n, a in dep.adapters.items()}
        default = dep.default
    else:
        sources = {n: n for n in names or []}
        defaults, default = {}, None
    spec = resolve_mix(names, weights, sources=sources, default_weights=defaults, default=default)
    if spec is None:
        return None
    pinned = MixSpec(tuple(MixComponent(c.name, resolve_and_check(c.source, name=c.name).source.canonical(), c.weight)
                           for c in spec.components))
    one = pinned.components[0] if len(pinned.components) == 1 and pinned.components[0].weight == 1.0 else None
    name, path = (one.name, one.source) if one is not None else (pinned.lora_name, pinned.lora_path)
    if llm is None:
        return LoRARequest(lora_name=name, lora_int_id=_REGISTRY.register(pinned)[0].lora_int_id, lora_path=path)
    return _load(llm.llm_engine, pinned, name, path)


def _load(engine: Any, pinned: MixSpec, name: str, path: str) -> Any:
    """Register ``pinned`` under an id none of the engine's own adapters holds, load it, and record it there.

    The user's own ``LoRARequest``s reach the engine through ``add_request`` (recorded by
    `engine_patches.preload_offline`) or ``add_lora`` (listed by the workers): a mix never takes one of their
    ids, and a later user request reusing the mix's id is refused by ``preload_offline``.
    """
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.engine_patches import add_lora_typed, offline_loaded

    loaded = offline_loaded(engine)
    listed = set(engine.list_loras()) if callable(getattr(engine, "list_loras", None)) else set()

    def taken(lora_id: int) -> bool:  # called under the registry's lock: reads only the engine's records
        return loaded.get(lora_id, path) != path or (lora_id in listed and lora_id not in loaded)

    entry, evicted = _REGISTRY.register(pinned, taken=taken)
    if taken(entry.lora_int_id):  # a live mix whose id the user has since given one of their own adapters
        _REGISTRY.remove(pinned)
        entry, more = _REGISTRY.register(pinned, taken=taken)
        evicted += more
    for old in evicted:
        engine.remove_lora(old.lora_int_id)
        loaded.pop(old.lora_int_id, None)
    req = LoRARequest(lora_name=name, lora_int_id=entry.lora_int_id, lora_path=path)
    try:
        add_lora_typed(engine, req)
    except Exception:
        _REGISTRY.remove(pinned)
        raise
    loaded[req.lora_int_id] = path
    return req


def prefetch(llm: Any, requests: Sequence[Any]) -> None:
    """Start building the adapters of ``requests`` in the background, for later ``llm.generate`` calls.

    Returns at once. ``generate`` then only registers each finished adapter (it waits for one still
    building); errors are raised by that ``generate`` call, as without prefetching. Each source is
    pinned here, so the later call reads exactly the bytes being built.

    Args:
        llm: a ``vllm.LLM``.
        requests: ``LoRARequest``s (``None`` entries are skipped), e.g. from [`lora_request`].

    Example:
        ```python
        reqs = [lora_request({"sql": 1.0}), lora_request({"sql": 0.5, "chat": 0.5})]
        prefetch(llm, reqs)  # the engine keeps serving meanwhile
        llm.generate(prompts, sampling, lora_request=reqs[0])
        ```
    """
    from vllm_lora_ext.integration.engine_patches import add_lora_typed
    from vllm_lora_ext.integration.prebuild import probe_for
    from vllm_lora_ext.resolve import pin_path

    engine = llm.llm_engine
    for req in requests:
        if req is None:
            continue
        req.lora_path = pin_path(req.lora_path, name=req.lora_name)
        add_lora_typed(engine, probe_for(req))  # an earlier build of it failed: its own error, typed from its record
