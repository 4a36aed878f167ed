"""Every exception this package raises, and nothing else.

Each class also inherits from a builtin so that callers' existing ``except ValueError`` /
``except FileNotFoundError`` clauses keep working. Messages follow one template: what failed,
for which adapter, which source part or key (with the value seen), then the fix.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = [
    "AdapterCompatibilityError",
    "AdapterAccessError",
    "AdapterDownloadError",
    "AdapterFormatError",
    "AdapterNotFoundError",
    "AdapterSourceError",
    "DeploymentConfigError",
    "DiskCacheFullError",
    "ExpertLayoutError",
    "KernelConfigError",
    "MixCapacityError",
    "MixError",
    "MixIdCollisionError",
    "OutputPathError",
    "SettingsError",
    "BuildProcessError",
    "UnmatchedKeysError",
    "UnsafeFormatError",
    "UnsupportedVLLMError",
    "VerifyError",
    "VllmLoraExtError",
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
        # rebuild from the message and the instance's fields (a build process sends its errors this way).
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
    """A pickle weight file (``.bin``/``.pt``) was named without the explicit opt-in."""


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

    def __init__(self, message: str, *, source: str) -> None:
        super().__init__(message)
        self.source = source

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


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


class ExpertLayoutError(AdapterFormatError):
    """Expert count, orientation or fused/per-expert layout does not fit the base model."""


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
    make room is in use. Nothing was evicted for it; retry once adapters are unloaded, or raise the bound.

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


class SettingsError(VllmLoraExtError, ValueError):
    """An environment setting (``VLLM_LORA_EXT_*``) has a value the plugin cannot use; the message names it.

    Raised at start-up (``register()``) for every bad setting at once, so a typo never surfaces later in a
    background build or a request.
    """
