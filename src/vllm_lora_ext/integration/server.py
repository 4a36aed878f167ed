"""API-server side: sources resolved off the event loop, mixes routed through a bounded, collision-free registry.

``--lora-modules name=SOURCE``, ``POST /v1/load_lora_adapter`` and the deployment config all end in
``OpenAIServingModels.load_lora_adapter``; the plugin runs `pre_resolve` first. It refuses what a
client may not ask for (a name the mix grammar reserves, a hand-made ``mix:`` path, a local path outside
``VLLM_LORA_EXT_ALLOWED_ROOTS``), downloads in a worker thread (the engine loop keeps serving),
validates the config, and replaces the path with the pinned source (``hf:org/repo@<commit>:file``).

Mixes (`route_adapters`) get their adapter id and name from one [`MixRegistry`] per API-server
process: ids never collide with another mix or a user adapter, at most ``VLLM_LORA_EXT_MAX_MIXES``
mixes are registered (default: ``--max-cpu-loras``), and the least recently used mix that no request
holds is evicted (``remove_lora``). A request holds its mix while its handler runs and while its
generation runs, never longer (`integration.leases`); routes that never generate never build one.

Every failure in these routes is an HTTP error with a message: 400 for bad input, 403 for a path
outside the allowed roots, 404 for a source that does not exist, 503 when every mix slot is held,
500 (message only, traceback in the server log) for anything unexpected.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
from typing import Any

from vllm_lora_ext import metrics
from vllm_lora_ext._util import clip, short_repr
from vllm_lora_ext.constants import (
    MAX_MODEL_FIELD_CHARS,
    MIX_NAME_PREFIX,
    MIX_PREFIX,
    PREBUILD_PREFIX,
    allowed_roots,
    max_mixes,
    prebuild_enabled,
    prebuild_wait_seconds,
)
from vllm_lora_ext.errors import (
    AdapterAccessError,
    AdapterNotFoundError,
    AdapterSourceError,
    DiskCacheFullError,
    MixCapacityError,
    MixError,
    MixIdCollisionError,
    OperatorNameError,
    RemoteError,
    VllmLoraExtError,
    error_from_text,
)
from vllm_lora_ext.integration._compat import error_response, is_base_model, lora_config_of, never_generates
from vllm_lora_ext.integration.build_errors import build_failure, server_fault, worker_error, worker_reason
from vllm_lora_ext.integration.leases import (  # noqa: F401 (_KEY_LOCKS, on_lease_released: read through here too)
    _KEY_FAILURES, _KEY_LOCKS, KeyLock, keep_for_request, on_lease_released, refuse_render_of_mix, register_when_free,
    release, unload_mix, withdrawn_while_loading,
)
from vllm_lora_ext.integration.patching import DEPLOYMENT_ATTR, DISK_HOLDS_ATTR, PINNED_NAMES_ATTR, ROUTED_ATTR
from vllm_lora_ext.mixing import MixSpec, resolve_mix
from vllm_lora_ext.naming import check_adapter_name, check_mix_fields, mix_in_model, reserved_part, server_only_prefix
from vllm_lora_ext.prebuild import RecentlyUsed
from vllm_lora_ext.registry import MixEntry, MixLease, MixRegistry
from vllm_lora_ext.resolve import check_allowed_root, pin_path

logger = logging.getLogger(__name__)

# True while the server registers its start-up adapters (--lora-modules, deployment config): those come
# from the operator, so the allowed-roots rule (for runtime loads by clients) does not apply.
STARTUP: contextvars.ContextVar[bool] = contextvars.ContextVar("vllm_lora_ext_startup", default=False)


def http_error(err: BaseException) -> Any:
    """Map an exception to vLLM's ``ErrorResponse``: our typed errors to 4xx/503, anything else to 500.

    The message is the error's client message (it never lists the server's folders); an unexpected
    exception is logged with its traceback and answered with its type and message only.
    """
    metrics.record_error(err, where="server")
    if isinstance(err, AdapterNotFoundError):
        return error_response(err.client_message(), err_type="NotFoundError", status=404)
    if isinstance(err, (AdapterAccessError, OperatorNameError)):
        return error_response(err.client_message(), err_type="PermissionDeniedError", status=403)
    if isinstance(err, (MixCapacityError, DiskCacheFullError)):  # capacity, not bad input: retry later
        return error_response(err.client_message(), err_type="ServiceUnavailableError", status=503)
    if isinstance(err, VllmLoraExtError) and not isinstance(err, RemoteError):
        return error_response(err.client_message(), err_type="BadRequestError", status=400)
    logger.exception("vllm_lora_ext: unexpected error while handling a request")
    kind = err.type_name if isinstance(err, RemoteError) else type(err).__name__
    return error_response(f"Internal error in vllm_lora_ext: {kind}: {short_repr(str(err))}",
                          err_type="InternalServerError", status=500)


def check_client_adapter(name: str | None, path: str | None) -> None:
    """Refuse what no client (or config) may register: a name the mix grammar reserves (`check_adapter_name`:
    ``+``, ``=``, the ``mix-`` prefix) or a hand-made ``mix:`` path.

    Raises:
        [`AdapterSourceError`]: the name is reserved for mixes, or the path is a ``mix:`` spec.
    """
    check_adapter_name(name)
    if server_only_prefix(path) == PREBUILD_PREFIX:
        raise AdapterSourceError(f"Adapter path {short_repr(path)} starts with {PREBUILD_PREFIX!r}, which only the "
                                 f"server uses. Give the adapter's source.", source=clip(path), part="path")
    if server_only_prefix(path) == MIX_PREFIX:
        raise AdapterSourceError(
            f"Adapter path {short_repr(path)} is a {MIX_PREFIX!r} spec, which only the server makes. Register the "
            f"adapters, then ask for a mix with 'adapters' and 'adapter_weights' in the request body.",
            source=clip(path), part="path")


async def pre_resolve(request: Any) -> Any:
    """Return ``request`` with its ``lora_path`` pinned, or an ``ErrorResponse`` naming the problem and fix."""
    path = getattr(request, "lora_path", None)
    name = getattr(request, "lora_name", None)
    try:
        check_client_adapter(name, path)
        if not path:
            return request
        roots = None if STARTUP.get() else allowed_roots()
        inside = check_allowed_root(path, roots) if roots is not None else path  # a local path: its real path
        pinned = await asyncio.to_thread(pin_path, inside, name=name or "adapter")
    except Exception as err:  # every failure becomes a clean HTTP error
        return http_error(err)
    if pinned != path:
        logger.info("adapter %r: source %r pinned to %r", name, path, pinned)
        request = request.model_copy(update={"lora_path": pinned})
    return request


def refuse_operator_name(models: Any, name: str, action: str) -> Any | None:
    """A 403 when a client would ``action`` (load over, unload) an adapter name the operator set, else ``None``."""
    if STARTUP.get():  # the operator's own start-up loads
        return None
    names = {m.name for m in (getattr(models, "static_lora_modules", None) or [])}
    deployment = getattr(models, DEPLOYMENT_ATTR, None)
    names.update(deployment.adapters if deployment is not None else ())
    if name not in names:
        return None
    return http_error(OperatorNameError(
        f"Adapter {short_repr(name)} is set by this server's operator (--lora-modules or the deployment config), so "
        f"a client may not {action} it: it stays what the operator configured for every client. Load your adapter "
        f"under another name.", name=name))


def _known_adapters(models: Any) -> tuple[dict[str, str], dict[str, float], str | None]:
    """Names a request may use: registered adapters (pinned paths) plus the deployment's defaults."""
    deployment = getattr(models, DEPLOYMENT_ATTR, None)
    sources = {name: req.lora_path for name, req in models.lora_requests.items()
               if not req.lora_path.startswith(MIX_PREFIX)}
    weights: dict[str, float] = {}
    default = None
    if deployment is not None:
        for name, adapter in deployment.adapters.items():
            sources.setdefault(name, adapter.source.canonical())
            weights[name] = adapter.weight
        default = deployment.default
    return sources, weights, default


def _cpu_loras(engine_client: Any) -> int:
    """The engine's ``--max-cpu-loras`` (which vLLM defaults to ``--max-loras``), else 8."""
    lora_config = lora_config_of(engine_client)
    return int(getattr(lora_config, "max_cpu_loras", None) or getattr(lora_config, "max_loras", None) or 8)


# ------------------------------------------------------------------------------------------- background builds

_BUILDS: dict[str, asyncio.Future[None]] = {}  # pinned source -> the one wait every request for it shares
_RECENT: RecentlyUsed | None = None


def recently_used(engine_client: Any = None) -> RecentlyUsed:
    """The adapters this API server used last, as many as a worker's CPU cache holds (``--max-cpu-loras``)."""
    global _RECENT
    if _RECENT is None:
        _RECENT = RecentlyUsed(_cpu_loras(engine_client))
    return _RECENT


async def ensure_built(engine_client: Any, lora_request: Any) -> None:
    """Return once every worker has built ``lora_request``'s adapter in the background; the engine keeps stepping.

    Each worker is asked through ``add_lora`` with a probe (see `integration.prebuild`) and polled
    until it answers that the build is done; requests for the same source share one wait. After
    ``VLLM_LORA_EXT_PREBUILD_WAIT_S`` the request goes on and the engine builds the adapter itself,
    as stock vLLM does.

    Raises:
        The worker's error, of its own type with its fields (`errors.with_record` carries them across vLLM's
        text-only answer), or vLLM's text of it from a worker without the plugin: the build failed.
    """
    if not prebuild_enabled() or not hasattr(engine_client, "add_lora"):
        return
    key = str(lora_request.lora_path)
    wait = _BUILDS.get(key)
    if wait is None:
        wait = asyncio.ensure_future(_wait_built(engine_client, lora_request))
        _BUILDS[key] = wait
        wait.add_done_callback(functools.partial(_forget_build, key))
    await asyncio.shield(wait)


def _forget_build(key: str, wait: asyncio.Future[None]) -> None:
    if _BUILDS.get(key) is wait:
        del _BUILDS[key]


_FAST_WAITS = [0]  # waits probing every 2 ms now (the server's event loop is one thread)
_MAX_FAST_WAITS = 4


async def _wait_built(engine_client: Any, lora_request: Any) -> None:
    """Probe until the build is done. A probe waits in the engine's queue for the step in progress, so a busy
    engine answers about one a step whatever the delay: the first ``_MAX_FAST_WAITS`` waits at a time ask again
    2 ms after an answer for their first 2 s (a new adapter's first token waits on it), then back off to 25 ms
    (long builds, downloads); any more waits (a client naming many evicted adapters) probe every 25 ms."""
    from vllm_lora_ext.integration.prebuild import probe_for

    probe = probe_for(lora_request)
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + prebuild_wait_seconds()
    fast = _FAST_WAITS[0] < _MAX_FAST_WAITS
    _FAST_WAITS[0] += fast
    probes = 1
    try:
        while not await _probe(engine_client, probe):
            now = loop.time()
            if now >= deadline:
                logger.warning("adapter %r: not built after %.0f s; the engine will build it in its step",
                               clip(str(lora_request.lora_name)), prebuild_wait_seconds())
                return
            await asyncio.sleep(0.002 if fast and now - start < 2.0 else 0.025)
            probes += 1
    finally:
        _FAST_WAITS[0] -= fast
    if probes > 1:  # (one probe: it was resident already)
        logger.info("adapter %r: built in the background, answered %.3f s after the first probe (%d probes)",
                    clip(str(lora_request.lora_name)), loop.time() - start, probes)


async def _probe(engine_client: Any, probe: Any) -> bool:
    """Send ``probe``; a failed build raises the worker's own error again, typed from the record its text carries."""
    try:
        return bool(await engine_client.add_lora(probe))
    except Exception as err:
        crossed = error_from_text(str(err))
        if crossed is None:
            raise
        raise crossed from err


# ------------------------------------------------------------------------------------------------ registry

_REGISTRY: MixRegistry | None = None


def registry(engine_client: Any = None) -> MixRegistry:
    """Return this API-server process's mix registry, creating it on first use.

    Its bound is ``VLLM_LORA_EXT_MAX_MIXES``, else the engine's ``--max-cpu-loras`` (which vLLM
    defaults to ``--max-loras``); its id block is the process's API-server index.
    """
    global _REGISTRY
    if _REGISTRY is None:
        block = int(getattr(engine_client, "client_index", 0) or 0)
        _REGISTRY = MixRegistry(max_mixes(_cpu_loras(engine_client)), block=block % 64)
        logger.info("mix registry: at most %d mixes, ids from %d", _REGISTRY.capacity, _REGISTRY.first_id)
    return _REGISTRY


def live_registry() -> MixRegistry | None:
    """This process's mix registry if a mix was asked for yet, else ``None``."""
    return _REGISTRY


def reset_registry() -> None:
    """Forget the process's registry (tests)."""
    global _REGISTRY, _RECENT
    _REGISTRY = None
    _RECENT = None
    _KEY_LOCKS.clear()
    _KEY_FAILURES.clear()
    _BUILDS.clear()


def claim_lease(lora_request: Any) -> MixLease | None:
    """Called when vLLM asks the engine to generate: hold the request's mix until the returned lease is released."""
    if lora_request is None or _REGISTRY is None:
        return None
    return _REGISTRY.claim(int(lora_request.lora_int_id))


def routed_lora(request: Any) -> Any:
    """Return the ``LoRARequest`` `route_adapters` attached to ``request``, or ``None``.

    A routed request is served this exact adapter even if its mix is evicted from the registry before
    generation starts (its id is not reused while the id block lasts, and the path carries the spec),
    so it can never fall back to the base model or to another adapter.
    """
    from vllm.lora.request import LoRARequest

    # Set with object.__setattr__, so it lives in the request's __dict__, where a client's body fields (pydantic
    # extras) never land; read back from there only.
    routed = getattr(request, "__dict__", {}).get(ROUTED_ATTR)
    return routed if isinstance(routed, LoRARequest) else None


async def register_mix(models: Any, spec: MixSpec) -> Any:
    """Make ``spec`` a registered adapter of the engine, held for the request being handled; return its ``LoRARequest``.

    The mix is held from before any await until the request's handler returns (`leases.keep_for_request`);
    outside a request's handler, only while it loads.

    Raises:
        [`MixCapacityError`]: every mix slot stayed held for ``VLLM_LORA_EXT_MIX_WAIT_S`` seconds.
        [`MixIdCollisionError`]: the name is registered for another spec (never serves it).
        [`MixError`]: the engine refused the composite (the message names the cause).
    """
    reg = registry(models.engine_client)
    async with KeyLock(spec.key) as key_lock:
        shared = key_lock.failure()
        if shared is not None:  # its load failed while this request waited: the same answer, no second build
            raise shared
        entry = reg.get(spec)
        evicted: list[MixEntry] = []
        if entry is None:
            user_ids = {r.lora_int_id for r in models.lora_requests.values() if not r.lora_name.startswith(MIX_NAME_PREFIX)}
            entry, evicted = await register_when_free(reg, spec, taken=user_ids.__contains__)
        lease = reg.lease(entry)  # before any await: nothing may evict it while it loads
        try:
            for old in evicted:
                await unload_mix(models, old)
            req = await _load_mix(models, reg, spec, entry)
        except BaseException as err:  # refused, failed or cancelled: the slot is free again at once
            release(lease)
            if isinstance(err, Exception):
                key_lock.failed(err)
            raise
        keep_for_request(lease)
    return req


async def _load_mix(models: Any, reg: MixRegistry, spec: MixSpec, entry: MixEntry) -> Any:
    from vllm.lora.request import LoRARequest

    name = spec.lora_name
    held = models.lora_requests.get(name)
    if held is not None and held.lora_path != spec.lora_path:  # a squatter (or a digest collision)
        raise MixIdCollisionError(f"Adapter name {name!r} is registered for another adapter; refusing to serve "
                                  f"this mix under it. Unload that adapter.")
    if held is not None and held.lora_int_id == entry.lora_int_id:
        return held
    req = LoRARequest(lora_name=name, lora_int_id=entry.lora_int_id, lora_path=spec.lora_path)
    try:
        await ensure_built(models.engine_client, req)  # off the engine loop; add_lora then only registers
        await models.engine_client.add_lora(req)
    except Exception as err:  # the worker's message names the problem (rank, keys, ...)
        reg.remove(spec)
        metrics.MIXES_ACTIVE.set(len(reg))
        fault = server_fault(found := worker_error(err)[0], name, spec.lora_path)  # the engine or a worker: 500
        if fault is not None:
            raise fault from err
        text, public = worker_reason(found)
        failed = MixError(f"Mix {name!r} could not be loaded: {text}")
        failed.public_message = f"Mix {name!r} could not be loaded: {public}"
        raise failed from err
    withdrawn = await withdrawn_while_loading(models, reg, entry, _known_adapters(models)[0])
    if withdrawn is not None:  # an adapter of it was unloaded meanwhile: never published with its weights
        raise withdrawn
    models.lora_requests[name] = req
    recently_used(models.engine_client).touch(req.lora_path)
    metrics.MIXES_REGISTERED.inc()
    metrics.MIXES_ACTIVE.set(len(reg))
    logger.info("registered mix %r as id %d (%s)", name, entry.lora_int_id,
                ", ".join(f"{c.name}={c.weight:g}" for c in spec.components))
    return req


def _hold_named_mix(models: Any, request: Any) -> None:
    """A request naming a registered mix by its name is routed to it and holds it: it cannot be evicted (and the
    request answered 404) between vLLM's model check and its adapter lookup."""
    lora = models.lora_requests.get(request.model) if isinstance(request.model, str) else None
    if lora is None or _REGISTRY is None:
        return
    entry = _REGISTRY.by_id(int(lora.lora_int_id))
    if entry is None or entry.lora_name != lora.lora_name or entry.spec.lora_path != lora.lora_path:
        return
    _REGISTRY.get(entry.spec)  # recently used
    keep_for_request(_REGISTRY.lease(entry))
    object.__setattr__(request, ROUTED_ATTR, lora)


def _base_model_name(models: Any) -> str | None:
    paths = getattr(models, "base_model_paths", None)
    return paths[0].name if paths else None


async def route_adapters(serving: Any, request: Any) -> Any:
    """Turn a request's adapter choice into a registered adapter name in ``request.model``.

    Rules: body ``adapters`` (+ ``adapter_weights``) win; else a mix written in ``model``
    (``a=0.7+b=0.3``); else, for a request naming the base model (or none), the deployment default.
    A single adapter at weight 1 is that adapter; anything else is a composite registered through
    the mix registry and shared by every request naming the same canonical mix. On a route that never
    generates (tokenize, detokenize) a mix is checked but not built: the request goes to the base model,
    whose tokenizer a mix shares, and the deployment default does not apply; render refuses a mix (400).

    Returns ``None`` (request ready) or an ``ErrorResponse`` naming what is wrong.
    """
    getattr(request, "__dict__", {}).pop(ROUTED_ATTR, None)
    try:
        return await _route(serving, request)
    except Exception as err:
        return http_error(err)


async def _route(serving: Any, request: Any) -> Any:
    models = serving.models
    generates = not never_generates(serving, request)
    adapters, weights = check_mix_fields(getattr(request, "adapters", None),
                                         getattr(request, "adapter_weights", None))
    model = getattr(request, "model", None)
    if isinstance(model, str) and len(model) > MAX_MODEL_FIELD_CHARS:
        raise MixError(f"'model' has {len(model)} characters, more than {MAX_MODEL_FIELD_CHARS}. "
                       "Name a model or a mix.")
    sources, default_weights, default = _known_adapters(models)
    if adapters is None and weights is not None:
        raise MixError("adapter_weights were given without adapters; name the adapters they weigh.")
    if adapters is None and model and model not in models.lora_requests and reserved_part(model) is not None \
            and not is_base_model(serving, model):
        adapters, weights = mix_in_model(model, sources=sources, default_weights=default_weights)
    elif adapters is None:
        if not generates or not default or (model and not is_base_model(serving, model)):
            if generates:
                await build_if_evicted(models, model)
                _hold_named_mix(models, request)
            return None  # a named adapter or the base model: vLLM's own handling
    spec = resolve_mix(adapters, weights, sources=sources, default_weights=default_weights, default=default)
    if spec is None:
        return None
    if len(spec.components) == 1 and spec.components[0].weight == 1.0 and spec.components[0].name in models.lora_requests:
        request.model = spec.components[0].name
        if generates:
            await build_if_evicted(models, request.model)
        return None
    if not generates:
        refuse_render_of_mix(serving, spec)
        request.model = _base_model_name(models)
        return None
    lora = await register_mix(models, spec)
    request.model = lora.lora_name
    object.__setattr__(request, ROUTED_ATTR, lora)
    return None


async def build_if_evicted(models: Any, name: Any) -> None:
    """Before a request on a registered adapter that may not be in the workers' cache (evicted, or registered
    unbuilt at start: `integration.startup`), build it in the background.

    The guess: an adapter among the last ``--max-cpu-loras`` this server used is still cached (the
    worker answers a probe for a resident adapter at once anyway). A wrong guess costs what stock
    vLLM always pays: the engine builds the adapter in its step. An adapter counts as used only once its build
    succeeded, and a request that comes while it is being built waits for that build: no request reaches the
    engine with an adapter whose build has not answered.
    """
    req = models.lora_requests.get(name) if isinstance(name, str) else None
    if req is None or str(req.lora_path).startswith(MIX_PREFIX):
        return
    recent = recently_used(models.engine_client)
    if str(req.lora_path) not in _BUILDS and req.lora_path in recent:
        recent.touch(req.lora_path)
        return
    try:
        await ensure_built(models.engine_client, req)
    except Exception as err:  # e.g. its files changed or vanished since it was registered: a 4xx, not a 500
        recent.forget(req.lora_path)
        raise build_failure(err, name=str(name), source=str(req.lora_path)) from err
    recent.touch(req.lora_path)


async def sync_disk_holds(models: Any) -> None:
    """Hold, in the shared disk cache, the hub revisions of every registered adapter and live mix;
    at start-up (``STARTUP``) they are pinned there."""
    from vllm_lora_ext.diskholds import HeldSources
    from vllm_lora_ext.diskuse import sync_server_holds

    held = models.__dict__.setdefault(DISK_HOLDS_ATTR, HeldSources())
    pinned = models.__dict__.setdefault(PINNED_NAMES_ATTR, set())
    paths = {name: str(req.lora_path) for name, req in list(models.lora_requests.items())}
    if STARTUP.get():
        pinned.update(paths)
    await asyncio.to_thread(sync_server_holds, held, paths, pinned=frozenset(pinned))
