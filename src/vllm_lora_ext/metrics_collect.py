"""What ``/metrics`` shows of the plugin's metrics: prometheus_client's multi-process files in the metrics folder,
plus the in-memory samples of a process whose folder had no room (``metrics`` writes both).

The collector runs in the API server at scrape time, never on a request's path.
"""

from __future__ import annotations

import glob
import json
import os
import stat
from collections.abc import Callable
from typing import Any

__all__ = ["Collector"]


class Collector:
    """prometheus_client's multi-process collector over ``path`` (if any), plus this process's in-memory samples."""

    def __init__(self, path: str | None, memory: Callable[[], list[tuple[str, str, float]]]) -> None:
        self.path = path
        self.memory = memory

    def describe(self) -> list[Any]:
        return []  # names vary with the files; prometheus_client then skips its duplicate-name check

    def collect(self) -> Any:
        from prometheus_client.multiprocess import MultiProcessCollector

        files = glob.glob(os.path.join(glob.escape(self.path), "*.db")) if self.path and os.path.isdir(self.path) else []
        files = [f for f in files if _readable_size(f)]  # an empty file (or a folder) would fail every scrape
        if not hasattr(MultiProcessCollector, "_read_metrics"):  # another prometheus_client: the files alone
            return MultiProcessCollector(None, path=self.path).collect() if files else []  # type: ignore[no-untyped-call]
        found = MultiProcessCollector._read_metrics(files)
        _add_memory_samples(found, self.memory())
        return MultiProcessCollector._accumulate_metrics(found, True)


def _readable_size(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_size >= 8


def _add_memory_samples(found: dict[str, Any], memory: list[tuple[str, str, float]]) -> None:
    """Add in-memory samples to ``found`` as prometheus_client's file reader would (before accumulating)."""
    from prometheus_client.metrics_core import Metric

    for prefix, key, value in memory:
        metric_name, name, labels, help_text = json.loads(key)
        typ = "gauge" if prefix.startswith("gauge") else prefix
        metric = found.get(metric_name)
        if metric is None:
            metric = found[metric_name] = Metric(metric_name, help_text, typ)
        labels_key = tuple(sorted(labels.items()))
        if typ == "gauge":
            metric._multiprocess_mode = "sum"
            metric.add_sample(name, labels_key + (("pid", str(os.getpid())),), value, None)
        else:
            metric.add_sample(name, labels_key, value)
