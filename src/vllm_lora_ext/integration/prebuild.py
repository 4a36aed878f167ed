"""Worker side of background adapter loading: probes start builds, the engine step takes finished ones.

The API server sends each worker a probe through vLLM's own ``add_lora`` path: a ``LoRARequest``
whose ``lora_path`` is ``PREBUILD_PREFIX + <pinned source>``. The patched ``add_adapter`` answers it
here, without registering anything: ``True`` if the adapter is built (or already resident under
that id), ``False`` while it builds in a background thread, or the build's error. The probe itself
costs the engine loop one dictionary lookup.

When the engine later needs the adapter (``add_lora`` or a request's activation), the patched
``_load_adapter`` takes the finished ``LoRAModel`` instead of building it in the step. The build is
the whole load (source resolution, read, checks, MoE packing), each worker building only its own
share under expert parallelism, as the synchronous path does. The adapter's whole life, step by step and
process by process, is told once in ``transport``'s docstring.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from vllm_lora_ext.constants import PREBUILD_PREFIX, build_process_enabled, prebuild_builds, prebuild_bytes
from vllm_lora_ext.errors import AdapterNotFoundError, with_record
from vllm_lora_ext.integration.patching import IDENTITY_ATTR, MERGED_ATTR, PREBUILD_ATTR, PREBUILD_NAMES_ATTR
from vllm_lora_ext.prebuild import PrebuildTable

logger = logging.getLogger(__name__)

_LOCK = threading.Lock()


def is_probe(lora_request: Any) -> bool:
    """Return whether ``lora_request`` is a build-ahead probe rather than an adapter to register."""
    return str(getattr(lora_request, "lora_path", "")).startswith(PREBUILD_PREFIX)


def probe_for(lora_request: Any) -> Any:
    """Return the probe ``LoRARequest`` for ``lora_request`` (same name and id, prefixed path)."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=lora_request.lora_name, lora_int_id=lora_request.lora_int_id,
                       lora_path=PREBUILD_PREFIX + lora_request.lora_path)


def model_bytes(lora: Any) -> int:
    """Bytes of the tensors a ``LoRAModel`` holds (packed MoE blocks included)."""
    total = 0
    for weights in getattr(lora, "loras", {}).values():
        for name in ("lora_a", "lora_b", "embeddings_tensor"):
            value = getattr(weights, name, None)
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if t is not None and hasattr(t, "nbytes"):
                    total += int(t.nbytes)
    return total


def table(manager: Any) -> PrebuildTable[Any]:
    """This worker manager's table of background builds, keyed by pinned source."""
    found: PrebuildTable[Any] | None = manager.__dict__.get(PREBUILD_ATTR)
    if found is None:
        with _LOCK:
            found = manager.__dict__.get(PREBUILD_ATTR)
            if found is None:
                found = PrebuildTable(lambda path: _build(manager, path), size_of=model_bytes,
                                      max_builds=prebuild_builds(), budget_bytes=prebuild_bytes())
                manager.__dict__[PREBUILD_ATTR] = found
                if _use_build_process():
                    from vllm_lora_ext.integration.build_process import prestart

                    prestart()
    return found


def _use_build_process() -> bool:
    """Whether background builds go to a build process: switched on, and its folder usable (else one warning)."""
    if not build_process_enabled():
        return False
    from vllm_lora_ext.integration.build_process import build_dir_usable

    return build_dir_usable()


def _build(manager: Any, path: str) -> Any:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.loader import load_lora_model
    from vllm_lora_ext.integration.staging import refuse_nonfinite, stage

    name = manager.__dict__.get(PREBUILD_NAMES_ATTR, {}).get(path) or "adapter"
    logger.info("adapter %r: building in the background", name)
    device = getattr(manager, "device", "cpu")
    def finish(lora: Any) -> None:  # inside the load's count: a refusal here is a rejected load
        stage(lora, device)  # the step's slot copy then runs GPU to GPU (a mix built on the GPU is staged already)
        refuse_nonfinite(lora, name)

    # On a GPU, the MoE factors' NaN/inf scan waits for staging, where it takes a millisecond instead of a CPU pass
    # over every byte on the build's path; what is not staged is scanned on the CPU there all the same
    lora = load_lora_model(manager, LoRARequest(lora_name=name, lora_int_id=1, lora_path=path),
                           separate_process=_use_build_process(), device=device, scan_moe=not _on_cuda(device),
                           finish=finish)
    merge_ahead(manager, lora, name)
    return lora


def _on_cuda(device: Any) -> bool:
    from vllm_lora_ext.transport.cuda import cuda_device_in_use

    return cuda_device_in_use(device) is not None


def merge_ahead(manager: Any, lora: Any, name: str = "adapter") -> None:
    """Run vLLM's merge of ``lora``'s packed modules (``_create_merged_loras_inplace``, which its registration runs
    in the engine step) here, on the table's thread, and mark the model so that the registration skips it.

    The merge touches only the model (and reads the manager's fixed layout). Any GPU tensors it makes from a staged
    model's are made on the staging stream and complete before the engine can take the model; ``unstage`` copies
    such tensors back to the CPU after the slot copy, as it did when the engine thread made them.
    """
    adapters = getattr(manager, "_adapter_manager", None)
    merge = getattr(adapters, "_create_merged_loras_inplace", None)
    if merge is None or getattr(lora, MERGED_ATTR, False):
        return
    from vllm_lora_ext.integration.activation import plan_activation
    from vllm_lora_ext.integration.staging import on_staging_stream

    def work() -> None:
        t0 = time.perf_counter()
        merge(lora)
        logger.info("adapter %r: merged ahead in %.4f s", name, time.perf_counter() - t0)
        plan_activation(adapters, lora, name)  # the slot writes too, for the step to do in a few calls

    on_staging_stream(lora, work)
    setattr(lora, MERGED_ATTR, True)


_MAX_NAMES = 4096


def answer_probe(manager: Any, lora_request: Any) -> bool:
    """Answer a probe: ``True`` if built or resident, else start (or continue) the build and answer ``False``.

    Raises:
        The build's error, of its own type, with its record in its message (`errors.with_record`): vLLM hands the
        server only the text of a failed ``add_lora``, and the server reads the type and fields back from it.
    """
    path = lora_request.lora_path[len(PREBUILD_PREFIX):]
    adapter_manager = getattr(manager, "_adapter_manager", None)
    get = getattr(adapter_manager, "get_adapter", None)
    held = get(lora_request.lora_int_id) if get is not None else None
    if held is not None and getattr(held, IDENTITY_ATTR, None) == path:
        return True  # resident under this id already: nothing to build
    names: dict[str, str] = manager.__dict__.setdefault(PREBUILD_NAMES_ATTR, {})
    if len(names) >= _MAX_NAMES:
        names.clear()
    names[path] = str(lora_request.lora_name)
    try:
        return table(manager).poll(path)
    except Exception as err:
        raise _crossing(err) from err


def _crossing(err: Exception) -> BaseException:
    """``err`` as it crosses to the server: vLLM's not-found error as the [`AdapterNotFoundError`] it wraps (the
    loader raises vLLM's for vLLM's own callers), with its record in its message."""
    from vllm.exceptions import LoRAAdapterNotFoundError

    cause = err.__cause__
    if isinstance(err, LoRAAdapterNotFoundError) and isinstance(cause, AdapterNotFoundError):
        text = str(err)
        return with_record(AdapterNotFoundError(text, source=cause.source, revision=cause.revision,
                                                public_message=text))
    return with_record(err)


def take_built(manager: Any, lora_request: Any) -> Any | None:
    """Return the finished model for ``lora_request`` (waiting for a build in flight), or ``None`` if none was started."""
    found = manager.__dict__.get(PREBUILD_ATTR)
    if found is None:
        return None
    lora = found.take(lora_request.lora_path)
    if lora is not None:
        lora.id = lora_request.lora_int_id  # built under a placeholder id; the key is the pinned source
        logger.info("adapter %r (id %d): built in the background, taken by the engine", lora_request.lora_name,
                    lora_request.lora_int_id)
    return lora
