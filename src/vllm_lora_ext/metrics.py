"""Prometheus metrics in the ``vllm_lora_ext_*`` namespace, written by every vLLM process, shown by the API server.

vLLM serves ``/metrics`` from its API-server process, while adapters load in worker processes. This
module uses prometheus_client's multi-process mechanism (the one vLLM itself uses for several API
servers): each process writes its samples to memory-mapped ``.db`` files in one directory, and a
``MultiProcessCollector`` in the API server sums them at scrape time.

* If ``PROMETHEUS_MULTIPROC_DIR`` is set (the user set it, or ``vllm serve --api-server-count N``
  did), the files go there and vLLM's own collector already reads them.
* Otherwise a top-level process that calls [`setup`] (the API server, when the plugin registers)
  makes a private directory, exports it as ``VLLM_LORA_EXT_METRICS_DIR`` so the engine and worker
  processes it starts (multiprocessing children) write there too, adds a collector for it to
  prometheus' default registry (the one ``/metrics`` serves), and removes the directory when it exits.
  Processes started another way (Ray workers) write to a directory of their own, which no
  ``/metrics`` reads.

Only this package's samples live in these files (named ``<type>_<pid>-vllm_lora_ext.db``, so they
never share a file with vLLM's own); vLLM's metrics are untouched. Without prometheus_client, or
before [`setup`] has made a directory (e.g. the ``vllm-lora`` CLI), every record call does nothing.

The metrics:

| name | type | labels |
|---|---|---|
| ``vllm_lora_ext_adapter_loads_total`` | counter | ``kind`` (adapter, mix), ``outcome`` (ok, not_found, rejected, error) |
| ``vllm_lora_ext_adapter_load_seconds`` | histogram | ``kind`` |
| ``vllm_lora_ext_adapter_bytes_read_total`` | counter | |
| ``vllm_lora_ext_sources_resolved_total`` | counter | ``cache`` (hit, miss, local) |
| ``vllm_lora_ext_source_download_seconds`` | histogram | |
| ``vllm_lora_ext_mixes_registered_total`` | counter | |
| ``vllm_lora_ext_mixes_evicted_total`` | counter | |
| ``vllm_lora_ext_mixes_active`` | gauge | |
| ``vllm_lora_ext_errors_total`` | counter | ``where`` (server, worker), ``type`` (the error class) |
| ``vllm_lora_ext_disk_cache_bytes`` | gauge (last set) | |
| ``vllm_lora_ext_disk_cache_evictions_total`` | counter | |

Loads are counted once per engine (by its first tensor/pipeline rank); bytes read are summed over
every worker, so with expert parallelism they are the bytes all ranks read together.
"""

from __future__ import annotations

import atexit
import logging
import math
import multiprocessing
import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

from vllm_lora_ext.constants import ENV_METRICS_DIR

__all__ = [
    "ADAPTER_BYTES_READ", "ADAPTER_LOADS", "ADAPTER_LOAD_SECONDS", "ERRORS", "MIXES_ACTIVE", "MIXES_EVICTED",
    "MIXES_REGISTERED", "SOURCES_RESOLVED", "SOURCE_DOWNLOAD_SECONDS", "Counter", "Gauge", "Histogram",
    "metrics_dir", "record_error", "setup", "DISK_CACHE_BYTES", "DISK_CACHE_EVICTIONS", "LatestGauge",
]

logger = logging.getLogger(__name__)

PROMETHEUS_DIR_ENV = "PROMETHEUS_MULTIPROC_DIR"
_FILE_TAG = "vllm_lora_ext"
_LOCK = threading.Lock()
_FILES: dict[str, Any] = {}  # file prefix -> MmapedDict, for _FILES_PID
_FILES_PID: int | None = None
_OWNED: dict[str, Any] = {}  # the directory this process made, and its collector


def metrics_dir() -> str | None:
    """Return the directory this process writes metrics to, or ``None`` (metrics off)."""
    path = os.environ.get(PROMETHEUS_DIR_ENV) or os.environ.get(ENV_METRICS_DIR)
    return path if path and os.path.isdir(path) else None


def setup() -> str | None:
    """Make sure this process tree has a metrics directory and that ``/metrics`` reads it; return it.

    Idempotent. Called by the plugin's ``register()`` in every vLLM process: the first one (the API
    server or the ``LLM`` process) makes the directory, the processes it starts inherit it.
    Returns ``None`` when prometheus_client is not installed.
    """
    try:
        from prometheus_client import REGISTRY
        from prometheus_client.multiprocess import MultiProcessCollector
    except ImportError:
        return None
    with _LOCK:
        if os.environ.get(PROMETHEUS_DIR_ENV):
            return metrics_dir()  # vLLM's collector (get_prometheus_registry) reads this directory
        if _OWNED.get("pid") == os.getpid():
            return str(_OWNED["path"])
        current = metrics_dir()
        if current is not None and multiprocessing.parent_process() is not None:
            return current  # an engine or worker process: its parent made the directory and serves /metrics
        # A top-level process (``vllm serve``, a script with ``LLM``): a fresh directory, even if one was inherited
        # from an unrelated parent, so two servers started by one program never add up each other's counts.
        path = tempfile.mkdtemp(prefix="vllm_lora_ext_metrics_")
        os.environ[ENV_METRICS_DIR] = path
        collector = MultiProcessCollector(None, path=path)  # type: ignore[no-untyped-call]
        REGISTRY.register(collector)
        _OWNED.update(path=path, pid=os.getpid(), collector=collector)
        atexit.register(_remove_owned_dir)
        logger.debug("metrics directory %s", path)
        return path


def _remove_owned_dir() -> None:
    if _OWNED.get("pid") == os.getpid():  # never from a forked child, which inherits this hook
        shutil.rmtree(_OWNED["path"], ignore_errors=True)


def teardown() -> None:
    """Undo [`setup`] in this process (tests): unregister the collector, remove its directory, close files."""
    with _LOCK:
        _close_files()
        if _OWNED.get("pid") == os.getpid():
            from prometheus_client import REGISTRY

            try:
                REGISTRY.unregister(_OWNED["collector"])
            except KeyError:
                pass
            shutil.rmtree(_OWNED["path"], ignore_errors=True)
            if os.environ.get(ENV_METRICS_DIR) == _OWNED["path"]:
                del os.environ[ENV_METRICS_DIR]
        _OWNED.clear()


def _close_files() -> None:
    global _FILES_PID
    for f in _FILES.values():
        f.close()
    _FILES.clear()
    _FILES_PID = None


def _file(prefix: str) -> Any:
    """This process's mmap file for ``prefix`` (``counter``, ``histogram``, ``gauge_sum``); ``None`` if metrics are off."""
    global _FILES_PID
    pid = os.getpid()
    if _FILES_PID != pid:  # first use, or a fork: never write into the parent's files
        _FILES.clear()
        _FILES_PID = pid
    f = _FILES.get(prefix)
    if f is None:
        path = metrics_dir()
        if path is None:
            return None
        try:
            from prometheus_client.mmap_dict import MmapedDict
        except ImportError:
            return None
        f = _FILES[prefix] = MmapedDict(  # type: ignore[no-untyped-call]
            os.path.join(path, f"{prefix}_{pid}-{_FILE_TAG}.db"))
    return f


def _add(prefix: str, key: str, amount: float, *, replace: bool = False) -> None:
    if not key:
        return
    try:
        with _LOCK:
            f = _file(prefix)
            if f is None:
                return
            value = amount if replace else f.read_value(key)[0] + amount
            f.write_value(key, value, 0.0)
    except Exception:  # a metric must never fail a load or a request
        logger.debug("could not record metric %s", key, exc_info=True)


def _key(metric: str, sample: str, labelnames: Sequence[str], labelvalues: Sequence[str], help_text: str) -> str:
    """The sample's key in prometheus_client's files ("" without prometheus_client: nothing is recorded)."""
    try:
        from prometheus_client.mmap_dict import mmap_key
    except ImportError:
        return ""
    return str(mmap_key(metric, sample, list(labelnames), list(labelvalues), help_text))


class _Metric:
    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def _values(self, labels: dict[str, str]) -> tuple[str, ...]:
        if set(labels) != set(self.labelnames):
            raise ValueError(f"metric {self.name} takes labels {self.labelnames}, got {sorted(labels)}")
        return tuple(str(labels[n]) for n in self.labelnames)


class Counter(_Metric):
    """A monotonic counter; ``name`` is given without ``_total``."""

    def inc(self, amount: float = 1.0, **labels: str) -> None:
        """Add ``amount`` (≥ 0) to the sample with ``labels``."""
        if not amount >= 0:
            raise ValueError(f"counter {self.name} can only grow, got {amount}")
        _add("counter", _key(self.name, self.name + "_total", self.labelnames, self._values(labels), self.help), amount)


class Gauge(_Metric):
    """A gauge summed over processes (``multiprocess_mode='sum'``)."""

    def set(self, value: float, **labels: str) -> None:
        """Set this process's sample with ``labels`` to ``value``."""
        _add("gauge_sum", _key(self.name, self.name, self.labelnames, self._values(labels), self.help), float(value),
             replace=True)


class Histogram(_Metric):
    """A histogram with fixed ``buckets`` (upper bounds; ``+Inf`` is added)."""

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = (), *,
                 buckets: Sequence[float]) -> None:
        super().__init__(name, help_text, labelnames)
        self.buckets = tuple(sorted(float(b) for b in buckets)) + (math.inf,)

    def observe(self, value: float, **labels: str) -> None:
        """Count one observation of ``value`` in its first bucket (the collector makes the buckets cumulative).

        Every bucket of the label set is written (0 where it does not grow), so a scrape shows them all.
        """
        values = self._values(labels)
        try:
            from prometheus_client.utils import floatToGoString
        except ImportError:
            return
        bound = next(b for b in self.buckets if value <= b)
        _add("histogram", _key(self.name, self.name + "_sum", self.labelnames, values, self.help), float(value))
        for b in self.buckets:
            _add("histogram", _key(self.name, self.name + "_bucket", self.labelnames + ("le",),
                                   values + (floatToGoString(b),), self.help),  # type: ignore[no-untyped-call]
                 1.0 if b == bound else 0.0)


_SECONDS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)

ADAPTER_LOADS = Counter("vllm_lora_ext_adapter_loads", "Adapter and mix loads in the workers, by outcome.",
                        ("kind", "outcome"))
ADAPTER_LOAD_SECONDS = Histogram("vllm_lora_ext_adapter_load_seconds",
                                 "Seconds to build an adapter or mix in a worker (resolve, read, check, pack).",
                                 ("kind",), buckets=_SECONDS)
ADAPTER_BYTES_READ = Counter("vllm_lora_ext_adapter_bytes_read", "Adapter weight bytes read, summed over workers.")
SOURCES_RESOLVED = Counter("vllm_lora_ext_sources_resolved",
                           "Adapter sources resolved: hub cache hit, hub download (miss), or local path.", ("cache",))
SOURCE_DOWNLOAD_SECONDS = Histogram("vllm_lora_ext_source_download_seconds",
                                    "Seconds spent resolving a hub source that downloaded files.", buckets=_SECONDS)
MIXES_REGISTERED = Counter("vllm_lora_ext_mixes_registered", "Weighted mixes registered by the API server.")
MIXES_EVICTED = Counter("vllm_lora_ext_mixes_evicted", "Weighted mixes evicted from the API server's registry.")
MIXES_ACTIVE = Gauge("vllm_lora_ext_mixes_active", "Weighted mixes registered now.")
ERRORS = Counter("vllm_lora_ext_errors", "Errors answered or raised by the plugin, by where and error class.",
                 ("where", "type"))


def record_error(err: BaseException, *, where: str) -> None:
    """Count ``err`` in ``vllm_lora_ext_errors_total`` by its class name (``where``: server or worker)."""
    ERRORS.inc(where=where, type=type(err).__name__)


# ----------------------------------------------------------------------------------------- disk tier (issue 41)
# The disk cache is one quantity shared by every process that uses it, so its gauge is the value set last
# (prometheus_client's 'mostrecent' mode), not a sum over processes.


class LatestGauge(_Metric):
    """A gauge whose value is the one any process set last (``multiprocess_mode='mostrecent'``)."""

    def set(self, value: float, **labels: str) -> None:
        """Set the sample with ``labels`` to ``value``, stamped now."""
        import time

        key = _key(self.name, self.name, self.labelnames, self._values(labels), self.help)
        if not key:
            return
        try:
            with _LOCK:
                f = _file("gauge_mostrecent")
                if f is not None:
                    f.write_value(key, float(value), time.time())
        except Exception:  # a metric must never fail a load or a request
            logger.debug("could not record metric %s", key, exc_info=True)


DISK_CACHE_BYTES = LatestGauge("vllm_lora_ext_disk_cache_bytes",
                               "Bytes of the adapter revisions the plugin downloaded into the Hugging Face cache.")
DISK_CACHE_EVICTIONS = Counter("vllm_lora_ext_disk_cache_evictions",
                               "Adapter revisions evicted from the Hugging Face cache to keep its bound.")
