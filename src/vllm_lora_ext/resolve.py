"""Source resolution with validation and pinning: the steps every entry point runs before a load.

``resolve_and_check`` resolves a source (downloading only what is needed) and validates its config;
``pin_path`` rewrites a LoRA path (a source, or every component of a ``mix:`` path) to the pinned
form that identifies exactly those bytes; ``check_allowed_root`` keeps runtime-loaded local paths
inside the folders an operator allows. Pure core: no vLLM.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from vllm_lora_ext._util import short_repr
from vllm_lora_ext.constants import MIX_PREFIX
from vllm_lora_ext.errors import AdapterAccessError
from vllm_lora_ext.mixing import MixComponent, MixSpec
from vllm_lora_ext.sources import ResolvedAdapter, _looks_like_repo_id, parse_source, resolve_source
from vllm_lora_ext.summary import load_config

__all__ = ["resolve_and_check", "pin_path", "check_allowed_root"]


def resolve_and_check(path: str, *, name: str = "adapter") -> ResolvedAdapter:
    """Resolve a source and validate its config (blocking; a server runs it in a thread).

    Raises:
        [`AdapterSourceError`], [`AdapterNotFoundError`], [`AdapterFormatError`]: as the source or config is bad.
    """
    resolved = resolve_source(path)
    load_config(resolved, name=name)
    return resolved


def pin_path(path: str, *, name: str = "adapter") -> str:
    """Return ``path`` with every source pinned (a plain source, or each component of a ``mix:`` path)."""
    if path.startswith(MIX_PREFIX):
        spec = MixSpec.from_path(path)
        comps = tuple(MixComponent(c.name, resolve_and_check(c.source, name=c.name).source.canonical(), c.weight)
                      for c in spec.components)
        return MixSpec(comps).lora_path
    return resolve_and_check(path, name=name).source.canonical()


def check_allowed_root(path: str, roots: Sequence[str]) -> None:
    """Refuse a local source whose real path (symlinks followed) lies outside every allowed root.

    Hub sources pass (they are read from the Hub cache). Checked before any file is opened.

    Raises:
        [`AdapterAccessError`]: the path is outside ``roots``.

    Example:
        >>> check_allowed_root("hf:acme/lora", ["/srv/loras"])
        >>> check_allowed_root("/etc/passwd", ["/srv/loras"])
        Traceback (most recent call last):
        ...
        vllm_lora_ext.errors.AdapterAccessError: Adapter path '/etc/passwd' is outside the folders this server may read. Put the adapter under one of them, or load it from the Hub (hf:org/repo).
    """
    src = parse_source(path)
    if src.kind != "local" or src.local_path is None:
        return
    if not src.local_path.exists() and _looks_like_repo_id(path):
        return  # read as 'hf:org/repo' (vLLM's own rule), not as a local path
    real = os.path.realpath(src.local_path)
    for root in roots:
        if real == root or real.startswith(root.rstrip(os.sep) + os.sep):
            return
    raise AdapterAccessError(
        f"Adapter path {short_repr(path)} is outside the folders this server may read. Put the adapter under one "
        f"of them, or load it from the Hub (hf:org/repo).", source=path, part="path")

