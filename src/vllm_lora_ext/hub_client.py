"""The only code that talks to huggingface_hub ([`HubClient`]), and what it says when the Hub cannot be used.

huggingface_hub retries a file it cannot find in the cache for about 25 s when the network is down (five
retries, 1 to 8 s apart). Before such a download, [`hub_unreachable`] makes one TCP connection to the
endpoint: a refused connection, an unknown host or an unreachable network fails at once, with the
messages below, which name offline mode whenever it is on and give the concrete settings
(``HF_HUB_OFFLINE``, ``HF_ENDPOINT``, the cache folder). A connection that is slow to answer, or any proxy
setting, leaves the decision to huggingface_hub.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol
from urllib.parse import quote, urlsplit

import msgspec

from vllm_lora_ext import diskcache, hubdeadline, hubguard, hubrefs
from vllm_lora_ext._progress import logging_tqdm_class
from vllm_lora_ext.constants import MAX_LISTING_BYTES, PICKLE_SUFFIXES, SAFETENSORS_SUFFIX, hf_offline, proxy_configured
from vllm_lora_ext.diskholds import cache_path, state_root
from vllm_lora_ext.diskledger import commit_of, drop_missing_mark, missing_mark
from vllm_lora_ext.errors import AdapterDownloadError, AdapterNotFoundError
from vllm_lora_ext.hubguard import COMMIT_SHA, hub_endpoint

__all__ = ["HubClient", "HubRepo", "hub_endpoint", "hub_unreachable", "offline_message",
           "unreachable_message"]

logger = logging.getLogger(__name__)


class HubRepo(Protocol):
    """What the client needs of a hub source (``sources.AdapterSource`` is one; sources.py imports this module)."""

    @property
    def raw(self) -> str: ...

    @property
    def repo_id(self) -> str | None: ...



# errors of this host's cache folder: no retry of the download helps
_LOCAL_FAULTS = frozenset({errno.ENAMETOOLONG, errno.ENOTDIR, errno.ELOOP, errno.EFBIG, errno.EACCES, errno.EROFS,
                           errno.EISDIR})
_DEFINITE = (errno.ECONNREFUSED, errno.ENETUNREACH, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL)
PROBE_SECONDS = 1.5

# How a client found a file missing (`HubClient.absent`): the Hub answered 404 to it; the cache records that the Hub
# answered 404 before (huggingface_hub's ``.no_exist`` marker), believed without asking; or that, asked again.
ANSWERED, RECORDED, ASKED_AGAIN = "answered", "recorded", "asked again"


def hub_unreachable() -> str | None:
    """Return why the Hub endpoint certainly cannot be reached (one TCP connection), or ``None``.

    ``None`` also where the answer is not certain: a proxy is set, or the connection does not answer within
    1.5 s (huggingface_hub then decides, with its own timeouts and retries).
    """
    if proxy_configured():
        return None
    url = urlsplit(hub_endpoint())
    host = url.hostname
    if not host:
        return None
    try:
        port = url.port or (443 if url.scheme == "https" else 80)
    except ValueError:
        return None
    found: list[str | None] = []

    def attempt() -> None:
        try:
            with socket.create_connection((host, port), timeout=PROBE_SECONDS):
                found.append(None)
        except socket.gaierror as err:
            found.append(f"host {host!r} is unknown: {err.strerror or err}")
        except OSError as err:
            found.append(f"{err.strerror or err}" if err.errno in _DEFINITE else None)

    worker = threading.Thread(target=attempt, name="vllm-lora-ext-hub-probe", daemon=True)
    worker.start()
    worker.join(PROBE_SECONDS + 0.2)
    return found[0] if found else None


def cached_weight_files(repo_id: str, revision: str | None, *, cache_dir: str | os.PathLike[str] | None,
                        limit: int = 1000) -> list[str]:
    """The ``.safetensors`` files the local cache holds for ``repo_id`` at ``revision`` (a branch, tag or commit;
    default ``main``), sorted; empty when nothing of that revision is cached. Looks at ``limit`` entries at most.

    Example:
        >>> import tempfile
        >>> cached_weight_files("acme/x", None, cache_dir=tempfile.mkdtemp())
        []
    """
    if ".." in repo_id or ".." in (revision or "") or (revision or "").startswith("/"):
        return []  # (sources are checked before this; never a path out of the cache)
    repo = diskcache.repo_folder(cache_path(cache_dir), repo_id)
    ref = repo / "refs" / (revision or "main")
    try:
        sha = ref.read_text()[:64].strip() if ref.is_file() else (revision or "")
        snapshot = repo / "snapshots" / sha
        if not sha or "/" in sha or not snapshot.is_dir():
            return []
        found = []
        for n, path in enumerate(snapshot.rglob("*")):
            if n >= limit:
                break
            if path.name.endswith(SAFETENSORS_SUFFIX):
                found.append(path.relative_to(snapshot).as_posix())
        return sorted(found)
    except OSError:
        return []


def _offline_setting() -> str:
    return "offline mode is on (HF_HUB_OFFLINE=1)" if hf_offline() else "the Hub may not be contacted (local_files_only)"


def offline_message(what: str, filename: str, revision: str | None, *, cache_dir: str | os.PathLike[str] | None,
                    fix: str, public: bool = False) -> str:
    """The message for a file that is not cached while the Hub may not be asked (``public``: for a client, without
    the server's cache folder)."""
    where = "" if public else f"; cache {str(cache_path(cache_dir))!r}"
    return (f"{what} is not in the local Hugging Face cache ({filename!r} at revision {revision or 'main'!r}{where}), "
            f"and {_offline_setting()}, so the Hub was not asked. {fix}")


def unreachable_message(what: str, filename: str, reason: str, *, cache_dir: str | os.PathLike[str] | None,
                        fix: str, public: bool = False) -> str:
    """The message for a file that is not cached while the Hub does not answer (``public``: for a client, without
    the server's Hub address and cache folder)."""
    if public:
        return f"Could not reach the Hugging Face Hub for {what}, and {filename!r} is not in the server's cache. {fix}"
    return (f"Could not reach the Hugging Face Hub at {hub_endpoint()!r} ({reason.rstrip('.')}) for {what}, and "
            f"{filename!r} is not in the local cache ({str(cache_path(cache_dir))!r}). Check the network, or set HF_ENDPOINT "
            f"to a Hub or mirror that answers. {fix}")


class HubClient:
    """The only code that talks to huggingface_hub: one call per file, errors mapped to ours."""

    def __init__(self, src: HubRepo, *, cache_dir: str | os.PathLike[str] | None, token: str | bool | None,
                 local_files_only: bool, label: str = "adapter source", fetching: bool = False) -> None:
        self.src = src
        self.cache_dir = cache_dir
        self.token = token
        self.local_only = local_files_only
        self.label = label  # what the source is, in messages: "adapter source" or "base model"
        self.fetching = fetching  # the caller is 'vllm-lora fetch' (its advice is not to run it)
        self.downloaded = False  # whether any fetch had to download (a cache miss)
        self.absent: dict[str, tuple[str, str]] = {}  # a file found missing: how (ANSWERED, ...), and why so
        self.asked_again: set[tuple[str, str]] = set()  # (file, commit): recorded missing, asked again

    def _no_hub(self, filename: str, revision: str | None, reason: str | None) -> AdapterNotFoundError:
        """The error for a file that is not cached while the Hub may not be asked (``reason=None``) or does not answer."""
        raw, repo = self.src.raw, self.src.repo_id
        what = f"{self.label.capitalize()} {raw!r}"
        if self.label != "adapter source":
            fix = (f"Download it where the Hub is reachable ('hf download {repo} {filename}' into this cache), or pass "
                   f"the model's config.json or its folder to --base-config" + (", or unset HF_HUB_OFFLINE." if
                                                                                 reason is None else "."))
        elif self.fetching:
            fix = ("'vllm-lora fetch' downloads only with offline mode off: unset HF_HUB_OFFLINE (or set it to 0) and "
                   "run it again." if reason is None else "Then run it again; HF_HOME or HF_HUB_CACHE choose the cache.")
        elif reason is None:
            held = ([f for f in cached_weight_files(repo or "", revision, cache_dir=self.cache_dir) if f != filename]
                    if filename.endswith(SAFETENSORS_SUFFIX) else [])  # a missing config: listing weights misleads
            fix = (f"Run 'vllm-lora fetch {raw}' where the Hub is reachable (with this HF_HOME or HF_HUB_CACHE), or "
                   f"unset HF_HUB_OFFLINE to download it here." + (
                       f" The cached snapshot of this revision holds {held[:5]}{' and more' if len(held) > 5 else ''}"
                       f"; name one of those to use it offline." if held else ""))
        else:
            fix = (f"To work from the cache only, fill it with 'vllm-lora fetch {raw}' where the Hub is reachable, "
                   f"then set HF_HUB_OFFLINE=1.")
        message, public = (
            (offline_message(what, filename, revision, cache_dir=self.cache_dir, fix=fix, public=p) if reason is None
             else unreachable_message(f"{self.label} {raw!r}", filename, reason, cache_dir=self.cache_dir, fix=fix,
                                      public=p)) for p in (False, True))
        return AdapterNotFoundError(message, source=raw, revision=revision, public_message=public)

    def fetch(self, filename: str, revision: str | None, *, again: bool = False) -> Path | None:
        """Return the cached path of ``filename`` at ``revision``, or ``None`` if the repo lacks it (and in `absent`
        how that was learned). At a commit, the cache's record that the Hub answered 404 for the file (huggingface_hub's
        ``.no_exist`` marker) is believed without a request, unless ``again``: online, the Hub is then asked again,
        once per file and client, and the record stays only where it answers 404 again or cannot be asked."""
        try:  # huggingface_hub's HTTP module parses HF_ENDPOINT as it is imported, and a port that is not one stops it
            from huggingface_hub import try_to_load_from_cache
        except ValueError as err:
            raise AdapterNotFoundError(
                f"huggingface_hub cannot start with HF_ENDPOINT {hub_endpoint()!r} ({err}), so {self.label} "
                f"{self.src.raw!r} cannot be read, not even from the cache. Set HF_ENDPOINT to a Hub or mirror address "
                f"such as https://huggingface.co, or unset it.", source=self.src.raw, revision=revision,
                public_message="The server's Hub address (HF_ENDPOINT) is malformed; tell the server's operator.",
            ) from err

        cache_dir = None if self.cache_dir is None else Path(self.cache_dir)
        try:  # one cache lookup: it answers a pinned sha outright, and tells a cache hit from a download
            cached = try_to_load_from_cache(self.src.repo_id or "", filename, revision=revision, cache_dir=cache_dir)
        except Exception:  # e.g. an unusual cache layout: hf_hub_download below decides
            cached = None
        if revision is not None and COMMIT_SHA.match(revision):
            repo = diskcache.repo_folder(cache_path(cache_dir), self.src.repo_id or "")
            if isinstance(cached, str):
                return Path(hubguard.contained(cached, repo, source=self.src.raw, commit=revision))
            if cached is not None:  # _CACHED_NO_EXIST: the Hub answered 404 for it at this commit before
                held = repo / "snapshots" / revision / filename
                if held.is_file():  # got since by another client ('hf download'), which leaves the record
                    drop_missing_mark(repo, revision, filename)
                    return Path(hubguard.contained(str(held), repo, source=self.src.raw, commit=revision))
                if not again or self.local_only or (filename, revision) in self.asked_again:
                    self.absent[filename] = (RECORDED, "offline mode is on" if self.local_only else "")  # (why not)
                    return None
                return self._ask_again(filename, revision, cache_dir)
        return self._get(filename, revision, cache_dir, cached)

    def _ask_again(self, filename: str, commit: str, cache_dir: Path | None) -> Path | None:
        """Ask the Hub again for a file the cache records as missing at ``commit`` (`fetch`); where it cannot be asked
        (unreachable, too slow, or the repo not found now), the record stands, with a warning."""
        self.asked_again.add((filename, commit))
        try:
            path = self._get(filename, commit, cache_dir, None)
        except (AdapterNotFoundError, AdapterDownloadError) as err:
            logger.warning("%s %r: could not ask the Hub again for %r at commit %s, which the cache records as "
                           "missing: %s", self.label, self.src.raw, filename, commit, err)
            self.absent[filename] = (RECORDED, f"asking failed, {type(err).__name__}: see the warning before")
            return None
        if path is None:
            self.absent[filename] = (ASKED_AGAIN, "")
        return path

    def _get(self, filename: str, revision: str | None, cache_dir: Path | None, cached: object) -> Path | None:
        """`fetch` from the Hub (or, offline, the cache), its errors mapped to ours."""
        from huggingface_hub import errors as hf_errors

        if not self.local_only and not isinstance(cached, str):  # a download: not ~25 s of retries for nothing
            self._check_endpoint(filename, revision)
            reason = hub_unreachable()
            if reason is not None:
                raise self._no_hub(filename, revision, reason)
        try:
            path = self._download(filename, revision, cache_dir, cached)
            if not isinstance(cached, str) or Path(cached) != path:
                self.downloaded = True
                drop_missing_mark(diskcache.repo_folder(cache_path(cache_dir), self.src.repo_id or ""), commit_of(path),
                                  filename)
            return path
        except AdapterDownloadError:  # the plugin's own (HubTooSlowError): said already, not wrapped again
            raise
        except hf_errors.GatedRepoError as err:
            raise AdapterNotFoundError(
                f"Repo {self.src.repo_id!r} of {self.label} {self.src.raw!r} is gated and this token has no access. "
                f"Accept its terms on the Hub and set HF_TOKEN.", source=self.src.raw, revision=revision) from err
        except hf_errors.RepositoryNotFoundError as err:
            raise AdapterNotFoundError(
                f"Repo {self.src.repo_id!r} of {self.label} {self.src.raw!r} was not found (or is private). "
                f"Check the repo id, or set HF_TOKEN for a private repo.", source=self.src.raw, revision=revision) from err
        except hf_errors.RevisionNotFoundError as err:
            raise AdapterNotFoundError(
                f"Revision {revision!r} of {self.label} {self.src.raw!r} was not found in repo {self.src.repo_id!r}. "
                f"Give an existing branch, tag or commit sha.", source=self.src.raw, revision=revision) from err
        except hf_errors.LocalEntryNotFoundError as err:
            raise self._no_hub(filename, revision, None if self.local_only else str(err)) from err
        except hf_errors.EntryNotFoundError:
            self.absent[filename] = (ANSWERED, "")
            return None
        except (hf_errors.HfHubHTTPError, OSError, ConnectionError) as err:
            raise self._failed(filename, err, str(err).rstrip(".")) from err
        except Exception as err:  # httpx transport errors have no common base with the above
            if "Timeout" in type(err).__name__:
                via = " through the proxy set in HTTPS_PROXY/HTTP_PROXY/ALL_PROXY" if proxy_configured() else ""
                said = f"did not answer in time for {filename!r} of {self.label} {self.src.raw!r} ({type(err).__name__})"
                raise AdapterDownloadError(
                    f"The Hugging Face Hub at {hub_endpoint()!r}{via} {said}. Check the network{' and the proxy' if via else ''}"
                    f", or set HF_HUB_OFFLINE=1 to use the local cache only (fill it with 'vllm-lora fetch' where the "
                    f"Hub answers).", source=self.src.raw, public_message=f"The server's Hub {said}. Retry later.") from err
            if type(err).__module__.split(".")[0] in ("httpx", "httpx2", "httpcore", "httpcore2", "requests", "urllib3"):
                raise self._failed(filename, err, repr(err)) from err
            raise

    def _download(self, filename: str, revision: str | None, cache_dir: Path | None, cached: object) -> Path:
        """``hf_hub_download`` within the disk cache bound (`diskcache.download_file`) and the file's deadline
        (`hubdeadline`); a file not ``cached`` before is checked against its ETag (`diskcache.check_download`).
        huggingface_hub moves a branch's or tag's ref to the commit the Hub names before it transfers the file:
        where the transfer then fails, the ref is put back, so that the commit of it already cached still serves
        offline, and after a success it names the commit got ([`hubrefs`]: safe beside other downloads)."""
        repo = diskcache.repo_folder(cache_path(cache_dir), self.src.repo_id or "")
        pinned = self.local_only or (revision is not None and COMMIT_SHA.match(revision) is not None)
        ref = None if pinned else repo / "refs" / (revision or "main")
        if not self.local_only:
            hubguard.writes_inside(repo, source=self.src.raw, ref=ref)
        with hubrefs.moving(ref, repo, state_root(cache_dir)) as move:  # an error puts the ref back
            with self._timed(filename):
                path = Path(diskcache.download_file(self.src.repo_id or "", filename, revision=revision,
                                                    cache_dir=cache_dir, token=self.token,
                                                    local_files_only=self.local_only,
                                                    tqdm_class=logging_tqdm_class(f"{self.src.repo_id}:{filename}")))
            if not self.local_only and (not isinstance(cached, str) or Path(cached) != path):
                diskcache.check_download(path, self.src.repo_id or "", filename, source=self.src.raw,
                                         cache_dir=cache_dir)
        move.settle(commit_of(path))  # another's failure may have put it back meanwhile
        return path

    def _timed(self, filename: str) -> contextlib.AbstractContextManager[None]:
        """Hold a download of ``filename`` to its deadline, whose window opens at the Hub's first answer for it."""
        if self.local_only:
            return contextlib.nullcontext()
        hubguard.watch_clients()
        return hubdeadline.timed(hubdeadline.DownloadClock(self.src.raw, filename))

    def _check_endpoint(self, filename: str, revision: str | None) -> None:
        """Refuse a download from an ``HF_ENDPOINT`` that is no http(s) address with a host (huggingface_hub's own
        words: a URL "missing an 'http://' or 'https://' protocol", then a retry). One that huggingface_hub cannot
        even parse is a bad setting (`constants.check_settings`)."""
        url = urlsplit(hub_endpoint())
        if url.scheme in ("http", "https") and url.hostname:
            return
        raise AdapterNotFoundError(
            f"HF_ENDPOINT {hub_endpoint()!r} is no http:// or https:// address with a host, so {filename!r} of "
            f"{self.label} {self.src.raw!r}, which is not in the local cache ({str(cache_path(self.cache_dir))!r}), "
            f"cannot be downloaded. Set HF_ENDPOINT to a Hub or mirror address such as https://huggingface.co, or "
            f"unset it.", source=self.src.raw, revision=revision,
            public_message="The server's Hub address (HF_ENDPOINT) is malformed; tell the server's operator.")

    def _failed(self, filename: str, err: BaseException, detail: str) -> AdapterDownloadError:
        """A failed transfer: ``detail`` (the library's words, which may name the Hub's address) for the operator;
        for a client, the error's kind and HTTP status only."""
        status = getattr(getattr(err, "response", None), "status_code", None)
        what, tail = f"Downloading {filename!r} of {self.label} {self.src.raw!r} failed", "Retry; a partial file is " \
            "not kept in the cache."
        if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT):
            tail = ("Free space on the cache's disk (or raise its quota), or choose another HF_HUB_CACHE. Nothing was "
                    "kept.")
        elif isinstance(err, OSError) and err.errno in _LOCAL_FAULTS:  # this host's cache, not the transfer
            tail = ("Retrying will not help: the Hugging Face cache cannot take the file there (HF_HOME or "
                    "HF_HUB_CACHE chooses it). Nothing was kept.")
        kind = type(err).__name__ + (f", HTTP {status}" if isinstance(status, int) else "")
        return AdapterDownloadError(f"{what}: {detail}. {tail}", source=self.src.raw,
                                    public_message=f"{what} ({kind}). {tail}")


    def first_found(self, names: Sequence[str], commit: str | None, *, required: bool) -> tuple[Path, str] | None:
        """The first of ``names`` at ``commit`` that the cache or the Hub has, with its name. Where none is found,
        online, and the caller cannot go on without one (``required``: the weights) or is 'vllm-lora fetch', those
        the cache only recorded as missing are asked for again (`fetch`), in order: a 404 the Hub or a mirror
        answered wrongly once does not stand for good. Otherwise (a config, which may be inferred) the record is
        believed, so that a pinned, cached source resolves with no request; `absence` says how to clear it."""
        for name in names:
            path = self.fetch(name, commit)
            if path is not None:
                return path, name
        for name in self.recorded_missing(names) if (required or self.fetching) and not self.local_only else []:
            path = self.fetch(name, commit, again=True)
            if path is not None:
                return path, name
        return None

    def recorded_missing(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` found missing only by the cache's record of an earlier 404 (not asked again)."""
        return [n for n in names if self.absent.get(n, ("",))[0] == RECORDED]

    def absence(self, names: Sequence[str], commit: str | None, *, public: bool = False) -> str:
        """Say how the client found ``names`` missing at ``commit`` (after `first_found`), and what to do where the
        repo has one of them after all (``public``: for a client, without the server's cache and settings)."""
        said = {how: [repr(n) for n in names if self.absent.get(n, ("",))[0] == how]
                for how in (ANSWERED, ASKED_AGAIN, RECORDED)}
        parts = [f"{text} {', '.join(said[how])}" for how, text in (
            (ANSWERED, "the Hub answered 404 for"), (ASKED_AGAIN, "the Hub answered 404 again for"),
            (RECORDED, "the local cache records that the Hub answered 404 before for")) if said[how]]
        text = f"At commit {commit}, " + ("; ".join(parts) or "none was found") + "."
        recorded = self.recorded_missing(names)
        if recorded and public:
            text += " It was not asked again. If the repo has the file, tell the server's operator."
        elif recorded:
            why = next((self.absent[n][1] for n in recorded if self.absent[n][1]), "")
            marks = [str(missing_mark(diskcache.repo_folder(cache_path(self.cache_dir), self.src.repo_id or ""),
                                      commit or "", n)) for n in recorded]
            unset = " (unset HF_HUB_OFFLINE)" if self.local_only else ""
            text += (f" It was not asked again{f' ({why})' if why else ''}. If the repo has the file, that record is "
                     f"wrong: run 'vllm-lora fetch {self.src.raw}' with the Hub reachable{unset}, which asks again "
                     f"and drops the record; or delete {', '.join(map(repr, marks))}.")
        elif said[ANSWERED] or said[ASKED_AGAIN]:
            text += (f" If the repo has the file, the Hub or mirror (HF_ENDPOINT) answered wrongly; once it answers "
                     f"rightly, 'vllm-lora fetch {self.src.raw}' asks again.")
        return text

    def weight_files(self, revision: str | None, under: str = "") -> list[str]:
        """Return the repo's weight paths, ``.safetensors`` first, then pickle files, those in folder ``under``
        first within each (for an error message; empty offline or on any failure)."""
        if self.local_only:
            return []
        try:
            files = _listed(self.src.repo_id or "", revision, self.token)
        except Exception:  # only an error message depends on it
            return []
        shown = (f for f in files if len(f) <= 255 and f.isprintable() and not f.startswith("/")
                 and ".." not in f.split("/") and f.endswith((SAFETENSORS_SUFFIX, *PICKLE_SUFFIXES)))  # names to quote
        return sorted(shown, key=lambda f: (not f.endswith(SAFETENSORS_SUFFIX), not f.startswith(under), f))


class _Sibling(msgspec.Struct):
    rfilename: str = ""


class _Listing(msgspec.Struct):
    siblings: list[_Sibling] | None = None


def _listed(repo_id: str, revision: str | None, token: str | bool | None) -> list[str]:
    """The file names of the Hub's listing of ``repo_id`` at ``revision`` (what ``HfApi.model_info`` asks for),
    read as it arrives and uncompressed (``Accept-Encoding: identity``): an answer over ``MAX_LISTING_BYTES``, or
    still arriving after ``HF_HUB_ETAG_TIMEOUT`` seconds (checked as each chunk arrives, so at most about twice
    that in all), lists nothing (a Hub or mirror that sends gigabytes or drips must not hold a server's memory or a
    request; ``model_info`` reads the whole body, with only a per-read timeout)."""
    from huggingface_hub import constants, get_session
    from huggingface_hub.utils import build_hf_headers

    url = f"{hub_endpoint()}/api/models/{repo_id}" + (f"/revision/{quote(revision, safe='')}" if revision else "")
    timeout = constants.HF_HUB_ETAG_TIMEOUT
    deadline, body = time.monotonic() + timeout, bytearray()
    session, headers = get_session(), {**build_hf_headers(token=token), "Accept-Encoding": "identity"}
    if callable(getattr(session, "stream", None)):  # httpx (huggingface_hub >= 1.0); requests' is a flag
        answer = session.stream("GET", url, headers=headers, timeout=timeout)
    else:  # requests (huggingface_hub 0.x)
        answer = session.get(url, headers=headers, timeout=timeout, stream=True)
    with answer as response:
        if response.status_code != 200:
            return []
        chunks = response.iter_bytes() if hasattr(response, "iter_bytes") else response.iter_content(1 << 16)
        for chunk in chunks:
            body += chunk
            if len(body) > MAX_LISTING_BYTES or time.monotonic() > deadline:
                return []
    return [s.rfilename for s in msgspec.json.decode(bytes(body), type=_Listing).siblings or []]
