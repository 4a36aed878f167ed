"""A branch's ref in the Hugging Face cache while several resolves of it run, in one process and in two (hubrefs.py):
a failure puts back only its own move, and a success is never left undone; with the real huggingface_hub client
against tests/hubserver.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from factories import hub_adapter_files, lora_config
from vllm_lora_ext import resolve_source
from vllm_lora_ext.errors import AdapterFormatError, HubAnswerError

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"


def two_adapters(seed: int) -> dict[str, bytes]:
    """Adapters ``a/`` and ``b/`` of one repo, each with its own weights and config."""
    files = {}
    for i, folder in enumerate(("a", "b")):
        files[f"{folder}/{WEIGHTS}"] = hub_adapter_files(seed * 10 + i)[WEIGHTS]
        files[f"{folder}/{CONFIG}"] = json.dumps(lora_config(r=4, alpha=seed * 10 + i + 1)).encode()
    return files


@pytest.fixture
def pushed(hub: Any) -> Iterator[dict[str, Any]]:
    """acme/r: both adapters resolved (cached) at the first commit of main, then main moved to a second."""
    repo = hub.repo("acme/r")
    first = repo.commit(two_adapters(1))
    for folder in ("a", "b"):
        assert resolve_source(f"hf:acme/r:{folder}").commit == first
    second = repo.commit(two_adapters(2))
    yield {"hub": hub, "first": first, "second": second, "mark": hub.count()}
    for gate in hub.gates.values():
        gate.set()
    hub.gates.clear()


def ref(cache: Path) -> str:
    return (cache / "models--acme--r" / "refs" / "main").read_text()


def resolve_in_another_process(source: str) -> str:
    """Resolve ``source`` in a new interpreter sharing this test's cache and Hub; return its commit."""
    import vllm_lora_ext

    env = dict(os.environ, PYTHONPATH=str(Path(vllm_lora_ext.__file__).parents[1]))
    done = subprocess.run([sys.executable, "-c", "from vllm_lora_ext import resolve_source\n"
                           f"print('commit', resolve_source({source!r}).commit)"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split("commit ")[-1].strip()


def in_thread(fn: Any) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as err:  # handed to the test
            out.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    return worker, out


def wait_for(pushed: dict[str, Any], method: str, path: str) -> None:
    """Wait for a request of ``path`` made since main was moved."""
    hub, deadline = pushed["hub"], time.monotonic() + 30
    while not any(m == method and p.endswith(path) for m, p in hub.requests[pushed["mark"]:]):
        assert time.monotonic() < deadline, f"no {method} of {path}: {hub.requests}"
        time.sleep(0.02)


def tampered(data: bytes) -> bytes:
    bad = bytearray(data)
    bad[-1] ^= 0xFF
    return bytes(bad)


def test_a_failed_download_does_not_undo_the_ref_of_a_resolve_that_succeeded_in_another_process(
        pushed: dict[str, Any], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolve A of ``hf:acme/r:a`` moved main to the new commit and is still receiving its weights; meanwhile resolve
    B of ``hf:acme/r:b``, in another process, completes at that commit. A's weights then arrive tampered and are
    refused. A's put-back saw main naming a commit without A's file and moved it back to the old commit: B's
    completed revision no longer served ``hf:acme/r:b`` offline (its old one did). Now a put-back leaves a commit
    of which a file is complete."""
    hub, second = pushed["hub"], pushed["second"]
    gate = hub.gates[f"acme/r/a/{WEIGHTS}"] = threading.Event()
    hub.lies[f"a/{WEIGHTS}"] = {"body": tampered(two_adapters(2)[f"a/{WEIGHTS}"])}
    worker, out = in_thread(lambda: resolve_source("hf:acme/r:a"))
    wait_for(pushed, "GET", f"/a/{WEIGHTS}")  # huggingface_hub moved main before this request
    assert ref(isolated_hf_cache) == second

    assert resolve_in_another_process("hf:acme/r:b") == second
    gate.set()
    worker.join(60)
    assert isinstance(out[0], HubAnswerError), out

    assert ref(isolated_hf_cache) == second
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = resolve_source("hf:acme/r:b")
    assert offline.commit == second and offline.weights_path.read_bytes() == two_adapters(2)[f"b/{WEIGHTS}"]


def test_a_failed_download_does_not_undo_the_ref_of_a_resolve_still_running_that_got_a_file(
        pushed: dict[str, Any], isolated_hf_cache: Path) -> None:
    """A moved main and waits for its weights; B, in another thread, gets its own weights at the new commit and waits
    for its config. A's weights are refused: its put-back moved main back, and B's config, fetched by the commit,
    never moved it again, so B succeeded with main naming the old commit."""
    hub, second = pushed["hub"], pushed["second"]
    a_gate = hub.gates[f"acme/r/a/{WEIGHTS}"] = threading.Event()
    b_gate = hub.gates[f"acme/r/b/{CONFIG}"] = threading.Event()
    hub.lies[f"a/{WEIGHTS}"] = {"body": tampered(two_adapters(2)[f"a/{WEIGHTS}"])}
    a_thread, a_out = in_thread(lambda: resolve_source("hf:acme/r:a"))
    wait_for(pushed, "GET", f"/a/{WEIGHTS}")
    b_thread, b_out = in_thread(lambda: resolve_source("hf:acme/r:b"))
    wait_for(pushed, "GET", f"/b/{CONFIG}")
    a_gate.set()
    a_thread.join(60)
    assert isinstance(a_out[0], HubAnswerError), a_out
    b_gate.set()
    b_thread.join(60)
    assert getattr(b_out[0], "commit", b_out) == second
    assert ref(isolated_hf_cache) == second


def test_a_resolve_that_fails_again_on_a_half_revision_puts_the_branch_back(
        pushed: dict[str, Any], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The new commit's config is refused twice (announced too large). The first failure put main back; the second
    found the weights it had kept for a retry, so downloaded nothing and undid nothing: main was left at the half
    revision and ``hf:acme/r:a`` no longer resolved offline."""
    hub, first = pushed["hub"], pushed["first"]
    hub.lies[f"a/{CONFIG}"] = {"size": 2 << 20}
    for _ in range(2):
        with pytest.raises(AdapterFormatError, match="larger than a config may be"):
            resolve_source("hf:acme/r:a")
        assert ref(isolated_hf_cache) == first
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = resolve_source("hf:acme/r:a")
    assert offline.commit == first and offline.weights_path.read_bytes() == two_adapters(1)[f"a/{WEIGHTS}"]


def test_a_resolve_that_succeeds_after_a_failure_put_the_branch_back_points_it_at_its_commit(
        pushed: dict[str, Any], isolated_hf_cache: Path) -> None:
    """A downloaded the new weights and is asking for its config; B, reusing those weights, waits for its config's
    bytes; then A's config is refused (announced too large), and A puts main back (no one has completed the
    revision). B's config then arrives, by the commit, which moves no ref: B's success points main at its commit
    again."""
    hub, first, second = pushed["hub"], pushed["first"], pushed["second"]
    asked = threading.Event()
    gate = hub.gates[f"acme/r/a/{CONFIG}"] = threading.Event()

    def script(nth: int, method: str, status: int, hdrs: list, body: bytes) -> tuple:
        if nth == 1:  # A's first question: answered once B waits for the bytes, and too large
            asked.wait(4)  # (within huggingface_hub's 5 s metadata timeout)
            hdrs = [(k, v) for k, v in hdrs if k != "Content-Length"] + [("Content-Length", str(2 << 20))]
        return status, hdrs, body

    hub.seen.clear()
    hub.script[f"a/{CONFIG}"] = script
    a_thread, a_out = in_thread(lambda: resolve_source("hf:acme/r:a"))
    wait_for(pushed, "HEAD", f"/a/{CONFIG}")
    b_thread, b_out = in_thread(lambda: resolve_source("hf:acme/r:a"))
    wait_for(pushed, "GET", f"/a/{CONFIG}")
    asked.set()
    a_thread.join(60)
    assert isinstance(a_out[0], AdapterFormatError), a_out
    assert ref(isolated_hf_cache) == first
    gate.set()
    b_thread.join(60)
    assert getattr(b_out[0], "commit", b_out) == second
    assert ref(isolated_hf_cache) == second


def test_two_failed_downloads_of_a_moving_branch_leave_it_at_the_commit_cached_before(
        pushed: dict[str, Any], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A moved main to the second commit and waits for its weights; main moves on to a third commit, and B (which
    found main at A's second) moves it there and waits too. A's weights are refused first, then B's. Had a
    put-back compared the ref with the commit its own download moved it to, A would have left B's move, and B would
    have put back the commit it found, A's, with nothing cached: main named no usable commit. A put-back compares
    with what is cached: A moves main back to the first commit (B's, still running, has nothing yet), and B leaves
    that cached commit."""
    hub, first = pushed["hub"], pushed["first"]
    released = {3: threading.Event(), 6: threading.Event()}  # A's GET is the file's 3rd request, B's its 6th

    def script(nth: int, method: str, status: int, hdrs: list, body: bytes) -> tuple:
        if method == "GET":
            released[nth].wait(4)  # (within huggingface_hub's 5 s read timeout)
            body = tampered(body)
        return status, hdrs, body

    hub.seen.clear()
    hub.script[f"a/{WEIGHTS}"] = script
    a_thread, a_out = in_thread(lambda: resolve_source("hf:acme/r:a"))
    wait_for(pushed, "GET", f"/a/{WEIGHTS}")
    hub.repo("acme/r").commit(two_adapters(3))
    b_thread, b_out = in_thread(lambda: resolve_source("hf:acme/r:a"))
    while hub.seen[f"a/{WEIGHTS}"] < 6:
        time.sleep(0.02)
    for nth, thread, out in ((3, a_thread, a_out), (6, b_thread, b_out)):
        released[nth].set()
        thread.join(60)
        assert isinstance(out[0], HubAnswerError), out
        assert ref(isolated_hf_cache) == first
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_source("hf:acme/r:a").commit == first
