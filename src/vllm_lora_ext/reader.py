"""Read adapter weight files: headers without tensors, then only the requested keys and row/column slices.

A ``.safetensors`` file is an 8-byte little-endian header length, a JSON header
(``{key: {dtype, shape, data_offsets}, "__metadata__": {...}}``) and a byte buffer. The header is
parsed here directly, so shapes, dtypes and byte sizes are known before any tensor is read.
Tensors are read with ``safetensors.safe_open``; slices go through ``get_slice`` so that only the
requested rows/columns are copied. Every read is counted in a [`ReadStats`].
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from vllm_lora_ext.errors import AdapterFormatError

__all__ = ["TensorInfo", "FileHeader", "ReadStats", "SafetensorsReader", "read_header", "read_tensors", "load_pickle_tensors"]

_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FileHeader:
    """A parsed safetensors header: tensor infos in file order, metadata, header size."""

    path: Path
    tensors: Mapping[str, TensorInfo]
    metadata: Mapping[str, str]
    header_bytes: int
    offsets: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # absolute byte ranges in the file

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Return ``{key: shape}``."""
        return {k: v.shape for k, v in self.tensors.items()}

    @property
    def total_bytes(self) -> int:
        """Return the bytes of all tensors (without the header)."""
        return sum(v.nbytes for v in self.tensors.values())


@dataclass
class ReadStats:
    """Bytes and tensors actually read from disk (header bytes included)."""

    bytes_read: int = 0
    tensors_read: int = 0
    files: list[str] = field(default_factory=list)


def read_header(path: str | os.PathLike[str]) -> FileHeader:
    """Parse a safetensors header without reading any tensor data.

    Raises:
        [`AdapterFormatError`]: the file is truncated, its header is not JSON, or exceeds 100 MB.
    """
    p = Path(path)
    with p.open("rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise AdapterFormatError(f"{str(p)!r} is not a safetensors file (shorter than 8 bytes). Re-download or re-save it.")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER:
            raise AdapterFormatError(f"{str(p)!r} declares a {n}-byte header (limit 100 MB); it is corrupt or not safetensors.")
        blob = f.read(n)
    if len(blob) != n:
        raise AdapterFormatError(f"{str(p)!r} is truncated inside its header. Re-download it.")
    try:
        raw = json.loads(blob)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise AdapterFormatError(f"{str(p)!r} has a header that is not JSON ({err}); not a safetensors file.") from err
    meta = raw.pop("__metadata__", None) or {}
    infos: dict[str, TensorInfo] = {}
    offsets: dict[str, tuple[int, int]] = {}
    base = 8 + n
    for key, entry in sorted(raw.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        start, end = entry["data_offsets"]
        infos[key] = TensorInfo(dtype=entry["dtype"], shape=tuple(entry["shape"]), nbytes=end - start)
        offsets[key] = (base + start, base + end)
    size = p.stat().st_size
    if infos and 8 + n + max(e["data_offsets"][1] for e in raw.values()) > size:
        raise AdapterFormatError(f"{str(p)!r} is truncated: its header points past the end of the file. Re-download it.")
    return FileHeader(path=p, tensors=infos, metadata={str(k): str(v) for k, v in meta.items()}, header_bytes=8 + n,
                      offsets=offsets)



def read_tensors(
    path: str | os.PathLike[str],
    keys: Iterable[str] | None = None,
    *,
    slices: Mapping[str, Sequence[tuple[int, int, int]]] | None = None,
    stats: ReadStats | None = None,
    header: FileHeader | None = None,
) -> dict[str, torch.Tensor]:
    """Read the named tensors (all if ``keys`` is None), each fully or as a union of slices.

    Args:
        path: the ``.safetensors`` file.
        keys: which tensors to read, in this order.
        slices: for some keys, a list of ``(dim, start, stop)`` ranges; the tensor returned is the
            concatenation of those ranges along ``dim`` (all ranges of one key share one ``dim``),
            read through ``get_slice`` so that no other rows or columns are copied.
        stats: counts bytes and tensors read.
        header: a header already parsed by [`read_header`].

    Returns:
        ``{key: tensor}`` in the order of ``keys``; tensors own their memory (no mmap views).
    """
    from safetensors import safe_open

    hdr = header or read_header(path)
    wanted = list(hdr.tensors) if keys is None else list(keys)
    missing = [k for k in wanted if k not in hdr.tensors]
    if missing:
        raise AdapterFormatError(f"{str(path)!r} has no tensor {missing[0]!r} ({len(missing)} missing).", key=missing[0])
    out: dict[str, torch.Tensor] = {}
    slices = slices or {}
    if stats is not None:
        stats.bytes_read += hdr.header_bytes
        stats.files.append(str(path))
    with safe_open(str(path), framework="pt") as f:
        for key in wanted:
            info = hdr.tensors[key]
            ranges = slices.get(key)
            if ranges is None:
                t = f.get_tensor(key)
                nbytes = info.nbytes
            else:
                t, nbytes = _read_ranges(f.get_slice(key), info, ranges)
            out[key] = t
            if stats is not None:
                stats.bytes_read += nbytes
                stats.tensors_read += 1
    return out


def _read_ranges(sl: object, info: TensorInfo, ranges: Sequence[tuple[int, int, int]]) -> tuple[torch.Tensor, int]:
    dims = {d for d, _, _ in ranges}
    if len(dims) != 1:
        raise ValueError("all ranges of one tensor must share one dim")
    (dim,) = dims
    parts = []
    elem = _DTYPE_BYTES.get(info.dtype, 2)
    other = 1
    for i, s in enumerate(info.shape):
        if i != dim:
            other *= s
    nbytes = 0
    for _, start, stop in ranges:
        index = tuple([slice(None)] * dim + [slice(start, stop)])
        parts.append(sl[index])  # type: ignore[index]
        nbytes += (stop - start) * other * elem
    t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    return t.contiguous(), nbytes


def load_pickle_tensors(path: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Load a pickle weight file with ``torch.load(weights_only=True)`` (only after the user opted in)."""
    obj = torch.load(str(path), map_location="cpu", weights_only=True)
    if not isinstance(obj, dict) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise AdapterFormatError(f"{str(path)!r} does not hold a flat dict of tensors.")
    return dict(obj)


_TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                 "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                 "BOOL": torch.bool}


_ITEMSIZE = {dt: torch.empty((), dtype=dt).element_size() for dt in _TORCH_DTYPES.values()}


class SafetensorsReader:
    """Reads one safetensors file key by key, slice by slice, or many keys at once; counts every byte.

    ``read_many`` reads runs of adjacent tensors with one ``pread`` each (no per-key file open), which
    matters for MoE adapters with tens of thousands of small tensors. No file stays open between calls.
    """

    def __init__(self, path: str | os.PathLike[str], *, header: FileHeader | None = None,
                 stats: ReadStats | None = None) -> None:
        self.path = Path(path)
        self.header = header or read_header(self.path)
        self.stats = stats if stats is not None else ReadStats()
        self.stats.bytes_read += self.header.header_bytes
        self.stats.files.append(str(self.path))

    def read(self, key: str, ranges: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
        """Read one tensor, or only the ``(dim, start, stop)`` ranges of it (concatenated along ``dim``)."""
        local = ReadStats()
        t = read_tensors(self.path, [key], slices={key: ranges} if ranges else None, stats=local, header=self.header)
        self.stats.bytes_read += local.bytes_read - self.header.header_bytes  # the header was counted once
        self.stats.tensors_read += local.tensors_read
        return t[key]

    def read_many(self, keys: Sequence[str], *, copy: bool = True) -> dict[str, torch.Tensor]:
        """Read whole tensors for many keys with one ``pread`` per run of adjacent tensors.

        Requested tensors that lie next to each other in the file are read as one span into a
        buffer; each result is a view of its span. With ``copy=False`` the views are returned as
        they are (the caller copies them, e.g. by stacking, and the span is freed with the last
        view); with ``copy=True`` each result owns exactly its own memory. Only requested bytes are
        read, so ``stats.bytes_read`` is exact.
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
        fd = os.open(self.path, os.O_RDONLY)
        try:
            for span in spans:
                start, end = offsets[span[0]][0], offsets[span[-1]][1]
                buf = torch.empty(end - start, dtype=torch.uint8)
                view = memoryview(buf.numpy())  # type: ignore[arg-type]  # ndarray is a buffer
                got = 0
                while got < end - start:
                    n = os.preadv(fd, [view[got:]], start + got)
                    if n <= 0:
                        raise AdapterFormatError(f"{str(self.path)!r} ended early while reading {span[0]!r}; "
                                                 f"the file is truncated. Re-download it.", key=span[0])
                    got += n
                self.stats.bytes_read += end - start
                for key in span:
                    info = self.header.tensors[key]
                    a, b = offsets[key]
                    dt = _TORCH_DTYPES[info.dtype]
                    if (a - start) % _ITEMSIZE[dt]:  # unaligned inside the span: copy the bytes out first
                        t = buf[a - start:b - start].clone().view(dt).view(info.shape)
                    else:
                        t = buf[a - start:b - start].view(dt).view(info.shape)
                    out[key] = t.clone() if copy else t
                    self.stats.tensors_read += 1
                del buf, view
        finally:
            os.close(fd)
        return {k: out[k] for k in keys}
