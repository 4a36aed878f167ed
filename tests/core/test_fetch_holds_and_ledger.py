"""`vllm-lora fetch` of several sources under a disk bound, a recency update of the ledger on a full disk, and a
repo that huggingface_hub's cache scan skips as corrupt. Found by an attacker helper in r42; each docstring says
what went wrong before."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save

from factories import dense_tensors, llama_shapes, lora_config
from vllm_lora_ext import resolve_source
from vllm_lora_ext.diskcache import list_cache
from vllm_lora_ext.diskholds import state_root

CONFIG = json.dumps(lora_config(r=4)).encode()


def weights(seed: int) -> bytes:
    return save(dense_tensors(llama_shapes(), rank=4, seed=seed))


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    import vllm_lora_ext

    env = dict(os.environ, PYTHONPATH=str(Path(vllm_lora_ext.__file__).parents[1]))
    return subprocess.run([sys.executable, "-m", "vllm_lora_ext.cli", *args], env=env, capture_output=True,
                          text=True, timeout=timeout)



def test_fetch_of_several_sources_under_a_bound_keeps_each_fetched_revision_or_exits_1(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`vllm-lora fetch A B C` (to fill a cache for offline serving) with VLLM_LORA_EXT_DISK_CACHE_BYTES set, as
    on the server: each fetched revision is released as soon as it is fetched, so fetching C evicts A and B. The
    command prints all three as fetched, with weight paths that no longer exist, and exits 0; the offline server
    then finds A missing. It should hold what it fetched until it ends (as `mix`/`inspect` do) and fail the sources
    that do not fit together."""
    from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES

    for i in range(3):
        hub.repo(f"acme/f{i}").commit({"adapter_model.safetensors": weights(i), "adapter_config.json": CONFIG})
    rev_bytes = len(weights(0)) + len(CONFIG)
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(int(rev_bytes * 1.5)))
    done = cli("fetch", "--json", "hf:acme/f0", "hf:acme/f1", "hf:acme/f2")
    records = [json.loads(line) for line in done.stdout.splitlines()]
    missing = [r["source"] for r in records if "weights" in r and not Path(r["weights"]).exists()]
    assert done.returncode != 0 or not missing, \
        f"exit {done.returncode}, every source reported fetched, but {missing} were evicted by the same command"


def test_a_recency_update_on_a_full_disk_leaves_the_ledger_whole(
        hub: Any, isolated_hf_cache: Path) -> None:
    """`_touch` (every resolve: fetch, inspect, a server's load) rewrites the ledger in place
    (`write_in_place`: overwrite, then truncate). When the file must grow by a few bytes (a `last_use` whose repr is
    longer) and the disk is full (ENOSPC; here the file size limit, EFBIG), the write stops part-way: the ledger is
    left torn, the command still exits 0 (the failure is logged at debug), and the next reader moves it aside and
    forgets every revision the plugin downloaded: none is ever counted or evicted again, on exactly the full disk the
    bound exists for. A recency update should be all-or-nothing (or leave the old ledger whole)."""
    import resource

    for i in range(3):
        hub.repo(f"acme/t{i}").commit({"adapter_model.safetensors": weights(i), "adapter_config.json": CONFIG})
        resolve_source(f"hf:acme/t{i}")
    ledger = state_root() / "ledger.json"
    data = json.loads(ledger.read_text())
    for v in data["revisions"].values():
        v["last_use"] = 1700000000.0  # an older use (written by an older run), a short float repr
    first = next(iter(data["revisions"].values()))
    first["pad"] = ""  # (an extra field the ledger keeps) so that the file is exactly 2048 bytes
    first["pad"] = "x" * (2048 - len(json.dumps(data, sort_keys=True)))
    ledger.write_text(json.dumps(data, sort_keys=True))
    assert ledger.stat().st_size == 2048 and len(list_cache()) == 3

    import vllm_lora_ext

    env = dict(os.environ, PYTHONPATH=str(Path(vllm_lora_ext.__file__).parents[1]))
    full = subprocess.run([sys.executable, "-m", "vllm_lora_ext.cli", "fetch", "hf:acme/t0"], env=env,
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048)))
    assert full.returncode == 0, full.stderr  # (the adapter was cached: the fetch itself succeeds)
    kept = list_cache()
    assert len(kept) == 3, f"after one recency update on a full disk the ledger lists {len(kept)} of 3 revisions " \
        f"({sorted(p.name for p in state_root().iterdir())})"


def test_a_repo_the_cache_scan_calls_corrupt_keeps_its_revisions_listed(
        hub: Any, isolated_hf_cache: Path) -> None:
    """huggingface_hub, asked for a file that a moved branch lacks (transformers probing `config.json` in an
    adapter repo, `hf_hub_download(repo, "README.md")`), caches the 404 and points refs/main at the NEW commit
    without making its snapshot. scan_cache_dir calls that repo corrupt ("Reference(s) refer to missing commit
    hashes") and leaves it out of its answer; `_scan` took every listed revision of the repo as "deleted outside
    the plugin" and removed it from the ledger for good, even from a read-only `vllm-lora cache ls` (before r42)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    repo = hub.repo("acme/r")
    old = repo.commit({"adapter_model.safetensors": weights(0), "adapter_config.json": CONFIG})
    resolve_source("hf:acme/r")  # the plugin downloads revision `old` (listed in the ledger)
    assert [(r.repo_id, r.commit) for r in list_cache()] == [("acme/r", old)]
    repo.commit({"adapter_model.safetensors": weights(1)})  # main moves on
    with pytest.raises(EntryNotFoundError):  # another tool sharing the cache probes a file the repo lacks
        hf_hub_download("acme/r", "config.json", cache_dir=isolated_hf_cache)
    listed = cli("cache", "ls", "--json")  # an operator looks at the cache
    commits = {json.loads(line)["commit"] for line in listed.stdout.splitlines()}
    assert old in commits, f"cache ls no longer lists acme/r@{old[:12]} (on disk: " \
        f"{(isolated_hf_cache / 'models--acme--r' / 'snapshots' / old).is_dir()}); stderr: {listed.stderr[-300:]}"


def test_after_the_ref_heals_the_revision_is_evicted_again(hub: Any, isolated_hf_cache: Path) -> None:
    """Once refs/main is whole again (the next download of main), the revision kept through the skipped scans is
    counted and evicted as before: `cache prune --max-bytes 0` removes it (before r42 it was forgotten for good)."""
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    repo = hub.repo("acme/r")
    old = repo.commit({"adapter_model.safetensors": weights(0), "adapter_config.json": CONFIG})
    resolve_source("hf:acme/r")
    repo.commit({"adapter_model.safetensors": weights(1)})
    with pytest.raises(EntryNotFoundError):
        hf_hub_download("acme/r", "config.json", cache_dir=isolated_hf_cache)
    cli("cache", "ls")
    resolve_source("hf:acme/r")  # main downloaded by the plugin: the ref is whole again
    done = cli("cache", "prune", "--max-bytes", "0")
    snap = isolated_hf_cache / "models--acme--r" / "snapshots" / old
    assert not snap.exists(), f"prune --max-bytes 0 left {snap.name[:12]} on disk (exit {done.returncode}): " \
        f"{done.stdout.strip()}"


@pytest.mark.parametrize("which", ["ledger", "holds"])
def test_a_fifo_in_place_of_the_ledger_or_a_holds_file_is_refused_not_waited_on(
        which: str, hub: Any, isolated_hf_cache: Path) -> None:
    """The state files were size-checked (MAX_STATE_FILE_BYTES) against a hostile or corrupt cache, but read
    with `read_text()` whatever they were (before r42): a FIFO (or a device) at `ledger.json` or at a live process's
    `holds/<name>.json` blocks the reader forever, under the cache-wide state lock, so `cache ls`, `cache prune` and
    every server download on that cache hang (not an error naming the file). The README refuses a FIFO for
    VLLM_LORA_EXT_CONFIG at once; these files should be opened non-blocking / checked to be regular files."""
    from filelock import FileLock

    hub.repo("acme/q").commit({"adapter_model.safetensors": weights(0), "adapter_config.json": CONFIG})
    resolve_source("hf:acme/q")
    root = state_root()
    owner = None
    if which == "ledger":
        (root / "ledger.json").unlink()
        os.mkfifo(root / "ledger.json")
    else:
        (root / "holds").mkdir(exist_ok=True)
        owner = FileLock(str(root / "holds" / "999-abc.lock"), thread_local=False)
        owner.acquire()  # a live owner (this process)
        os.mkfifo(root / "holds" / "999-abc.json")
    try:
        try:
            done = cli("cache", "ls", timeout=20)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`vllm-lora cache ls` hung on a FIFO {which} file")
        assert done.returncode in (0, 1), done.stderr
    finally:
        if owner is not None:
            owner.release()
