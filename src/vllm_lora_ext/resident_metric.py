"""The ``vllm_lora_ext_adapter_resident`` gauge: what one engine holds now, for routers outside Ray.

One sample per adapter the engine holds, ``{adapter_name, level}`` = 1, ``level`` being the highest of
``gpu`` (in a LoRA slot), ``cpu`` (in the CPU cache) and ``building`` (a background build in flight); see
`vllm_lora_ext.residency.adapter_levels`. Mapping to vLLM's proposed ``vllm:lora_adapter_loaded{adapter_name,
level,pinned}`` (vLLM PR #54830, open): same ``adapter_name`` (the vLLM adapter name: a registered name, a mix's
``mix-...`` name, a client source's whole model id), same ``level`` values ``gpu``/``cpu``; ``building`` is
extra, ``pinned`` is absent (the plugin pins no slot). When the installed vLLM exports the upstream metric the
plugin writes nothing here (`vllm_lora_ext.integration._compat.has_upstream_residency_metric`).

Cardinality: the samples are the adapters held *now*, not every name ever seen. Each write replaces the
process's whole sample file (written aside, then renamed over), so an evicted adapter's series disappears
instead of staying at 0; held adapters are bounded by the engine's caches (``max_cpu_loras`` plus the build
table), and the write refuses more than ``max_series`` samples (the rest are counted in ``dropped``, and a
warning names the bound). Names longer than ``MAX_LABEL_CHARS`` are shortened with a digest.

The file is ``gauge_max_<pid>-vllm_lora_ext_resident.db`` in the metrics directory of `vllm_lora_ext.metrics`,
aggregated by ``max`` over processes: tensor-parallel workers that hold the same adapters show it once.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import threading
from collections.abc import Mapping

from vllm_lora_ext import metrics
from vllm_lora_ext.constants import cuda_visible_devices

__all__ = ["RESIDENT_METRIC", "MAX_LABEL_CHARS", "write_resident", "clear_resident"]

logger = logging.getLogger(__name__)

RESIDENT_METRIC = "vllm_lora_ext_adapter_resident"
_HELP = "Adapters this engine holds, by level: gpu (LoRA slot), cpu (CPU cache), building (background build)."
_LABELS = ("adapter_name", "level")
MAX_LABEL_CHARS = 256
_LOCK = threading.Lock()
_LAST: dict[int, tuple[tuple[str, str], ...]] = {}  # pid -> the samples last written (skip identical writes)
_WARNED: set[int] = set()
_AT_EXIT: set[int] = set()


def _label(name: str) -> str:
    # (a lone surrogate would make every scrape of /metrics fail: prometheus_client encodes the page as UTF-8)
    name = name.encode("utf-8", "backslashreplace").decode("utf-8")
    if len(name) <= MAX_LABEL_CHARS:
        return name
    return f"{name[:MAX_LABEL_CHARS - 18]}...{hashlib.sha256(name.encode()).hexdigest()[:15]}"


def _path(directory: str, pid: int) -> str:
    return os.path.join(directory, f"gauge_max_{pid}-vllm_lora_ext_resident.db")


def write_resident(levels: Mapping[str, str], *, max_series: int) -> int:
    """Replace this process's residency samples with ``levels`` (adapter name -> level); return how many were
    left out over ``max_series``. Does nothing without a metrics directory; never raises."""
    samples = tuple(sorted((_label(n), lvl) for n, lvl in levels.items()))
    dropped = max(0, len(samples) - max(0, max_series))
    samples = samples[:max(0, max_series)]
    pid = os.getpid()
    try:
        with _LOCK:
            directory = metrics.metrics_dir()
            if directory is None or _LAST.get(pid) == samples or metrics.health().get("degraded"):
                return dropped
            final = _path(directory, pid)
            tmp = final + ".tmp"  # the collector reads *.db only
            _write_allocated(tmp, [metrics._key(RESIDENT_METRIC, RESIDENT_METRIC, _LABELS, (name, level), _HELP)
                                   for name, level in samples])
            os.replace(tmp, final)
            if pid not in _AT_EXIT:  # a worker that exits takes its samples with it (a restarted one writes anew)
                _AT_EXIT.add(pid)
                atexit.register(clear_resident)
            _LAST[pid] = samples
    except Exception:  # a metric never fails a load or a step
        logger.debug("could not write %s", RESIDENT_METRIC, exc_info=True)
    if dropped and pid not in _WARNED:
        _WARNED.add(pid)
        logger.warning("%s: %d adapters held but at most %d samples are written; raise the bound or lower "
                       "max_cpu_loras", RESIDENT_METRIC, len(levels), max_series)
    return dropped


def _write_allocated(path: str, keys: list[str]) -> None:
    """Write ``keys`` = 1 into a new prometheus_client file at ``path`` whose every page is allocated before it is
    written (`vllm_lora_ext.metrics.BackedFile`): a full disk raises ``OSError`` here, never SIGBUS later."""
    from vllm_lora_ext.metrics import BackedFile

    for stale in (path, path + ".new"):
        try:
            os.unlink(stale)
        except FileNotFoundError:
            pass
    out = BackedFile(path)
    try:
        for key in keys:
            if not out.make_room(key):
                raise OSError(28, "no room to grow the residency metrics file", path)
            out.write_value(key, 1.0, 0.0)
    except BaseException:
        out.close()
        os.unlink(path)
        raise
    out.close()


def clear_resident() -> None:
    """Remove this process's residency samples (an engine shutting down, tests)."""
    pid = os.getpid()
    with _LOCK:
        _LAST.pop(pid, None)
        directory = metrics.metrics_dir()
        if directory is not None:
            try:
                os.remove(_path(directory, pid))
            except OSError:
                pass


def scrape_plugin_metrics(worker: object = None) -> dict[str, object]:
    """This process tree's ``vllm_lora_ext_*`` samples as its ``/metrics`` shows them (Prometheus text), with the
    metrics directory and pid; for ``collective_rpc`` where no ``/metrics`` route reads the directory (Ray
    Serve LLM replicas). ``text`` is empty without a metrics directory."""
    directory = metrics.metrics_dir()
    text = ""
    if directory is not None:
        from prometheus_client import CollectorRegistry, generate_latest
        from prometheus_client.multiprocess import MultiProcessCollector

        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
        text = generate_latest(registry).decode()
    return {"pid": os.getpid(), "metrics_dir": directory, "text": text,
            "cuda_visible_devices": cuda_visible_devices()}  # tells nodes of one host apart
