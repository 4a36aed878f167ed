"""Where offline tools may write: a new or empty folder, never over a source, unless the user says ``--force``.

A write is one claim on the target folder ``DIR``:

1. an exclusive ``flock`` on the lock file ``.DIR.lock`` beside it (a second writer is refused at once, so two
   runs never both "succeed" into one folder); stale ``.DIR.tmp-*``/``.DIR.old-*`` folders left by a killed run
   are removed under that lock (an old adapter a killed fallback swap left aside is first put back);
2. the checks: ``DIR`` is not a file; without ``force`` it is new or empty and holds no input adapter;
3. every file is written into a fresh folder ``.DIR.tmp-*`` beside it (files of an existing ``DIR`` that the new
   adapter does not replace are linked in first), then that folder is swapped in with one
   ``renameat2(RENAME_EXCHANGE)`` (Linux): ``DIR`` holds the old adapter, whole, until that one call, and the new
   one, whole, after it. Where the exchange is not available (another OS, a file system without it), the old
   folder is renamed aside and the new one renamed in, and the old one is put back if the second rename fails;
4. the old folder is removed and the lock file unlinked (while still held, so a waiter re-opens a new one).

A failure or Ctrl-C at any step before the swap leaves ``DIR`` as it was and removes the temporary folder.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import glob
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from types import TracebackType

from vllm_lora_ext._util import root_of
from vllm_lora_ext.errors import OutputPathError

__all__ = ["OutputClaim", "check_output_dir", "claim_output", "write_atomically"]

# Files an adapter write produces; an existing folder's other files are kept across a --force write.
_ADAPTER_FILES = frozenset({"adapter_model.safetensors", "adapter_config.json", "adapter_model.bin", "adapter_model.pt",
                            "vllm_lora_ext_mix.json"})
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _absolute(out: str | os.PathLike[str]) -> Path:
    """The output folder as an absolute path, ``~`` expanded as a shell does (``~name`` of no user stays), ``.`` and
    ``..`` taken away as written (``x/..`` is the folder that holds ``x``, never a folder inside ``x``); a symbolic
    link to a folder is the folder it names (which the write replaces, and beside which it locks).

    Raises:
        [`OutputPathError`]: ``out`` is empty (an unset variable in ``-o "$OUT"``: not the current folder), or a
            link whose target's folder does not exist (a write would make it, e.g. under an unmounted disk).
    """
    if not os.fspath(out):
        raise OutputPathError("The output folder is empty (''), e.g. an unset variable in -o \"$OUT\". Name the "
                              "folder to write the adapter into.")
    path = Path(os.path.normpath(Path(os.path.expanduser(out)).absolute()))
    try:
        if not path.is_symlink():
            return path
        target = Path(os.path.realpath(path))
    except OSError:  # a folder on the way that cannot be searched: the lock's open names it
        return path
    if not target.parent.is_dir():
        raise OutputPathError(f"Output {str(path)!r} is a link to {str(target)!r}, whose folder does not exist. Make "
                              f"it first (a disk meant to be mounted there?), or name another output folder.")
    return target


def _holds_cwd(path: Path) -> bool:
    """Whether ``path`` is this process's working folder or holds it."""
    try:
        cwd = os.path.realpath(os.getcwd())
    except OSError:  # the working folder is gone already
        return False
    return root_of(cwd, [os.path.realpath(path)]) is not None


def _mount_points() -> list[str] | None:
    """Every mount point of this process's mount namespace (``/proc/self/mountinfo``, bind mounts of one file system
    too), or ``None`` where it cannot be read."""
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return None
    octal = re.compile(r"\\([0-7]{3})")  # a space, tab, newline or backslash in a path is written \ooo
    return [octal.sub(lambda m: chr(int(m.group(1), 8)), line.split()[4]) for line in lines if len(line.split()) > 4]


def _mount_in(path: Path) -> Path | None:
    """``path`` itself if something is mounted there, else the first mount point under it, or ``None``. Without
    ``/proc``, mount points are told by the device numbers that change at them (a bind mount of the same file
    system is then not seen)."""
    real = os.path.realpath(path)
    points = _mount_points()
    if points is not None:
        under = sorted(p for p in points if root_of(p, [real]) is not None)
        return Path(under[0]) if under else None
    if os.path.ismount(path):
        return path
    device = path.stat().st_dev
    for folder, subfolders, _ in os.walk(path):
        for name in subfolders:
            sub = Path(folder) / name
            try:
                if sub.lstat().st_dev != device and not sub.is_symlink():
                    return sub
            except OSError:
                continue
    return None


def _check_replaceable(path: Path) -> None:
    """Refuse to swap a new folder in for ``path`` where the old one cannot go: it is or holds this process's working
    folder, or a mount point (which a write can neither carry over nor remove without emptying it).

    Raises:
        [`OutputPathError`]: naming the folder, why, and what to write to instead.
    """
    if _holds_cwd(path):
        raise OutputPathError(f"Output folder {str(path)!r} is the current folder or holds it: the write replaces "
                              f"that folder, which would leave this shell in a deleted one. Name a folder inside "
                              f"it (e.g. -o ./adapter), or run from another folder.")
    mount = _mount_in(path)
    if mount is not None:
        where = ("is a mount point" if os.path.realpath(mount) == os.path.realpath(path)
                 else f"holds a mount point at {str(mount)!r}")
        raise OutputPathError(f"Output folder {str(path)!r} {where}, which a write cannot carry over: it replaces "
                              f"the folder with a new one. Name a new folder inside it (e.g. "
                              f"{str(path / 'adapter')!r}), or another folder.")


def check_output_dir(out: str | os.PathLike[str], *, inputs: Iterable[Path] = (), force: bool = False) -> Path:
    """Return the output folder after checking that writing there destroys nothing.

    Raises:
        [`OutputPathError`]: ``out`` is a file; a folder no write may replace (the working folder or one holding
            it, a mount point or one holding one: [`_check_replaceable`], with or without ``force``); or, without
            ``force``, a non-empty folder or one that holds an input.
    """
    path = _absolute(out)
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"Output {str(path)!r} is a file; name a folder to write the adapter into.")
    if path.is_dir():  # a write swaps a new folder in for this one: refused first, so no refusal below offers a
        _check_replaceable(path)  # --force that this one would refuse (-o . in a non-empty folder)
    real = os.path.realpath(path)
    for src in inputs:
        folder = os.path.realpath(src if src.is_dir() else src.parent)
        if real == folder and not force:
            raise OutputPathError(f"Output folder {str(path)!r} holds an input adapter; writing there would overwrite "
                                  f"it. Choose another folder, or pass --force.")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise OutputPathError(f"Output folder {str(path)!r} is not empty. Choose a new or empty folder, or pass --force "
                              f"to replace the adapter files in it.")
    return path


def _unwritable(folder: Path, err: OSError) -> str:
    """Why no new file or folder could be made in ``folder`` (``err``: the failed ``open`` or ``mkdir``), as the
    reason a user can act on: a file in the way, a read-only or virtual file system, a permission, a full disk."""
    try:
        fs = os.statvfs(folder)
        # (no blocks and no inodes: /proc, /sys; a tmpfs of size=0 is unbounded, with inodes that can run out)
        read_only, virtual = bool(fs.f_flag & os.ST_RDONLY), fs.f_blocks == 0 == fs.f_files and folder.is_dir()
    except OSError:
        read_only = virtual = False
    if err.errno in (errno.ENOTDIR, errno.EEXIST) or (folder.exists() and not folder.is_dir()):
        return "it is a file, not a folder"
    if err.errno == errno.EROFS or read_only:
        return "it is on a read-only file system (remount it read-write, or write elsewhere)"
    room = _no_room(err)
    if room:
        return room
    if virtual:  # /proc answers ENOENT, /sys EACCES (to root too): neither is a missing folder or a permission
        return "it is on a virtual file system with no disk behind it (as /proc and /sys are), which takes no new files"
    if err.errno in (errno.EACCES, errno.EPERM):
        return "permission denied: this user may not make files there"
    return err.strerror or str(err)


class OutputClaim(os.PathLike[str]):
    """An exclusive claim on an output folder (see the module docstring); use it as a context manager.

    It is a path-like object, so it can be passed wherever an output folder is taken; [`write_atomically`]
    then writes under this claim instead of taking its own.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock_path = path.parent / f".{path.name}.lock"
        self._fd: int | None = None

    def __fspath__(self) -> str:
        return str(self.path)

    @property
    def held(self) -> bool:
        """Whether this claim holds its lock now."""
        return self._fd is not None

    def _open_lock(self) -> int:
        """Open (or make) the lock file, and its folder; a folder that cannot be written is named, with the fix."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as err:
            failed = Path(err.filename) if err.filename else self.lock_path  # the entry that could not be made,
            folder = failed if err.errno == errno.EEXIST else failed.parent  # or (EEXIST) a file in a folder's place
            raise OutputPathError(f"Cannot write into {str(folder)!r}: {_unwritable(folder, err)}, so not "
                                  f"{str(self.path)!r} either. Choose an output folder you can write to.") from err

    def acquire(self) -> OutputClaim:
        """Take the lock (refused at once if another process holds it), then remove a killed run's leftovers."""
        while True:
            fd = self._open_lock()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise OutputPathError(
                    f"Output folder {str(self.path)!r} is being written by another vllm-lora command (it holds "
                    f"{str(self.lock_path)!r}). Wait for it to finish, or choose another folder.") from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.lock_path).st_ino
            except FileNotFoundError:
                same = False
            if same:  # not a lock file its last holder unlinked after we opened it
                break
            os.close(fd)
        self._fd = fd
        for stale in self.path.parent.glob(f".{glob.escape(self.path.name)}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        for stale in self.path.parent.glob(f".{glob.escape(self.path.name)}.old-*"):
            if (stale / "old").is_dir() and not self.path.exists():  # killed between the two fallback renames
                os.rename(stale / "old", self.path)
            shutil.rmtree(stale, ignore_errors=True)
        return self

    def release(self) -> None:
        """Unlink the lock file and drop the lock."""
        if self._fd is None:
            return
        try:
            self.lock_path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> OutputClaim:
        return self if self._fd is not None else self.acquire()

    def __exit__(self, kind: type[BaseException] | None, err: BaseException | None, tb: TracebackType | None) -> None:
        self.release()


def claim_output(out: str | os.PathLike[str], *, inputs: Iterable[Path] = (), force: bool = False) -> OutputClaim:
    """Lock the output folder ``out``, then check it as [`check_output_dir`] does; release with ``with`` or ``release()``.

    Raises:
        [`OutputPathError`]: another process is writing there, or a check of [`check_output_dir`] fails.
    """
    claim = OutputClaim(_absolute(out)).acquire()
    try:
        check_output_dir(claim.path, inputs=inputs, force=force)
    except BaseException:
        claim.release()
        raise
    return claim


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one ``renameat2(RENAME_EXCHANGE)`` call; ``False`` where that call is not available."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, f"cannot swap {str(a)!r} into {str(b)!r}: {os.strerror(code)}")


def _keep_others(old: Path, tmp: Path) -> None:
    """Link (or copy) into ``tmp`` what ``old`` holds besides the files an adapter write replaces."""
    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    for entry in old.iterdir():
        if entry.name in _ADAPTER_FILES or (tmp / entry.name).exists():
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.copytree(entry, tmp / entry.name, symlinks=True, copy_function=link)
        elif entry.is_symlink():
            os.symlink(os.readlink(entry), tmp / entry.name)
        else:
            link(str(entry), str(tmp / entry.name))


def _own_like(src: Path, dst: Path) -> None:
    """Give ``dst`` the owner and group of ``src`` where this process may (root); elsewhere they are its own."""
    st = src.lstat()
    try:
        os.chown(dst, st.st_uid, st.st_gid, follow_symlinks=False)
    except OSError:
        pass


def _swap_in(tmp: Path, out: Path) -> None:
    """Put the finished folder ``tmp`` at ``out``; what ``out`` held ends up at ``tmp`` (removed by the caller). An
    existing ``out``'s mode, extended attributes (ACLs), owner and group go to the new folder, and to each
    folder it holds: a 0700 folder stays one around the files it kept private."""
    if not out.exists():
        os.rename(tmp, out)
        return
    _keep_others(out, tmp)
    shutil.copystat(out, tmp)  # its mode, flags and extended attributes; its times are the write's own:
    os.utime(tmp)
    _own_like(out, tmp)
    for folder, subfolders, _ in os.walk(out):
        for name in subfolders:
            old = Path(folder) / name
            if not old.is_symlink():
                _own_like(old, tmp / old.relative_to(out))
    if _exchange(tmp, out):
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, aside / "old")
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(aside / "old", out)
        raise
    os.rename(aside / "old", tmp)  # the caller removes it, as after an exchange
    aside.rmdir()


def write_atomically(out: str | os.PathLike[str], write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` into a fresh folder beside ``out``, then swap that folder in (see the module docstring).

    ``out`` may be an [`OutputClaim`] already held (the CLI checks and locks the folder before its work); a plain
    path is claimed for the write (with no emptiness check: a library call replaces the adapter files there).

    Raises:
        [`OutputPathError`]: another process is writing to ``out``.
    """
    if isinstance(out, OutputClaim) and out.held:
        return _write_under(out.path, write)
    with OutputClaim(_absolute(out)) as claim:
        return _write_under(claim.path, write)


def _write_under(target: Path, write: Callable[[Path], None]) -> Path:
    if target.is_dir():  # (checked again: a library call claims no more than this; the folder may have changed)
        _check_replaceable(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        try:
            write(tmp)
        except Exception as err:
            full = _no_room(err)
            if full is None:
                raise
            raise OutputPathError(
                f"Could not write the adapter into {str(target)!r}: {full} ({type(err).__name__}); nothing was "
                f"written there. Free space on that disk (or raise the file size limit, ulimit -f), or choose an "
                f"output folder on another disk.") from err
        mask = _umask()
        os.chmod(tmp, 0o777 & ~mask)
        for path in tmp.rglob("*"):  # writers that make 0600 files (safetensors' save_file) follow the umask too
            if path.is_file() and not path.is_symlink():
                os.chmod(path, 0o666 & ~mask)
        _swap_in(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


_NO_ROOM = {errno.ENOSPC: "no space left on the device", errno.EFBIG: "a file passed the file size limit",
            errno.EDQUOT: "the disk quota is used up"}


def _no_room(err: BaseException) -> str | None:
    """What ran out, if ``err`` is a write that found no room (an ``OSError``, or safetensors' own error naming one)."""
    if isinstance(err, OSError) and err.errno in _NO_ROOM:
        return _NO_ROOM[err.errno]
    text = str(err)
    return next((why for code, why in _NO_ROOM.items() if f"(os error {code})" in text), None)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
