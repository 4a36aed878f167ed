"""A failed adapter or mix build, typed for the client: the worker's reason, capped, without server folders.

A build runs in the engine's worker; its error crosses back inside the text vLLM hands the API server for the
failed engine call, with the plugin's error record (`errors.with_record`) when the worker runs the plugin.
"""

from __future__ import annotations

from vllm_lora_ext._util import clip
from vllm_lora_ext.constants import MAX_MESSAGE_CHARS
from vllm_lora_ext.errors import (RECORD_MARK, AdapterFormatError, AdapterNotFoundError, BuildProcessError,
                                  RemoteError, VllmLoraExtError, error_from_text, is_rebuilt)

__all__ = ["build_failure", "server_fault", "worker_error", "worker_reason"]

# vLLM's own not-found text (LoRAAdapterNotFoundError). A worker where the plugin is not active answers a probe
# through vLLM's own loader, whose error crosses as this text alone, without the plugin's record.
_VLLM_NOT_FOUND = "No adapter found"


def build_failure(err: BaseException, *, name: str, source: str) -> VllmLoraExtError:
    """Type a failed background build for the client: [`AdapterNotFoundError`] if the worker found no adapter
    (404), the server's fault as an internal error ([`server_fault`]: 500), else [`AdapterFormatError`] (400); the
    message names the adapter and carries the worker's reason.

    The worker's error is read from its record (`errors.with_record`), which crosses inside the text vLLM hands
    back for a failed engine call; an error without one is typed by itself (in process) or, from a worker
    without the plugin, by vLLM's own not-found text.
    """
    found, plain = worker_error(err)
    fault = server_fault(found, name, source)
    if fault is not None:
        return fault
    text, public = worker_reason(found)
    message, public = f"Adapter {name!r} could not be loaded: {text}", f"Adapter {name!r} could not be loaded: {public}"
    if isinstance(found, AdapterNotFoundError) or (plain and _VLLM_NOT_FOUND in text):
        return AdapterNotFoundError(message, source=clip(source), public_message=public)
    failed = AdapterFormatError(message, adapter=name)
    failed.public_message = public
    return failed


_ENGINE_GONE = ("EngineDeadError", "EngineGenerateError")  # vLLM's engine client: the engine itself failed


def server_fault(found: BaseException, *client_texts: str) -> RemoteError | None:
    """The error to answer a failed build with when the server is at fault, not the adapter: an internal error
    (HTTP 500, which clients and load balancers may retry, where a 400 says the request was wrong). That is the
    worker's unexpected error (a [`RemoteError`]: CUDA out of memory, say), its build process lost
    ([`BuildProcessError`]), or vLLM's engine gone; else ``None``. Never where a client's text (the adapter's name
    or source, which vLLM's error text may quote) holds an error record: a forged record chooses among the 4xx
    answers of its own load only."""
    if any(RECORD_MARK.strip() in text for text in client_texts):
        return None
    if isinstance(found, RemoteError):
        return found
    if isinstance(found, BuildProcessError) or (not isinstance(found, VllmLoraExtError)
                                                and type(found).__name__ in _ENGINE_GONE):
        return RemoteError(str(found) or type(found).__name__, type_name=type(found).__name__)
    return None


def worker_error(err: BaseException) -> tuple[BaseException, bool]:
    """``err`` as the worker raised it, read from the record its text carries, and whether it is plain text (no
    type, no record: a worker without the plugin). An error typed already is never read again (a name in it)."""
    if is_rebuilt(err) or isinstance(err, VllmLoraExtError):
        return err, False
    crossed = error_from_text(str(err))
    return (crossed, False) if crossed is not None else (err, True)


def worker_reason(err: BaseException) -> tuple[str, str]:
    """A failed build's reason for the log and for the client (its ``client_message``: no server folders), each
    capped at ``MAX_MESSAGE_CHARS``."""
    def cap(text: str) -> str:
        return text if len(text) <= MAX_MESSAGE_CHARS else text[:MAX_MESSAGE_CHARS] + " [...]"

    public = err.client_message() if isinstance(err, VllmLoraExtError) else str(err)
    return cap(str(err)), cap(public)


def typed_load_answer(answer: object, *, name: str, source: str) -> object | None:
    """The error to answer instead of vLLM's own for a failed ``load_lora_adapter`` whose text carries the
    worker's typed error (the engine built the adapter in its step: background builds off, or past their wait),
    else ``None``. vLLM answers such a failure with the worker's whole text, a 500 or a 400 that may name server
    folders; this is [`build_failure`]'s error, answered with its client message and status."""
    info = getattr(answer, "error", None)  # vLLM's ErrorResponse(error=ErrorInfo(message, type, code))
    text = getattr(info, "message", None)
    # Only vLLM's failed add_lora (500), whose text ends with the worker's record: its other answers (400 "already
    # loaded") may quote a client's name holding a mark.
    crossed = error_from_text(text) if getattr(info, "code", None) == 500 and isinstance(text, str) else None
    return None if crossed is None else build_failure(crossed, name=name, source=source)
