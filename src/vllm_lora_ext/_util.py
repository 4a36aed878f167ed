"""Small helpers shared by the core (no vLLM, no torch)."""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import os
import re
import reprlib
import stat
import threading
from collections.abc import Iterator, Sequence
from typing import Any

from vllm_lora_ext.errors import AdapterAccessError, AdapterFormatError, SettingsError

_REPR = reprlib.Repr()
_REPR.maxstring = 80
_REPR.maxother = 80
_REPR.maxlist = _REPR.maxtuple = _REPR.maxdict = _REPR.maxset = 6
_REPR.maxlevel = 3


def read_capped(path: str | os.PathLike[str], limit: int, *,
                roots: Sequence[str] | None = None) -> tuple[bytes, bool]:
    """Read at most ``limit + 1`` bytes of a file; return them and whether the file is larger than ``limit``.

    With ``roots``, the file is opened with `open_confined` (its real path must lie in one of them).
    """
    with os.fdopen(open_confined(path, roots), "rb") as f:
        data = f.read(limit + 1)
    return data, len(data) > limit


def read_json_capped(path: str | os.PathLike[str], limit: int, what: str, *, fix: str,
                     roots: Sequence[str] | None = None, adapter: str | None = None) -> dict[str, Any]:
    """Read a JSON object from a file of at most ``limit`` bytes (with ``roots``: only if its real path lies in one).

    Messages read ``f"{what} {path!r} <problem>; {fix}"``, e.g. ``"Base config '/m/config.json' is not valid JSON
    (...); pass the model's config.json."``.

    Raises:
        [`AdapterFormatError`]: the file is larger than ``limit``, not UTF-8 JSON, or not a JSON object
            (``adapter`` names the adapter).
        [`AdapterAccessError`]: with ``roots``, the file's real path is outside them.
        OSError: the file cannot be read.
    """
    where = f"{what} {str(path)!r}"
    data, too_big = read_capped(path, limit, roots=roots)
    if too_big:
        raise AdapterFormatError(f"{where} is larger than {limit} bytes; {fix}", adapter=adapter, key=None)
    try:
        raw = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise AdapterFormatError(f"{where} is not valid JSON ({clip(str(err))}); {fix}", adapter=adapter,
                                 key=None) from None
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"{where} must be a JSON object; {fix}", adapter=adapter, key=None)
    return raw


SHOWN_CHARS = 200  # a client's or a file's string quoted in an error (a name, a source, a key) is cut here


def clip(text: str) -> str:
    """``text`` cut to what an error quotes of a client's or a file's string (``SHOWN_CHARS``)."""
    return text[:SHOWN_CHARS]


def root_of(real: str, roots: Sequence[str]) -> str | None:
    """Return the root (a real path) that the real path ``real`` lies in, or ``None``."""
    for root in roots:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return root
    return None


def open_confined(path: str | os.PathLike[str], roots: Sequence[str] | None) -> int:
    """Open a file for reading and return its descriptor; with ``roots``, only a file whose real path lies in one.

    The check cannot race the open: the real path (symlinks and ``..`` resolved) is checked, that path is
    opened with ``O_NOFOLLOW``, and the file opened must be the one checked (the same device and inode,
    and, where ``/proc/self/fd`` exists, the same path as the kernel sees it). A symlink swapped in at any
    moment is refused, never read.

    Raises:
        [`AdapterAccessError`]: the real path is outside ``roots``, or the file changed while it was opened.
    """
    flags = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0) | os.O_NONBLOCK  # a FIFO opens at once, never waits
    if roots is None:
        return _regular(os.open(path, flags), path)
    real = os.path.realpath(path)
    if root_of(real, roots) is None:
        raise _outside(path, roots, f"resolves to {short_repr(real)}, which is ")
    before = os.stat(real)
    fd = _regular(os.open(real, flags | getattr(os, "O_NOFOLLOW", 0)), path)
    try:
        after = os.fstat(fd)
        seen = _kernel_path(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or (seen is not None and seen != real):
            raise _outside(path, roots, "changed while it was opened (a link or folder swapped); it may now be ")
    except BaseException:
        os.close(fd)
        raise
    return fd


def file_kind(mode: int) -> str:
    """Name what a file of ``st_mode`` is, for messages: ``"a regular file"``, ``"a folder"``, ``"a FIFO (named
    pipe)"``, ``"a socket"``, ``"a device"`` or ``"not a regular file"``."""
    return ("a regular file" if stat.S_ISREG(mode) else "a folder" if stat.S_ISDIR(mode)
            else "a FIFO (named pipe)" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode)
            else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file")


def _regular(fd: int, path: str | os.PathLike[str]) -> int:
    """Return ``fd``, blocking again, if it is a regular file; else close it and raise ``OSError`` naming the kind."""
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise OSError(errno.EINVAL, f"is {file_kind(mode)}; a regular file is needed", os.fspath(path))
    os.set_blocking(fd, True)
    return fd


def _kernel_path(fd: int) -> str | None:
    """The path the kernel gives an open descriptor (Linux), or ``None`` where it cannot say."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _outside(path: str | os.PathLike[str], roots: Sequence[str], how: str) -> AdapterAccessError:
    shown = os.pathsep.join(roots)
    fix = "Put the adapter under one of them, or load it from the Hub (hf:org/repo)."
    err = AdapterAccessError(f"Adapter file {short_repr(str(path))} {how}outside the folders this server may read "
                             f"(VLLM_LORA_EXT_ALLOWED_ROOTS={shown}). {fix}", source=clip(str(path)), part="path")
    err.public_message = (f"Adapter file {short_repr(str(path))} is outside the folders this server may read "
                          f"(VLLM_LORA_EXT_ALLOWED_ROOTS={shown}). {fix}")
    return err


def file_stamp(st: os.stat_result) -> tuple[int, int, int, int]:
    """Return what tells one file's version from another: device, inode, size and modification time."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def files_unchanged(files: Sequence[tuple[str, tuple[int, int, int, int]]]) -> bool:
    """Whether each ``(path, stamp)`` still names the file of that [`file_stamp`] (gone or replaced: ``False``)."""
    try:
        return all(file_stamp(os.stat(path)) == stamp for path, stamp in files)
    except OSError:
        return False


def fmt_bytes(n: float) -> str:
    """A byte count in B, KiB, MiB or GiB (``1536`` -> ``"1.5 KiB"``; whole bytes below 1 KiB)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB"):
        if value < 1024:
            return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} GiB"


def short_repr(value: Any) -> str:
    """Return a bounded ``repr`` for error messages (a hostile value is never echoed whole).

    Example:
        >>> short_repr("x" * 1000)[:12]
        "'xxxxxxxxxxx"
        >>> len(short_repr(list(range(10**6)))) < 100
        True
    """
    return _REPR.repr(value)


_GC_LOCK = threading.Lock()
_gc_users = 0  # blocks inside gc_paused now, in every thread
_gc_was_enabled = False  # whether the collector was on when the first of them entered


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while a block builds many objects, e.g. a 37k-entry header.

    Such a block triggers collections that walk the whole heap and multiply its time, unpredictably.
    Nested uses and uses from several threads at once share one pause: the first to enter turns the
    collector off (if it was on), and it is turned back on only when the last one leaves.
    """
    global _gc_users, _gc_was_enabled
    with _GC_LOCK:
        if _gc_users == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_users += 1
    try:
        yield
    finally:
        with _GC_LOCK:
            _gc_users -= 1
            if _gc_users == 0 and _gc_was_enabled:
                gc.enable()


def usable_cores() -> int:
    """The CPUs this process may run on: its affinity set where the OS has one (a container's or ``taskset``'s
    cpuset), else every core; at least 1. Thread counts for reads, scans and copies are sized from it."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # no affinity call here (macOS)
        return os.cpu_count() or 1


class FreshPools:
    """Thread pools made for each call and shut down after it: what the data modules use when their caller lends
    none. Serving code passes the transport layer's kept pools instead (``vllm_lora_ext.transport.pools``, the same
    two functions), whose threads also run torch's ops on one OpenMP thread each."""

    @staticmethod
    @contextlib.contextmanager
    def lent_pool(name: str, workers: int) -> Iterator[Any]:
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(workers, thread_name_prefix=name) as pool:
            yield pool

    @staticmethod
    def run_in_pool(name: str, workers: int, fn: Any, items: Any) -> list[Any]:
        with FreshPools.lent_pool(name, workers) as pool:
            return run_all(pool, fn, items)


def run_all(pool: Any, fn: Any, items: Any) -> list[Any]:
    """``[fn(x) for x in items]`` on ``pool``, results in order. If one call raises, the calls not started yet are
    dropped and the running ones finish before the error reaches the caller: nothing is left running."""
    from concurrent.futures import wait

    futures = []
    try:  # (a submit that fails part-way, e.g. no thread can start: the calls submitted are waited for too)
        for x in items:
            futures.append(pool.submit(fn, x))
        return [f.result() for f in futures]
    finally:
        for f in futures:
            f.cancel()
        wait(futures)


def path_kind(path: str | os.PathLike[str]) -> str:
    """``"file"`` (a regular file, through links), ``"absent"`` or ``"other"`` (a folder, a FIFO, a device, a
    dangling link), from one ``stat``: a folder on the path swapped meanwhile reads as absent, never as another
    kind, as two checks (``is_file`` then ``exists``) could read it."""
    try:
        return "file" if stat.S_ISREG(os.stat(path).st_mode) else "other"
    except OSError as err:  # (any other error, a permission refused, reaches the caller)
        if err.errno == errno.ELOOP:  # a loop of links
            return "other"
        if err.errno not in (errno.ENOENT, errno.ENOTDIR):
            raise
        return "other" if os.path.islink(path) else "absent"


def not_a_regular_file(path: str | os.PathLike[str]) -> str | None:
    """Return why ``path`` cannot be read as a config file (missing, a folder, a FIFO, a device), or ``None``.

    Only ``stat`` is used: a FIFO is never opened (opening one for reading waits for a writer).
    """
    try:
        mode = os.stat(path).st_mode
    except OSError as err:
        return f"cannot be read ({err.strerror or err})"
    if stat.S_ISREG(mode):
        return None
    return f"is {file_kind(mode)}, not a regular file"


def _generated(part: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- generated: {part} [^\n]*-->\n)(.*?)(<!-- end: {part} -->)", re.S)


def generated_part(text: str, part: str) -> str:
    """Return what ``text`` holds between ``<!-- generated: part ... -->`` and ``<!-- end: part -->`` (empty if
    it has no such part)."""
    match = _generated(part).search(text)
    return match.group(2).removesuffix("\n") if match else ""


def replace_generated(text: str, part: str, body: str, *, what: str) -> str:
    """Return ``text`` with its generated part ``part`` replaced by ``body``.

    Raises:
        ValueError: ``text`` (``what``, e.g. ``"README"``) has no such part.
    """
    pattern = _generated(part)
    if not pattern.search(text):
        raise ValueError(f"{what} has no '<!-- generated: {part} ... -->' ... '<!-- end: {part} -->' section")
    return pattern.sub(lambda m: m.group(1) + body + "\n" + m.group(3), text, count=1)


def endpoint_unreadable(url: str) -> str | None:
    """Why ``url`` (``HF_ENDPOINT``) is no address at all, as huggingface_hub parses it when imported (a port that
    is not one, a broken IPv6 host), said as a bad setting; ``None`` for an empty or readable one."""
    from urllib.parse import urlsplit

    try:
        urlsplit(url).port  # noqa: B018 (parsed when read)
    except ValueError as err:
        return (f"HF_ENDPOINT={url[:80]!r} is no address huggingface_hub can read ({err}), and it stops "
                f"huggingface_hub, the cache included; set it to a Hub or mirror address such as "
                f"https://huggingface.co, or unset it.")
    return None


_SIZE = re.compile(r"^([0-9]+(?:\.[0-9]+)?)\s*([kmgt]i?b|b)?$", re.IGNORECASE)
_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
SIZE_FORMS = "a number of bytes (2147483648), or a number with a unit: 2GiB, 512MiB (powers of 1024) or 2GB, 500MB " \
             "(powers of 1000)"


def parse_size(raw: str, *, name: str) -> int:
    """Return the bytes a size setting means: plain bytes, or ``2GiB``/``512MiB``/``2GB``/``500MB``/``1.5TiB``.

    Raises:
        [`SettingsError`]: the value is none of these forms (the message names ``name`` and the forms).

    Example:
        >>> parse_size("2GiB", name="X"), parse_size("2GB", name="X"), parse_size("1024", name="X")
        (2147483648, 2000000000, 1024)
    """
    text = raw.strip()
    m = _SIZE.match(text)
    if m is None:
        try:  # plain numbers as before (e.g. 1e9), whole and finite
            value = float(text)
        except ValueError:
            value = float("nan")
        if value == value and value not in (float("inf"),) and value >= 0 and value == int(value):
            return int(value)
        raise SettingsError(f"{name}={raw[:80]!r} is not a size. Give {SIZE_FORMS}.")
    if m.group(2) is None and "." in m.group(1):
        raise SettingsError(f"{name}={raw[:80]!r} is not a whole number of bytes. Give {SIZE_FORMS}.")
    value = float(m.group(1)) * _UNITS[(m.group(2) or "b").lower()]
    if value != value or value == float("inf"):  # more digits than a float holds
        raise SettingsError(f"{name}={raw[:80]!r} is too large a size. Give {SIZE_FORMS}.")
    return int(value)
