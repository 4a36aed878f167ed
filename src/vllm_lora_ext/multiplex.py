"""What a multiplexed model id (``<base>:<adapter>``, Ray Serve LLM's convention) asks the plugin for.

Ray Serve LLM names a LoRA request ``model="<base model id>:<adapter id>"``. Its router sends the request
to a replica with that whole string as the multiplexed model id, and the replica's downloader then looks
``<adapter id>`` up as a folder under ``dynamic_lora_loading_path`` (S3, GCS or Azure only). A name from the
plugin's deployment config, a mix such as ``style=0.7+domain=0.3`` and an ``hf:`` source are none of those.
`plan_model_id` says, for one id, which of the plugin's paths serves it; it is pure, so it is tested without
Ray, and `vllm_lora_ext.integration.ray` carries the plan out in a replica.

| adapter part of the id | plan | the replica then |
|---|---|---|
| a name the replica registered (deployment config, ``--lora-modules``, a mix name it made) | ``NAME`` | runs the request on that name |
| a mix written as in ``model`` on ``vllm serve`` (``a=0.7+b=0.3``, ``a+b``), or a ``mix-`` name | ``MIX`` | the plugin's mix routing |
| a source under a prefix the operator lets clients name (``VLLM_LORA_EXT_CLIENT_SOURCES``) | ``SOURCE`` | registers the source under the whole id, pinned, then runs the request on it (an id holding ``+``/``=`` or starting with ``mix-`` is refused: the name rule of `vllm_lora_ext.naming`) |
| anything else, where Ray's own downloader is configured | ``RAY`` | Ray's downloader, unchanged |
| anything else | an error | 403 for a source clients may not name, else 404 naming the fix |
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum

from vllm_lora_ext._util import clip, short_repr
from vllm_lora_ext.constants import HF_PREFIX, MAX_MODEL_FIELD_CHARS, MIX_NAME_PREFIX
from vllm_lora_ext.errors import AdapterAccessError, AdapterNotFoundError, AdapterSourceError
from vllm_lora_ext.naming import reserved_part, server_only_prefix
from vllm_lora_ext.sources import parse_source


class Plan(str, Enum):
    NAME = "name"
    MIX = "mix"
    SOURCE = "source"
    RAY = "ray"


@dataclass(frozen=True)
class ModelIdPlan:
    """The plan for one multiplexed id: ``adapter`` is what goes to vLLM as the request's ``model``
    (``NAME``, ``MIX``) or as the source to register under ``model_id`` (``SOURCE``)."""

    plan: Plan
    model_id: str
    adapter: str


def split_model_id(model_id: str) -> tuple[str, str]:
    """Split ``<base>:<adapter>`` at its first colon: ``("qwen", "hf:org/repo@v1:sub")``.

    The adapter part keeps every later colon (as Ray's ``get_lora_id`` does), so ``hf:`` sources and
    sub-paths survive.
    """
    base, _, adapter = model_id.partition(":")
    return base, adapter


def looks_like_source(adapter: str) -> bool:
    """Return whether an adapter id is written as a source (``hf:``, a path) rather than a name."""
    return adapter.startswith((HF_PREFIX, "/", "./", "../", "~", "file:")) or "\\" in adapter


def plan_model_id(model_id: str, *, names: Collection[str], client_sources: Collection[str] = (),
                  ray_downloads: bool = False) -> ModelIdPlan:
    """Plan how a replica serves the multiplexed id ``model_id``.

    Args:
        model_id: ``<base>:<adapter>``, as Ray's router passes it.
        names: adapter names the replica already serves (registered adapters, deployment-config names).
        client_sources: source prefixes (``hf:acme/``) clients may name directly; empty: none.
        ray_downloads: whether Ray's own downloader (``dynamic_lora_loading_path``) is configured.

    Raises:
        [`AdapterSourceError`]: an empty, oversized or reserved adapter part.
        [`AdapterAccessError`]: a source no prefix in ``client_sources`` admits.
        [`AdapterNotFoundError`]: a name the replica does not serve, and no Ray downloader to ask.
    """
    _, adapter = split_model_id(model_id)
    if not adapter:
        raise AdapterSourceError(f"Model id {short_repr(model_id)} has no adapter after ':'. Write "
                                 f"'<base>:<adapter name>' or '<base>:<a>=0.7+<b>=0.3'.", source=clip(model_id))
    if len(adapter) > MAX_MODEL_FIELD_CHARS:
        raise AdapterSourceError(f"The adapter part of the model id has {len(adapter)} characters, more than "
                                 f"{MAX_MODEL_FIELD_CHARS}. Name an adapter or a mix.", source=clip(adapter))
    if server_only_prefix(adapter) is not None:
        raise AdapterSourceError(f"Adapter id {short_repr(adapter)} is a spec only the server makes. Name registered "
                                 f"adapters, or a mix of them such as 'a=0.7+b=0.3'.", source=clip(adapter))
    if adapter in names:
        return ModelIdPlan(Plan.NAME, model_id, adapter)
    if looks_like_source(adapter):
        _check_source_id(model_id, adapter)  # the id names the registered adapter: never a mix's spelling
        admitted = admitted_source(adapter, client_sources)
        if admitted is not None:
            return ModelIdPlan(Plan.SOURCE, model_id, admitted)
        raise AdapterAccessError(
            f"Adapter source {short_repr(adapter)} may not be named by clients of this deployment. Ask the operator "
            f"to add it to the deployment config (VLLM_LORA_EXT_CONFIG) under a name, or to admit its prefix in "
            f"VLLM_LORA_EXT_CLIENT_SOURCES.", source=clip(adapter))
    if reserved_part(adapter) is not None:  # a mix, or a mix name the server made
        return ModelIdPlan(Plan.MIX, model_id, adapter)
    if ray_downloads:
        return ModelIdPlan(Plan.RAY, model_id, adapter)
    shown = ", ".join(repr(n) for n in sorted(names)[:20]) or "none"
    raise AdapterNotFoundError(f"Adapter {short_repr(adapter)} is not served here (served: {shown}). Name one of "
                               f"them, or a mix of them such as 'a=0.7+b=0.3'.", source=clip(adapter))


def admitted_source(adapter: str, prefixes: Collection[str]) -> str | None:
    """Return the source a client names, normalised, if a prefix in ``prefixes`` admits it, else ``None``.

    Both sides are compared normalised, never as raw text: a local path and a local prefix by their real paths
    (``~``, ``.``, ``..``, repeated separators and symlinks resolved), so ``<L>/../private`` or a link inside
    ``<L>`` that leads out of it is not under ``<L>/``; a prefix that ends in a separator or is a folder admits
    what lies in that folder (not ``<L>-other``), another (``/srv/loras/team-``) admits real paths that start
    with its own real path. A hub source is compared in its canonical form (a malformed one, ``..`` in it
    included, is admitted by nothing). The local source comes back as its real path, which is what gets
    registered and read.
    """
    if adapter.startswith(HF_PREFIX):
        try:
            canonical = parse_source(adapter).canonical()
        except ValueError:
            return None
        hub = [p for p in prefixes if p.startswith(HF_PREFIX)]
        return canonical if any(canonical.startswith(p) for p in hub) else None
    try:
        real = _real(adapter)
        for prefix in prefixes:
            if not prefix or prefix.startswith(HF_PREFIX):
                continue
            folder = _real(prefix)
            if prefix.endswith(("/", os.sep, "/.", "/..")) or os.path.isdir(folder):  # a folder: what lies in it
                if real.startswith(folder.rstrip(os.sep) + os.sep):
                    return real
            elif real.startswith(folder):
                return real
    except (ValueError, OSError):  # a NUL byte, a loop of links: admitted by nothing
        return None
    return None


def _real(path: str) -> str:
    return os.path.realpath(os.path.expanduser(path))


def _check_source_id(model_id: str, adapter: str) -> None:
    """Refuse a client-named source whose model id cannot be an adapter name (the replica registers it under it)."""
    part = reserved_part(model_id)
    if part is not None:
        raise AdapterSourceError(
            f"Model id {short_repr(model_id)} {part}, which the mix grammar reserves; a source named in a model id is "
            f"registered under the whole id, so it cannot hold '+' or '=' or start with {MIX_NAME_PREFIX!r}. Ask the "
            f"operator to add the source {short_repr(adapter)} to the deployment config (VLLM_LORA_EXT_CONFIG) under "
            f"a name.", source=clip(adapter), part="name")
