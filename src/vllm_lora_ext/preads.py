"""Positional reads from an open file: buffers filled exactly with ``preadv``, and ranges of one tensor.

[`SafetensorsReader`] reads everything through one descriptor with these (``pread`` moves no file offset, so
threads share the descriptor).
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vllm_lora_ext.errors import AdapterFormatError

__all__ = ["IOV_MAX", "preadv_exactly", "read_ranges"]

IOV_MAX = max(1, min(1024, os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024))


def preadv_exactly(fd: int, into: list[memoryview], offset: int, *, path: Path, key: str | None = None) -> int:
    """Fill the buffers ``into``, in order, from ``fd``'s bytes at ``offset`` on; return the bytes read.

    ``preadv`` may read less than asked, and takes at most ``IOV_MAX`` buffers a call: it is called until all are full.

    Raises:
        [`AdapterFormatError`]: the file ends first (it is truncated).
    """
    bufs = [b for b in into if len(b)]
    total = sum(len(b) for b in bufs)
    at, got = 0, 0
    while at < len(bufs):
        n = os.preadv(fd, bufs[at:at + IOV_MAX], offset + got)
        if n <= 0:
            raise AdapterFormatError(f"{str(path)!r} ended early at byte {offset + got}"
                                     f"{f' while reading {key!r}' if key else ''}; the file is truncated. "
                                     f"Re-download it.", key=key)
        got += n
        while at < len(bufs) and n >= len(bufs[at]):  # skip the buffers filled, keep the rest of a partial one
            n -= len(bufs[at])
            at += 1
        if n:
            bufs[at] = bufs[at][n:]
    return total


def read_ranges(reader: Any, key: str, dt: torch.dtype,
                 ranges: Sequence[tuple[int, int, int]]) -> torch.Tensor:
    """`SafetensorsReader.read` of some ``(dim, start, stop)`` ranges of one tensor, concatenated along ``dim``
    (each clipped to the tensor as Python slices are). Ranges of rows (``dim`` 0) are read alone, straight into
    the result; ranges of another dim are copied out of the tensor's rows, a block at a time."""
    dims = {d for d, _, _ in ranges}
    shape = tuple(reader.header.shapes[key])
    if len(dims) != 1:
        raise ValueError("all ranges of one tensor must share one dim")
    (dim,) = dims
    if not 0 <= dim < len(shape):
        raise ValueError(f"tensor {key!r} of shape {shape} has no dim {dim}")
    size = shape[dim]
    spans = [(min(max(a, 0), size), min(max(b, 0), size)) for _, a, b in ranges]
    spans = [(a, max(a, b)) for a, b in spans]
    total = sum(b - a for a, b in spans)
    out = torch.empty((*shape[:dim], total, *shape[dim + 1:]), dtype=dt)
    inner = math.prod(shape[dim + 1:]) * dt.itemsize  # bytes of one index of ``dim``
    if out.numel() and dim == 0:
        raw = memoryview(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
        base, at = reader.header.offsets[key][0], 0
        for a, b in spans:
            preadv_exactly(reader.fileno(), [raw[at:at + (b - a) * inner]], base + a * inner, path=reader.path,
                            key=key)
            at += (b - a) * inner
    elif out.numel():
        with contextlib.closing(reader._blocks_of_rows(key, shape[0], reader.header.nbytes[key] // shape[0])) as blocks:
            for i, block_bytes in blocks:
                block = block_bytes.view(dt).view(-1, *shape[1:])
                rows, at = out[i:i + block.shape[0]], 0
                for a, b in spans:
                    rows.narrow(dim, at, b - a).copy_(block.narrow(dim, a, b - a))
                    at += b - a
    reader.stats.count(out.numel() * dt.itemsize, 1)
    return out
