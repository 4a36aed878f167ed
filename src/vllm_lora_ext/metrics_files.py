"""The files behind the plugin's metrics: prometheus_client's mmap files with every page allocated, or memory.

A write through a mapping whose page the disk cannot back kills the process with SIGBUS, which Python cannot
catch. So a file is allocated (``posix_fallocate``) to its full size before prometheus_client maps it, and again
before it grows; where that fails, the process keeps its metrics in memory ([`MemoryFile`]) and ``metrics`` says
so once.
"""

from __future__ import annotations

import os
import struct

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
