"""What the plugin checks of a Hub's answers before huggingface_hub writes by them.

``hf_hub_download`` names the cached blob after the Hub's ``ETag`` and the snapshot folder after its
``X-Repo-Commit``, and writes a body until it ends. A Hub or mirror (``HF_ENDPOINT``) that answers an ETag such as
``../../x`` or an absolute path, or a commit that is not a sha, would make it write, or link the adapter to a file,
outside the cache; one that announces 100 bytes and sends gigabytes would fill the disk past the disk cache bound.
So before a download (the one place is [`diskcache.download_file`]):

1. `head` asks for the file's metadata once and refuses an ETag that is not one plain file name or a commit that is
   not 40 hex digits, also on a 404 (huggingface_hub marks a missing file under the commit it was told);
2. the download's byte counter (`capped`) stops the transfer once it passes the size announced (or, when none was,
   the disk cache bound), and huggingface_hub removes its partial file. Not for a file in Xet storage: hf_xet
   catches errors raised in its progress callbacks, so there only the bound's check after the download holds;
3. `expecting` holds huggingface_hub's own requests during the download to that first answer: its second metadata
   request must name the same commit, ETag, size and storage (Xet or not), and every answer's commit must be a
   sha, checked as each answer arrives (an event hook on huggingface_hub's HTTP client), before huggingface_hub
   names or writes anything by it (a blob, a snapshot link, a ``.no_exist`` marker, ``refs/<revision>``);
4. `contained` refuses a returned path that is not ``snapshots/<sha>/…`` of the repo's folder (of the commit asked
   for, or named by the Hub just before) or resolves outside the cache: nothing is read from it;
5. `check_content` refuses a downloaded file whose blob is named by a digest that its bytes do not have (an LFS
   file's ETag, the Hub's ``X-Linked-Etag``, is their sha256; a git file's is its git blob id, a sha1), and removes
   it: huggingface_hub checks only the size.

Each refusal is a [`HubAnswerError`] naming the header and its value, and for the operator the endpoint; a
client is told the server's Hub answered wrongly, not where it is.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

from vllm_lora_ext import hubdeadline
from vllm_lora_ext.constants import MAX_CONFIG_BYTES
from vllm_lora_ext.errors import AdapterFormatError, HubAnswerError

__all__ = ["COMMIT_SHA", "HubFacts", "capped", "check_commit", "check_content", "check_etag", "check_listing",
           "contained", "expecting", "head", "hub_endpoint", "transfer_cap", "watch_clients"]

logger = logging.getLogger(__name__)

COMMIT_SHA = re.compile(r"[0-9a-f]{40}\Z")  # a commit (with .match): a pinned revision, a snapshot folder
LFS_SHA256 = re.compile(r"[0-9a-f]{64}\Z")  # an LFS file's ETag: the sha256 of its bytes
GIT_BLOB_ID = re.compile(r"[0-9a-f]{40}\Z")  # a git file's ETag: its git blob id (the sha1 of a header and its bytes)
ETAG_BAD = re.compile(r"[/\\\x00]|^\.|\.\.")  # a separator, NUL, a leading dot or "..": not one plain file name


@dataclass(frozen=True)
class HubFacts:
    """What the Hub said of one file: its size and commit (``None`` where it said nothing or could not be asked)."""

    size: int | None = None
    commit: str | None = None
    etag: str | None = None
    failed: BaseException | None = None  # the Hub was busy or unreachable through every retry
    xet: bool = False  # served from Xet storage, whose transfer reports no bytes the cap could stop


def hub_endpoint() -> str:
    """Return the Hub endpoint huggingface_hub uses (``HF_ENDPOINT``, read by it at import)."""
    from huggingface_hub import constants

    return str(constants.ENDPOINT)


_CLIENT_FIX = "The server's Hub or mirror answers otherwise than huggingface.co; tell the server's operator."


def _refuse(source: str, header: str, value: str, why: str, filename: str = "", *, retry: bool = False) -> HubAnswerError:
    of = f"{source!r}" + (f" (file {filename!r})" if filename and not source.endswith(filename) else "")
    said = f"answered {header} {value[:80]!r} for {of}, which is {why}; nothing was downloaded."
    fix = "" if retry else " Point HF_ENDPOINT at a Hub or mirror that answers as huggingface.co does."
    return HubAnswerError(f"The Hub at {hub_endpoint()!r} {said}{fix}", source=source, header=header, value=value[:200],
                          public_message=f"The Hub {said}" + (" Retry." if retry else f" {_CLIENT_FIX}"))


def check_commit(value: str | None, source: str, filename: str = "") -> str | None:
    """Return ``value`` if it is a commit sha (or ``None``), else raise [`HubAnswerError`] (naming ``filename``)."""
    if value is not None and not COMMIT_SHA.match(value):
        raise _refuse(source, "X-Repo-Commit", value, "not a 40-hex-digit commit", filename)
    return value


def check_etag(value: str | None, source: str, filename: str = "") -> str | None:
    """Return ``value`` if it can name a blob file (or ``None``), else raise [`HubAnswerError`] naming ``filename``."""
    if value is not None and (not value or len(value.encode("utf-8", "surrogatepass")) > 200 or ETAG_BAD.search(value)):
        raise _refuse(source, "ETag", value, "not a plain file name (a blob in the cache is named by it)", filename)
    return value


def head(repo_id: str, filename: str, *, revision: str | None, token: str | bool | None, source: str,
         backoff: bool = False) -> HubFacts:
    """Ask the Hub for ``filename``'s metadata once and check it (see the module's step 1); with ``backoff``,
    through huggingface_hub's round of retries instead, which ``hf_hub_download`` runs after a busy answer (408,
    429, 5xx) when nothing is cached.

    A 4xx answer gives empty facts: ``hf_hub_download`` asks again and raises its own error (and marks a missing
    file in the cache), which the callers map. A busy or unreachable Hub comes back as ``failed``: the caller then
    reads the cache, and asks again with ``backoff`` only if nothing is cached and the Hub was busy.
    """
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    url = hf_hub_url(repo_id, filename, revision=revision)
    can_retry = "retry_on_errors" in inspect.signature(get_hf_file_metadata).parameters
    try:
        meta = get_hf_file_metadata(url, token=token, **({"retry_on_errors": backoff} if can_retry else {}))
    except Exception as err:
        response = getattr(err, "response", None)
        check_commit((getattr(response, "headers", None) or {}).get("X-Repo-Commit"), source, filename)
        logger.debug("no metadata for %s:%s before its download: %s", repo_id, filename, err)
        status = getattr(response, "status_code", None)
        if status is not None and status < 500 and status not in (408, 429):  # (those two: busy, retried)
            return HubFacts()
        return HubFacts(failed=err)
    commit, etag = check_commit(meta.commit_hash, source, filename), check_etag(meta.etag, source, filename)
    size = int(meta.size) if meta.size is not None and int(meta.size) >= 0 else None
    return HubFacts(size=size, commit=commit, etag=etag, xet=getattr(meta, "xet_file_data", None) is not None)


def transfer_cap(facts: HubFacts, limit: int | None, *, source: str, filename: str,
                 disk: Path | None = None) -> int | None:
    """The bytes a download of ``filename`` may write (`capped`): the size the Hub announced, else the disk cache
    bound ``limit``, else the free space of ``disk`` (the cache's folder) less a margin, so that a Hub announcing no
    size never fills the disk; for a JSON file (a config, which is read whole) at most ``MAX_CONFIG_BYTES``;
    ``None`` for a file in Xet storage that hf_xet transfers (it swallows the cap's error; with hf_xet missing or
    turned off, huggingface_hub downloads it over HTTP, counted). A config announced larger is refused undownloaded.

    Raises:
        [`AdapterFormatError`]: a JSON file the Hub announces larger than ``MAX_CONFIG_BYTES``, or a file larger than
            huggingface_hub downloads over HTTP (its ``ValueError`` otherwise).
    """
    from huggingface_hub import constants

    most = MAX_CONFIG_BYTES if filename.endswith(".json") else None
    if most is not None and facts.size is not None and facts.size > most:
        raise AdapterFormatError(f"{filename!r} of {source!r} is {facts.size} bytes on the Hub, larger than a config "
                                 f"may be ({most} bytes); nothing was downloaded. Use a config of at most 1 MiB.")
    if facts.xet and _xet_transfers():
        return None
    http_most = getattr(constants, "MAX_HTTP_DOWNLOAD_SIZE", None)
    if http_most is not None and facts.size is not None and facts.size > http_most:
        raise AdapterFormatError(f"{filename!r} of {source!r} is {facts.size} bytes on the Hub, more than "
                                 f"huggingface_hub downloads over plain HTTP ({http_most} bytes); nothing was "
                                 f"downloaded. For a file in Xet storage, install hf_xet and leave HF_HUB_DISABLE_XET "
                                 f"unset.")
    cap = facts.size if facts.size is not None else limit if limit is not None else _free_room(disk)
    return cap if most is None else most if cap is None else min(cap, most)


def _free_room(disk: Path | None) -> int | None:
    """The free bytes of the disk that holds ``disk`` (its nearest existing folder) less a margin (1 GiB, or 5% of a
    disk smaller than 20 GiB), or ``None``."""
    folder = disk
    while folder is not None and not folder.exists() and folder != folder.parent:
        folder = folder.parent
    try:
        usage = None if folder is None else shutil.disk_usage(folder)
    except OSError:
        return None
    return None if usage is None else max(usage.free - min(1 << 30, usage.total // 20), 0)


def _xet_transfers() -> bool:
    """Whether huggingface_hub hands a file in Xet storage to hf_xet (installed, and not turned off)."""
    try:
        from huggingface_hub.utils._runtime import is_xet_available
    except ImportError:  # a huggingface_hub that does not say: assume it does
        return True
    return bool(is_xet_available())


def capped(tqdm_class: Any, cap: int, *, source: str, filename: str,
           on_bytes: Callable[[int], None] | None = None) -> Any:
    """Return ``tqdm_class`` (or huggingface_hub's) counting the bytes written, which stops past ``cap`` bytes and
    tells ``on_bytes`` the count after each update (it may stop the transfer by raising)."""
    if tqdm_class is None:
        from huggingface_hub.utils import tqdm as tqdm_class

    class _Capped(tqdm_class):  # type: ignore[misc,valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            self._vle_bytes = int(kwargs.get("initial") or 0)
            super().__init__(*args, **kwargs)

        def update(self, n: float | None = 1) -> bool | None:
            self._vle_bytes += int(n or 0)
            if self._vle_bytes > cap:
                raise HubAnswerError(
                    f"The Hub at {hub_endpoint()!r} sent more than {cap} bytes of {filename!r} for {source!r}, more than "
                    f"it announced (or, announcing no size, than the disk cache bound VLLM_LORA_EXT_DISK_CACHE_BYTES, "
                    f"the cache disk's free space less a margin, or a config's {MAX_CONFIG_BYTES} bytes); the transfer "
                    f"was stopped and its partial file is not kept. Point HF_ENDPOINT at a Hub or mirror that answers "
                    f"as huggingface.co does.", source=source, header="Content-Length", value=str(cap),
                    public_message=f"The Hub sent more than {cap} bytes of {filename!r} for {source!r}, more than it "
                                   f"announced or than the server allows; the transfer was stopped. {_CLIENT_FIX}")
            if on_bytes is not None:
                on_bytes(self._vle_bytes)
            return super().update(n)

    return _Capped


def contained(path: str, repo: Path, *, source: str, commit: str | None = None) -> str:
    """Return ``path`` if it is ``snapshots/<sha>/…`` of ``repo`` (the repo's cache folder), of ``commit`` when
    given (a pinned commit, or the one the Hub named just before the download), and resolves inside the Hugging
    Face cache that holds it (huggingface_hub 2's xet store keeps blobs in ``<cache>/blobs``, shared by every
    repo). The folders are compared resolved, so a cache reached through a link is the same cache. A snapshot of
    another commit also removes ``refs/<commit>`` if the cache maps the pinned commit to it."""
    snapshots = os.path.realpath(repo / "snapshots")
    folder = os.path.realpath(os.path.dirname(os.path.abspath(path)))  # the file itself stays a link
    inside_snapshots = os.path.commonpath([folder, snapshots]) == snapshots
    parts = (*Path(os.path.relpath(folder, snapshots)).parts, os.path.basename(path)) if inside_snapshots else ()
    real, cache = os.path.realpath(path), os.path.realpath(repo.parent)
    raced = False  # another commit's snapshot: a race or an inconsistent Hub, not a cache to clean by hand
    if len(parts) < 2 or not COMMIT_SHA.match(parts[0]) or ".." in parts:
        why = "is not a snapshot of a commit in the repo's cache folder"
    elif commit is not None and parts[0] != commit:
        raced = True
        why = (f"is of commit {parts[0]}, not of {commit}, which was asked for (pinned, or the commit the Hub named "
               f"just before: pushed meanwhile, or a Hub that answers two requests differently; retry)")
        with contextlib.suppress(OSError):  # a pinned commit the cache maps to another: never read that way again
            if (repo / "refs" / commit).read_text().strip() == parts[0]:
                os.unlink(repo / "refs" / commit)
    elif os.path.commonpath([real, cache]) != cache:
        why = "links outside the Hugging Face cache"
    else:
        return path
    public = (f"The cached file of {source!r} {why}. Nothing was read from it." if raced else
              f"The cached file of {source!r} {why}: the server's Hub answered otherwise than huggingface.co, or its "
              f"cache was changed by hand. Nothing was read from it. Tell the server's operator.")
    private = public if raced else (
        f"The cached file of {source!r} {why}: the Hub at {hub_endpoint()!r} answered huggingface_hub otherwise than "
        f"the plugin, or the cache was changed by hand. Nothing was read from it. Remove the repo's folder from the "
        f"Hugging Face cache, and point HF_ENDPOINT at a Hub or mirror that answers as huggingface.co does.")
    raise HubAnswerError(f"{private} (path {path!r}, resolves to {real!r})", source=source, header="cached path",
                         value=path[:200], public_message=public)


def check_content(path: str | os.PathLike[str], *, source: str, filename: str) -> None:
    """Refuse the downloaded file ``path`` (a snapshot's link to its blob) if its blob is named by a digest its bytes
    do not have: a sha256 (an LFS file's ETag) or a git blob id (a git file's: the sha1 of ``b"blob <size>\\0"`` and
    the bytes; a mirror that drops the Hub's ``X-Linked-Etag`` answers an LFS file's by its pointer's, and some
    mirrors a file's by the plain sha1 of its bytes: both are taken too). Remove the link and the blob, so that the cache serves no wrong bytes and a retry downloads the
    file again, and raise [`HubAnswerError`] naming the file, the source and both digests. A blob named otherwise
    (a mirror's own kind of ETag) or a copy instead of a link is not checked."""
    if not os.path.islink(path):
        return
    blob = os.path.join(os.path.dirname(path), os.readlink(path))  # (one link: a shared Xet blob is named otherwise)
    etag = os.path.basename(blob)
    if LFS_SHA256.match(etag):
        kind, got = "sha256", _digest(path, hashlib.sha256())
    elif GIT_BLOB_ID.match(etag):
        size = os.path.getsize(path)
        kind, got = "git blob id", _digest(path, hashlib.sha1(b"blob %d\0" % size))
        if got != etag and etag in (_lfs_pointer_id(_digest(path, hashlib.sha256()), size),
                                    _digest(path, hashlib.sha1())):  # (a mirror's sha1 of the bytes themselves)
            return
    else:
        return
    if got == etag:
        return
    for place in (path, blob):
        with contextlib.suppress(OSError):
            os.unlink(place)
    said = (f"sent bytes of {filename!r} for {source!r} whose {kind} is {got}, not the {etag} its ETag names; the "
            f"file was removed from the cache and nothing was read from it.")
    raise HubAnswerError(f"The Hub at {hub_endpoint()!r} {said} Retry; if it recurs, point HF_ENDPOINT at a Hub or "
                         f"mirror that serves the files huggingface.co does.", source=source, header="ETag", value=etag,
                         public_message=f"The Hub {said} Retry; if it recurs, tell the server's operator.")


def _digest(path: str | os.PathLike[str], seeded: Any) -> str:
    """The hex digest of ``seeded`` (a hashlib object, maybe fed a prefix already) over the file's bytes."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, lambda: seeded).hexdigest()


def _lfs_pointer_id(sha256: str, size: int) -> str:
    """The git blob id of the LFS pointer file of a file with this sha256 and size (what git stores for it)."""
    pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{sha256}\nsize {size}\n".encode()
    return hashlib.sha1(b"blob %d\0" % len(pointer) + pointer).hexdigest()


def writes_inside(repo: Path, *, source: str, ref: Path | None = None) -> None:
    """Refuse a download into ``repo`` (the repo's cache folder) where huggingface_hub would write through a link out
    of the cache that holds it: the repo's folder, its ``blobs``, ``refs``, ``.no_exist`` or ``snapshots`` (or
    one of those snapshots), the branch's ``ref`` file, or the cache's ``.locks`` and the repo's own there.
    `contained` checks the file only after it is written; a link planted in a shared cache would have had the Hub's
    bytes written where it points. A link planted after this check is not seen.

    Raises:
        [`HubAnswerError`]: naming the link and where it leads; nothing was downloaded.
    """
    cache = os.path.realpath(repo.parent)
    snapshots = repo / "snapshots"
    locks = repo.parent / ".locks"
    places = [repo, repo / "blobs", repo / "refs", snapshots, repo / ".no_exist", locks, locks / repo.name,
              *([ref] if ref is not None else [])]  # (the branch's ref: older huggingface_hub writes through it)
    if snapshots.is_dir() and not snapshots.is_symlink():
        places += sorted(snapshots.iterdir())
    for place in places:
        real = os.path.realpath(place)
        if os.path.lexists(place) and os.path.commonpath([real, cache]) != cache:
            said = (f"The Hugging Face cache's {str(place)!r} links outside the cache (to {real!r}), so a download of "
                    f"{source!r} would write there; nothing was downloaded. Remove that link (the cache was changed "
                    f"by hand), or use another HF_HUB_CACHE.")
            public = f"The server's Hugging Face cache holds a link out of it, so {source!r} was not downloaded. " \
                     f"Tell the server's operator."
            raise HubAnswerError(said, source=source, header="cache folder", value=str(place)[:200],
                                 public_message=public)


# What huggingface_hub's requests in an `expecting` block must agree with: (source, filename, what `head` was told,
# the commit the download must land in, whether that commit was pinned). Per thread (and task): other traffic on
# the shared client is untouched.
_EXPECTED: ContextVar[tuple[str, str, HubFacts, str | None, bool] | None] = ContextVar(
    "vllm_lora_ext_hub_expected", default=None)


@contextlib.contextmanager
def expecting(facts: HubFacts, commit: str | None, *, source: str, filename: str, pinned: bool = False
              ) -> Iterator[None]:
    """Within the block, refuse any answer to huggingface_hub (its own metadata request, its download) that names a
    commit other than a sha or than ``commit`` (``pinned``: the caller's, which no retry changes), or, on its
    metadata request, another ETag, size or storage than ``facts`` (see the module's step 3). Needs
    huggingface_hub's httpx client (1.0 and later); with an older one only steps 1, 2 and 4 hold."""
    watch_clients()
    token = _EXPECTED.set((source, filename, facts, commit, pinned))
    try:
        yield
    finally:
        _EXPECTED.reset(token)


def watch_clients() -> None:
    """Put `_check_answer` (and with it `hubdeadline.on_answer`) on huggingface_hub's shared client and on every
    client its factory makes from now on: it makes a new one after a connection error in a retried request, after a
    fork, or after ``set_client_factory`` (whose factory is wrapped at the next `expecting`)."""
    from huggingface_hub import get_session

    try:
        from huggingface_hub.utils import _http
    except ImportError:  # pragma: no cover - an older huggingface_hub: its one session is watched below
        _http = None
    with getattr(_http, "_CLIENT_LOCK", contextlib.nullcontext()):  # as set_client_factory swaps it: none lost
        factory = getattr(_http, "_GLOBAL_CLIENT_FACTORY", None)
        if callable(factory) and getattr(factory, "_vllm_lora_ext_watched", None) is not True:
            _http._GLOBAL_CLIENT_FACTORY = _watched(factory)  # not set_client_factory: it closes the client in use
    _hook(get_session())  # (after the lock, which get_session takes)


def _watched(factory: Any) -> Any:
    """``factory``, making clients that carry `_check_answer`."""
    def watched() -> Any:
        client = factory()
        _hook(client)
        return client

    watched._vllm_lora_ext_watched = True  # type: ignore[attr-defined]
    return watched


def _hook(client: Any) -> None:
    hooks = getattr(client, "event_hooks", {}).get("response")
    if isinstance(hooks, list) and _check_answer not in hooks:
        hooks.append(_check_answer)  # a client is long-lived: once (a second copy would only check twice)


def check_listing(repo: Path, commit: str, filename: str, facts: HubFacts, *, source: str) -> None:
    """Check a pinned file's entry in the commit's cached tree listing (``trees/<commit>.json`` of the repo's cache
    folder, which any ``snapshot_download`` of the repo writes): huggingface_hub reads a file in Xet storage by
    it instead of asking the Hub, so no hook sees that answer. Its ETag must be a plain file name and, like a
    second answer, agree with ``facts`` (`expecting`)."""
    try:
        from huggingface_hub._tree_cache import read_tree_cache
    except ImportError:  # a huggingface_hub without the listing cache: it always asks
        return
    entry = (read_tree_cache(str(repo), commit) or {}).get(filename)
    if entry is None or getattr(entry, "lfs_sha256", None) is None or getattr(entry, "xet_hash", None) is None:
        return  # listed as no file in Xet storage: huggingface_hub asks the Hub, and `expecting` sees the answer
    etag = check_etag(str(entry.lfs_sha256), source, filename)
    if facts == HubFacts():
        return  # the plugin's request got an error (a private repo, a token gone): huggingface_hub's own says which
    _agree((("ETag", etag, facts.etag), ("Content-Length", entry.lfs_size, facts.size),
            ("X-Xet-Hash", _STORAGE[True], _STORAGE[facts.xet])), source, filename,
           why="in its cached tree listing, not the {!r} it answered the plugin's request with")


def _normal_etag(raw: str) -> str:
    """An ETag header as huggingface_hub reads it into a file name (its leading ``W/`` and quotes stripped)."""
    return raw.lstrip("W/").strip('"')


_STORAGE = {True: "Xet storage", False: "no Xet storage"}


def _in_xet(response: Any) -> bool:
    """Whether huggingface_hub reads the answer as a file in Xet storage (as `head` reads ``HubFacts.xet``)."""
    try:
        from huggingface_hub.utils import parse_xet_file_data_from_response
    except ImportError:  # a huggingface_hub without Xet
        return False
    return parse_xet_file_data_from_response(response) is not None


def _followed(response: Any) -> bool:
    """Whether huggingface_hub follows this answer to a metadata request (a redirect it takes to the same Hub, as
    its ``_httpx_follow_relative_redirects`` decides) rather than reading it as the file's metadata."""
    location = response.headers.get("Location")
    if not (response.has_redirect_location and location):
        return False
    url = str(response.request.url)
    target = urljoin(url, location)
    try:
        from huggingface_hub.utils._http import _is_same_or_hub_host
    except ImportError:  # an older huggingface_hub: it follows the relative ones
        return not urlsplit(location).netloc
    return bool(_is_same_or_hub_host(url, target))


def _check_answer(response: Any) -> None:
    """The event hook of `expecting` and `hubdeadline.timed`: runs on each answer before huggingface_hub reads it."""
    hubdeadline.on_answer(response)
    expected = _EXPECTED.get()
    if expected is None:
        return
    source, filename, facts, commit, pinned = expected
    headers = response.headers
    said = check_commit(headers.get("X-Repo-Commit"), source, filename)
    if said is not None and commit is not None and said != commit:
        raise _refuse(source, "X-Repo-Commit", said, f"not the commit asked for, {commit} (pinned, or named by the Hub "
                      f"just before: pushed meanwhile, or a Hub that answers two requests differently)",
                      filename, retry=not pinned)
    if response.request.method != "HEAD" or response.status_code >= 400 or _followed(response):
        return  # a download's body, an error, or a redirect huggingface_hub follows: no file's metadata
    raw_etag = headers.get("X-Linked-Etag") or headers.get("ETag")
    etag = check_etag(_normal_etag(raw_etag), source, filename) if raw_etag else None
    if facts == HubFacts():  # the plugin's own request was answered with an error, this one with the file
        raise _refuse(source, "status", str(response.status_code), "not the error it answered the plugin's request "
                      "with just before (a Hub that answers two requests differently)", filename)
    size = headers.get("X-Linked-Size") or headers.get("Content-Length")
    _agree((("ETag", etag, facts.etag), ("Content-Length", size, facts.size),
            ("X-Xet-Hash", _STORAGE[_in_xet(response)], _STORAGE[facts.xet])), source, filename,
           why="not the {!r} it answered the plugin's request just before")


def _agree(pairs: Any, source: str, filename: str, *, why: str) -> None:
    """Refuse the first ``(header, now, before)`` whose value now differs from what the Hub told the plugin before
    (either unknown: no check); ``why`` says so, given ``before``."""
    for header, now, before in pairs:
        if before is not None and now is not None and str(now) != str(before):
            raise _refuse(source, header, str(now), f"{why.format(before)} (a Hub that answers two requests "
                          f"differently)", filename)
