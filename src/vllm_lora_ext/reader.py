"""Read adapter weight files: headers without tensors, then only the requested keys and row/column slices.

A [`SafetensorsReader`] opens its file once and reads everything through that one descriptor: the header
([`read_header`], in `vllm_lora_ext.headers`) and then every tensor, slice, stack, gather and transposed read,
with ``pread``/``preadv`` (positional, so threads share it). A load is one snapshot: a file replaced at its path
meanwhile (a deploy tool's atomic ``os.replace``) is never read from, and no offset of one file is applied to
another's bytes. Every read is counted in a [`ReadStats`]. A reader is the tensor source MoE blocks are read from
(`vllm_lora_ext.formats.moe_read.TensorSource`).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import os
import threading
from collections.abc import Callable, Generator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from vllm_lora_ext._util import open_confined
from vllm_lora_ext.constants import GPU_HEADROOM_BYTES as _GPU_HEADROOM  # left free on a worker's GPU
from vllm_lora_ext.errors import AdapterFormatError
from vllm_lora_ext.headers import DTYPES, FileHeader, TensorInfo, dtype_by_name, file_stamp, read_header, torch_dtype_of
from vllm_lora_ext.preads import preadv_exactly as _preadv_exactly, read_ranges as _read_ranges

__all__ = ["TensorInfo", "FileHeader", "ReadStats", "SafetensorsReader", "DictSource", "read_header", "read_tensors",
           "load_pickle_tensors", "DTYPES", "torch_dtype_of", "dtype_by_name"]


@dataclass
class ReadStats:
    """Bytes and tensors actually read from disk (header bytes included); safe to count into from many threads."""

    bytes_read: int = 0
    tensors_read: int = 0
    files: list[str] = field(default_factory=list)
    turned_on_gpu: int = 0  # tensors `read_transposed` turned on a GPU
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def count(self, nbytes: int = 0, tensors: int = 0, *, on_gpu: int = 0) -> None:
        """Add ``nbytes`` read and ``tensors`` read, ``on_gpu`` of them turned on a GPU (MoE blocks are read on
        several threads at once)."""
        with self._lock:
            self.bytes_read += nbytes
            self.tensors_read += tensors
            self.turned_on_gpu += on_gpu



def read_tensors(
    path: str | os.PathLike[str],
    keys: Iterable[str] | None = None,
    *,
    slices: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
    stats: ReadStats | None = None,
    header: FileHeader | None = None,
) -> dict[str, torch.Tensor]:
    """Read the named tensors (all if ``keys`` is None), each fully or as a union of slices, from one open file.

    Args:
        path: the ``.safetensors`` file.
        keys: which tensors to read, in this order.
        slices: for some keys, a list of ``(dim, start, stop)`` ranges; the tensor returned is the
            concatenation of those ranges along ``dim`` (all ranges of one key share one ``dim``).
        stats: counts bytes and tensors read.
        header: a header already parsed by [`read_header`] (used only if the file is still the one it was read from).

    Returns:
        ``{key: tensor}`` in the order of ``keys``; tensors own their memory (no mmap views).
    """
    with SafetensorsReader(path, header=header, stats=stats) as reader:
        wanted = list(reader.header.shapes) if keys is None else list(keys)
        missing = [k for k in wanted if k not in reader.header.shapes]
        if missing:
            raise AdapterFormatError(f"{str(path)!r} has no tensor {missing[0]!r} ({len(missing)} missing).",
                                     key=missing[0])
        ranges = slices or {}
        return {key: reader.read(key, ranges.get(key)) for key in wanted}


def load_pickle_tensors(path: str | os.PathLike[str], *, roots: Sequence[str] | None = None) -> dict[str, torch.Tensor]:
    """Load a pickle weight file with ``torch.load(weights_only=True)`` (only after the user opted in), from one
    open file (with ``roots``: one whose real path lies in them, `open_confined`)."""
    with os.fdopen(open_confined(path, roots), "rb") as f:
        obj = torch.load(f, map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise AdapterFormatError(f"{str(path)!r} does not hold a flat dict of tensors.")
    return dict(obj)


class DictSource:
    """A pickle adapter already in memory (`load_pickle_tensors`) as a tensor source: `SafetensorsReader`'s ``read``
    and ``read_many``, without its reads straight into place (a MoE block is read from it key by key)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def read(self, key: str, ranges: Any = None) -> torch.Tensor:
        t = self.tensors[key]
        if not ranges:
            return t
        return torch.cat([t.narrow(d, s, e - s) for d, s, e in ranges], dim=ranges[0][0]).contiguous()

    def read_many(self, keys: Any, *, copy: bool = True) -> dict[str, torch.Tensor]:
        return {k: self.tensors[k] for k in keys}

    def close(self) -> None:  # (the file was read whole and closed)
        pass


# Bytes of rows `gather` and `read_transposed` read at a time: the block stays in a core's L2 cache (1 MiB a core
# is common) while its pieces are copied or transposed out of it.
_GATHER_BLOCK = 1 << 20
# The largest tensor `read_transposed` turns on a GPU (its temporaries stay cached per stream: see transport.cuda).
_GPU_TRANSPOSE_MAX = 64 << 20


class SafetensorsReader:
    """Reads one safetensors file key by key, slice by slice, or many keys at once; counts every byte.

    The file is opened once, here, and the header and every tensor are read through that descriptor (``pread``:
    threads share it), so one reader sees one file even if its path is replaced meanwhile. Close the reader
    (``close()``, or use it as a context manager) when the load is done; it is closed when collected otherwise.
    ``read_many`` reads runs of adjacent tensors with one ``preadv`` each, which matters for MoE adapters with
    tens of thousands of small tensors.

    Args:
        path: the ``.safetensors`` file.
        header: a header [`read_header`] parsed; used only if it was read from the file opened here (else the
            header is read again, through the descriptor).
        stats: counts bytes and tensors read (header bytes included).
        roots: real folders the file must lie in (`open_confined`: checked race-free, then opened).

    Raises:
        [`AdapterFormatError`]: the header is invalid.
        [`AdapterAccessError`]: with ``roots``, the file's real path is outside them.
    """

    def __init__(self, path: str | os.PathLike[str], *, header: FileHeader | None = None,
                 stats: ReadStats | None = None, roots: Sequence[str] | None = None) -> None:
        self.path = Path(path)
        self._fd = -1
        fd = open_confined(self.path, roots)
        try:
            if header is None or header.stamp is None or header.stamp != file_stamp(os.fstat(fd)):
                header = read_header(self.path, fd=fd)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self.header = header
        self.stats = stats if stats is not None else ReadStats()
        self.stats.bytes_read += self.header.header_bytes
        self.stats.files.append(str(self.path))

    def fileno(self) -> int:
        """Return the descriptor every read goes through."""
        if self._fd < 0:
            raise ValueError(f"the reader of {str(self.path)!r} is closed")
        return self._fd

    def close(self) -> None:
        """Close the file (reads after this raise ``ValueError``)."""
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()

    def check_unchanged(self) -> None:
        """Refuse a file written over in place while it was read (its size or modification time changed since the
        header was read): the bytes read may mix two versions. (A file replaced at its path is another file, never
        read here.)

        Raises:
            [`AdapterFormatError`]: the file changed.
        """
        if self.header.stamp is not None and file_stamp(os.fstat(self.fileno())) != self.header.stamp:
            raise AdapterFormatError(f"{str(self.path)!r} was written over while it was being read, so the tensors "
                                     f"read may mix two versions of it. Load it again once it is written; deploy "
                                     f"adapter files by writing a new file and renaming it over the old one.")

    def read(self, key: str, ranges: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
        """Read one tensor, or only the ``(dim, start, stop)`` ranges of it (concatenated along ``dim``).

        Raises:
            [`AdapterFormatError`]: the file has no such tensor, or ends before it does.
            ValueError: the ranges name more than one dim, or a dim the tensor lacks.
        """
        if key not in self.header.offsets:
            raise AdapterFormatError(f"{str(self.path)!r} has no tensor {key!r}.", key=key)
        dt = torch_dtype_of(self.header.dtypes[key], key=key)
        if ranges:
            return _read_ranges(self, key, dt, ranges)
        out = torch.empty(tuple(self.header.shapes[key]), dtype=dt)
        if out.numel():
            raw = memoryview(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
            _preadv_exactly(self.fileno(), [raw], self.header.offsets[key][0], path=self.path, key=key)
        self.stats.count(self.header.nbytes[key], 1)
        return out

    def read_many(self, keys: Sequence[str], *, copy: bool = True,
                  into: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Read whole tensors for many keys with one ``pread`` per run of adjacent tensors.

        Requested tensors that lie next to each other in the file are read as one span into a
        buffer; each result is a view of its span. With ``copy=False`` the views are returned as
        they are (the caller copies them, e.g. by stacking, and the span is freed with the last
        view); with ``copy=True`` each result owns exactly its own memory. With ``into(shape, dtype)``,
        each span is read into the memory it gives (a host arena) and the views are kept, whatever
        ``copy`` says. Only requested bytes are read, so ``stats.bytes_read`` is exact.
        """
        keys = list(keys)
        if not keys:
            return {}
        offsets = self.header.offsets
        order = sorted(keys, key=lambda k: offsets[k][0])
        spans: list[list[str]] = []
        for key in order:
            if spans and offsets[spans[-1][-1]][1] == offsets[key][0]:
                spans[-1].append(key)
            else:
                spans.append([key])
        out: dict[str, torch.Tensor] = {}
        fd = self.fileno()
        for span in spans:
            start, end = offsets[span[0]][0], offsets[span[-1]][1]
            buf = into((end - start,), torch.uint8) if into is not None else torch.empty(end - start,
                                                                                           dtype=torch.uint8)
            _preadv_exactly(fd, [memoryview(buf.numpy())], start, path=self.path, key=span[0])  # type: ignore[arg-type]
            self.stats.count(end - start)
            for key in span:
                a, b = offsets[key]
                dt = torch_dtype_of(self.header.dtypes[key], key=key)
                shape = self.header.shapes[key]
                t = buf[a - start:b - start]
                if (a - start) % dt.itemsize:  # unaligned inside the span: copy the bytes out first
                    t = t.clone()
                try:
                    t = t.view(dt).view(shape)
                except RuntimeError as err:  # e.g. [2^63-1, ..., 0]: no bytes, yet no size torch can count
                    raise AdapterFormatError(f"{str(self.path)!r}: tensor {key!r} has shape {list(shape)}, which "
                                             f"torch cannot hold ({err}). Re-save the file.", key=key) from None
                out[key] = t.clone() if copy and into is None else t
                self.stats.count(tensors=1)
            del buf
        return {k: out[k] for k in keys}

    def read_stacks(self, groups: Sequence[Sequence[str]],
                    into: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None, *,
                    bundle: int = 1) -> list[torch.Tensor | None]:
        """Read groups of same-shape tensors stacked: each result equals ``torch.stack([read(k) for k in group])``.

        Made for per-expert MoE factors (a block's 128 experts × 3 projections × A/B): each tensor's bytes
        are read straight into its row of the stacked result, with one ``preadv`` per run of adjacent
        tensors in the file (``IOV_MAX`` rows at a time). There is no tensor per key and
        no copy after the read, whatever order the file keeps the experts in, whether all experts are read
        or a rank's share of them. ``None`` comes back for a group whose tensors differ in shape or dtype
        (or that is empty), and the caller reads it key by key. ``into(shape, dtype)`` gives the memory a
        stack is written to (default: a new tensor). With ``bundle``, each ``bundle`` consecutive groups (an
        A and its B) are stacked together or not at all, so that ``into`` gives no memory to half a pair.
        Only the bytes of the groups returned are read, each once (a key in two places is copied).

        Raises:
            [`AdapterFormatError`]: the file ends before a tensor does (it is truncated).
        """
        dtypes, shapes, offsets = self.header.dtypes, self.header.shapes, self.header.offsets
        plans: list[tuple[torch.dtype, tuple[int, ...], int] | None] = []
        for group in groups:  # (the header's per-key dicts: no object per key is made here)
            kinds = set(map(dtypes.__getitem__, group))
            forms = set(map(tuple, map(shapes.__getitem__, group)))
            if len(kinds) != 1 or len(forms) != 1:
                plans.append(None)
                continue
            (dtype,), (shape,) = kinds, forms
            dt = torch_dtype_of(dtype, key=group[0])
            plans.append((dt, shape, math.prod(shape) * dt.itemsize))
        results: list[torch.Tensor | None] = [None] * len(groups)
        live = [g for g in range(len(groups)) if all(m < len(plans) and plans[m] is not None
                                                     for m in range(g - g % bundle, g - g % bundle + bundle))]
        if not live:
            return results
        targets: list[tuple[int, int, memoryview]] = []  # (file start, file end, where its bytes go)
        for g in live:
            dt, shape, nbytes = plans[g]  # type: ignore[misc]
            n = len(groups[g])
            out = into((n, *shape), dt) if into is not None else torch.empty((n, *shape), dtype=dt)
            results[g] = out
            if nbytes == 0:
                continue
            rows = memoryview(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
            for i, key in enumerate(groups[g]):
                a, b = offsets[key]
                targets.append((a, b, rows[i * nbytes:(i + 1) * nbytes]))
            self.stats.count(tensors=n)
        targets.sort(key=operator.itemgetter(0))
        runs: list[tuple[int, list[memoryview]]] = []  # (file start, destinations back to back in the file)
        copies: list[tuple[memoryview, memoryview]] = []  # a key asked for again: (destination, first copy)
        end = -1
        for a, b, dest in targets:
            if a < end:  # the same key again (tensors do not overlap, read_header checks)
                copies.append((dest, runs[-1][1][-1]))
            elif a == end:
                runs[-1][1].append(dest)
            else:
                runs.append((a, [dest]))
            end = max(end, b)
        fd = self.fileno()
        for start, dests in runs:
            self.stats.count(_preadv_exactly(fd, dests, start, path=self.path))
        for dest, origin in copies:
            dest[:] = origin
        return results

    def _blocks_of_rows(self, key: str, rows: int, row_bytes: int) -> Generator[tuple[int, torch.Tensor], None, None]:
        """Yield ``(first row, its block's bytes)`` for ``key``'s rows, `_GATHER_BLOCK` bytes of whole rows at a time,
        each block read with ``preadv`` into one reused buffer (valid until the next block); close it when done.

        Raises:
            [`AdapterFormatError`]: the file ends before the tensor does (it is truncated).
        """
        start = self.header.offsets[key][0]
        per = min(rows, max(1, _GATHER_BLOCK // row_bytes))
        scratch = torch.empty(per * row_bytes, dtype=torch.uint8)
        view = memoryview(scratch.numpy())  # type: ignore[arg-type]  # an ndarray is a buffer
        fd = self.fileno()
        for i in range(0, rows, per):
            n = min(per, rows - i)
            _preadv_exactly(fd, [view[:n * row_bytes]], start + i * row_bytes, path=self.path, key=key)
            yield i, scratch[:n * row_bytes]

    def _transposed_on(self, device: torch.device, key: str, out: torch.Tensor, rows: int, cols: int,
                       scale: float | None) -> bool:
        """`read_transposed` on a CUDA ``device``, into ``out`` ``(cols, rows)``; ``False`` (``out`` unspecified)
        where the GPU lacks the memory, for the CPU to do it instead."""
        nbytes = out.numel() * out.element_size()
        if nbytes > _GPU_TRANSPOSE_MAX:
            return False
        from vllm_lora_ext.transport.cuda import gpu_free_bytes, turn_on_gpu

        if gpu_free_bytes(device, reuse_cached=False) < 2 * nbytes + _GPU_HEADROOM:
            return False
        raw = out.view(-1).view(torch.uint8)
        _preadv_exactly(self.fileno(), [memoryview(raw.numpy())], self.header.offsets[key][0],  # type: ignore[arg-type]
                        path=self.path, key=key)
        return turn_on_gpu(device, raw, out, rows, cols, scale)

    def gather(self, key: str, pieces: Callable[[torch.Tensor], Sequence[torch.Tensor]],
               into: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None) -> torch.Tensor:
        """Copy some elements of every row of one tensor out of the file: ``torch.cat(pieces(t))``, ``t`` the tensor.

        ``pieces`` takes rows of ``t`` and returns views of them (slices, reshapes, permutes) that keep those
        rows as their second dim: ``pieces(t[i:j])`` is ``[p[:, i:j] for p in pieces(t)]``. The tensor is read
        a block of rows at a time into one small buffer that stays in cache, and each block's pieces are
        copied from there straight to their place in the result (``into(shape, dtype)``'s memory, default a
        new tensor): each element is copied once, and no memory the size of ``t`` is touched.

        Made for a rank's experts of a fused 3D B, whose columns sit in every row in ``(i, e)`` order: one
        copy into ``(e, out, i)`` order instead of reading ``r`` column ranges, concatenating them and
        reordering the result. ``stats`` counts the bytes of the pieces (what is kept).

        Raises:
            [`AdapterFormatError`]: the file ends before the tensor does (it is truncated).
            ValueError: ``pieces`` gives no piece, or one that does not keep the rows as its second dim.
        """
        start, end = self.header.offsets[key]
        dt = torch_dtype_of(self.header.dtypes[key], key=key)
        shape = tuple(self.header.shapes[key])
        if not shape:
            raise ValueError(f"gather needs a tensor with rows; {key!r} is a scalar")
        shapes = [tuple(p.shape) for p in pieces(torch.empty(shape, dtype=dt, device="meta"))]
        if not shapes or any(len(s) < 2 or s[1] != shape[0] or s[2:] != shapes[0][2:] for s in shapes):
            raise ValueError(f"gather: the pieces of {key!r} must keep its {shape[0]} rows as their second dim "
                             f"and agree past it (got {shapes[:4]})")
        offsets = list(itertools.accumulate([0] + [s[0] for s in shapes]))
        out_shape = (offsets[-1], *shapes[0][1:])
        out = into(out_shape, dt) if into is not None else torch.empty(out_shape, dtype=dt)
        rows = shape[0]
        row_bytes = (end - start) // rows if rows else 0
        if row_bytes:
            with contextlib.closing(self._blocks_of_rows(key, rows, row_bytes)) as blocks:
                for i, raw in blocks:
                    block = raw.view(dt).view(-1, *shape[1:])
                    for j, part in enumerate(pieces(block)):
                        out[offsets[j]:offsets[j + 1], i:i + block.shape[0]].copy_(part)
        self.stats.count(math.prod(out_shape) * dt.itemsize, 1)
        return out

    def read_transposed(self, key: str, cols: int, into: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None
                        = None, *, scale: float | None = None, dtype: torch.dtype | None = None,
                        device: torch.device | None = None, lying: bool = False) -> torch.Tensor | None:
        """Read a tensor as the transpose of its bytes taken as a row-major ``(numel // cols, cols)`` matrix.

        Returns ``None`` (nothing read) if ``dtype`` is given and the tensor is stored in another: scaled in its
        own dtype and converted after, it would be rounded twice; the caller reads it another way.

        The result, ``(cols, numel // cols)`` and contiguous, is ``t.reshape(-1, cols).t() * scale`` bit for bit
        (``scale`` multiplies as ``torch.mul`` does, in float32 for 16-bit floats, rounded once). The tensor is
        read a block of rows at a time into a small buffer, each block is transposed in cache (torch's tiled
        transpose), then scaled on its way to the result (``into(shape, dtype)``'s memory, default a new
        tensor): the result is written once, and no memory the size of ``t`` is touched.

        Made for a fused 3D B, stored ``(out, r·E)`` with columns in ``(i, e)`` order: its bytes as an
        ``(out·r, E)`` matrix, transposed, are the ``(E, out, r)`` factors vLLM's MoE layer takes, so the
        read, the reorder and the scaling are one pass instead of three over memory.

        With a CUDA ``device`` (a GPU worker's), the bytes are read as they lie into the result's memory, sent to
        that GPU, transposed and scaled there (``torch.mul`` into a contiguous tensor, the same float32 opmath
        and one rounding) and copied back over them: the same tensor bit for bit. On the CPU this transpose is
        the largest part of a fused 3D adapter's build. The GPU's temporaries are twice the tensor; for a tensor over 64 MiB, where the GPU lacks that much free memory (and 512 MiB), or
        where it runs out, the CPU does it.

        With ``lying``, nothing is turned or scaled: the result holds the tensor's bytes as they lie (a row-major
        ``(numel // cols, cols)`` matrix, read with one ``preadv``) under the result's shape, and the caller turns
        and scales them later (``formats.moe.turn_in_place``, or on a GPU once staged). ``device`` is then unused.

        Raises:
            [`AdapterFormatError`]: the file ends before the tensor does (it is truncated).
            ValueError: ``cols`` does not divide the tensor's elements.
        """
        dt = torch_dtype_of(self.header.dtypes[key], key=key)
        if dtype is not None and dt != dtype:
            return None
        numel = math.prod(self.header.shapes[key])
        if cols <= 0 or numel % cols:
            raise ValueError(f"read_transposed: {cols} columns do not divide the {numel} elements of {key!r}")
        rows = numel // cols
        out = into((cols, rows), dt) if into is not None else torch.empty((cols, rows), dtype=dt)
        if lying:
            if numel:
                raw = memoryview(out.view(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]
                _preadv_exactly(self.fileno(), [raw], self.header.offsets[key][0], path=self.path, key=key)
            self.stats.count(numel * dt.itemsize, 1)
            return out
        if numel and device is not None and self._transposed_on(device, key, out, rows, cols, scale):
            self.stats.count(numel * dt.itemsize, 1, on_gpu=1)
            return out
        if numel:
            turned: torch.Tensor | None = None  # the transposed block, as large as the first (largest) one
            with contextlib.closing(self._blocks_of_rows(key, rows, cols * dt.itemsize)) as blocks:
                for i, raw in blocks:
                    block = raw.view(dt).view(-1, cols)
                    turned = turned if turned is not None else torch.empty(block.numel(), dtype=dt)
                    n = block.shape[0]
                    flat = turned[:n * cols].view(cols, n)
                    flat.copy_(block.t())  # contiguous from a transposed view: torch's tiled transpose
                    if scale is None:
                        out[:, i:i + n].copy_(flat)
                    else:
                        torch.mul(flat, scale, out=out[:, i:i + n])
        self.stats.count(numel * dt.itemsize, 1)
        return out
