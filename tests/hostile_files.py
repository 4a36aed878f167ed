"""Hostile file-system moves made at exact moments of a load: a deploy tool's replace, an attacker's link swap."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from vllm_lora_ext.reader import SafetensorsReader


@contextlib.contextmanager
def deploy_between_header_and_data(monkeypatch: pytest.MonkeyPatch, path: Path, staged: Path,
                                   *, in_place: bool = False) -> Iterator[threading.Event]:
    """A deploy tool on another thread swaps ``staged`` in at ``path`` (``os.replace``; with ``in_place``, writes
    its bytes over the old file) once a load's reader has read the header, before the load reads any tensor."""
    header_read, deployed = threading.Event(), threading.Event()
    real_init = SafetensorsReader.__init__

    def init(self: SafetensorsReader, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        if Path(self.path) == path and not header_read.is_set():
            header_read.set()
            assert deployed.wait(10)

    def deploy() -> None:
        if header_read.wait(10):
            if in_place:
                with open(path, "r+b") as f:
                    f.write(staged.read_bytes())
            else:
                os.replace(staged, path)
        deployed.set()

    monkeypatch.setattr(SafetensorsReader, "__init__", init)
    tool = threading.Thread(target=deploy)
    tool.start()
    try:
        yield deployed
    finally:
        tool.join()
    assert header_read.is_set() and deployed.is_set(), "the load never read the header: nothing was deployed"


def swap_for_link(place: Path, target: Path) -> None:
    """Swap ``place`` (a folder or file) for a symlink to ``target`` in one rename, as an attacker would."""
    link = place.with_name(place.name + ".link")
    os.symlink(target, link)
    if place.is_dir() and not place.is_symlink():
        place.rename(place.with_name(place.name + ".old"))
    os.replace(link, place)
