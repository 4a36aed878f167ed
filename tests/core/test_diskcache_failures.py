"""The disk tier when a download fails: an adapter larger than the whole bound, the revision a failed resolve had
half downloaded, and the partial file a killed download leaves. Found by an attacker helper in r43; each docstring
says what went wrong before."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save

from factories import dense_tensors, llama_shapes, lora_config
from vllm_lora_ext import resolve_source
from vllm_lora_ext.cli import main
from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES
from vllm_lora_ext.diskcache import list_cache, prune_cache
from vllm_lora_ext.errors import AdapterFormatError, DiskCacheFullError

CONFIG = json.dumps(lora_config(r=4)).encode()


def weights(seed: int) -> bytes:
    return save(dense_tensors(llama_shapes(), rank=4, seed=seed))


def kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def blob_bytes(cache: Path) -> int:
    """Bytes in the cache's repo blob folders, partial files included (independent of the plugin's ledger)."""
    return sum(p.stat().st_size for p in cache.glob("models--*/blobs/*"))


@pytest.mark.parametrize("too_large", ["weights alone", "weights and config"])
def test_an_adapter_larger_than_the_bound_is_refused_naming_its_size_the_bound_and_the_fix(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch, too_large: str) -> None:
    """An adapter that cannot fit the bound even in an empty cache was refused as if the cache were full: "0 B of it
    is held by revisions in use (pinned, registered, or being read) ... Unload adapters", and with the weights
    fitting but not the config, the adapter's own weights were counted as the revisions in use."""
    hub.repo("acme/big").commit({"adapter_model.safetensors": weights(1), "adapter_config.json": CONFIG})
    size = len(weights(1)) + (len(CONFIG) if too_large == "weights and config" else 0)
    limit = len(weights(1)) // 2 if too_large == "weights alone" else len(weights(1)) + len(CONFIG) // 2
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(limit))
    with pytest.raises(DiskCacheFullError) as e:
        resolve_source("hf:acme/big")
    msg = str(e.value)
    assert "'hf:acme/big" in msg and f"needs {kib(size)}" in msg and f"({kib(limit)})" in msg
    assert f"Raise {ENV_DISK_CACHE_BYTES} above {kib(size)}" in msg and "local folder as the source" in msg
    assert "in use" not in msg and "Unload" not in msg
    assert (e.value.needed, e.value.limit) == (size, limit)


def test_a_resolve_refused_part_way_leaves_no_half_revision_listed_or_on_disk(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The weights fit the bound and were downloaded and listed; the config did not fit and the resolve was refused;
    the weights stayed on disk and in `vllm-lora cache ls`, a revision no resolve could use, listed as cached."""
    hub.repo("acme/big").commit({"adapter_model.safetensors": weights(1), "adapter_config.json": CONFIG})
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(len(weights(1)) + len(CONFIG) // 2))
    with pytest.raises(DiskCacheFullError):
        resolve_source("hf:acme/big")
    assert list_cache() == [] and blob_bytes(isolated_hf_cache) == 0
    assert main(["cache", "ls"]) == 0 and "0 revisions, 0 bytes listed" in capsys.readouterr().out


def test_a_failed_resolve_of_a_new_commit_leaves_the_cached_one_listed_and_serving_offline(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`main` moved to a commit whose config the Hub announces too large: the resolve failed after its weights were
    downloaded, with `refs/main` left naming that half revision, so the commit cached before no longer served
    `hf:acme/big` offline. The ref is put back; the new weights, whole, stay for a retry, which reuses them."""
    repo = hub.repo("acme/big")
    first = repo.commit({"adapter_model.safetensors": weights(1), "adapter_config.json": CONFIG})
    resolve_source("hf:acme/big")
    second = repo.commit({"adapter_model.safetensors": weights(2)})
    hub.lies["adapter_config.json"] = {"size": 2 << 20}
    with pytest.raises(AdapterFormatError, match="larger than a config may be"):
        resolve_source("hf:acme/big")
    assert {r.commit for r in list_cache()} == {first, second}
    offline = resolve_source("hf:acme/big", local_files_only=True)
    assert offline.commit == first and offline.weights_path.read_bytes() == weights(1)
    del hub.lies["adapter_config.json"]
    before = hub.count()
    again = resolve_source("hf:acme/big")
    assert again.commit == second and again.weights_path.read_bytes() == weights(2)
    assert [r for r in hub.requests[before:] if r[0] == "GET"] == []  # the kept weights reused: HEADs only


def test_the_partial_file_of_a_killed_download_counts_toward_the_bound(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A process killed mid-transfer leaves its partial file in `blobs/` (`<etag>.<hex>.incomplete`), which no
    later download reuses; the bound never counted it, so the cache held the bound plus every such file. (While the
    transfer runs, its bytes are not counted a second time.)"""
    import vllm_lora_ext

    big = b"\0" * (16 << 20)  # huggingface_hub writes 10 MiB chunks: 12 MiB sent leaves 10 MiB in the partial file
    hub.repo("acme/big").commit({"big.safetensors": big})
    hub.script["big.safetensors"] = lambda nth, command, status, hdrs, body: (  # 12 MiB, then a stall
        status, hdrs, body if command == "HEAD" else body[: 12 << 20])
    for i in range(2):
        hub.repo(f"acme/a{i}").commit({"adapter_model.safetensors": weights(i), "adapter_config.json": CONFIG})
    resolve_source("hf:acme/a0")
    rev = len(weights(0)) + len(CONFIG)
    env = dict(os.environ, PYTHONPATH=str(Path(vllm_lora_ext.__file__).parents[1]), HF_HUB_DOWNLOAD_TIMEOUT="60")
    env.pop(ENV_DISK_CACHE_BYTES, None)
    proc = subprocess.Popen([sys.executable, "-c", "from vllm_lora_ext import resolve_source\n"
                             "resolve_source('hf:acme/big:big.safetensors')"], env=env)
    try:
        deadline = time.monotonic() + 60
        while blob_bytes(isolated_hf_cache) == rev and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        assert proc.poll() is None and prune_cache(1 << 40).bytes_before == rev  # being written: not counted
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    partial = blob_bytes(isolated_hf_cache) - rev
    assert 0 < partial < len(big)
    assert [p.suffix for p in isolated_hf_cache.glob("models--acme--big/blobs/*")] == [".incomplete"]
    assert prune_cache(1 << 40).bytes_before == rev + partial
    limit = partial + rev * 3 // 2
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(limit))
    resolve_source("hf:acme/a1")
    assert blob_bytes(isolated_hf_cache) <= limit
    assert [r.repo_id for r in list_cache()] == ["acme/a1"]  # a0 went to make room beside the partial file
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(partial + rev // 2))
    with pytest.raises(DiskCacheFullError, match=r"partial files of interrupted downloads .*'\*\.incomplete'") as e:
        resolve_source("hf:acme/a0")
    assert e.value.in_use == partial


def test_a_refused_resolve_never_evicts_a_revision_another_resolve_used_since(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A listed the weights first; B (another request) resolved the same revision whole and returned; then A was
    refused by the bound (here injected: other downloads' pending bytes are one real cause), and A's undo evicted
    the revision B had just returned (r43 reviewer). A revision used since it was listed is kept."""
    import threading

    from vllm_lora_ext import diskcache

    hub.repo("acme/x").commit({"adapter_model.safetensors": weights(1), "adapter_config.json": CONFIG})
    real = diskcache.download_file
    other: dict[str, Any] = {}

    def download(repo_id: str, filename: str, **kwargs: Any) -> Any:
        if filename == "adapter_config.json" and not other:
            other["started"] = True
            thread = threading.Thread(target=lambda: other.setdefault("b", resolve_source("hf:acme/x")))
            thread.start()  # B, in a context of its own, resolves the revision whole meanwhile
            thread.join()
            raise DiskCacheFullError("refused", source="hf:acme/x", limit=1, in_use=0, needed=1)
        return real(repo_id, filename, **kwargs)

    monkeypatch.setattr(diskcache, "download_file", download)
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(1 << 30))
    with pytest.raises(DiskCacheFullError):
        resolve_source("hf:acme/x")
    b = other["b"]
    assert b.weights_path.read_bytes() == weights(1) and b.config_path is not None and b.config_path.exists()
    assert [r.commit for r in list_cache()] == [b.commit]
