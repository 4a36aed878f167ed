"""Where offline tools may write: a new or empty folder, never over a source, unless the user says ``--force``.

Files are written into a temporary folder beside the target and moved into place only when all of
them are complete, so a failure leaves the target as it was.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

from vllm_lora_ext.errors import OutputPathError

__all__ = ["check_output_dir", "write_atomically"]


def check_output_dir(out: str | os.PathLike[str], *, inputs: Iterable[Path] = (), force: bool = False) -> Path:
    """Return the output folder after checking that writing there destroys nothing.

    Raises:
        [`OutputPathError`]: ``out`` is a file; or, without ``force``, it is a non-empty folder or holds an input.
    """
    path = Path(out).expanduser().absolute()
    if path.exists() and not path.is_dir():
        raise OutputPathError(f"Output {str(path)!r} is a file; name a folder to write the adapter into.")
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


def write_atomically(out: Path, write: Callable[[Path], None]) -> Path:
    """Run ``write(tmp)`` into a fresh folder beside ``out``, then move every file it wrote into ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        write(tmp)
        out.mkdir(exist_ok=True)
        for f in tmp.iterdir():
            os.replace(f, out / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out
