"""Adapter sources: the grammar, its parser, and resolution to files on local disk.

Grammar (everything a LoRA path may be)::

    hf:ORG/REPO[@REVISION][:PATH]     an adapter on the Hugging Face Hub
    LOCAL_DIR                         a folder holding adapter_config.json + adapter_model.safetensors
    LOCAL_FILE.safetensors            one weight file (its config is looked up beside it, see below)

- ``ORG/REPO`` follows the Hub's repo-id rules: one or two names of ``[A-Za-z0-9_.-]``, no ``--``/``..``,
  not starting or ending with ``-`` or ``.``, at most 96 characters.
- ``REVISION`` is a branch, tag or commit sha (``refs/pr/N`` allowed); no ``:``, no empty, ``.`` or ``..``
  component (``a//b`` and ``a/.`` would name the cache's ref ``a/b`` or ``a``). A 40-hex sha is a *pinned* source:
  once cached it resolves with no HTTP request (but see ``HubClient.first_found`` for files recorded missing).
- ``PATH`` is relative and POSIX: no leading ``/``, no ``..``, ``\\`` or NUL, no empty component.
  Ending in ``.safetensors`` it names one weight file; ending in ``.bin``/``.pt``/``.pth``/``.ckpt``
  it names a pickle file, refused unless pickle is explicitly allowed; anything else names a
  subfolder holding an adapter.

Config lookup for a weight file ``DIR/STEM.safetensors`` (first hit wins):
``DIR/STEM_config.json``, ``DIR/STEM.json``, ``DIR/adapter_config.json``; else the config is
*inferred* (rank from the ``lora_A`` shapes, ``lora_alpha`` from the safetensors metadata). The
per-file names come first because a repo holding several adapters side by side may also hold one
shared ``adapter_config.json`` that describes only one of them.

A bare ``ORG/REPO`` that is not an existing local path is read as ``hf:ORG/REPO`` (vLLM's own
behaviour), with a log line.
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Literal

from vllm_lora_ext.constants import (ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME, HF_PREFIX, PICKLE_SUFFIXES,
                                     PICKLE_WEIGHTS_NAMES, SAFETENSORS_SUFFIX, SourceKind, hf_offline)
from vllm_lora_ext.constants import allow_pickle as _env_allow_pickle, allowed_roots
from vllm_lora_ext import diskcache, metrics
from vllm_lora_ext._util import path_kind
from vllm_lora_ext.diskledger import commit_of
from vllm_lora_ext.headers import may_hold_lora
from vllm_lora_ext.errors import AdapterDownloadError, AdapterNotFoundError, AdapterSourceError, UnsafeFormatError
from vllm_lora_ext.hub_client import COMMIT_SHA as _COMMIT_SHA, HubClient

__all__ = ["AdapterSource", "ResolvedAdapter", "ConfigRule", "parse_source", "resolve_source", "fetch_source"]

logger = logging.getLogger(__name__)

ConfigRule = Literal["adapter_config.json", "<stem>_config.json", "<stem>.json", "inferred"]

_REPO_PART = re.compile(r"[A-Za-z0-9_.\-]{1,96}\Z")  # \Z: '$' would let a trailing newline through
_REVISION = re.compile(r"[A-Za-z0-9_.\-/+]{1,255}\Z")


@dataclass(frozen=True)
class AdapterSource:
    """A parsed, validated adapter source. Build it with [`parse_source`].

    Attributes:
        raw: the string as given.
        kind: ``"hf"`` or ``"local"``.
        repo_id: ``org/repo`` for hub sources.
        revision: branch, tag or sha for hub sources (``None`` = the default branch).
        path_in_repo: subfolder or weight file inside the repo (``None`` = repo root).
        local_path: the expanded local path for local sources.
    """

    raw: str
    kind: SourceKind
    repo_id: str | None = None
    revision: str | None = None
    path_in_repo: str | None = None
    local_path: Path | None = None

    def __post_init__(self) -> None:
        if self.kind == "hf" and not self.repo_id:
            raise AdapterSourceError(f"Hub source {self.raw!r} has no repo id.", source=self.raw, part="repo")
        if self.kind == "local" and self.local_path is None:
            raise AdapterSourceError(f"Local source {self.raw!r} has no path.", source=self.raw, part="path")

    @property
    def names_file(self) -> bool:
        """Whether the source names one weight file (rather than an adapter folder)."""
        if self.kind == "hf":
            return self.path_in_repo is not None and _is_weight_file_name(self.path_in_repo)
        assert self.local_path is not None  # guaranteed by __post_init__
        return _is_weight_file_name(self.local_path.name)

    @property
    def is_pinned(self) -> bool:
        """Whether the revision is a full commit sha (resolvable from cache with no HTTP request)."""
        return self.revision is not None and bool(_COMMIT_SHA.match(self.revision))

    def with_revision(self, revision: str) -> AdapterSource:
        """Return the same hub source at another revision (e.g. pinned to the resolved commit)."""
        if self.kind != "hf":
            raise AdapterSourceError(f"Local source {self.raw!r} has no revision.", source=self.raw, part="revision")
        pinned = replace(self, revision=revision)
        return replace(pinned, raw=pinned.canonical())

    def canonical(self) -> str:
        """Return the normalized source string (``hf:org/repo@rev:path`` or an absolute path)."""
        if self.kind == "hf":
            out = f"{HF_PREFIX}{self.repo_id}"
            if self.revision:
                out += f"@{self.revision}"
            if self.path_in_repo:
                out += f":{self.path_in_repo}"
            return out
        assert self.local_path is not None
        return str(self.local_path)

    def __str__(self) -> str:
        return self.canonical()


@dataclass(frozen=True)
class ResolvedAdapter:
    """An adapter source resolved to files on local disk.

    Attributes:
        source: the source as parsed (hub sources carry the resolved commit in ``revision``).
        weights_path: the weight file to read.
        config_path: the config file used, or ``None`` when the config is inferred.
        config_rule: which lookup rule found the config.
        commit: the resolved commit sha (hub sources only).
        config_note: for a hub source whose config is inferred, what the Hub or the cache said of each config file.
    """

    source: AdapterSource
    weights_path: Path
    config_path: Path | None
    config_rule: ConfigRule
    commit: str | None = None
    config_note: str | None = None

    @property
    def identity(self) -> str:
        """A string that changes whenever the served bytes may change (pinned source or local path)."""
        return self.source.canonical()

    @property
    def is_pickle(self) -> bool:
        """Whether the weight file is a pickle file (read only with ``weights_only=True``)."""
        return self.weights_path.suffix in PICKLE_SUFFIXES


def _is_weight_file_name(name: str) -> bool:
    return name.endswith(SAFETENSORS_SUFFIX) or name.endswith(PICKLE_SUFFIXES)


def _fail(source: str, part: str, what: str, fix: str) -> AdapterSourceError:
    return AdapterSourceError(f"Invalid adapter source {source!r}: {what}. {fix}", source=source, part=part)


def _check_repo_id(source: str, repo_id: str) -> None:
    if not repo_id:
        raise _fail(source, "repo", "empty repo id after 'hf:'", "Write it as 'hf:org/repo'.")
    parts = repo_id.split("/")
    if len(parts) > 2 or any(not p for p in parts):
        raise _fail(source, "repo", f"repo id {repo_id!r} must be 'org/repo'", "Use exactly one '/' between org and repo.")
    if repo_id.endswith(".git"):
        raise _fail(source, "repo", f"repo id {repo_id!r} ends with '.git'",
                    "Give the repo id without '.git', e.g. 'hf:org/repo'.")
    for p in parts:
        if not _REPO_PART.match(p) or "--" in p or ".." in p or p[0] in "-." or p[-1] in "-.":
            raise _fail(
                source, "repo", f"repo id {repo_id!r} has an invalid name {p!r}",
                "Use letters, digits, '_', '-' and '.', not starting or ending with '-' or '.', without '--' or '..'.",
            )


def _check_revision(source: str, revision: str) -> None:
    if not revision:
        raise _fail(source, "revision", "empty revision after '@'",
                    "Remove '@' or give a branch, tag or commit, e.g. '@main'.")
    if not _REVISION.match(revision) or ".." in revision or any(c in ("", ".") for c in revision.split("/")):
        raise _fail(source, "revision", f"revision {revision!r} is not a valid branch, tag or commit",
                    "Use a branch or tag name, 'refs/pr/N', or a 40-character commit sha.")


def _check_relative_path(source: str, path: str, part: str) -> None:
    if not path:
        raise _fail(source, part, "empty path after ':'", "Remove the trailing ':' or name a file or folder in the repo.")
    if "\x00" in path:
        raise _fail(source, part, "NUL byte in path", "Remove it.")
    if "\\" in path:
        raise _fail(source, part, f"backslash in path {path!r}", "Use '/' to separate folders.")
    if path.startswith("/") or re.match(r"^[A-Za-z]:", path):
        raise _fail(source, part, f"absolute path {path!r}", "Give the path relative to the repo root.")
    components = path.split("/")
    if any(c == ".." for c in components):
        raise _fail(source, part, f"'..' in path {path!r}", "Paths may not leave the repo; name the file from the repo root.")
    if any(c in ("", ".") for c in components):
        raise _fail(source, part, f"empty or '.' component in path {path!r}", "Remove the doubled or trailing '/'.")
    if len(components) > _DEPTH_MAX:  # huggingface_hub makes each folder in the cache, one call deeper for each
        raise _fail(source, part, f"path of {len(components)} parts", f"A path may have at most {_DEPTH_MAX} parts.")
    _check_component_lengths(source, path, part)


_NAME_MAX, _PATH_MAX, _DEPTH_MAX = 255, 4095, 64  # bytes in a path's part and in the path (Linux), parts in a repo


def _check_component_lengths(source: str, path: str, part: str) -> None:
    name = ("path component", "a file or folder name", _NAME_MAX)
    for c, (what, limit, most) in [*((c, name) for c in path.split("/")), (path, ("path", "a path", _PATH_MAX))]:
        if (n := len(os.fsencode(c))) > most:  # quoted shortened: the source itself is at least this long
            shown = source if len(source) <= 80 else source[:60] + "..." + source[-10:]
            raise AdapterSourceError(f"Invalid adapter source {shown!r}: {what} {c[:24]!r}... is {n} bytes long, and "
                                     f"{limit} is at most {most} bytes. Check the path.", source=source, part=part)


def _check_weight_suffix(source: str, name: str, allow_pickle: bool) -> None:
    if name.endswith(PICKLE_SUFFIXES) and not allow_pickle:
        raise UnsafeFormatError(
            f"Adapter source {source!r} names a pickle weight file {name!r}, which can run code when loaded. "
            f"Convert it to .safetensors, or opt in with VLLM_LORA_EXT_ALLOW_PICKLE=1 "
            f"(it is then read with torch.load(weights_only=True)).",
            source=source, filename=name,
        )


def parse_source(source: str | os.PathLike[str], *, allow_pickle: bool | None = None) -> AdapterSource:
    """Parse an adapter source string without touching disk or network.

    Args:
        source (`str` or `os.PathLike`):
            ``hf:org/repo[@rev][:path]``, or a local folder or ``.safetensors`` file (``~`` is expanded).
        allow_pickle (`bool`, *optional*):
            Accept ``.bin``/``.pt`` weight files. Defaults to ``VLLM_LORA_EXT_ALLOW_PICKLE``.

    Returns:
        [`AdapterSource`]: the parsed source, already validated.

    Raises:
        [`AdapterSourceError`]: the repo id, revision or path part is empty or malformed, absolute,
            or contains ``..``, a backslash or NUL.
        [`UnsafeFormatError`]: a pickle weight file is named without the opt-in.

    Example:
        >>> parse_source("hf:acme/sql-lora@v2:adapter.safetensors").revision
        'v2'
        >>> parse_source("hf:acme/loras:sql").path_in_repo
        'sql'
    """
    raw = os.fspath(source)
    pickle_ok = _env_allow_pickle() if allow_pickle is None else allow_pickle
    if not isinstance(raw, str) or not raw.strip():
        raise AdapterSourceError("Empty adapter source. Give 'hf:org/repo' or a local path.", source=str(raw), part="source")
    if raw != raw.strip():
        raise _fail(raw, "source", "leading or trailing whitespace", "Remove the spaces around the source.")
    if "\x00" in raw:
        raise _fail(raw, "source", "NUL byte in source", "Remove it.")
    bad = next((ch for ch in raw if "\ud800" <= ch <= "\udfff"), None)
    if bad is not None:  # a lone surrogate: no file name, no UTF-8 on the wire
        raise _fail(raw.encode("utf-8", "replace").decode(), "source",
                    f"unpaired surrogate U+{ord(bad):04X} in source (shown as '?')", "Send the source as valid UTF-8 text.")
    if raw.lower().startswith(("hf://", "huggingface:", "huggingface://")):
        raise _fail(raw, "source", "unknown scheme",
                    f"Write hub sources as 'hf:org/repo[@rev][:path]', e.g. 'hf:{raw.split('//', 1)[-1].split(':', 1)[-1]}'.")
    if not raw.startswith(HF_PREFIX):
        _check_component_lengths(raw, raw, "path")
        try:
            path = Path(raw).expanduser()
        except RuntimeError:  # '~name' of no user here
            raise _fail(raw, "path", f"no home folder for {raw.split('/', 1)[0]!r}", "Write the whole path.") from None
        if _is_weight_file_name(path.name):
            _check_weight_suffix(raw, path.name, pickle_ok)
        return AdapterSource(raw=raw, kind="local", local_path=path.absolute())

    body = raw[len(HF_PREFIX):]
    repo_rev, sep, path_part = body.partition(":")
    repo_id, at, revision = repo_rev.partition("@")
    _check_repo_id(raw, repo_id)
    if at:
        _check_revision(raw, revision)
    path_in_repo: str | None = None
    if sep:
        _check_relative_path(raw, path_part, "path")
        path_in_repo = path_part
        last = path_part.rsplit("/", 1)[-1]
        if last.endswith(".json"):
            raise _fail(raw, "path", f"{path_part!r} is a config file",
                        "Name the weight file (.safetensors) or the adapter's folder; its config is found beside it.")
        if _is_weight_file_name(last):
            _check_weight_suffix(raw, last, pickle_ok)
    return AdapterSource(raw=raw, kind="hf", repo_id=repo_id, revision=revision if at else None, path_in_repo=path_in_repo)


# --------------------------------------------------------------------------------------------
# resolution


def _config_candidates(weights_name: str) -> list[tuple[str, ConfigRule]]:
    stem = weights_name[: -len(SAFETENSORS_SUFFIX)] if weights_name.endswith(SAFETENSORS_SUFFIX) else Path(weights_name).stem
    out: list[tuple[str, ConfigRule]] = []
    if weights_name not in (ADAPTER_WEIGHTS_NAME, *PICKLE_WEIGHTS_NAMES):
        out += [(f"{stem}_config.json", "<stem>_config.json"), (f"{stem}.json", "<stem>.json")]
    out.append((ADAPTER_CONFIG_NAME, "adapter_config.json"))
    return out


def _resolve_local(src: AdapterSource, pickle_ok: bool) -> ResolvedAdapter:
    assert src.local_path is not None
    path = src.local_path
    if src.names_file:
        if not path.is_file():  # (a FIFO or a device is no file to read either)
            what = "is not a regular file" if path.exists() else "does not exist"
            raise AdapterNotFoundError(f"Adapter weight file {str(path)!r} {what} (source {src.raw!r}). Check the "
                                       f"path, or write hub sources as 'hf:org/repo:file'.", source=src.raw)
        weights = path
    else:
        if not path.exists():
            raise AdapterNotFoundError(f"Adapter folder {str(path)!r} does not exist (source {src.raw!r}). Check the "
                                       f"path, or write hub sources as 'hf:org/repo'.", source=src.raw)
        if path.is_file():
            raise AdapterSourceError(f"Invalid adapter source {src.raw!r}: {path.name!r} is neither a folder nor a "
                                     f".safetensors file. Name the adapter's folder or its .safetensors weight file.",
                                     source=src.raw, part="path")
        weights = path / ADAPTER_WEIGHTS_NAME
        if not weights.is_file():
            pickles = [path / n for n in PICKLE_WEIGHTS_NAMES if (path / n).is_file()]
            if pickles and pickle_ok:
                weights = pickles[0]
            elif pickles:
                raise UnsafeFormatError(
                    f"Adapter folder {str(path)!r} holds only the pickle file {pickles[0].name!r}, which can run code "
                    f"when loaded. Convert it to adapter_model.safetensors, or opt in with VLLM_LORA_EXT_ALLOW_PICKLE=1.",
                    source=src.raw, filename=pickles[0].name,
                )
            else:
                found = sorted(p.name for p in path.glob("*.safetensors") if p.is_file())[:10]
                lora = [f for f in found if may_hold_lora(path / f, allowed_roots())]
                hint = (f" It holds {lora}: name one of them, e.g. '{path / lora[0]}'." if lora
                        else f" Its {found} hold no lora_A/lora_B weights: it looks like a base model, not an "
                             f"adapter. Name the adapter's folder." if found
                        else " Save the adapter with PEFT's save_pretrained().")
                has = "a weight file that is not a regular file:" if weights.exists() else "no"
                message = f"Adapter folder {str(path)!r} has {has} {ADAPTER_WEIGHTS_NAME} (source {src.raw!r})."
                raise AdapterNotFoundError(  # the file listing is for the operator's log, not for HTTP clients
                    message + hint, source=src.raw,
                    public_message=message + " Name the adapter's .safetensors weight file, or save the adapter "
                                             "with PEFT's save_pretrained().",
                )
    for name, rule in _config_candidates(weights.name):
        cand = weights.parent / name
        kind = path_kind(cand)  # (one stat: a folder swapped meanwhile is absent then, not "not a regular file")
        if kind == "file":
            return ResolvedAdapter(src, weights, cand, rule)
        if kind == "other":  # a FIFO, folder or dangling link: never skipped for an inferred one
            raise AdapterSourceError(f"Adapter config {str(cand)!r} is not a regular file (source {src.raw!r}). "
                                     f"Replace it with the adapter's {name}.", source=src.raw, part="path")
    return ResolvedAdapter(src, weights, None, "inferred")


def _resolve_hub(src: AdapterSource, pickle_ok: bool, client: HubClient) -> ResolvedAdapter:
    if src.names_file:
        assert src.path_in_repo is not None
        weight_candidates = [src.path_in_repo]
    else:
        base = f"{src.path_in_repo}/" if src.path_in_repo else ""
        weight_candidates = [base + ADAPTER_WEIGHTS_NAME] + ([base + n for n in PICKLE_WEIGHTS_NAMES] if pickle_ok else [])
    weights, weight_name = client.first_found(weight_candidates, src.revision, required=True) or (None, "")
    if weights is None:
        where = f"folder {src.path_in_repo!r}" if src.path_in_repo and not src.names_file else "repo root"
        what = repr(src.path_in_repo) if src.names_file else f"{ADAPTER_WEIGHTS_NAME} in the {where}"
        found = client.weight_files(src.revision, under=(src.path_in_repo or "").rpartition("/")[0] + "/"
                                    if src.names_file else f"{src.path_in_repo}/" if src.path_in_repo else "")
        rev, listed = f"@{src.revision}" if src.revision else "", f"{found[:5]}{' and more' if len(found) > 5 else ''}"
        recorded = not found and client.recorded_missing(weight_candidates)  # offline: the cache's record of a 404
        if found and found[0].endswith(PICKLE_SUFFIXES) and not pickle_ok:  # no .safetensors at all
            fix = (f"The repo holds only pickle weights, {listed}, which can run code when loaded: re-save them as "
                   f".safetensors, or opt in with VLLM_LORA_EXT_ALLOW_PICKLE=1 (read with weights_only=True).")
        elif found:
            fix = f"The repo holds {listed}; name one, e.g. 'hf:{src.repo_id}{rev}:{found[0]}'."
        elif recorded:
            fix = client.absence(weight_candidates, src.revision)
        else:
            fix = (f"The repo holds no .safetensors file at this revision (or it could not be listed); check the "
                   f"revision, e.g. 'hf:{src.repo_id}@main'.")
        said = (f"Adapter source {src.raw!r}: {what} not found in repo {src.repo_id!r} at revision "
                f"{src.revision or 'main'!r}.")
        raise AdapterNotFoundError(f"{said} {fix}", source=src.raw, revision=src.revision, public_message=(
            f"{said} {client.absence(weight_candidates, src.revision, public=True)}" if recorded else None))
    commit = commit_of(weights) or src.revision
    folder = weight_name.rsplit("/", 1)[0] + "/" if "/" in weight_name else ""
    basename = weight_name.rsplit("/", 1)[-1]
    pinned = src.with_revision(commit) if commit else src
    rules = {folder + name: rule for name, rule in _config_candidates(basename)}
    cfg = client.first_found(list(rules), commit, required=False)
    if cfg is not None:
        return ResolvedAdapter(pinned, weights, cfg[0], rules[cfg[1]], commit)
    note = client.absence(list(rules), commit)
    logger.warning("adapter source %r has no config file, so its config is inferred from the weights (rank from the "
                   "lora_A shapes, lora_alpha from the safetensors metadata): %s", src.raw, note)
    return ResolvedAdapter(pinned, weights, None, "inferred", commit, note)


def resolve_source(
    source: str | os.PathLike[str] | AdapterSource,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    token: str | bool | None = None,
    local_files_only: bool | None = None,
    allow_pickle: bool | None = None,
) -> ResolvedAdapter:
    """Resolve an adapter source to its weight file and config on local disk, downloading only those.

    Hub sources download the weight file and the first config that exists (see the module docstring)
    with ``hf_hub_download`` into the standard cache, pinned to the commit the weight file came from.
    A source pinned to a commit sha that is already cached resolves with no HTTP request.

    Args:
        source (`str`, `os.PathLike` or [`AdapterSource`]):
            The source; strings are parsed with [`parse_source`].
        cache_dir (`str` or `os.PathLike`, *optional*):
            The hub cache (default: huggingface_hub's, from ``HF_HOME``/``HF_HUB_CACHE``).
        token (`str` or `bool`, *optional*):
            Hub token (default: ``HF_TOKEN`` / the stored login).
        local_files_only (`bool`, *optional*):
            Never contact the hub. Defaults to ``HF_HUB_OFFLINE``.
        allow_pickle (`bool`, *optional*):
            Accept ``.bin``/``.pt`` weights. Defaults to ``VLLM_LORA_EXT_ALLOW_PICKLE``.

    Returns:
        [`ResolvedAdapter`]: the weight file, the config file (or ``None`` if inferred) and the commit.

    Raises:
        [`AdapterSourceError`]: the source string is malformed.
        [`AdapterNotFoundError`]: the folder, file, repo, revision or file in repo does not exist,
            or is not cached while offline.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()); (d / "adapter_model.safetensors").write_bytes(b"")
        0
        >>> resolve_source(str(d)).config_rule
        'inferred'
    """
    pickle_ok = _env_allow_pickle() if allow_pickle is None else allow_pickle
    src = source if isinstance(source, AdapterSource) else parse_source(source, allow_pickle=pickle_ok)
    offline = hf_offline() if local_files_only is None else local_files_only
    return _resolve(src, cache_dir=cache_dir, token=token, offline=offline, pickle_ok=pickle_ok)


def fetch_source(source: str, *, cache_dir: str | os.PathLike[str] | None = None) -> ResolvedAdapter:
    """Download an adapter source into the Hugging Face cache: what ``vllm-lora fetch`` does.

    As [`resolve_source`], but online unless ``HF_HUB_OFFLINE`` is set (then a source already cached is
    returned, and one that is not is refused naming that setting), with messages for its caller.

    Raises:
        [`AdapterSourceError`], [`AdapterNotFoundError`], [`AdapterDownloadError`]: as [`resolve_source`].
    """
    pickle_ok = _env_allow_pickle()
    src = parse_source(source, allow_pickle=pickle_ok)
    return _resolve(src, cache_dir=cache_dir, token=None, offline=hf_offline(), pickle_ok=pickle_ok, fetching=True)


def _resolve(src: AdapterSource, *, cache_dir: str | os.PathLike[str] | None, token: str | bool | None, offline: bool,
             pickle_ok: bool, fetching: bool = False) -> ResolvedAdapter:
    if src.kind == "local":
        assert src.local_path is not None
        if src.local_path.exists() or not _looks_like_repo_id(src.raw):
            local = _resolve_local(src, pickle_ok)
            metrics.SOURCES_RESOLVED.inc(cache="local")
            return local
        logger.info("adapter source %r is no local path; reading it as 'hf:%s'", src.raw, src.raw)
        try:  # a mistyped relative path reads as org/repo: say both what is not here and what the Hub said
            return _resolve(parse_source(HF_PREFIX + src.raw, allow_pickle=pickle_ok), cache_dir=cache_dir, token=token,
                            offline=offline, pickle_ok=pickle_ok, fetching=fetching)
        except (AdapterNotFoundError, AdapterDownloadError) as err:  # (the client's text: no server folder)
            raise AdapterNotFoundError(f"No local folder {src.raw!r} ({str(src.local_path)!r} does not exist); as a Hub "
                                       f"repo: {err}", source=src.raw, public_message=f"No local folder {src.raw!r}; "
                                       f"as a Hub repo: {err.client_message()}") from err
    client = HubClient(src, cache_dir=cache_dir, token=token, local_files_only=offline, fetching=fetching)
    t0 = time.perf_counter()
    with diskcache.resolving(src.repo_id or "", src.revision, cache_dir=cache_dir) as use:  # no eviction meanwhile
        resolved = use.done(_resolve_hub(src, pickle_ok, client))
    metrics.SOURCES_RESOLVED.inc(cache="miss" if client.downloaded else "hit")
    if client.downloaded:
        metrics.SOURCE_DOWNLOAD_SECONDS.observe(time.perf_counter() - t0)
    logger.info("resolved adapter source %r to commit %s (%s, config: %s)", src.raw, resolved.commit,
                resolved.weights_path.name, resolved.config_rule)
    return resolved


def _looks_like_repo_id(raw: str) -> bool:
    if raw.startswith((".", "/", "~")) or raw.count("/") != 1:
        return False
    try:
        _check_repo_id(raw, raw)
    except AdapterSourceError:
        return False
    return True
