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

Metrics never fail or kill anything. prometheus_client writes through a memory mapping, and a write
to a page a full disk cannot back kills the process (SIGBUS, which Python cannot catch); so every page
of a file is allocated (``posix_fallocate``) before prometheus_client maps or grows into it ([`BackedFile`]). When that
fails, when the folder has less than 1 MiB free at start, or when it cannot be made, the process keeps
its metrics in memory from then on ([`MemoryFile`]), with one warning (the API server's collector shows its own; other
processes' are then not shown). A write that fails anyway is dropped and counted ([`health`]), with one
warning. Each top-level process holds a lock on its folder's lock file ([`sharedfiles`]); the next one
removes the folders of owners that died without removing theirs (a SIGKILLed server).

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
import struct
import tempfile
import threading
from collections.abc import Sequence
from typing import Any

from vllm_lora_ext.constants import PROMETHEUS_DIR_ENV, export_metrics_dir, metrics_dir_setting, prometheus_dir_set
from vllm_lora_ext.metrics_collect import Collector
from vllm_lora_ext.sharedfiles import claim_owner, release_owner, sweep_dead_owners

__all__ = [
    "ADAPTER_BYTES_READ", "ADAPTER_LOADS", "ADAPTER_LOAD_SECONDS", "ERRORS", "MIXES_ACTIVE", "MIXES_EVICTED",
    "MIXES_REGISTERED", "SOURCES_RESOLVED", "SOURCE_DOWNLOAD_SECONDS", "Counter", "Gauge", "Histogram",
    "BackedFile", "MemoryFile", "health", "metrics_dir", "record_error", "setup", "DISK_CACHE_BYTES", "DISK_CACHE_EVICTIONS", "LatestGauge",
]

logger = logging.getLogger(__name__)

_FILE_TAG = "vllm_lora_ext"
_DIR_STEM = "vllm_lora_ext_metrics_"  # <stem><owner tag>-<random>: the folder a top-level process makes
_MIN_FREE_BYTES = 1 << 20  # less free space than this in the metrics folder at start: metrics stay in memory
_LOCK = threading.Lock()
_FILES: dict[str, Any] = {}  # file prefix -> BackedFile or MemoryFile, for _FILES_PID
_FILES_PID: int | None = None
_OWNED: dict[str, Any] = {}  # the directory this process made, and its collector
_MEMORY: dict[str, dict[str, float]] = {}  # file prefix -> key -> value, once this process's metrics are in memory
_HEALTH: dict[str, Any] = {"pid": None, "degraded": None, "write_failures": 0}


def metrics_dir() -> str | None:
    """Return the directory this process writes metrics to, or ``None`` (metrics off)."""
    path = metrics_dir_setting()
    return path if path and os.path.isdir(path) else None


def health() -> dict[str, Any]:
    """Return this process's metrics state: ``degraded`` (why its metrics are kept in memory, or ``None``) and
    ``write_failures`` (metric writes that failed and were dropped)."""
    with _LOCK:
        _this_process()
        return {"degraded": _HEALTH["degraded"], "write_failures": _HEALTH["write_failures"]}


def setup() -> str | None:
    """Make sure this process tree has a metrics directory and that ``/metrics`` reads it; return it.

    Idempotent. Called by the plugin's ``register()`` in every vLLM process: the first one (the API
    server or the ``LLM`` process) makes the directory, the processes it starts inherit it. A top-level
    process first removes the folders of top-level processes that died without removing theirs.
    When the directory cannot be made or has less than 1 MiB free, this process's metrics are kept in
    memory (one warning) and ``None`` is returned. Returns ``None`` when prometheus_client is not installed.
    """
    try:
        from prometheus_client import REGISTRY
    except ImportError:
        return None
    with _LOCK:
        if prometheus_dir_set():
            path = metrics_dir()  # vLLM's collector (get_prometheus_registry) reads this directory
            _check_free(path)
            return path
        if _OWNED.get("pid") == os.getpid():
            return _OWNED["path"]  # type: ignore[no-any-return]
        current = metrics_dir()
        if current is not None and multiprocessing.parent_process() is not None:
            _check_free(current)
            return current  # an engine or worker process: its parent made the directory and serves /metrics
        # A top-level process (``vllm serve``, a script with ``LLM``): a fresh directory, even if one was inherited
        # from an unrelated parent, so two servers started by one program never add up each other's counts.
        root = "the temp dir"
        try:
            root = tempfile.gettempdir()  # raises when no candidate folder takes a file
            swept = sweep_dead_owners(root, _DIR_STEM)
            if swept:
                logger.info("removed %d metrics folders of processes that are gone from %s", len(swept), root)
            path = tempfile.mkdtemp(prefix=f"{_DIR_STEM}{claim_owner(root, _DIR_STEM)}-", dir=root)
        except OSError as err:
            export_metrics_dir(None)  # never an inherited one: the children keep theirs in memory too
            _degrade(f"no metrics folder could be made in {root} ({err.strerror or err})")
            collector = Collector(None, _memory_samples)
            REGISTRY.register(collector)
            _OWNED.update(path=None, pid=os.getpid(), collector=collector)
            return None
        export_metrics_dir(path)
        collector = Collector(path, _memory_samples)
        REGISTRY.register(collector)
        _OWNED.update(path=path, pid=os.getpid(), collector=collector, root=root)
        atexit.register(_remove_owned_dir)
        _check_free(path)
        logger.debug("metrics directory %s", path)
        return path


def _check_free(path: str | None) -> None:
    if path is None:
        return
    try:
        free = shutil.disk_usage(path).free
    except OSError as err:
        _degrade(f"the metrics folder {path} cannot be checked ({err.strerror or err})")
        return
    if free < _MIN_FREE_BYTES:
        _degrade(f"the metrics folder {path} has {free} bytes free")


def _remove_owned_dir() -> None:
    if _OWNED.get("pid") == os.getpid() and _OWNED.get("path"):  # never from a forked child, which inherits this hook
        _close_files()
        shutil.rmtree(_OWNED["path"], ignore_errors=True)
        release_owner(_OWNED["root"], _DIR_STEM)


def teardown() -> None:
    """Undo [`setup`] in this process (tests): unregister the collector, remove its directory, close files."""
    with _LOCK:
        _close_files()
        _MEMORY.clear()
        _HEALTH.update(pid=None, degraded=None, write_failures=0)
        if _OWNED.get("pid") == os.getpid():
            from prometheus_client import REGISTRY

            try:
                REGISTRY.unregister(_OWNED["collector"])
            except KeyError:
                pass
            if _OWNED["path"]:
                _remove_owned_dir()
                export_metrics_dir(None, only_if=_OWNED["path"])
        _OWNED.clear()


def _close_files() -> None:
    global _FILES_PID
    for f in _FILES.values():
        f.close()
    _FILES.clear()
    _FILES_PID = None


def _this_process() -> None:
    """Forget a parent's open files, memory values and state after a fork (under the lock)."""
    global _FILES_PID
    pid = os.getpid()
    if _FILES_PID != pid:  # first use, or a fork: never write into the parent's files
        _FILES.clear()
        _FILES_PID = pid
    if _HEALTH["pid"] != pid:
        _MEMORY.clear()
        _HEALTH.update(pid=pid, write_failures=0)  # "degraded" is kept: a full disk is full for the child too


def _degrade(reason: str, fix: str = "Free space there, or set {env} to a folder with room") -> None:
    """Keep this process's metrics in memory from now on; warn once (under the lock, or before any thread)."""
    _this_process()
    if _HEALTH["degraded"] is not None:
        return
    _HEALTH["degraded"] = reason
    logger.warning("vllm_lora_ext metrics: %s; this process keeps its metrics in memory from now on (only the "
                   "API server's own appear on /metrics). %s.", reason, fix.format(env=PROMETHEUS_DIR_ENV))
    for prefix, f in list(_FILES.items()):
        if isinstance(f, BackedFile):
            f.close(zero_gauges=prefix == "gauge_sum")  # counters stay in the file; memory adds to them
    _FILES.clear()


def _rescue(reason: str, fix: str = "Make the folder again, or set {env} to an existing one") -> None:
    """Keep in memory what this process's files that left the folder held, then `_degrade`."""
    for prefix, f in list(_FILES.items()):
        if isinstance(f, BackedFile) and os.fstat(f.fd).st_nlink == 0:
            values = _MEMORY.setdefault(prefix, {})
            values.update({key: f.read_value(key)[0] for key in f.keys})
    _degrade(reason, fix)


# prometheus_client's first size of a file (it doubles it as keys are added)
INITIAL_FILE_BYTES = 1 << 16


class BackedFile:
    """One of prometheus_client's mmap files whose pages are all allocated (``posix_fallocate``) before it writes
    them: a write through the mapping can then never meet a full disk, which would kill the process (SIGBUS)."""

    def __init__(self, path: str) -> None:
        from prometheus_client.mmap_dict import MmapedDict

        self.path = path
        try:
            self.fd = os.open(path, os.O_RDWR)  # this pid's file from before (a reused pid): kept, fully allocated
            fresh = None
        except FileNotFoundError:  # made under another name and renamed once allocated: a reader never sees it empty
            fresh = f"{path}.new"
            self.fd = os.open(fresh, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            self.size = max(os.fstat(self.fd).st_size, INITIAL_FILE_BYTES)
            os.posix_fallocate(self.fd, 0, self.size)
            if fresh is not None:
                os.rename(fresh, path)
            self.data = MmapedDict(path)  # type: ignore[no-untyped-call]
        except BaseException:
            os.close(self.fd)
            if fresh is not None:
                for leftover in (fresh, path):
                    try:
                        os.unlink(leftover)
                    except OSError:
                        pass
            raise
        self.keys: set[str] = set()

    def make_room(self, key: str) -> bool:
        """Allocate what the file grows to when ``key`` is added (as prometheus_client doubles it); ``False``: no room."""
        if key in self.keys:
            return True
        encoded = len(key.encode("utf-8"))
        entry = 4 + encoded + (8 - (encoded + 4) % 8) + 16
        used = struct.unpack("i", os.pread(self.fd, 4, 0))[0]
        size = self.size
        while used + entry > size:
            size *= 2
        if size != self.size:
            try:
                os.posix_fallocate(self.fd, 0, size)
            except OSError:
                return False
            self.size = size
        self.keys.add(key)
        return True

    def read_value(self, key: str) -> tuple[float, float]:
        return self.data.read_value(key)  # type: ignore[no-any-return]

    def write_value(self, key: str, value: float, timestamp: float) -> None:
        self.data.write_value(key, value, timestamp)

    def close(self, *, zero_gauges: bool = False) -> None:
        try:
            if zero_gauges:  # the entries' pages are allocated already: these writes are safe
                for key in list(self.keys):
                    self.data.write_value(key, 0.0, 0.0)
            self.data.close()
        finally:
            os.close(self.fd)


class MemoryFile:
    """This process's metrics in memory, once its metrics folder has no room (shown by the API server's collector)."""

    def __init__(self, values: dict[str, float]) -> None:
        self.values = values

    def read_value(self, key: str) -> tuple[float, float]:
        return self.values.get(key, 0.0), 0.0

    def write_value(self, key: str, value: float, timestamp: float) -> None:
        self.values[key] = value

    def close(self) -> None:
        pass


def _file(prefix: str) -> Any:
    """This process's store for ``prefix`` (``counter``, ``histogram``, ``gauge_sum``); ``None`` if metrics are off."""
    _this_process()
    f = _FILES.get(prefix)
    if f is None:
        if _HEALTH["degraded"] is not None:
            f = _FILES[prefix] = MemoryFile(_MEMORY.setdefault(prefix, {}))
            return f
        path = metrics_dir()
        if path is None and metrics_dir_setting():  # the folder was removed while this process ran, or never made
            _rescue(f"the metrics folder {metrics_dir_setting()} does not exist (removed, or never made)",
                    "Make it, or set {env} to an existing folder")
            return _file(prefix)
        if path is None:
            return None
        try:
            import prometheus_client.mmap_dict  # noqa: F401
        except ImportError:
            return None
        try:
            f = _FILES[prefix] = BackedFile(os.path.join(path, f"{prefix}_{os.getpid()}-{_FILE_TAG}.db"))
        except OSError as err:
            _degrade(f"a metrics file cannot be made in {path} ({err.strerror or err})")
            f = _FILES[prefix] = MemoryFile(_MEMORY.setdefault(prefix, {}))
    return f


def _add(prefix: str, key: str, amount: float, *, replace: bool = False) -> None:
    if not key:
        return
    try:
        with _LOCK:
            f = _file(prefix)
            if f is None:
                return
            if isinstance(f, BackedFile) and os.fstat(f.fd).st_nlink == 0:  # its folder was removed (a cleaner)
                _rescue(f"the metrics folder {os.path.dirname(f.path)} was removed")
                f = _file(prefix)
            if isinstance(f, BackedFile) and not f.make_room(key):
                _degrade(f"the metrics folder {os.path.dirname(f.path)} is full")
                f = _file(prefix)
            value = amount if replace else f.read_value(key)[0] + amount
            f.write_value(key, value, 0.0)
    except Exception as err:  # a metric must never fail a load or a request
        with _LOCK:
            _HEALTH["write_failures"] += 1
            first = _HEALTH["write_failures"] == 1
        if first:
            logger.warning("vllm_lora_ext metrics: a metric write failed (%s: %s); metric writes that fail are "
                           "dropped and counted (metrics.health())", type(err).__name__, err)
        logger.debug("could not record metric %s", key, exc_info=True)


def _memory_samples() -> list[tuple[str, str, float]]:
    """This process's in-memory samples ``(file prefix, key, value)``, for the collector of ``/metrics``."""
    with _LOCK:
        if _HEALTH["pid"] != os.getpid():
            return []
        return [(prefix, key, value) for prefix, values in _MEMORY.items() for key, value in values.items()]


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


# ----------------------------------------------------------------------------------------------------- disk tier
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
                if f is not None and (not isinstance(f, BackedFile) or f.make_room(key)):  # pages allocated first
                    f.write_value(key, float(value), time.time())
        except Exception:  # a metric must never fail a load or a request
            logger.debug("could not record metric %s", key, exc_info=True)


DISK_CACHE_BYTES = LatestGauge("vllm_lora_ext_disk_cache_bytes",
                               "Bytes of the adapter revisions the plugin downloaded into the Hugging Face cache, "
                               "and of the partial files interrupted downloads left there.")
DISK_CACHE_EVICTIONS = Counter("vllm_lora_ext_disk_cache_evictions",
                               "Adapter revisions evicted from the Hugging Face cache to keep its bound.")
