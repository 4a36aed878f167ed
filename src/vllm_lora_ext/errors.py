"""Every exception this package raises, and nothing else.

Each class also inherits from a builtin so that callers' existing ``except ValueError`` /
``except FileNotFoundError`` clauses keep working. Messages follow one template: what failed,
for which adapter, which source part or key (with the value seen), then the fix.

An error crosses a process as plain data: `error_record` gives its type, message, arguments and fields,
`rebuild_error` makes the same type again on the other side (this module's errors and Python's builtin
ones; any other type becomes a [`RemoteError`] with the original text). Where only text can cross (vLLM
turns a failed engine call into a message), `with_record` puts the record into the error's message and
`error_from_text` finds it there again.
"""

from __future__ import annotations

import builtins
import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = [
    "AdapterCompatibilityError", "AdapterAccessError", "AdapterDownloadError", "AdapterFormatError",
    "AdapterNotFoundError", "AdapterSourceError", "DeploymentConfigError", "DiskCacheAccessError", "DiskCacheFullError",
    "ExpertLayoutError",
    "HubTooSlowError", "KernelConfigError", "MixCapacityError", "MixError", "MixIdCollisionError", "OutputPathError",
    "RemoteError", "SettingsError", "BuildProcessError", "UnmatchedKeysError", "UnsafeFormatError",
    "UnsupportedVLLMError", "VerifyError", "VllmLoraExtError", "error_from_text", "is_rebuilt", "error_record",
    "offline_pickle_error", "rebuild_error", "with_record", "has_record",
]


class VllmLoraExtError(Exception):
    """Base class of every error raised by `vllm_lora_ext`.

    ``public_message`` is what an HTTP client may see: the same text, minus anything about the
    server's own disk (the files a local folder holds, cache paths). It defaults to ``str(err)``.
    """

    public_message: str | None = None

    def client_message(self) -> str:
        """Return the message for an untrusted client (never lists the server's folders)."""
        return self.public_message if self.public_message is not None else str(self)

    def __reduce__(self) -> tuple[Any, ...]:
        # The subclasses take keyword-only fields, which Exception's own pickling does not pass back:
        # rebuild from the message and the instance's fields, so an error pickles whole (e.g. between Ray actors).
        return (_rebuild, (type(self), self.args, dict(self.__dict__)))


def _rebuild(cls: type[VllmLoraExtError], args: tuple[Any, ...], fields: dict[str, Any]) -> VllmLoraExtError:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(fields)
    return err


class AdapterSourceError(VllmLoraExtError, ValueError):
    """A source string is malformed (raised before any disk or network access).

    Example message: ``Invalid source 'hf:acme/sql@:a.safetensors': empty revision after '@'.
    Remove '@' or give a branch, tag or commit, e.g. 'hf:acme/sql@main'.``
    """

    def __init__(self, message: str, *, source: str, part: str | None = None) -> None:
        super().__init__(message)
        self.source = source
        self.part = part


class UnsafeFormatError(AdapterSourceError):
    """A pickle weight file (``.bin``/``.pt``) was named without the explicit opt-in; ``filename`` is its name."""

    def __init__(self, message: str, *, source: str, filename: str, part: str | None = "path") -> None:
        super().__init__(message, source=source, part=part)
        self.filename = filename


class AdapterNotFoundError(VllmLoraExtError, FileNotFoundError):
    """A well-formed source points at nothing: no such folder, file, repo, revision or file in repo."""

    def __init__(self, message: str, *, source: str, revision: str | None = None,
                 public_message: str | None = None) -> None:
        super().__init__(message)
        self.source = source
        self.revision = revision
        self.public_message = public_message

    def __str__(self) -> str:  # FileNotFoundError would otherwise print "[Errno None]"
        return str(self.args[0]) if self.args else ""


class AdapterDownloadError(VllmLoraExtError, OSError):
    """The hub was reachable but the download failed (network cut, server error); retrying may work."""

    def __init__(self, message: str, *, source: str, public_message: str | None = None) -> None:
        super().__init__(message)
        self.source = source
        self.public_message = public_message

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class HubTooSlowError(AdapterDownloadError, TimeoutError):
    """A file of an adapter fetch from the Hub fell behind its deadline (``VLLM_LORA_EXT_DOWNLOAD_MIN_RATE`` bytes per
    second after ``VLLM_LORA_EXT_DOWNLOAD_GRACE_S`` seconds from the Hub's first answer for it): a Hub or mirror that
    trickles or keeps stalling. The transfer was stopped and its partial file is not kept; ``received`` bytes of the
    file had arrived after ``seconds``.

    Example message: ``Downloading 'adapter_model.safetensors' of 'hf:acme/sql' was stopped after 61 s, having
    received 12 B (12 bytes) of it: slower than the 1.0 MiB/s after 60 s that a file must average; its partial
    file is not kept. The Hub at 'https://mirror.example' (HF_ENDPOINT) sends too slowly. Retry, point HF_ENDPOINT at
    a faster Hub or mirror, or lower VLLM_LORA_EXT_DOWNLOAD_MIN_RATE (0: no deadline) or raise
    VLLM_LORA_EXT_DOWNLOAD_GRACE_S.``
    """

    def __init__(self, message: str, *, source: str, received: int, seconds: float,
                 public_message: str | None = None) -> None:
        super().__init__(message, source=source, public_message=public_message)
        self.received = received
        self.seconds = seconds


class AdapterFormatError(VllmLoraExtError, ValueError):
    """The adapter's config, keys or shapes fit no supported layout."""

    def __init__(self, message: str, *, adapter: str | None = None, key: str | None = None) -> None:
        super().__init__(message)
        self.adapter = adapter
        self.key = key


class UnmatchedKeysError(AdapterFormatError):
    """Keys that map to no LoRA module of the base model; ``keys`` holds all of them."""

    def __init__(self, message: str, *, adapter: str | None = None, keys: Sequence[str] = ()) -> None:
        super().__init__(message, adapter=adapter, key=keys[0] if keys else None)
        self.keys = list(keys)


def offline_pickle_error(adapter: str, filename: str) -> AdapterFormatError:
    """The error of an offline tool (inspect, convert, mix) given the pickle weight file ``filename``: the fix that
    works there (re-save as safetensors), not the server's opt-in, which the offline tools do not take."""
    return AdapterFormatError(
        f"Adapter {adapter!r}: offline tools (inspect, convert, mix) read .safetensors only, and {filename!r} is a "
        f"pickle file (VLLM_LORA_EXT_ALLOW_PICKLE lets only the server read it). Re-save it once as safetensors, "
        f"e.g. PeftModel.from_pretrained(base, folder).save_pretrained(out).", adapter=adapter)


class ExpertLayoutError(AdapterFormatError):
    """Expert count, orientation or fused/per-expert layout does not fit the base model."""


class ExpertCountError(ExpertLayoutError):
    """The expert count given for an MoE block (a base config, ``--num-experts``, recorded metadata) contradicts
    the adapter's own shapes: an expert index at or past it, or fused rows that are not the config's ``r`` times it.
    Read by that count, the adapter would be another adapter."""


class AdapterCompatibilityError(VllmLoraExtError, ValueError):
    """A valid adapter that the running model or vLLM's limits cannot serve (e.g. rank > max_lora_rank).

    ``rank`` and ``max_rank`` are set when the rank budget refused it (`validation.check_rank_budget`): the rank
    needed and the ``max_lora_rank`` in force.
    """

    def __init__(self, message: str, *, adapter: str | None = None, rank: int | None = None,
                 max_rank: int | None = None) -> None:
        super().__init__(message)
        self.adapter = adapter
        self.rank = rank
        self.max_rank = max_rank


class MixError(VllmLoraExtError, ValueError):
    """Weights, ranks or targets that cannot be mixed exactly."""


class MixCapacityError(MixError):
    """Every slot of the bounded mix registry is held by requests in flight; retry later (HTTP 503).

    Example message: ``All 64 mix slots are in use by requests in flight. Retry, or raise
    VLLM_LORA_EXT_MAX_MIXES.``
    """


class MixIdCollisionError(MixError):
    """An adapter id already names another adapter or mix; serving it would hand out the wrong tensors.

    Example message: ``lora_int_id 1073741825 is already used by adapter 'mix-a=0.5-…' (another source).
    Give each adapter its own lora_int_id.``
    """


class AdapterAccessError(AdapterSourceError):
    """A source names a local path outside the roots this server may read (``VLLM_LORA_EXT_ALLOWED_ROOTS``)."""


class OperatorNameError(VllmLoraExtError, PermissionError):
    """A client asked to load, reload or unload an adapter name the operator set (``--lora-modules``, the
    deployment config): those stay what the operator configured, for every client."""

    def __init__(self, message: str, *, name: str) -> None:
        super().__init__(message)
        self.name = name


class OutputPathError(VllmLoraExtError, ValueError):
    """An offline tool's output folder is a file, is not empty, or holds an input adapter (``--force`` overrides)."""


class DeploymentConfigError(VllmLoraExtError, ValueError):
    """The deployment config file (``VLLM_LORA_EXT_CONFIG``) is unreadable or inconsistent."""


class KernelConfigError(VllmLoraExtError, ValueError):
    """A LoRA kernel config table (``{gpu}_SHRINK.json``, ``{gpu}_EXPAND_*.json``) is not one vLLM can use.

    vLLM reads these tables inside the kernel launch, where a missing key fails the engine step; the
    plugin checks a shipped table before its shrink/expand lookup answers from it.
    """


class BuildProcessError(VllmLoraExtError, RuntimeError):
    """A worker's build process could not start, or exited during a build; its output is in the worker's log.

    The build is not retried in the engine step: the adapter's request fails with this message and the
    next build starts a new process.
    """


class UnsupportedVLLMError(VllmLoraExtError, RuntimeError):
    """The installed vLLM is outside the tested range (raised only by `vllm_lora_ext.integration`)."""


class VerifyError(VllmLoraExtError, RuntimeError):
    """``vllm-lora verify`` could not compare: the model cannot be truncated, a side failed, or HF + PEFT would not
    apply every key of the adapter (then its reference would be wrong)."""


class DiskCacheFullError(VllmLoraExtError, RuntimeError):
    """A download would pass the disk cache bound (``VLLM_LORA_EXT_DISK_CACHE_BYTES``) and every revision that could
    make room is in use. Nothing was evicted for it, unless the message says its transfer was stopped part-way
    (revisions held since it began left no room for the rest); retry once adapters are unloaded, or raise the bound.
    An adapter larger than the whole bound is told so (``needed`` is its size): raise the bound, or use a local path.

    Not an ``OSError``: the download path maps those to a retryable download failure, and this one is not.

    Example message: ``Adapter source 'hf:acme/sql' needs 64.0 MiB in the Hugging Face cache, but the disk cache
    bound VLLM_LORA_EXT_DISK_CACHE_BYTES is 256.0 MiB and 224.0 MiB of it is held by revisions in use (pinned,
    registered, or being read). Unload adapters that are no longer needed, or raise VLLM_LORA_EXT_DISK_CACHE_BYTES.``
    """

    def __init__(self, message: str, *, source: str, limit: int, in_use: int, needed: int) -> None:
        super().__init__(message)
        self.source = source
        self.limit = limit
        self.in_use = in_use
        self.needed = needed


class DiskCacheAccessError(VllmLoraExtError, OSError):
    """``vllm-lora cache prune`` cannot change the Hugging Face cache (it is on a read-only file system, or this user
    may not write it), or ``cache ls`` may not read it. ``folder`` is the cache folder.

    Example message: ``Cannot prune the Hugging Face cache '/mnt/hf/hub': it is on a read-only file system (at
    '/mnt/hf/hub/.locks/vllm_lora_ext/state.lock'); nothing was evicted. Remount it read-write, or prune it where it
    is writable; for another cache pass --cache-dir DIR (or set HF_HUB_CACHE or HF_HOME). 'vllm-lora cache ls'
    lists it without writing.``
    """

    def __init__(self, message: str, *, folder: str) -> None:
        super().__init__(message)
        self.folder = folder


class HubAnswerError(VllmLoraExtError, RuntimeError):
    """The Hub (``HF_ENDPOINT``) answered something huggingface_hub would write by unsafely: an ETag that is not a
    plain file name, a commit that is not a sha, more bytes than it announced, bytes other than the digest its ETag
    names (a sha256 or git blob id; the file is removed from the cache), or a cached path outside the repo's cache
    folder. Nothing was downloaded or read by it. Not an ``OSError``: retrying the same Hub does not help.

    Example message: ``The Hub at 'https://mirror.example' answered ETag '../../x' for 'hf:acme/sql', which is not a
    plain file name (a blob in the cache is named by it); nothing was downloaded. Point HF_ENDPOINT at a Hub or
    mirror that answers as huggingface.co does.``
    """

    def __init__(self, message: str, *, source: str, header: str, value: str,
                 public_message: str | None = None) -> None:
        super().__init__(message)
        self.source = source
        self.header = header
        self.value = value
        self.public_message = public_message


class SettingsError(VllmLoraExtError, ValueError):
    """An environment setting (``VLLM_LORA_EXT_*``) has a value the plugin cannot use; the message names it.

    Raised at start-up (``register()``) for every bad setting at once, so a typo never surfaces later in a
    background build or a request.
    """


class RemoteError(VllmLoraExtError, RuntimeError):
    """An error of a type this package does not define, raised in another process; ``type_name`` names that type
    (e.g. ``torch.OutOfMemoryError``), the message is its original text and its other fields are attributes.
    Unexpected, not bad input: a server answers it as an internal error."""

    def __init__(self, message: str, *, type_name: str) -> None:
        super().__init__(message)
        self.type_name = type_name


# ------------------------------------------------------------------------------------------------ across processes

RECORD_MARK = " [vllm_lora_ext error record: "
_TEXT_LIMIT = 4096  # characters per string and items per list, in a record put into text


def _plain(value: Any, limit: int | None) -> Any:
    """``value`` as JSON data (a value JSON cannot hold becomes its text), strings and lists cut at ``limit``."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str):
        return value if limit is None else value[:limit]
    if isinstance(value, (list, tuple, set, frozenset)):
        items = list(value) if limit is None else list(value)[:limit]
        return [_plain(v, limit) for v in items]
    if isinstance(value, Mapping):
        return {str(k): _plain(v, limit) for k, v in value.items()}
    return _plain(str(value), limit)


def _type_name(cls: type[BaseException]) -> str:
    if cls.__module__ == __name__:
        return cls.__name__
    return f"{cls.__module__}.{cls.__qualname__}"


def error_record(err: BaseException, *, limit: int | None = None) -> dict[str, Any]:
    """Return ``err`` as plain data that any process can read: ``{"type", "message", "args", "fields"}``.

    ``type`` is the class name for this module's errors, else ``module.QualName`` (``builtins.OSError``). A
    [`RemoteError`] keeps the type it stands for. Fields are the instance's attributes; a value JSON cannot hold
    becomes its text. With ``limit``, strings and lists are cut to that many characters or items.

    Example:
        >>> rebuild_error(error_record(AdapterFormatError("bad key", adapter="a"))).adapter
        'a'
    """
    fields = {k: _plain(v, limit) for k, v in vars(err).items() if not k.startswith("_")}
    if isinstance(err, OSError):  # not in its args, and not in its __dict__
        fields.update({k: _plain(v, limit) for k in ("filename", "filename2") if (v := getattr(err, k)) is not None})
    name = _type_name(type(err))
    if isinstance(err, RemoteError):
        name = err.type_name
        fields.pop("type_name", None)
    base = next((c for c in type(err).__mro__ if c.__module__ == "builtins"), Exception)
    return {"type": name, "message": _plain(str(err), limit), "args": _plain(err.args, limit), "fields": fields,
            "base": f"builtins.{base.__name__}"}


def _known_type(name: str) -> type[BaseException] | None:
    cls = globals().get(name) if "." not in name else None
    if cls is None and name.startswith("builtins."):
        cls = getattr(builtins, name.removeprefix("builtins."), None)
    return cls if isinstance(cls, type) and issubclass(cls, BaseException) else None


def rebuild_error(record: Mapping[str, Any]) -> BaseException:
    """Return the error ``record`` (from `error_record`) describes: the same type, message and fields.

    This module's errors and Python's builtin exceptions come back as their own type; any other type, or a
    record that cannot be rebuilt, as a [`RemoteError`] with the original message and ``type_name``.
    """
    name, message = str(record.get("type", "")), str(record.get("message", ""))
    cls = _known_type(name)
    fields = dict(record.get("fields") or {})
    args = tuple(record.get("args") or (message,))
    if cls is None or not issubclass(cls, Exception):  # never SystemExit, KeyboardInterrupt, GeneratorExit
        base = _known_type(str(record.get("base", "")))
        if base is not None and issubclass(base, OSError):  # an OSError of another module stays an OSError
            err = base(message)
            err.type_name = name  # type: ignore[attr-defined]
            return err
        return _remote(name, message, fields)
    if issubclass(cls, VllmLoraExtError) and cls is not RemoteError:
        return _rebuild(cls, args, fields)
    if cls.__module__ == "builtins":
        try:
            err = cls(*args)
            for key, value in fields.items():
                setattr(err, key, value)
        except Exception:  # a builtin whose arguments did not survive as JSON
            return _remote(name, message, {})
        return err
    return _remote(name, message, fields)


def _remote(name: str, message: str, fields: Mapping[str, Any]) -> RemoteError:
    err = RemoteError(message, type_name=name)
    err.__dict__.update({k: v for k, v in fields.items() if k not in ("type_name", "public_message")})
    return err


def with_record(err: BaseException) -> BaseException:
    """Return ``err`` again, of the same type, with its record (`error_record`, long values cut) at the end of its
    message, for a channel that carries only the text (vLLM's engine calls); `error_from_text` reads it back.

    A type whose message cannot be replaced this way comes back as a [`RemoteError`] naming it.
    """
    record = error_record(err, limit=_TEXT_LIMIT)
    text = f"{record['message']}{RECORD_MARK}{json.dumps(record, separators=(',', ':'))}]"
    if isinstance(err, VllmLoraExtError):
        return _rebuild(type(err), (text,), dict(vars(err)))
    try:
        marked = type(err)(text)
    except Exception:
        marked = None
    if marked is None or str(marked) != text:  # KeyError's str() quotes its text: the record would not read back
        marked = RemoteError(text, type_name=record["type"])
    marked._recorded = True  # type: ignore[attr-defined]  # (a client's name may hold a mark: never asked by text)
    return marked


def error_from_text(text: str) -> BaseException | None:
    """Return the error whose record (`with_record`) ``text`` holds, rebuilt (`rebuild_error`); ``None`` if it holds
    none. Text around the record (a prefix such as vLLM's ``Call to add_lora method failed:``) is ignored.

    The record is the last mark followed by a JSON object with a ``type`` (vLLM may add text after it). A mark
    inside a message (a client's string) lies before the worker's record, or escaped inside its JSON, where it
    never parses; such marks are passed over. An error read this way is never read again ([`is_rebuilt`]): its
    text is the original message, which may hold a client's string.
    """
    at = len(text)
    while (at := text.rfind(RECORD_MARK, 0, at)) >= 0:
        try:
            record, _ = json.JSONDecoder().raw_decode(text, at + len(RECORD_MARK))
        except (ValueError, RecursionError):  # not JSON, or nested past the decoder's depth
            continue
        if isinstance(record, dict) and "type" in record:
            err = rebuild_error(record)
            err._from_record = True  # type: ignore[attr-defined]
            return err
    return None


def has_record(err: BaseException) -> bool:
    """Whether `with_record` made ``err`` (its message ends with its own record): asked of the error, never of its
    text, which may quote a client's string holding a mark."""
    return bool(getattr(err, "_recorded", False))


def is_rebuilt(err: BaseException) -> bool:
    """Whether ``err`` was rebuilt from a record (`error_from_text`): its text is the original message, which may
    hold a client's string, and is never read for a record again."""
    return bool(getattr(err, "_from_record", False))
