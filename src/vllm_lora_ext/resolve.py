"""Source resolution with validation and pinning: the steps every entry point runs before a load.

``resolve_and_check`` resolves a source (downloading only what is needed) and validates its config;
``pin_path`` rewrites a LoRA path (a source, or every component of a ``mix:`` path) to the pinned
form that identifies exactly those bytes; ``check_allowed_root`` keeps runtime-loaded local paths
inside the folders an operator allows. Pure core: no vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from vllm_lora_ext._util import root_of, short_repr
from vllm_lora_ext.constants import HF_PREFIX, MIX_PREFIX, allowed_roots
from vllm_lora_ext.errors import AdapterAccessError
from vllm_lora_ext.mixing import MixComponent, MixSpec
from vllm_lora_ext.sources import ResolvedAdapter, _looks_like_repo_id, parse_source, resolve_source
from vllm_lora_ext.summary import load_config

__all__ = ["resolve_and_check", "pin_path", "check_allowed_root", "confining_roots"]


def resolve_and_check(path: str, *, name: str = "adapter") -> ResolvedAdapter:
    """Resolve a source and validate its config (blocking; a server runs it in a thread).

    Raises:
        [`AdapterSourceError`], [`AdapterNotFoundError`], [`AdapterFormatError`]: as the source or config is bad.
        [`AdapterAccessError`]: a local source inside ``VLLM_LORA_EXT_ALLOWED_ROOTS`` whose config (or, without one,
            weight file) leads out of them.
    """
    resolved = resolve_source(path)
    load_config(resolved, name=name, roots=confining_roots(resolved))  # a file leading out of the roots: unread
    return resolved


def pin_path(path: str, *, name: str = "adapter") -> str:
    """Return ``path`` with every source pinned (a plain source, or each component of a ``mix:`` path)."""
    if path.startswith(MIX_PREFIX):
        spec = MixSpec.from_path(path)
        comps = tuple(MixComponent(c.name, resolve_and_check(c.source, name=c.name).source.canonical(), c.weight)
                      for c in spec.components)
        return MixSpec(comps).lora_path
    return resolve_and_check(path, name=name).source.canonical()


def check_allowed_root(path: str, roots: Sequence[str]) -> str:
    """Refuse a local source whose real path (symlinks followed) lies outside every allowed root; return the path
    to load: a local source's real path (so that a worker holds it to ``roots`` again on every build, see
    `confining_roots`), a bare ``org/repo`` that is no local folder as ``hf:org/repo`` (a folder made there later
    is never read in its place), any other source as given.

    Hub sources pass (they are read from the Hub cache). Checked before any file is opened, and before a ``~`` is
    looked up: a path starting with one is refused whoever it names.

    Raises:
        [`AdapterAccessError`]: the path is outside ``roots``.

    Example:
        >>> check_allowed_root("hf:acme/lora", ["/srv/loras"])
        'hf:acme/lora'
        >>> check_allowed_root("/etc/passwd", ["/srv/loras"])
        Traceback (most recent call last):
        ...
        vllm_lora_ext.errors.AdapterAccessError: Adapter path '/etc/passwd' is outside the folders this server may read (VLLM_LORA_EXT_ALLOWED_ROOTS=/srv/loras). Put the adapter under one of them, or load it from the Hub (hf:org/repo).
    """
    if path.startswith("~"):  # before any lookup: whether '~name' expands would tell a client which users exist
        raise AdapterAccessError(
            f"Adapter path {short_repr(path)} starts with '~': a client's path is not expanded to a home folder. "
            f"Give the whole path inside one of the folders this server may read "
            f"(VLLM_LORA_EXT_ALLOWED_ROOTS={os.pathsep.join(roots)}), or load it from the Hub (hf:org/repo).",
            source=path, part="path")
    src = parse_source(path)
    if src.kind != "local" or src.local_path is None:
        return path
    real = os.path.realpath(src.local_path)
    inside = root_of(real, roots) is not None
    if _looks_like_repo_id(path) and (not inside or not src.local_path.exists()):
        # vLLM's own rule (no such folder: a hub repo), and outside every root whether it exists or not (the answer
        # must not tell a client what exists there); written so, a folder of that name made later is never read
        return HF_PREFIX + path
    if inside:
        return real
    raise AdapterAccessError(
        f"Adapter path {short_repr(path)} is outside the folders this server may read "
        f"(VLLM_LORA_EXT_ALLOWED_ROOTS={os.pathsep.join(roots)}). Put the adapter under one of them, or load it "
        f"from the Hub (hf:org/repo).", source=path, part="path")


def confining_roots(resolved: ResolvedAdapter) -> tuple[str, ...] | None:
    """Return the allowed roots (``VLLM_LORA_EXT_ALLOWED_ROOTS``) a build holds ``resolved``'s files to, or ``None``.

    A local source written inside a root is held to the roots on every build, (re)builds after an eviction
    included: its files are opened only if their real paths still lie in a root, checked race-free
    (`open_confined`), so a link swapped to lead out of the root since the load is refused. A runtime-loaded
    source is always written inside a root (the server registers its real path, `check_allowed_root`); an
    adapter the operator named at start-up by a path outside every root is the operator's and is not held.
    """
    roots = allowed_roots()
    if roots is None or resolved.source.kind != "local" or resolved.source.local_path is None:
        return None
    written = os.path.normpath(os.path.abspath(resolved.source.local_path))
    return roots if root_of(written, roots) is not None else None
