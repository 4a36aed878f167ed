"""A review of the Hub guard and the disk tier's growing reservation: the guard survives huggingface_hub replacing its
client, an honest Hub's transient or private-repo answers are not called lies, a Xet file fetched over HTTP is
counted, and a transfer stopped part-way leaves nothing behind and names the file's size."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save

from factories import dense_tensors, llama_shapes, lora_config
from vllm_lora_ext import resolve_source
from vllm_lora_ext.cli import _args
from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES

WEIGHTS = "adapter_model.safetensors"


def files_outside(root: Path, cache: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p != cache and cache not in p.parents]


@pytest.fixture
def repo(hub: Any) -> str:
    hub.repo("acme/a").commit({WEIGHTS: save(dense_tensors(llama_shapes(), rank=4, seed=0)),
                               "adapter_config.json": json.dumps(lora_config(r=4)).encode()})
    return "hf:acme/a"


def test_hook_survives_the_shared_client_being_recreated_during_the_download(
        hub: Any, repo: str, isolated_hf_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub's `_http_backoff_base` calls `close_session()` on any ConnectError (in this thread's retry,
    or in any other thread's download), and `set_client_factory` does too; the next `get_session()` is a fresh
    client without `_check_answer`. Simulated here: the shared client is recreated just before huggingface_hub's
    own HEAD, which then lies with a traversing ETag."""
    import huggingface_hub.file_download as fd
    from huggingface_hub.utils import _http

    from vllm_lora_ext import hubguard

    real = fd.get_hf_file_metadata

    def recreated(*a: Any, **k: Any) -> Any:
        if hubguard._EXPECTED.get() is not None:
            _http.close_session()  # as another thread's ConnectError would
        return real(*a, **k)

    monkeypatch.setattr(fd, "get_hf_file_metadata", recreated)
    hub.lies[WEIGHTS] = {"etag": "../../../outside/blob", "from": 2}
    with pytest.raises(Exception):
        resolve_source(repo)
    assert files_outside(tmp_path, isolated_hf_cache) == []


def test_a_408_to_the_plugins_head_then_the_file_is_not_called_a_lying_hub(hub: Any, repo: str) -> None:
    """huggingface_hub retries 408 like 429/5xx (_DEFAULT_RETRY_ON_STATUS_CODES); `head` returns empty facts on it,
    and the hook then refuses the honest 200 as 'a Hub that answers two requests differently'."""
    from vllm_lora_ext.errors import HubAnswerError

    def script(nth: int, method: str, code: int, hdrs: list, body: bytes) -> tuple:
        if nth == 1:
            return 408, [("Content-Length", "0")], b""
        return code, hdrs, body

    hub.script[WEIGHTS] = script
    try:
        resolve_source(repo)
    except HubAnswerError as err:
        pytest.fail(f"an honest transient 408 was refused as a lying Hub: {err.client_message()}")


def test_growth_refused_mid_transfer_removes_the_partial_file_releases_the_hold_and_names_the_files_size(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another process registers (holds) every cached revision while a download runs: `_Room.grow` cannot make
    room for the next step and stops the transfer."""
    from vllm_lora_ext import diskcache
    from vllm_lora_ext.diskholds import hold, live_holds, state_root
    from vllm_lora_ext.errors import DiskCacheFullError

    size = len(save(dense_tensors(llama_shapes(), rank=4, seed=0)))
    rev = size + len(json.dumps(lora_config(r=4)))
    for i in range(4):
        hub.repo(f"acme/s{i}").commit({WEIGHTS: save(dense_tensors(llama_shapes(), rank=4, seed=i)),
                                       "adapter_config.json": json.dumps(lora_config(r=4)).encode()})
    for i in range(3):
        resolve_source(f"hf:acme/s{i}")
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(int(3.5 * rev)))
    monkeypatch.setattr(diskcache, "_STEP", rev // 8)
    import huggingface_hub.constants as hc
    monkeypatch.setattr(hc, "DOWNLOAD_CHUNK_SIZE", 64)  # many small updates, as a large file's 10 MB chunks are
    held: list[Any] = []

    def script(nth: int, method: str, code: int, hdrs: list, body: bytes) -> tuple:
        if method == "GET" and not held:  # the download started: every cached revision is registered meanwhile
            held.extend(hold(f"acme/s{i}", None, why="registered elsewhere") for i in range(3))
        return code, hdrs, body

    hub.script[WEIGHTS] = script
    try:
        with pytest.raises(DiskCacheFullError) as info:
            resolve_source("hf:acme/s3")
    finally:
        for h in held:
            h.release()
    assert not [p for p in isolated_hf_cache.rglob("*.incomplete")]
    assert not [h for h in live_holds(state_root()) if h.reserve_key is not None]
    assert info.value.needed == size, (info.value.needed, size, str(info.value))


def test_an_honest_401_with_a_cached_tree_listing_is_not_called_a_lying_hub(
        hub: Any, repo: str, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The repo went private (or the token changed) after vLLM's snapshot_download cached trees/<sha>.json, and the
    plugin evicted the revision (delete_revisions leaves trees/). An honest Hub answers 401 to everything; the
    client should be told the repo is private/not found, not that the server's Hub lies."""
    import hashlib

    import huggingface_hub.constants as hc
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    from vllm_lora_ext.errors import HubAnswerError

    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", False)
    sha = hub.repo("acme/a").refs["main"]
    data = hub.repo("acme/a").commits[sha][WEIGHTS]
    write_tree_cache(str(isolated_hf_cache / "models--acme--a"), sha, {
        WEIGHTS: TreeCacheEntry(size=len(data), blob_id="0" * 40, lfs_sha256=hashlib.sha256(data).hexdigest(),
                                lfs_size=len(data), xet_hash="a" * 64)})
    denied = (401, [("X-Error-Code", "RepoNotFound"), ("X-Error-Message", "Repository not found"),
                    ("Content-Length", "0")], b"")
    hub.script[WEIGHTS] = lambda nth, method, code, hdrs, body: denied
    hub.routes["/api/models/acme/a/*"] = lambda method, hdrs: denied
    try:
        resolve_source(f"{repo}@{sha}")
    except HubAnswerError as err:
        pytest.fail(f"an honest 401 became a 'lying Hub' error: {err.client_message()}")
    except Exception:  # noqa: BLE001  (any not-found/private error is right)
        pass


def test_a_xet_file_downloaded_over_plain_http_is_still_capped(
        hub: Any, repo: str, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """HF_HUB_DISABLE_XET=1 (or no hf_xet): huggingface_hub downloads a Xet-stored file with http_get, through the
    tqdm class it is given, so the byte cap could stop it; `transfer_cap` drops the cap for any Xet header."""
    import huggingface_hub.constants as hc

    from vllm_lora_ext.errors import HubAnswerError

    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", True)
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "1GiB")
    hub.lies[WEIGHTS] = {"xet": True}
    big = b"\0" * (8 << 20)

    def script(nth: int, method: str, code: int, hdrs: list, body: bytes) -> tuple:
        if method == "GET":
            return code, [(k, v) for k, v in hdrs if k.lower() != "content-length"] + [
                ("Content-Length", str(len(big)))], big
        return code, hdrs, body

    hub.script[WEIGHTS] = script
    with pytest.raises(HubAnswerError, match="sent more than"):
        resolve_source(repo)


def test_a_failed_narrowing_hold_keeps_the_branch_hold(
        hub: Any, repo: str, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch, released: None) -> None:
    """The commit's hold cannot be taken (a lock timeout under contention): the branch hold taken before the resolve
    stays, so the command never reads its source unheld."""
    from vllm_lora_ext import diskholds
    from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES
    from vllm_lora_ext.diskholds import live_holds, locked, state_root

    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "1GiB")
    real = diskholds.hold
    made: list[str] = []

    def flaky(repo_id: str, revision: str | None, **k: Any) -> Any:
        if k.get("why") == "read by a vllm-lora command":
            made.append(str(revision))
            if len(made) == 2:
                raise OSError("lock timeout")
        return real(repo_id, revision, **k)

    monkeypatch.setattr(diskholds, "hold", flaky)
    _args.resolve_offline(repo)
    root = state_root(None)
    with locked(root):
        mine = [h for h in live_holds(root) if h.repo_id == "acme/a" and h.why == "read by a vllm-lora command"]
    assert mine, "the source is read with no hold"


def test_a_busy_hub_with_a_cached_copy_answers_from_the_cache_without_a_backoff_round(
        hub: Any, repo: str) -> None:
    """As hf_hub_download does, a busy answer (408, 429, 5xx) to the first metadata request gives the cached copy at
    once; the round of backoff (1+2+4+8+8 s a file) is only for a file not cached."""
    import time

    from vllm_lora_ext import resolve_source

    resolve_source(repo)  # cached
    hub.script[WEIGHTS] = lambda nth, method, code, hdrs, body: (503, [("Content-Length", "0")], b"")
    started = time.monotonic()
    resolve_source(repo)
    assert time.monotonic() - started < 5, "a busy Hub with the file cached cost a full backoff round"


def test_a_file_renamed_by_another_download_mid_scan_does_not_fail_this_one(
        hub: Any, repo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub writes ``refs/<branch>`` through a temporary file it renames: a cache scan (the bound's) that
    lists the temporary file and reads it after the rename meets a FileNotFoundError; the scan is taken again."""
    import huggingface_hub

    real = huggingface_hub.scan_cache_dir
    raised: list[bool] = []

    def racing(*a: Any, **k: Any) -> Any:
        if not raised:
            raised.append(True)
            raise FileNotFoundError(2, "No such file or directory", "models--acme--b/refs/main.0123abcd.tmp")
        return real(*a, **k)

    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "1GiB")
    monkeypatch.setattr(huggingface_hub, "scan_cache_dir", racing)
    assert Path(resolve_source(repo).weights_path).is_file() and raised
