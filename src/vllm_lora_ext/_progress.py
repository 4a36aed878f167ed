"""Progress lines for slow work: a load or download that runs longer than 2 s logs bytes, rate and percent done."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ProgressLog", "logging_tqdm_class"]

logger = logging.getLogger("vllm_lora_ext.progress")

AFTER_S = 2.0  # first line after this long; then at most one line per interval
EVERY_S = 2.0


class ProgressLog:
    """Log ``what: 120.0/1589.0 MiB (8%), 60.2 MiB/s`` once work has run ``AFTER_S`` seconds, then every ``EVERY_S``.

    Example:
        >>> t = [0.0]
        >>> p = ProgressLog("loading 'x'", total=100 * 2**20, clock=lambda: t[0])
        >>> p.update(10 * 2**20) is None  # too early: nothing logged
        True
        >>> t[0] = 2.5
        >>> p.update(50 * 2**20)
        "loading 'x': 50.0/100.0 MiB (50%), 20.0 MiB/s"
    """

    def __init__(self, what: str, *, total: int | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.what = what
        self.total = total
        self._clock = clock
        self._start = clock()
        self._last: float | None = None
        self.lines: list[str] = []

    def update(self, done: int, *, total: int | None = None) -> str | None:
        """Record ``done`` bytes; return the line logged, if one was due."""
        if total is not None:
            self.total = total
        now = self._clock()
        elapsed = now - self._start
        if elapsed < AFTER_S or (self._last is not None and now - self._last < EVERY_S):
            return None
        self._last = now
        mib = done / 2**20
        line = f"{self.what}: {mib:.1f}"
        if self.total:
            line += f"/{self.total / 2**20:.1f} MiB ({100 * done / self.total:.0f}%)"
        else:
            line += " MiB"
        line += f", {mib / elapsed:.1f} MiB/s"
        logger.info("%s", line)
        self.lines.append(line)
        return line


def logging_tqdm_class(what: str) -> Any:
    """Return a tqdm class for ``hf_hub_download(tqdm_class=...)`` that also logs progress lines.

    It is a subclass of huggingface_hub's own tqdm, so its switches hold (``HF_HUB_DISABLE_PROGRESS_BARS``,
    ``disable_progress_bars()``, no bar where stderr is not a terminal); huggingface_hub gives any other class no
    ``disable``, and it drew a bar on every download. The progress lines are logged even with the bar off, as on
    a server.
    """
    from huggingface_hub.utils import tqdm

    class _LoggingTqdm(tqdm):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._progress = ProgressLog(f"downloading {what}", total=kwargs.get("total"))
            self._done = int(kwargs.get("initial") or 0)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            self._done += int(n or 0)
            self._progress.update(self._done)
            return super().update(n)

    return _LoggingTqdm
