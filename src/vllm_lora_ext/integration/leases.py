"""Which requests hold a mix, and for how long: leases follow generation, not routing.

A request on a generation route (completions, chat completions, responses: vLLM wraps each of their
handlers in ``GenerateBaseServing._with_kv_transfer_rejection_cleanup``) is handled inside a
`request_scope`. The hold its routing takes on its mix (`keep_for_request`) ends when its handler
returns, whatever the outcome: an answer, a too-long prompt, a render error, a disconnect. Each
generation takes its own lease when vLLM asks the engine to generate (`AsyncLLM.generate`, and once
for a whole online beam search, whose steps each generate) and releases it when the engine puts its finished output
(`make_collector_put`: a client that stops reading a stream holds no slot once the engine is done) or its output
ends (`leased`); a stream that is dropped before it starts releases it when it is collected.

Routes that never generate (tokenize, detokenize, render) check a mix but never build or hold one;
pooling routes (embeddings, score, classify, ...) refuse mixes with a 400 (`refuse_mix`). Routing
outside a request scope (a vLLM route whose handler the plugin does not wrap) builds the mix and
holds it only while it loads: the request still runs on its exact mix (``server.routed_lora``), and
an eviction before its generation costs a rebuild in the engine step.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import logging
import time
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any

from vllm_lora_ext import metrics
from vllm_lora_ext._util import clip, short_repr
from vllm_lora_ext.constants import MIX_NAME_PREFIX, MIX_PREFIX, mix_wait_seconds
from vllm_lora_ext.errors import AdapterNotFoundError, MixCapacityError, MixError
from vllm_lora_ext.integration._compat import is_base_model
from vllm_lora_ext.mixing import MixSpec
from vllm_lora_ext.naming import MIX_BODY_FIELDS, mix_body_fields, reserved_part
from vllm_lora_ext.registry import MixEntry, MixLease, MixRegistry

logger = logging.getLogger(__name__)

__all__ = ["KeyLock", "keep_for_request", "leased", "on_lease_released", "refuse_mix", "refuse_render_of_mix",
           "register_when_free", "release",
           "request_scope"]

# The leases the request being handled took while it was routed (None outside a generation handler).
_SCOPE: contextvars.ContextVar[list[MixLease] | None] = contextvars.ContextVar("vllm_lora_ext_request_scope",
                                                                               default=None)
_KEY_LOCKS: dict[str, tuple[asyncio.Lock, int]] = {}  # mix key -> (its routing lock, requests using it)
_WAITERS: set[asyncio.Future[None]] = set()  # requests waiting for a free mix slot
GENERATION_ROUTES = "/v1/completions, /v1/chat/completions and /v1/responses"


@contextlib.contextmanager
def request_scope() -> Iterator[None]:
    """Handle one request: every lease its routing keeps (`keep_for_request`) is released when the block exits."""
    held: list[MixLease] = []
    token = _SCOPE.set(held)
    try:
        yield
    finally:
        _SCOPE.reset(token)
        for lease in held:
            lease.release()
        if held:
            on_lease_released()


def keep_for_request(lease: MixLease) -> None:
    """Hold ``lease`` until the handler of the request being routed returns; outside a request scope, release it now."""
    scope = _SCOPE.get()
    if scope is None:
        release(lease)
    else:
        scope.append(lease)


def release(lease: MixLease | None) -> None:
    """Release ``lease`` (idempotent) and wake requests waiting for a mix slot."""
    if lease is not None and lease.held:
        lease.release()
        on_lease_released()


def leased(outputs: AsyncIterator[Any], lease: MixLease | None) -> AsyncIterator[Any]:
    """Return ``outputs`` holding ``lease`` until they end, fail or are closed, or are dropped without starting."""
    if lease is None:
        return outputs
    stream = _leased(outputs, lease)
    weakref.finalize(stream, release, lease)  # a stream never iterated runs no finally of its own
    return stream


# The lease of the generation whose first step is running in this context: vLLM's RequestOutputCollector, which
# AsyncLLM.generate makes in that step, takes it (`make_collector_init`) and releases it when the engine puts the
# request's finished output (`make_collector_put`), whether or not the client has read it yet.
_STEP_LEASE: contextvars.ContextVar[MixLease | None] = contextvars.ContextVar("vllm_lora_ext_step_lease",
                                                                             default=None)
COLLECTOR_LEASE_ATTR = "_vllm_lora_ext_lease"


async def _leased(outputs: AsyncIterator[Any], lease: MixLease) -> AsyncGenerator[Any, None]:
    try:
        it = outputs.__aiter__()
        token = _STEP_LEASE.set(lease)
        try:
            first = await it.__anext__()
        except StopAsyncIteration:
            return
        finally:
            with contextlib.suppress(ValueError):  # (a generator closed from another context)
                _STEP_LEASE.reset(token)
        yield first
        async for out in it:
            yield out
    finally:
        release(lease)


def make_collector_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``RequestOutputCollector.__init__``: vLLM's, then it takes the lease of the generation being started
    in this context (`_leased`), if any."""

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        setattr(self, COLLECTOR_LEASE_ATTR, _STEP_LEASE.get())

    return __init__


def make_collector_put(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``RequestOutputCollector.put``: vLLM's, then, for the request's finished output (or its error), the
    release of its lease: the engine is done with the mix even if the client has not read the output yet."""

    def put(self: Any, output: Any) -> None:
        original(self, output)
        lease = getattr(self, COLLECTOR_LEASE_ATTR, None)
        if lease is not None and (isinstance(output, Exception) or getattr(output, "finished", False) is True):
            release(lease)

    return put


async def register_when_free(reg: MixRegistry, spec: MixSpec, *, taken: Callable[[int], bool]
                             ) -> tuple[MixEntry, list[MixEntry]]:
    """``reg.register(spec)``, waiting up to ``VLLM_LORA_EXT_MIX_WAIT_S`` seconds for a slot no request holds.

    Raises:
        [`MixCapacityError`]: every slot stayed held that long.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + mix_wait_seconds()
    while True:
        try:
            return reg.register(spec, taken=taken)
        except MixCapacityError:
            if loop.time() >= deadline:
                raise
        waiter: asyncio.Future[None] = loop.create_future()
        _WAITERS.add(waiter)
        try:  # woken by a release (the timeout is a backstop)
            await asyncio.wait_for(waiter, timeout=min(0.5, max(0.0, deadline - loop.time())))
        except asyncio.TimeoutError:
            pass
        finally:
            _WAITERS.discard(waiter)


def on_lease_released() -> None:
    """Wake requests waiting for a free mix slot."""
    for waiter in list(_WAITERS):
        if not waiter.done():
            waiter.get_loop().call_soon_threadsafe(_wake, waiter)


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


class KeyLock:
    """One lock per mix key while requests for it are being routed; it goes with its last user, cancelled or not.

    A failed load of the mix is shared with the users that were waiting while it ran (`failure`): one build per
    mix however many requests wait for it, as for an adapter, failure included. Users arriving after it try again.
    """

    def __init__(self, key: str) -> None:
        self.key = key
        self.since = time.monotonic()

    async def __aenter__(self) -> KeyLock:
        lock, n = _KEY_LOCKS.get(self.key, (None, 0))
        lock = lock or asyncio.Lock()
        _KEY_LOCKS[self.key] = (lock, n + 1)
        try:
            await lock.acquire()
        except BaseException:  # cancelled while waiting: this user leaves without the lock
            self._leave()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        _KEY_LOCKS[self.key][0].release()
        self._leave()

    def failure(self) -> Exception | None:
        """A copy of the error of a load of this mix that failed while this user waited, or ``None``."""
        failed = _KEY_FAILURES.get(self.key)
        return copy.copy(failed[1]) if failed is not None and failed[0] >= self.since else None

    def failed(self, err: Exception) -> None:
        _KEY_FAILURES[self.key] = (time.monotonic(), err)

    def _leave(self) -> None:
        lock, n = _KEY_LOCKS[self.key]
        if n <= 1:
            del _KEY_LOCKS[self.key]
            _KEY_FAILURES.pop(self.key, None)  # (kept only for the users waiting on the lock)
        else:
            _KEY_LOCKS[self.key] = (lock, n - 1)


_KEY_FAILURES: dict[str, tuple[float, Exception]] = {}  # mix key -> when its last load failed, and the error


def refuse_mix(serving: Any, request: Any) -> None:
    """Refuse a mix on a route that does not generate with it (embeddings, score, classify, ...).

    Raises:
        [`MixError`]: the request has ``adapters``/``adapter_weights``, or its ``model`` is a mix
            (``a=0.7+b=0.3`` or a registered mix's name); vLLM answers 400 with the message.
    """
    fields = mix_body_fields({f: getattr(request, f, None) for f in MIX_BODY_FIELDS})
    model = getattr(request, "model", None)
    lora = serving.models.lora_requests.get(model) if isinstance(model, str) else None
    if lora is not None:
        is_mix = str(lora.lora_path).startswith(MIX_PREFIX)
    else:
        is_mix = isinstance(model, str) and reserved_part(model) is not None and not is_base_model(serving, model)
    if fields or is_mix:
        what = f"the field(s) {', '.join(fields)}" if fields else f"model {short_repr(model)}"
        raise MixError(f"This route does not serve adapter mixes, and the request names one ({what}). Mixes are "
                       f"served on the generation routes ({GENERATION_ROUTES}); here name the base model or a "
                       f"loaded adapter.")


def _unregister(models: Any, entry: MixEntry) -> None:
    """Drop ``entry``'s name from the server's adapters, if it still names that mix."""
    req = models.lora_requests.get(entry.lora_name)
    if req is not None and req.lora_int_id == entry.lora_int_id:
        del models.lora_requests[entry.lora_name]


async def unload_mix(models: Any, entry: MixEntry) -> None:
    """Unregister ``entry``'s mix (its name, if it still names it) and ask the engine to drop it."""
    _unregister(models, entry)
    try:
        await models.engine_client.remove_lora(entry.lora_int_id)
    except Exception:  # the worker LRU evicts it anyway; never fail a request over a cleanup
        logger.warning("vllm_lora_ext: remove_lora(%d) for evicted mix %r failed", entry.lora_int_id, entry.lora_name,
                       exc_info=True)
    metrics.MIXES_EVICTED.inc()
    logger.info("evicted mix %r (id %d)", entry.lora_name, entry.lora_int_id)


async def retire_mixes_of(models: Any, registry: MixRegistry | None, name: str) -> None:
    """After adapter ``name`` was unloaded or reloaded in place: forget every mix made with it, so that no new
    request is served its old weights through a mix (by the mix's name: 404; by its adapters: made anew, or
    ``name`` is unknown). Every such mix is forgotten before any await; one no request holds is then unloaded, one
    that requests hold keeps serving them (their routed ``LoRARequest``) and is left to the engine's LRU. A mix
    that was loading meanwhile is not published (`withdrawn_while_loading`)."""
    unheld = []
    for entry in registry.using(name) if registry is not None else []:
        if not registry.discard(entry):
            continue
        _unregister(models, entry)
        if not entry.in_use():
            unheld.append(entry)
        logger.info("mix %r retired: its adapter %r was unloaded or reloaded", entry.lora_name, name)
    for entry in unheld:
        await unload_mix(models, entry)


async def withdrawn_while_loading(models: Any, registry: MixRegistry, entry: MixEntry,
                                  sources: dict[str, str]) -> AdapterNotFoundError | None:
    """After a mix's load, before its name is published: if it was retired meanwhile, or an adapter of it is no
    longer registered with the source it was made from (unloaded or replaced while it waited or loaded), unload it
    again and return the error to answer (404); else ``None``."""
    gone = [c.name for c in entry.spec.components if sources.get(c.name) != c.source]
    if not gone and registry.by_id(entry.lora_int_id) is entry:
        return None
    registry.discard(entry)
    await unload_mix(models, entry)
    what = f"its adapter(s) {', '.join(map(short_repr, gone))}" if gone else "an adapter of it"
    return AdapterNotFoundError(f"Mix {short_repr(entry.lora_name)} was not registered: {what} was unloaded or "
                                f"reloaded while it loaded. Ask again with the adapters loaded now.",
                                source=clip(entry.lora_name))


def refuse_render_of_mix(serving: Any, spec: Any) -> None:
    """Refuse a mix on vLLM's render routes (``/v1/chat/completions/render``, ``/v1/completions/render``): what they
    answer is the request ``/inference/v1/generate`` then runs, and it names only ``model``, which on a route that
    does not generate is the base model; the mix would be lost between the two without an error.

    Raises:
        [`MixError`]: ``serving`` is vLLM's ``ServingRender`` (vLLM answers 400 with the message).
    """
    if any(kind.__name__ == "ServingRender" for kind in type(serving).__mro__):
        raise MixError(f"This route renders a request for /inference/v1/generate, which cannot carry the mix "
                       f"{short_repr('+'.join(f'{c.name}={c.weight:g}' for c in spec.components))}: it would "
                       f"name the base model. Render with the base model (or a loaded adapter), then send the mix "
                       f"as 'model' (\"a=0.7+b=0.3\") in the request to /inference/v1/generate.")


def refuse_mix_unload(models: Any, name: object) -> MixError | None:
    """The error for a client's unload of a mix the server made (its name, or a name the ``mix-`` prefix reserves),
    else ``None``: mixes are shared by every client that asks for them and retired with their adapters."""
    lora = models.lora_requests.get(name) if isinstance(name, str) else None
    made = lora is not None and str(lora.lora_path).startswith(MIX_PREFIX)
    if not made and not (isinstance(name, str) and name.startswith(MIX_NAME_PREFIX)):
        return None
    return MixError(f"{short_repr(name)} is a mix the server makes from its adapters for every client that asks for "
                    f"it, so a client may not unload it: it is unloaded when unused, or with an adapter it is made "
                    f"of. Unload that adapter instead, or stop asking for the mix.")
