"""A Hub or mirror (HF_ENDPOINT) that trickles bytes, or sends bytes other than the sha256 its ETag names, against
the fetch's deadline (hubdeadline.py) and the content check (hubguard.check_content), with the real
huggingface_hub client and tests/hubserver.py."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from factories import hub_adapter_files
from vllm_lora_ext import resolve_source

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def weights() -> bytes:
    return hub_adapter_files()[WEIGHTS]


@pytest.fixture
def repo(hub: Any) -> str:
    hub.repo("acme/a").commit(hub_adapter_files())
    return "hf:acme/a"


@pytest.fixture
def stop() -> Iterator[threading.Event]:
    """Set at the end of the test: the server's slow answers stop sending."""
    event = threading.Event()
    yield event
    event.set()


def in_thread(fn: Any, seconds: float) -> BaseException | object:
    """Run ``fn`` in a thread for at most ``seconds``; return what it raised or returned (a hang fails the test)."""
    out: list[Any] = []

    def run() -> None:
        try:
            out.append(fn())
        except BaseException as err:  # handed to the test
            out.append(err)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, f"still downloading after {seconds} s: no overall deadline"
    return out[0]


def answer(hub: Any, etag: str) -> list[tuple[str, str]]:
    """The headers of the weights' answer at main (the caller adds Content-Length and Content-Range)."""
    return [("X-Repo-Commit", hub.repo("acme/a").refs["main"]), ("ETag", f'"{etag}"'),
            ("Content-Type", "application/octet-stream")]


def trickle(hub: Any, stop: threading.Event, *, every: float, chunk: int = 1) -> None:
    """Answer the weights' GET with their true headers, then ``chunk`` bytes every ``every`` seconds (under the
    per-read timeout)."""
    data = weights()
    hdrs = [*answer(hub, hashlib.sha256(data).hexdigest()), ("Content-Length", str(len(data)))]

    def body() -> Iterator[bytes]:
        for i in range(0, len(data), chunk):
            if stop.wait(every):
                return
            yield data[i:i + chunk]

    hub.routes[f"/acme/a/resolve/main/{WEIGHTS}"] = lambda method, _: (200, hdrs, b"" if method == "HEAD" else body())


# --- 1. the overall deadline --------------------------------------------------------------------------------------
def test_a_hub_that_trickles_the_weights_is_given_up_at_the_fetchs_deadline(
        hub: Any, repo: str, stop: threading.Event, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte every 0.2 s never trips huggingface_hub's per-read timeout (5 s here), and the 2776 bytes of weights
    would take 9 minutes (gigabytes: for ever). The fetch must average 1 MiB/s after a grace of 1 s: it is stopped at
    about 1 s with an error that names the source, the bytes received and the settings that change it, and keeps no
    partial file."""
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_GRACE_S", "1")
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_MIN_RATE", str(1 << 20))
    trickle(hub, stop, every=0.2)
    began = time.monotonic()
    err = in_thread(lambda: resolve_source(repo), 30)
    from vllm_lora_ext.errors import AdapterDownloadError, HubTooSlowError

    assert isinstance(err, HubTooSlowError) and isinstance(err, AdapterDownloadError), repr(err)
    assert time.monotonic() - began < 8
    text = str(err)
    assert "'hf:acme/a'" in text and WEIGHTS in text and f"{err.received} bytes" in text, text
    assert 0 < err.received < 100, err.received
    assert "VLLM_LORA_EXT_DOWNLOAD_MIN_RATE" in text and "VLLM_LORA_EXT_DOWNLOAD_GRACE_S" in text, text
    assert hub.url.split("//")[1] not in err.client_message() and "'hf:acme/a'" in err.client_message()
    blobs = isolated_hf_cache / "models--acme--a" / "blobs"
    assert not blobs.exists() or list(blobs.iterdir()) == []


def test_a_hub_that_answers_each_resume_from_the_start_and_stalls_is_given_up_at_the_deadline(
        hub: Any, repo: str, stop: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub resumes a body that stalls past its read timeout, and resets its five retries whenever a 10 MiB
    chunk arrives. A Hub that announces 11 MiB, sends 10 MiB and stalls, and answers each resume (``Range``) with a
    200 from the start, keeps it downloading the same 10 MiB for ever at a fine average rate: bytes received
    again are no progress, and the fetch is given up at its deadline."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_GRACE_S", "1")
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_MIN_RATE", str(10 << 20))
    size, sent = 11 << 20, b"\0" * ((10 << 20) + 1)
    hdrs = [*answer(hub, "0" * 64), ("Content-Length", str(size))]

    def body() -> Iterator[bytes]:
        yield sent
        stop.wait(60)

    hub.routes[f"/acme/a/resolve/main/{WEIGHTS}"] = lambda method, _: (200, hdrs, b"" if method == "HEAD" else body())
    err = in_thread(lambda: resolve_source(repo), 40)
    from vllm_lora_ext.errors import HubTooSlowError

    assert isinstance(err, HubTooSlowError), repr(err)
    assert err.received == len(sent), err.received
    assert sum(1 for m, p in hub.requests if m == "GET" and p.endswith(WEIGHTS)) >= 2  # resumed at least once


@pytest.mark.parametrize("method", ["GET", "HEAD"])
def test_a_hub_that_trickles_its_headers_is_given_up_at_the_fetchs_deadline(
        hub: Any, repo: str, stop: threading.Event, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch,
        method: str) -> None:
    """A Hub that sends the status line, then a byte of headers every 0.2 s: no answer exists until the headers end,
    so only huggingface_hub's per-read timeout (5 s here) bounded it, and that never trips; the HTTP parser's 100 KiB
    header limit would be reached after hours (days at a byte per 9 s). Whether it trickles the download's headers
    or those of the first request for the file (the plugin's HEAD, which opens the window), the fetch is stopped
    at about its grace, having received nothing of the file, and no blob is kept."""
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_GRACE_S", "1")
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_MIN_RATE", str(1 << 20))
    hub.slow_headers[WEIGHTS] = (method, 0.2, stop)
    began = time.monotonic()
    err = in_thread(lambda: resolve_source(repo), 30)
    from vllm_lora_ext.errors import HubTooSlowError

    assert isinstance(err, HubTooSlowError) and err.received == 0, repr(err)
    assert time.monotonic() - began < 8
    assert f"'{WEIGHTS}' of 'hf:acme/a'" in str(err) and "VLLM_LORA_EXT_DOWNLOAD_MIN_RATE" in str(err), str(err)
    blobs = isolated_hf_cache / "models--acme--a" / "blobs"
    assert not blobs.exists() or list(blobs.iterdir()) == []

    stop.set()  # the Hub answers at once again: nothing of the trickle is left in the way
    del hub.slow_headers[WEIGHTS]
    assert Path(resolve_source(repo).weights_path).read_bytes() == weights()


def test_an_honest_hub_loads_within_a_tight_deadline(hub: Any, repo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The deadline grows with the bytes received: a Hub that sends at full speed loads within a short grace."""
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_GRACE_S", "0.5")
    assert Path(resolve_source(repo).weights_path).read_bytes() == weights()


@pytest.mark.parametrize(("rate", "loads"), [("0", True), ("1048576", False)])
def test_a_rate_of_0_turns_the_deadline_off(
        hub: Any, repo: str, stop: threading.Event, monkeypatch: pytest.MonkeyPatch, rate: str, loads: bool) -> None:
    """256 bytes every 0.1 s, with no grace: stopped at the default rate, loaded (in about a second) with 0."""
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_GRACE_S", "0")
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_MIN_RATE", rate)
    trickle(hub, stop, every=0.1, chunk=256)
    got = in_thread(lambda: resolve_source(repo), 30)
    if loads:
        assert Path(got.weights_path).read_bytes() == weights()  # type: ignore[union-attr]
    else:
        assert type(got).__name__ == "HubTooSlowError", repr(got)


@pytest.mark.parametrize(("name", "value", "fragment"), [
    ("VLLM_LORA_EXT_DOWNLOAD_MIN_RATE", "fast", "is not a number"),
    ("VLLM_LORA_EXT_DOWNLOAD_MIN_RATE", "-1", "must be a finite number >= 0"),
    ("VLLM_LORA_EXT_DOWNLOAD_GRACE_S", "inf", "must be a finite number >= 0"),
])
def test_a_bad_download_deadline_setting_is_refused_at_start_up(
        monkeypatch: pytest.MonkeyPatch, name: str, value: str, fragment: str) -> None:
    from vllm_lora_ext.constants import check_settings
    from vllm_lora_ext.errors import SettingsError

    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=fragment) as info:
        check_settings()
    assert name in str(info.value)


# --- 2. the content against its sha256 ETag ---------------------------------------------------------------------
def tampered() -> bytes:
    """The weights with one byte of their tensor data changed: the same size, still a valid safetensors file."""
    data = bytearray(weights())
    data[-1] ^= 0xFF
    return bytes(data)


def test_weights_whose_bytes_differ_from_their_sha256_etag_are_refused_and_removed(
        hub: Any, repo: str, isolated_hf_cache: Path) -> None:
    """The Hub announces the true size and sha256 ETag and sends other bytes of that size (a broken mirror or CDN,
    or a tampering proxy). huggingface_hub checks only the size (file_download.http_get); the plugin hashes what
    arrived, refuses it naming the file and the source, and leaves neither the blob nor the snapshot's link."""
    from vllm_lora_ext.errors import HubAnswerError

    hub.lies[WEIGHTS] = {"body": tampered()}
    with pytest.raises(HubAnswerError) as info:
        resolve_source(repo)
    text, sha = str(info.value), hashlib.sha256(weights()).hexdigest()
    assert f"'{WEIGHTS}'" in text and "'hf:acme/a'" in text and sha in text, text
    assert hashlib.sha256(tampered()).hexdigest() in text and "removed from the cache" in text, text
    assert hub.url.split("//")[1] not in info.value.client_message()
    folder = isolated_hf_cache / "models--acme--a"
    assert not (folder / "blobs" / sha).exists()
    assert list(folder.glob(f"snapshots/*/{WEIGHTS}")) == []

    hub.lies.clear()  # the Hub answers truly again: the cache was not poisoned
    assert Path(resolve_source(repo).weights_path).read_bytes() == weights()


@pytest.mark.parametrize("etag", ["abc-123", "A" * 64, "A" * 40])
def test_a_file_whose_etag_is_no_digest_is_not_refused(hub: Any, repo: str, etag: str) -> None:
    """A mirror may answer its own kind of ETag, or upper-case hex: none is a sha256 or git blob id to check against,
    and the file loads."""
    hub.lies[WEIGHTS] = {"etag": etag}
    assert Path(resolve_source(repo).weights_path).read_bytes() == weights()


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def test_a_config_whose_bytes_differ_from_its_git_blob_id_etag_is_refused_and_removed(
        hub: Any, repo: str, isolated_hf_cache: Path) -> None:
    """A git file's ETag (the config's: not in LFS) is its git blob id, the sha1 of ``b"blob <size>\\0"`` and its
    bytes. A Hub that sends other bytes of the same size was taken as it was (only a sha256 ETag was checked): the
    config is refused as the weights are, naming both ids, and removed, so that a retry downloads it again."""
    from vllm_lora_ext.errors import HubAnswerError

    config = hub_adapter_files()[CONFIG]
    bad = config.replace(b'"r": 4', b'"r": 8')
    assert len(bad) == len(config) and bad != config
    hub.lies[CONFIG] = {"body": bad}
    with pytest.raises(HubAnswerError) as info:
        resolve_source(repo)
    text = str(info.value)
    assert f"'{CONFIG}'" in text and "'hf:acme/a'" in text and git_blob_id(config) in text, text
    assert f"git blob id is {git_blob_id(bad)}" in text and "removed from the cache" in text, text
    assert info.value.header == "ETag" and info.value.value == git_blob_id(config)
    folder = isolated_hf_cache / "models--acme--a"
    assert not (folder / "blobs" / git_blob_id(config)).exists()
    assert list(folder.glob(f"snapshots/*/{CONFIG}")) == []

    hub.lies.clear()  # the Hub answers truly again: the retry downloads the config
    assert json.loads(resolve_source(repo).config_path.read_bytes()) == json.loads(config)


@pytest.mark.parametrize("bound", [None, "10MiB"])
def test_a_refused_file_leaves_the_disk_cache_ledger_with_the_cache(
        hub: Any, repo: str, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch, bound: str | None) -> None:
    """The ledger lists the files the plugin placed, which the bound counts and may evict with their revision: a
    file refused and removed (its bytes not those its ETag names) leaves it too, and a revision with no file left
    leaves it whole. Else a file someone else puts there later (the user's own 'hf download' of the config) was
    taken for the plugin's, and its revision evictable."""
    from huggingface_hub import hf_hub_download

    from vllm_lora_ext.diskcache import list_cache
    from vllm_lora_ext.diskholds import state_root
    from vllm_lora_ext.diskledger import read_ledger
    from vllm_lora_ext.errors import HubAnswerError

    if bound is not None:
        monkeypatch.setenv("VLLM_LORA_EXT_DISK_CACHE_BYTES", bound)
    first = hub.repo("acme/a").refs["main"]
    hub.lies[CONFIG] = {"body": hub_adapter_files()[CONFIG].replace(b'"r": 4', b'"r": 8')}
    with pytest.raises(HubAnswerError):
        resolve_source(repo)
    assert read_ledger(state_root(None))[f"acme/a@{first}"]["files"] == [WEIGHTS]
    hub.lies.clear()
    hf_hub_download("acme/a", CONFIG, revision=first)  # the user's own download
    [rev] = list_cache()
    assert (rev.commit, rev.files, rev.evictable) == (first, (WEIGHTS,), False)

    other = hub_adapter_files(seed=1)[WEIGHTS]
    second = hub.repo("acme/a").commit({WEIGHTS: other})
    hub.lies[WEIGHTS] = {"body": other[:-1] + bytes([other[-1] ^ 0xFF])}
    with pytest.raises(HubAnswerError):
        resolve_source(repo)
    assert f"acme/a@{second}" not in read_ledger(state_root(None))
    assert [r.commit for r in list_cache()] == [first]


def test_an_lfs_file_named_by_its_pointers_git_blob_id_loads(hub: Any, repo: str) -> None:
    """A mirror that drops the Hub's X-Linked-Etag answers an LFS file's ETag by the git blob id of its pointer
    file, not of its bytes: that is the right file, and it loads."""
    data = weights()
    pointer = (f"version https://git-lfs.github.com/spec/v1\noid sha256:{hashlib.sha256(data).hexdigest()}\n"
               f"size {len(data)}\n").encode()
    hub.lies[WEIGHTS] = {"etag": git_blob_id(pointer)}
    assert Path(resolve_source(repo).weights_path).read_bytes() == data


def test_a_file_named_by_the_plain_sha1_of_its_bytes_loads(hub: Any, repo: str) -> None:
    """(Review of r45.) Some mirrors answer a file's ETag by the sha1 of its bytes, 40 hex digits like a git blob id:
    that is the right file, and it loads (r45's git blob id check had refused and removed it)."""
    data = weights()
    hub.lies[WEIGHTS] = {"etag": hashlib.sha1(data).hexdigest()}
    assert Path(resolve_source(repo).weights_path).read_bytes() == data


def test_a_cached_file_is_not_hashed_again(hub: Any, repo: str, isolated_hf_cache: Path) -> None:
    """Only a download is checked: a later resolve of the same revision, which finds the file cached, reads it as
    it is (hashing gigabytes at every resolve would cost a load its time)."""
    first = resolve_source(repo)
    blob = Path(first.weights_path).resolve()
    blob.chmod(0o644)
    blob.write_bytes(tampered())  # changed by hand after the download
    assert Path(resolve_source(repo).weights_path).read_bytes() == tampered()


# --- 3. found attacking the download path -------------------------------------------------------------------------
def test_a_size_announced_past_what_huggingface_hub_downloads_over_http_is_refused_with_a_typed_error(
        hub: Any, repo: str) -> None:
    """With no disk bound, a HEAD that announces 60 GB made huggingface_hub raise a bare ``ValueError`` ("install
    hf_xet"), which a server answers as an internal error: it is refused before the download, naming the file."""
    from vllm_lora_ext.errors import AdapterFormatError

    def script(nth: int, method: str, code: int, hdrs: list, body: bytes) -> tuple:
        if method == "HEAD":
            hdrs = [(k, v) for k, v in hdrs if k != "Content-Length"] + [("Content-Length", str(60 * 10**9))]
        return code, hdrs, body

    hub.script[WEIGHTS] = script
    with pytest.raises(AdapterFormatError, match=f"'{WEIGHTS}' of 'hf:acme/a' is 60000000000 bytes on the Hub"):
        resolve_source(repo)
    assert not any(m == "GET" for m, _ in hub.requests)


def test_a_resume_answered_with_a_content_range_far_ahead_is_no_progress(
        hub: Any, repo: str, stop: threading.Event, monkeypatch: pytest.MonkeyPatch) -> None:
    """A Hub that stalls, then answers huggingface_hub's resume with a 206 whose Content-Range starts far beyond the
    bytes sent, cannot buy time with it: the deadline counts the bytes that arrived."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "HF_HUB_DOWNLOAD_TIMEOUT", 1)
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_GRACE_S", "2")
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_MIN_RATE", "100")
    data = weights()
    hdrs = answer(hub, hashlib.sha256(data).hexdigest())

    def route(method: str, asked: dict) -> tuple:
        def body(part: bytes) -> Iterator[bytes]:
            yield part
            stop.wait(60)
        if method == "HEAD":
            return 200, [*hdrs, ("Content-Length", str(len(data)))], b""
        if not any(k.lower() == "range" for k in asked):
            return 200, [*hdrs, ("Content-Length", str(len(data)))], body(data[:100])
        return 206, [*hdrs, ("Content-Range", f"bytes 2000-{len(data) - 1}/{len(data)}"),
                     ("Content-Length", str(len(data) - 2000))], body(data[2000:2001])

    hub.routes[f"/acme/a/resolve/main/{WEIGHTS}"] = route
    err = in_thread(lambda: resolve_source(repo), 30)
    from vllm_lora_ext.errors import HubTooSlowError

    assert isinstance(err, HubTooSlowError) and err.received == 100, repr(err)


def test_waiting_for_another_download_of_the_same_file_does_not_count_against_the_deadline(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another download of the same blob held huggingface_hub's lock for 3 s with a 1 s grace: the wait returned no
    HTTP bytes, so the fetch's clock (started at its first download) cut the config's download that followed, at
    "0 B", blaming the Hub (r43 reviewer). Each file's window now opens at the Hub's first answer for it."""
    import json

    from filelock import FileLock
    from safetensors.torch import save

    from factories import dense_tensors, llama_shapes, lora_config
    weights = save(dense_tensors(llama_shapes(), rank=4, seed=1))
    config = json.dumps(lora_config(r=4)).encode()
    hub.repo("acme/x").commit({"adapter_model.safetensors": weights, "adapter_config.json": config})
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_GRACE_S", "1")
    monkeypatch.setenv("VLLM_LORA_EXT_DOWNLOAD_MIN_RATE", str(1 << 20))
    etag = hashlib.sha256(weights).hexdigest()
    path = isolated_hf_cache / ".locks" / "models--acme--x" / f"{etag}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path), thread_local=False)
    lock.acquire()

    def the_other_download() -> None:  # honest, and slower than this fetch's grace
        time.sleep(3)
        blobs = isolated_hf_cache / "models--acme--x" / "blobs"
        blobs.mkdir(parents=True, exist_ok=True)
        (blobs / etag).write_bytes(weights)
        lock.release()

    other = threading.Thread(target=the_other_download)
    other.start()
    try:
        resolved = resolve_source("hf:acme/x")
    finally:
        other.join()
    assert resolved.weights_path.read_bytes() == weights
