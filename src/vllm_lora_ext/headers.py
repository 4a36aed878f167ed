"""Parse and validate a safetensors header: the dtype table, per-key shapes, dtypes and exact byte spans.

A ``.safetensors`` file is an 8-byte little-endian header length, a JSON header
(``{key: {dtype, shape, data_offsets}, "__metadata__": {...}}``) and a byte buffer. The header is parsed here
directly, so shapes, dtypes and byte sizes are known before any tensor is read. [`read_header`] reads it from a path
or from an open file descriptor (the one a [`SafetensorsReader`] then reads the tensors through).
"""

from __future__ import annotations

import itertools
import json
import math
import operator
import os
import struct
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from functools import cache
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple

if TYPE_CHECKING:
    import torch

try:
    import msgspec
except ImportError:  # pragma: no cover - a dependency (`_DECODERS`)
    msgspec = None  # type: ignore[assignment]

from vllm_lora_ext._util import clip, file_stamp, gc_paused, open_confined
from vllm_lora_ext.errors import AdapterFormatError, VllmLoraExtError

__all__ = ["TensorInfo", "FileHeader", "read_header", "may_hold_lora", "file_stamp", "DTYPES", "torch_dtype_of",
           "dtype_by_name", "safetensors_names"]

_MAX_HEADER = 100 * 1024 * 1024  # safetensors' own limit
_MAX_NDIM = 8
_MAX_DIM = (1 << 63) - 1  # torch sizes are int64: a longer dimension cannot be read, even beside a 0


# The one dtype table: safetensors name -> (bits per element, name of the torch dtype, or None where torch has none).
# The torch dtypes themselves are looked up on first use ([`torch_dtype_of`]), so reading headers never imports torch.
DTYPES: dict[str, tuple[int, str | None]] = {
    "BOOL": (8, "bool"), "U8": (8, "uint8"), "I8": (8, "int8"), "I16": (16, "int16"),
    "U16": (16, "uint16"), "I32": (32, "int32"), "U32": (32, "uint32"),
    "I64": (64, "int64"), "U64": (64, "uint64"), "F16": (16, "float16"),
    "BF16": (16, "bfloat16"), "F32": (32, "float32"), "F64": (64, "float64"),
    "C64": (64, "complex64"), "F8_E4M3": (8, "float8_e4m3fn"),
    "F8_E5M2": (8, "float8_e5m2"), "F8_E8M0": (8, "float8_e8m0fnu"),
    "F8_E4M3FNUZ": (8, "float8_e4m3fnuz"), "F8_E5M2FNUZ": (8, "float8_e5m2fnuz"),
    "F6_E2M3": (6, None), "F6_E3M2": (6, None), "F4": (4, None),
}


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    """Safetensors name -> torch dtype, for the [`DTYPES`] entries this torch has; imports torch (once)."""
    import torch

    found = {name: getattr(torch, attr, None) for name, (_, attr) in DTYPES.items() if attr is not None}
    return {name: dt for name, dt in found.items() if dt is not None}


def torch_dtype_of(name: str, *, key: str | None = None) -> torch.dtype:
    """Return the torch dtype of a safetensors dtype name (importing torch on the first call).

    Raises:
        [`AdapterFormatError`]: the name is unknown, or this torch has no such dtype.
    """
    dt = _torch_dtypes().get(name)
    if dt is None:
        raise AdapterFormatError(f"Tensor {key!r} has dtype {name!r}, which this torch cannot read. Re-save the "
                                 f"adapter in bfloat16, float16 or float32.", key=key)
    return dt


@cache
def _by_torch_name() -> dict[str, torch.dtype]:
    """Torch's own name of a dtype (``"bfloat16"``, as [`DTYPES`] holds it) -> the dtype, for the entries of
    [`_torch_dtypes`]."""
    return {DTYPES[name][1]: dt for name, dt in _torch_dtypes().items()}


@cache
def safetensors_names() -> dict[torch.dtype, str]:
    """Torch dtype -> its safetensors name, for tensors that came without a header (a pickle file, a hand-over)."""
    return {dt: st_name for st_name, dt in _torch_dtypes().items()}


def dtype_by_name(name: str) -> torch.dtype:
    """Return the torch dtype of a [`DTYPES`] entry named either way: safetensors' name or torch's.

    Example:
        >>> import torch
        >>> dtype_by_name("BF16") is dtype_by_name("bfloat16") is torch.bfloat16
        True

    Raises:
        [`AdapterFormatError`]: no entry of the table has that name, or this torch has no such dtype.
    """
    if name in DTYPES:
        return torch_dtype_of(name)
    dt = _by_torch_name().get(name)
    if dt is None:
        raise AdapterFormatError(f"Unknown dtype {name!r}: it is neither a safetensors dtype name "
                                 f"({', '.join(DTYPES)}) nor the torch name of one.")
    return dt


class TensorInfo(NamedTuple):
    """One tensor's entry in a safetensors header (a tuple: 37k of them are built per MoE adapter)."""

    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True)
class FileHeader:
    """A parsed safetensors header: per-key shapes, dtypes, sizes and byte ranges in file order, and metadata.

    The maps are plain dicts built in bulk (an MoE adapter has tens of thousands of keys);
    ``tensors`` gives the same facts as one [`TensorInfo`] per key, built on first use.
    """

    path: Path
    shapes: Mapping[str, tuple[int, ...]]
    dtypes: Mapping[str, str]
    nbytes: Mapping[str, int]
    metadata: Mapping[str, str]
    header_bytes: int
    offsets: Mapping[str, tuple[int, int]] = field(default_factory=dict)  # absolute byte ranges in the file
    # (st_dev, st_ino, st_size, st_mtime_ns) of the file the header was read from: a reader given this header
    # reads its tensors only from that same file (`SafetensorsReader`)
    stamp: tuple[int, int, int, int] | None = None
    # (header bytes, file size) of a header large enough to keep (see `_KEEP_MIN_BYTES`): headers with equal tokens
    # have equal entries, so what is planned from one holds for the other (``building``'s kept plan)
    token: tuple[bytes, int] | None = field(default=None, compare=False, repr=False)

    @property
    def tensors(self) -> Mapping[str, TensorInfo]:
        """Return ``{key: TensorInfo}`` in file order."""
        cached = self.__dict__.get("_tensors")
        if cached is None:
            cached = {k: TensorInfo(d, s, n) for (k, s), d, n in
                      zip(self.shapes.items(), self.dtypes.values(), self.nbytes.values())}
            object.__setattr__(self, "_tensors", cached)
        return cached

    @property
    def total_bytes(self) -> int:
        """Return the bytes of all tensors (without the header)."""
        return sum(self.nbytes.values())


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {clip(dup)!r}")
    return out


def read_header(path: str | os.PathLike[str], *, fd: int | None = None) -> FileHeader:
    """Parse and validate a safetensors header without reading any tensor data.

    The header is checked as strictly as safetensors checks it, before any offset is trusted or
    any memory is sized from it: a JSON object with no duplicate keys; string ``__metadata__``;
    for every tensor a known dtype, a shape of at most 8 non-negative integers and two integer
    ``data_offsets``; ``shape × dtype`` equal to its byte span; spans that start at 0, follow each
    other with no gap or overlap, and end exactly at the end of the file.

    Args:
        path: the file (named in messages; opened only when no ``fd`` is given).
        fd: a descriptor of the file open for reading, to read the header through it (``pread``: its offset is
            not moved). The tensors read through the same descriptor then come from the same file, even if its
            path is replaced meanwhile.

    Raises:
        [`AdapterFormatError`]: the file is not a valid safetensors file; the message names the entry.
    """
    with gc_paused():  # tens of thousands of small objects: no heap walks in between
        if fd is not None:
            return _read_header(path, fd)
        own = os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        try:
            return _read_header(path, own)
        finally:
            os.close(own)


def may_hold_lora(path: str | os.PathLike[str], roots: Sequence[str] | None) -> bool:
    """Whether a safetensors file's header may name a LoRA factor, for a hint: up to its first MiB of header is
    searched for ``lora_``, neither parsed nor kept. The file is opened as a load opens it (`open_confined`: a
    regular file within ``roots``, never waiting on a FIFO); one that cannot be opened counts as one."""
    try:
        fd = open_confined(path, roots)
    except (VllmLoraExtError, OSError):
        return True
    try:
        head = _pread_upto(fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        return b"lora_" in _pread_upto(fd, min(n, 1 << 20), 8)
    except OSError:
        return True
    finally:
        os.close(fd)


def _pread_upto(fd: int, n: int, offset: int) -> bytes:
    """Read up to ``n`` bytes at ``offset`` (fewer only at the end of the file)."""
    parts: list[bytes] = []
    got = 0
    while got < n:
        part = os.pread(fd, n - got, offset + got)
        if not part:
            break
        parts.append(part)
        got += len(part)
    return b"".join(parts)


def _read_header(path: str | os.PathLike[str], fd: int) -> FileHeader:
    """Parse and validate (see `read_header`)."""
    p = Path(path)
    where = str(p)
    st = os.fstat(fd)
    size = st.st_size
    head = _pread_upto(fd, 8, 0)
    if len(head) != 8:
        raise AdapterFormatError(f"{where!r} is not a safetensors file (shorter than 8 bytes). Re-download or "
                                 f"re-save it.")
    (n,) = struct.unpack("<Q", head)
    if n > _MAX_HEADER or 8 + n > size:
        raise AdapterFormatError(f"{where!r} declares a {n}-byte header but the file has {size} bytes (limit "
                                 f"100 MB); it is truncated, corrupt or not safetensors. Re-download it.")
    blob = _pread_upto(fd, n, 8)
    if len(blob) != n:
        raise AdapterFormatError(f"{where!r} is truncated inside its header. Re-download it.")
    base = 8 + n
    kept = _kept_header(blob, size)
    if kept is not None:  # the same bytes in a file of the same size: the same entries, checked the same way
        return _with_own_maps(kept, path=p, stamp=file_stamp(st))
    # (refused in bulk, or no msgspec: parsed and checked entry by entry, which names what is wrong)
    checked = _check_header_in_bulk(blob, size - base) or _check_header_one_by_one(blob, where, base, size)
    (keys, dtypes, shapes, starts, sizes), meta = checked
    if _has_unicode_escape(blob):  # it may spell a lone surrogate: no UTF-8 text, which safetensors refuses
        _refuse_surrogates(itertools.chain(keys, meta, meta.values()), where)
    # the spans follow each other (both checks saw to it): each ends where the next starts, the last at the file's end
    firsts = list(map(operator.add, starts, itertools.repeat(base)))
    header = FileHeader(path=p, shapes=dict(zip(keys, shapes)), dtypes=dict(zip(keys, dtypes)),
                        nbytes=dict(zip(keys, sizes)), metadata=dict(meta), header_bytes=base,
                        offsets=dict(zip(keys, zip(firsts, [*firsts[1:], size]))), stamp=file_stamp(st),
                        token=(blob, size) if _keepable(blob) else None)
    _keep_header(blob, size, header)
    return header


# The header parsed last, by its exact bytes and its file's size: adapters of one shape and config (a server's new
# adapter and the one before it) have byte-identical headers, and a 48-layer MoE adapter's takes 0.1 s to parse and
# check. Only valid headers are kept (a refusal raises before), each entry's maps copied out to its caller; the key is
# the bytes themselves (compared in full on a hit), not a digest of them.
_KEPT_HEADERS: OrderedDict[tuple[bytes, int], FileHeader] = OrderedDict()
_KEPT_LOCK = threading.Lock()
_KEEP_HEADERS = 1  # the last one: a parsed 5 MiB header (36,864 keys) holds about 30 MB
_KEEP_MIN_BYTES = 64 << 10  # about 800 keys: smaller headers parse in well under a millisecond
_KEEP_MAX_BYTES = 8 << 20  # about 100,000 keys: larger ones are not held in memory


def _with_own_maps(header: FileHeader, **changes: Any) -> FileHeader:
    """``header`` with ``changes`` and copies of its maps, which its holder may change without touching the kept one."""
    return replace(header, shapes=dict(header.shapes), dtypes=dict(header.dtypes), nbytes=dict(header.nbytes),
                   metadata=dict(header.metadata), offsets=dict(header.offsets), **changes)


def _keepable(blob: bytes) -> bool:
    return _KEEP_MIN_BYTES <= len(blob) <= _KEEP_MAX_BYTES


def _kept_header(blob: bytes, size: int) -> FileHeader | None:
    if not _keepable(blob):
        return None
    with _KEPT_LOCK:
        found = _KEPT_HEADERS.get((blob, size))
        if found is not None:
            _KEPT_HEADERS.move_to_end((blob, size))
        return found


def _keep_header(blob: bytes, size: int, header: FileHeader) -> None:
    if not _keepable(blob):
        return
    kept = _with_own_maps(header)
    with _KEPT_LOCK:
        _KEPT_HEADERS[(blob, size)] = kept
        while len(_KEPT_HEADERS) > _KEEP_HEADERS:
            _KEPT_HEADERS.popitem(last=False)


def _has_unicode_escape(blob: bytes) -> bool:
    """Whether the header's text holds a ``\\u`` escape (a search for the backslash alone first, which is far
    quicker and finds none in most headers)."""
    return b"\\" in blob and b"\\u" in blob


def _refuse_surrogates(texts: Any, where: str) -> None:
    for text in texts:
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            shown = clip(text.encode("utf-8", "replace").decode())
            raise AdapterFormatError(f"{where!r}: header name {shown!r} holds an unpaired surrogate escape (shown as "
                                     f"'?'), which is no UTF-8 text. Re-save the file.", key=shown) from None


_Entries = tuple[list[str], list[str], list[tuple[int, ...]], list[int], list[int]]  # keys, dtypes, shapes, starts,
# and sizes (bytes), in file order
_BITS = {name: bits for name, (bits, _) in DTYPES.items()}


# msgspec decoders of a safetensors header: every entry into a typed struct, and ``__metadata__`` alone. The types are
# the header's rules that a decoder checks in C as it parses: a dtype the table names, a shape of at most 8 non-negative
# integers below 2^63, exactly two non-negative integer offsets, metadata that maps strings to strings (msgspec
# decodes strictly: ``bool`` and ``float`` are not integers). Fields default to ``None`` so that ``__metadata__``
# decodes as an entry too (its strings are unknown fields, skipped); a real entry that lacks one is refused after. A
# dtype decodes as the table's own string (one object per name, not one per entry).
# Without msgspec (vLLM depends on it; so does this package) headers are parsed entry by entry.
if msgspec is not None:
    _Count = Annotated[int, msgspec.Meta(ge=0)]
    _Dim = Annotated[int, msgspec.Meta(ge=0, le=_MAX_DIM)]

    class _Entry(msgspec.Struct, gc=False):
        dtype: Literal[tuple(DTYPES)] | None = None  # type: ignore[valid-type]
        shape: Annotated[tuple[_Dim, ...], msgspec.Meta(max_length=_MAX_NDIM)] | None = None
        data_offsets: tuple[_Count, _Count] | None = None

    class _Metadata(msgspec.Struct, gc=False):
        metadata: dict[str, str] | None = msgspec.field(default=None, name="__metadata__")

    _DECODERS: tuple[Any, Any] | None = (msgspec.json.Decoder(dict[str, _Entry]), msgspec.json.Decoder(_Metadata))
else:  # pragma: no cover
    _DECODERS = None

_DTYPE = operator.attrgetter("dtype")
_SHAPE = operator.attrgetter("shape")
_OFFSETS = operator.attrgetter("data_offsets")
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)


def _one_of_each_field(blob: bytes, entries: int, objects: int) -> bool:
    """Whether the header's text names "dtype", "shape" and "data_offsets" once per entry of its parse, and holds
    as many braces as the parse accounts for (``objects``: the header, its entries, a metadata object, and the
    braces inside its names and metadata texts).

    A duplicate key collapses entries silently (the last wins) in json and in msgspec alike. Each entry names
    each field once, so unequal counts (cheap, in C) send the header through the slow parse that finds and names
    the duplicate (a metadata value mentioning those words only costs that parse). A duplicate whose first value
    names none of the fields (``{}``) leaves those counts equal; its brace does not.
    """
    if _has_unicode_escape(blob):  # a field name spelled with escapes ("\u0064type") escapes the counts
        return False  # (the slow parse reads it)
    return (blob.count(b'"dtype"') == blob.count(b'"shape"') == blob.count(b'"data_offsets"') == entries
            and blob.count(b"{") == objects)


def _check_header_in_bulk(blob: bytes, data_bytes: int) -> tuple[_Entries, dict[str, str]] | None:
    """Parse and validate a header's JSON with typed decoding and list-wide operations; return its entries sorted
    by offset and its metadata, or ``None`` if anything is off (or msgspec is missing).

    The same rules as `_check_header_one_by_one`, which runs instead on ``None`` to name what is wrong, and which
    alone decides the few headers json reads and msgspec does not (a lone surrogate in a key, ``"__metadata__":
    0``). msgspec checks the types while it parses (`_DECODERS`); what is left is a few C-level passes over
    lists, about half the time of ``json.loads`` and the same checks on its dicts.
    """
    if _DECODERS is None:
        return None
    entries_of, metadata_of = _DECODERS
    try:
        decoded = entries_of.decode(blob)
        meta = metadata_of.decode(blob).metadata if "__metadata__" in decoded else None
    except (ValueError, RecursionError):  # msgspec's DecodeError and ValidationError are ValueErrors; deep nesting
        return None
    decoded.pop("__metadata__", None)
    objects = 1 + len(decoded) + (meta is not None)  # the header's, each entry's and a metadata object's braces
    if blob.count(b"{") != objects:  # and those in names and metadata texts (no escapes: _one_of_each_field)
        in_texts = sum(k.count("{") for k in decoded)
        objects += in_texts + sum(k.count("{") + v.count("{") for k, v in (meta or {}).items())
    if not _one_of_each_field(blob, len(decoded), objects):  # a duplicate key: named by the entry-by-entry parse
        return None
    entries = list(decoded.values())
    dtypes = list(map(_DTYPE, entries))
    shapes = list(map(_SHAPE, entries))
    offs = list(map(_OFFSETS, entries))
    try:  # (an entry without one of its fields has None there: a KeyError or a TypeError)
        bits = list(map(_BITS.__getitem__, dtypes))  # (or an unknown dtype)
        starts = list(map(_FIRST, offs))
        ends = list(map(_SECOND, offs))
        numels = list(map(math.prod, shapes))
    except (KeyError, TypeError):
        return None
    sizes = list(map(operator.sub, ends, starts))
    smallest = min(sizes) if sizes else 0
    if smallest < 0 or not _sizes_fit(numels, bits, sizes):
        return None
    keys = list(decoded)
    # every span starting where the one before ends and none empty: the starts rise strictly, in file order already
    in_order = smallest > 0 and starts[1:] == ends[:-1]
    if not in_order and (starts != sorted(starts) or len(set(starts)) != len(starts)):  # (or empty tensors)
        spans = sorted(zip(starts, ends, keys, range(len(entries))))
        idx = [x[3] for x in spans]
        keys, dtypes, shapes = [x[2] for x in spans], [dtypes[i] for i in idx], [shapes[i] for i in idx]
        starts, ends, sizes = [x[0] for x in spans], [x[1] for x in spans], [sizes[i] for i in idx]
    if (starts and starts[0] != 0) or starts[1:] != ends[:-1] or (ends[-1] if ends else 0) != data_bytes:
        return None
    return (keys, dtypes, shapes, starts, sizes), meta or {}


def _sizes_fit(numels: list[int], bits: list[int], sizes: list[int]) -> bool:
    """Whether each entry's elements times its dtype's bits are its span's bytes times 8 (one multiplication an
    entry where all have one dtype of whole bytes)."""
    if bits and bits[0] % 8 == 0 and bits.count(bits[0]) == len(bits):
        return list(map(operator.mul, numels, itertools.repeat(bits[0] // 8))) == sizes
    return list(map(operator.mul, numels, bits)) == list(map(operator.mul, sizes, itertools.repeat(8)))


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # json takes NaN and Infinity; JSON and safetensors do not


def _check_header_one_by_one(blob: bytes, where: str, base: int, size: int) -> tuple[_Entries, dict[str, str]]:
    """Parse the header with json and validate entry by entry; return what `_check_header_in_bulk` returns, or
    raise [`AdapterFormatError`] naming what is wrong."""
    try:
        # Every header here was refused by the bulk parse (or msgspec is missing): read it through the hook that
        # finds and names a duplicate key, whatever its first value is (a number, null, {}).
        if blob.startswith(b"\xef\xbb\xbf"):  # json reads past a byte-order mark; safetensors does not
            raise ValueError("it starts with a byte-order mark")
        raw = json.loads(blob, object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise AdapterFormatError(f"{where!r} has a header that is not valid JSON ({clip(str(err))}); not a "
                                 f"safetensors file.") from None
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{where!r} has a header that is not a JSON object; not a safetensors file.")
    meta = raw.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise AdapterFormatError(f"{where!r}: '__metadata__' must map strings to strings. Re-save the file.")
    return _check_entries_one_by_one(raw, where, base, size), dict(meta)


def _check_entries_one_by_one(raw: dict[str, Any], where: str, base: int, size: int) -> _Entries:
    """Validate entry by entry and raise [`AdapterFormatError`] naming the first bad one."""
    spans: list[tuple[int, int, str, str, tuple[int, ...]]] = []
    for key, entry in raw.items():
        try:
            dtype, shape, (start, end) = entry["dtype"], entry["shape"], entry["data_offsets"]
            bits = DTYPES[dtype][0]
        except (TypeError, KeyError, ValueError):
            raise AdapterFormatError(f"{where!r}: header entry {clip(key)!r} is malformed or has an unknown dtype "
                                     f"({str(entry)[:120]}); it needs a known 'dtype', 'shape' and two "
                                     f"'data_offsets'. Re-save the file.", key=clip(key)) from None
        numel = 1
        ok = type(start) is int and type(end) is int and 0 <= start <= end and type(shape) is list \
            and len(shape) <= _MAX_NDIM
        if ok:
            for d in shape:
                if type(d) is not int or not 0 <= d <= _MAX_DIM:
                    ok = False
                    break
                numel *= d
        if not ok:
            raise AdapterFormatError(f"{where!r}: header entry {clip(key)!r} has an invalid shape or offsets "
                                     f"({str(entry)[:120]}). Re-save the file.", key=clip(key))
        if numel * bits != (end - start) * 8:
            raise AdapterFormatError(f"{where!r}: tensor {clip(key)!r} declares shape {shape} of {dtype} "
                                     f"({numel * bits // 8} bytes) but spans {end - start} bytes. Re-save the file.",
                                     key=clip(key))
        spans.append((start, end, key, dtype, tuple(shape)))
    spans.sort()
    expected = 0
    for start, end, key, _, _ in spans:
        if start != expected:
            what = "overlaps the tensor before it" if start < expected else "leaves a gap before it"
            raise AdapterFormatError(f"{where!r}: tensor {clip(key)!r} at byte {start} {what} (expected {expected}). "
                                     f"Re-save the file.", key=clip(key))
        expected = end
    if base + expected != size:
        raise AdapterFormatError(f"{where!r}: its tensors end at byte {base + expected} but the file has {size} "
                                 f"bytes; it is truncated or has trailing data. Re-download it.")
    return ([x[2] for x in spans], [x[3] for x in spans], [x[4] for x in spans], [x[0] for x in spans],
            [x[1] - x[0] for x in spans])
