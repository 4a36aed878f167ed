"""The bounded disk tier (issue 41): the real huggingface_hub client against the local Hub server, real files.

Every adapter revision here is a repo ``acme/aNN`` with one commit (weights + config, all the same size), so
"a bound that holds 5" is five revisions' bytes plus half of one.
"""

from __future__ import annotations

import contextlib
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
import torch
from safetensors.torch import load, save

from factories import dense_tensors, llama_shapes, lora_config, scrape
from vllm_lora_ext import resolve_source
from vllm_lora_ext.building import BuildJob, build_adapter
from vllm_lora_ext.cli import main
from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES, disk_cache_bytes, parse_size
from vllm_lora_ext.diskcache import list_cache, prune_cache
from vllm_lora_ext.diskholds import hold, state_root
from vllm_lora_ext.errors import DiskCacheFullError
from vllm_lora_ext.planning import ModelSpec, PeftKeyRouter

CONFIG = json.dumps(lora_config(r=4)).encode()


def weights_of(seed: int) -> bytes:
    return save(dense_tensors(llama_shapes(), rank=4, seed=seed))


REV_BYTES = len(weights_of(0)) + len(CONFIG)


@pytest.fixture
def adapters(hub: Any) -> dict[str, str]:
    """acme/a00 .. acme/a24: one commit each; returns repo id -> commit sha."""
    return {f"acme/a{i:02d}": hub.repo(f"acme/a{i:02d}").commit({"adapter_model.safetensors": weights_of(i),
                                                                  "adapter_config.json": CONFIG})
            for i in range(25)}


def bound(monkeypatch: pytest.MonkeyPatch, revisions: float) -> int:
    limit = int(REV_BYTES * revisions)
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(limit))
    return limit


def disk_bytes(cache: Path) -> int:
    """Bytes in the cache's repo folders, partial downloads included (independent of the plugin's ledger)."""
    total = 0
    for repo in cache.glob("models--*"):
        try:
            blobs = list(os.scandir(repo / "blobs"))
        except FileNotFoundError:  # evicted while we looked
            continue
        for blob in blobs:
            try:
                total += blob.stat().st_size
            except FileNotFoundError:
                pass
    return total


def cached(cache: Path, repo_id: str, sha: str) -> bool:
    return (cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / sha / "adapter_model.safetensors").exists()


def test_twenty_revisions_through_a_bound_of_five_never_put_more_than_the_bound_on_disk(
        adapters: dict[str, str], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = bound(monkeypatch, 5.5)
    peak, stop = [0], threading.Event()

    def watch() -> None:  # the bound holds at every moment, not only between resolves
        while not stop.is_set():
            peak[0] = max(peak[0], disk_bytes(isolated_hf_cache))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for i in range(20):
            resolved = resolve_source(f"hf:acme/a{i:02d}")
            assert resolved.weights_path.read_bytes() == weights_of(i)
            assert disk_bytes(isolated_hf_cache) <= limit
    finally:
        stop.set()
        watcher.join()
    assert 0 < peak[0] <= limit
    listed = list_cache()
    assert [r.repo_id for r in listed] == [f"acme/a{i:02d}" for i in (19, 18, 17, 16, 15)]
    assert sum(r.nbytes for r in listed) == disk_bytes(isolated_hf_cache) == 5 * REV_BYTES


def test_pinned_and_in_use_revisions_survive_and_recency_decides_the_rest(
        adapters: dict[str, str], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bound(monkeypatch, 5.5)
    sha = adapters
    pinned = hold("acme/a00", sha["acme/a00"], why="adapter 'a00' (pinned by --lora-modules)")
    registered = hold("acme/a01", None, why="adapter 'a01' (registered)")  # a branch holds every revision
    for i in range(3):
        resolve_source(f"hf:acme/a{i:02d}")
    for i in range(3, 12):
        resolve_source(f"hf:acme/a{i:02d}")
        resolve_source("hf:acme/a02")  # used after every download: the most recent, never the one to go
    for name in ("acme/a00", "acme/a01", "acme/a02", "acme/a11"):
        assert cached(isolated_hf_cache, name, sha[name]), name
    assert not any(cached(isolated_hf_cache, f"acme/a{i:02d}", sha[f"acme/a{i:02d}"]) for i in range(3, 9))
    held = {r.repo_id: r.held_by for r in list_cache()}
    assert held["acme/a00"] == (f"pid {os.getpid()}: adapter 'a00' (pinned by --lora-modules)",)
    assert held["acme/a01"] == (f"pid {os.getpid()}: adapter 'a01' (registered)",) and held["acme/a02"] == ()
    pinned.release()
    registered.release()
    prune_cache(0)
    assert list_cache() == [] and disk_bytes(isolated_hf_cache) == 0


def test_an_evicted_adapter_is_fetched_again_on_next_use_with_identical_tensors(
        adapters: dict[str, str], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hub = __import__("hubserver").SERVER
    bound(monkeypatch, 2.5)
    first = load(resolve_source("hf:acme/a00").weights_path.read_bytes())
    for i in range(1, 4):
        resolve_source(f"hf:acme/a{i:02d}")
    assert not cached(isolated_hf_cache, "acme/a00", adapters["acme/a00"])
    gets = sum(1 for m, p in hub.requests if m == "GET" and p.startswith("/acme/a00/resolve/"))
    again = resolve_source(f"hf:acme/a00@{adapters['acme/a00']}")
    assert sum(1 for m, p in hub.requests if m == "GET" and p.startswith("/acme/a00/resolve/")) == gets + 2
    second = load(again.weights_path.read_bytes())
    assert sorted(first) == sorted(second) and all(torch.equal(first[k], second[k]) for k in first)


def test_when_everything_is_in_use_the_download_is_refused_with_the_bound_and_the_in_use_total(
        adapters: dict[str, str], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = bound(monkeypatch, 3.5)
    holds = [hold(f"acme/a{i:02d}", adapters[f"acme/a{i:02d}"], why=f"adapter 'a{i:02d}'") for i in range(3)]
    for i in range(3):
        resolve_source(f"hf:acme/a{i:02d}")
    with pytest.raises(DiskCacheFullError) as e:
        resolve_source("hf:acme/a03")
    msg = str(e.value)
    assert ENV_DISK_CACHE_BYTES in msg and "hf:acme/a03" in msg and "nothing was evicted" in msg
    assert "Unload adapters" in msg and f"{3 * REV_BYTES / 1024:.1f} KiB" in msg
    assert (e.value.limit, e.value.in_use) == (limit, 3 * REV_BYTES)
    assert all(cached(isolated_hf_cache, f"acme/a{i:02d}", adapters[f"acme/a{i:02d}"]) for i in range(3))
    assert disk_bytes(isolated_hf_cache) <= limit
    holds[0].release()
    assert resolve_source("hf:acme/a03").weights_path.read_bytes() == weights_of(3)  # room once one is unused
    assert not cached(isolated_hf_cache, "acme/a00", adapters["acme/a00"])


def test_an_adapter_larger_than_the_bound_is_refused_before_any_byte_or_eviction(
        adapters: dict[str, str], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    resolve_source("hf:acme/a00")
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(REV_BYTES // 2))
    with pytest.raises(DiskCacheFullError, match="needs"):
        resolve_source("hf:acme/a01")
    assert cached(isolated_hf_cache, "acme/a00", adapters["acme/a00"])
    assert disk_bytes(isolated_hf_cache) == REV_BYTES  # a00 only: not a byte of a01 was written


def test_cache_entries_the_plugin_did_not_download_are_never_counted_or_evicted(
        adapters: dict[str, str], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import hf_hub_download

    user = hf_hub_download("acme/a00", "adapter_model.safetensors")  # the user's own download
    resolve_source("hf:acme/a00")  # the plugin only reads it: a cache hit for the weights
    bound(monkeypatch, 1.5)
    for i in range(1, 4):
        resolve_source(f"hf:acme/a{i:02d}")
    prune_cache(0)
    assert Path(user).read_bytes() == weights_of(0)
    assert [(r.repo_id, r.evictable) for r in list_cache()] == [("acme/a00", False)]  # it placed the config only


def test_two_processes_sharing_one_cache_evict_nothing_the_other_uses(
        adapters: dict[str, str], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Real processes: each holds its own revisions and streams others through one bound, at the same time."""
    import vllm_lora_ext

    limit = bound(monkeypatch, 6.5)
    script = (
        "import sys\n"
        "from vllm_lora_ext import resolve_source\n"
        "from vllm_lora_ext.diskholds import hold\n"
        "keep, stream = sys.argv[1].split(','), sys.argv[2].split(',')\n"
        "held = [hold(s.split('@')[0], s.split('@')[1], why='adapter (registered)') for s in keep]\n"
        "for s in keep: resolve_source('hf:' + s)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.readline()\n"
        "for s in stream: resolve_source('hf:' + s)\n"
        "print('streamed', flush=True)\n"
        "sys.stdin.readline()\n")
    src = str(Path(vllm_lora_ext.__file__).parents[1])
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    pinned = [f"{r}@{s}" for r, s in adapters.items()]
    a_keep, b_keep = pinned[0:2], pinned[2:4]
    a_stream, b_stream = pinned[4:14], pinned[14:24]
    procs = [subprocess.Popen([sys.executable, "-c", script, ",".join(keep), ",".join(stream)], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for keep, stream in ((a_keep, a_stream), (b_keep, b_stream))]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", p.stderr.read()  # type: ignore[union-attr]
        for p in procs:  # both stream at once
            p.stdin.write("go\n")  # type: ignore[union-attr]
            p.stdin.flush()  # type: ignore[union-attr]
        for p in procs:
            assert p.stdout.readline().strip() == "streamed", p.stderr.read()  # type: ignore[union-attr]
        for name in a_keep + b_keep:
            repo, sha = name.split("@")
            assert cached(isolated_hf_cache, repo, sha), name
        assert disk_bytes(isolated_hf_cache) <= limit
        holders = {r.repo_id: r.held_by for r in list_cache()}
        assert all(len(holders[n.split("@")[0]]) == 1 for n in a_keep + b_keep)
    finally:
        for p in procs:
            p.communicate("exit\n", timeout=60)
    assert all(p.returncode == 0 for p in procs)
    report = prune_cache(0)  # both owners ended: their holds expired with them
    assert report.bytes_after == 0 and {r.repo_id for r in report.evicted} >= {n.split("@")[0] for n in a_keep + b_keep}
    assert list((state_root() / "holds").glob("*.json")) == []


def test_eviction_racing_builds_of_the_same_revision_never_leaves_a_build_reading_deleted_files(
        adapters: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    hub = __import__("hubserver").SERVER
    sha = adapters["acme/a00"]
    expected = dense_tensors(llama_shapes(), rank=4, seed=0)
    job = BuildJob(path=f"hf:acme/a00@{sha}", name="a00", model=ModelSpec(frozenset(llama_shapes())))
    stop, evictions, failures = threading.Event(), [0], []

    def evict() -> None:
        while not stop.is_set():
            try:
                evictions[0] += len(prune_cache(0).evicted)
            except Exception as err:  # pragma: no cover - reported below
                failures.append(err)

    evictor = threading.Thread(target=evict)
    evictor.start()
    try:
        builds = 0
        while builds < 30 or (evictions[0] < 2 and builds < 400):  # on a loaded machine the evictor may lag
            builds += 1
            built = build_adapter(job, PeftKeyRouter())
            assert list(built.dense) == list(expected)
            assert all(torch.equal(built.dense[k], expected[k]) for k in expected)
    finally:
        stop.set()
        evictor.join()
    assert failures == []
    downloads = sum(1 for m, p in hub.requests if m == "GET" and p.endswith("/adapter_model.safetensors"))
    assert evictions[0] >= 2 and downloads >= 2  # the revision really went, and came back, between builds


def test_disk_cache_metrics_show_its_bytes_and_evictions(fresh_metrics: str, adapters: dict[str, str],
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from prometheus_client import REGISTRY, generate_latest

    bound(monkeypatch, 2.5)
    for i in range(5):
        resolve_source(f"hf:acme/a{i:02d}")
    got = scrape(generate_latest(REGISTRY).decode())
    assert got[("vllm_lora_ext_disk_cache_evictions_total", ())] == 3
    assert got[("vllm_lora_ext_disk_cache_bytes", ())] == 2 * REV_BYTES


def test_cli_cache_ls_lists_downloads_and_prune_evicts_offline_down_to_max_bytes(
        adapters: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    for i in range(3):
        resolve_source(f"hf:acme/a{i:02d}")
    keep = hold("acme/a00", adapters["acme/a00"], why="adapter 'a00' (registered)")
    assert main(["cache", "ls", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["repo_id"] for r in rows] == ["acme/a02", "acme/a01", "acme/a00"]
    assert rows[2]["held_by"] == [f"pid {os.getpid()}: adapter 'a00' (registered)"] and rows[0]["bytes"] == REV_BYTES
    assert main(["cache", "prune", "--max-bytes", f"{REV_BYTES * 2}B"]) == 0
    assert "1 evicted" in capsys.readouterr().out
    assert main(["cache", "prune", "--max-bytes", "0"]) == 1  # a00 is in use: it stays, and prune says so
    assert "stay in use" in capsys.readouterr().err
    assert [r.repo_id for r in list_cache()] == ["acme/a00"]
    keep.release()
    assert main(["cache", "prune", "--max-bytes", "0"]) == 0 and list_cache() == []



def test_cli_cache_ls_of_a_folder_that_does_not_exist_warns_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["cache", "ls", "--cache-dir", str(tmp_path / "typo")]) == 0  # an empty cache is no error
    out = capsys.readouterr()
    assert f"the Hugging Face cache folder '{tmp_path / 'typo'}' does not exist" in out.err
    assert main(["cache", "prune", "--max-bytes", "0", "--cache-dir", str(tmp_path / "typo")]) == 0  # prune too
    assert f"the Hugging Face cache folder '{tmp_path / 'typo'}' does not exist" in capsys.readouterr().err
    (tmp_path / "file").write_text("x")
    assert main(["cache", "ls", "--cache-dir", str(tmp_path / "file")]) == 0
    assert f"the Hugging Face cache folder '{tmp_path / 'file'}' is not a folder" in capsys.readouterr().err
    assert "0 revisions, 0 bytes listed" in out.out and "only the revisions the plugin downloaded" in out.out


@pytest.mark.parametrize(("text", "value"), [("20GiB", 20 * 2**30), ("20GB", 20 * 10**9), ("20 gib", 20 * 2**30),
                                             ("512", 512), ("64KiB", 65536), ("1TB", 10**12), ("0", 0)])
def test_sizes_accept_bytes_and_decimal_or_binary_units(text: str, value: int) -> None:
    assert parse_size(text, name="X") == value


@pytest.mark.parametrize("text", ["GB", "-1", "20XB", "20 G", "２０GB", "1.5", "inf"])
def test_a_malformed_bound_names_the_setting_and_the_accepted_forms(text: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, text)
    with pytest.raises(ValueError, match=f"{ENV_DISK_CACHE_BYTES}=.*2GiB"):
        disk_cache_bytes()


def test_the_bound_is_off_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_DISK_CACHE_BYTES, raising=False)
    assert disk_cache_bytes() is None
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "0")
    assert disk_cache_bytes() is None


def test_a_servers_registered_adapters_and_mixes_stay_and_an_unloaded_ones_revision_may_go(
        adapters: dict[str, str], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.diskholds import HeldSources
    from vllm_lora_ext.diskuse import sync_server_holds
    from vllm_lora_ext.mixing import MixComponent, MixSpec

    bound(monkeypatch, 4.5)
    pin = {i: f"hf:acme/a{i:02d}@{adapters[f'acme/a{i:02d}']}" for i in range(12)}
    for i in range(3):
        resolve_source(pin[i])
    mix = MixSpec((MixComponent("a01", pin[1], 0.5), MixComponent("a02", pin[2], 0.5)))
    registered = {"a00": pin[0], "a01": pin[1], mix.lora_name: mix.lora_path}
    held = HeldSources()
    sync_server_holds(held, registered, pinned={"a00"})
    for i in range(3, 9):
        resolve_source(pin[i])
    assert all(cached(isolated_hf_cache, f"acme/a{i:02d}", adapters[f"acme/a{i:02d}"]) for i in range(3))
    whys = {r.repo_id: r.held_by for r in list_cache()}
    assert whys["acme/a00"] == (f"pid {os.getpid()}: adapter 'a00' (pinned at start-up)",)
    assert whys["acme/a02"] == (f"pid {os.getpid()}: mix {mix.lora_name!r} (registered)",)
    del registered[mix.lora_name]  # the mix was evicted: a02 is no longer in use; a01 still is (registered)
    sync_server_holds(held, registered, pinned={"a00"})
    assert held.held() == [("acme/a00", adapters["acme/a00"]), ("acme/a01", adapters["acme/a01"])]
    for i in range(9, 12):
        resolve_source(pin[i])
    assert not cached(isolated_hf_cache, "acme/a02", adapters["acme/a02"])
    assert cached(isolated_hf_cache, "acme/a00", adapters["acme/a00"]) and cached(isolated_hf_cache, "acme/a01",
                                                                                  adapters["acme/a01"])


def test_revisions_of_one_repo_count_a_blob_they_share_once(hub: Any, isolated_hf_cache: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    repo = hub.repo("acme/rev")
    shas = [repo.commit({"adapter_model.safetensors": weights_of(i), "adapter_config.json": CONFIG})
            for i in range(6)]  # six commits of one repo: the config's blob is the same for all of them
    weights = len(weights_of(0))
    limit = 3 * weights + len(CONFIG) + len(CONFIG) // 2  # three revisions fit only if the config counts once
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(limit))
    for sha in shas:
        resolve_source(f"hf:acme/rev@{sha}")
        assert disk_bytes(isolated_hf_cache) <= limit
    assert [r.commit for r in list_cache()] == shas[:2:-1]
    assert disk_bytes(isolated_hf_cache) == 3 * weights + len(CONFIG)


def test_an_unreadable_ledger_is_moved_aside_and_what_it_listed_is_never_evicted(
        adapters: dict[str, str], isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    for i in range(2):
        resolve_source(f"hf:acme/a{i:02d}")
    ledger = state_root() / "ledger.json"
    ledger.write_text('{"version": 1, "revisions": {"acme/a00@')  # torn
    bound(monkeypatch, 1.5)
    with caplog.at_level("WARNING", logger="vllm_lora_ext.diskcache"):
        for i in range(2, 5):
            resolve_source(f"hf:acme/a{i:02d}")
    assert "could not be read" in caplog.text and (state_root() / "ledger.json.unreadable").exists()
    assert all(cached(isolated_hf_cache, f"acme/a{i:02d}", adapters[f"acme/a{i:02d}"]) for i in (0, 1, 4))
    assert [r.repo_id for r in list_cache()] == ["acme/a04"]


@contextlib.contextmanager
def _slow_download(hub: Any, repo_id: str) -> Iterator[tuple[threading.Thread, list[Any]]]:
    """Run a resolve of ``repo_id`` whose weights' bytes wait for a gate; enter once they are asked, and on exit
    open the gate and wait for the resolve (its result or error is in the list)."""
    gate, out = threading.Event(), []
    hub.gates[f"{repo_id}/adapter_model.safetensors"] = gate
    asked = ("GET", f"/{repo_id}/resolve/main/adapter_model.safetensors")

    def run() -> None:
        try:
            out.append(resolve_source(f"hf:{repo_id}"))
        except BaseException as err:  # handed to the test
            out.append(err)

    slow = threading.Thread(target=run)
    slow.start()
    deadline = time.monotonic() + 20
    while asked not in hub.requests and time.monotonic() < deadline:
        time.sleep(0.01)
    try:
        assert asked in hub.requests
        yield slow, out
    finally:
        gate.set()
        slow.join(30)
        hub.gates.clear()


def test_a_slow_download_never_keeps_a_resolve_of_another_adapter_waiting(
        adapters: dict[str, str], hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = bound(monkeypatch, 3.5)
    with _slow_download(hub, "acme/a00") as (slow, out):
        started = time.monotonic()
        assert resolve_source("hf:acme/a01").weights_path.read_bytes() == weights_of(1)  # while a00 transfers
        assert time.monotonic() - started < 5 and slow.is_alive() and out == []
        assert any(h.reserved and h.reserve_key.startswith("acme/a00@") for h in live_holds_of(isolated_hf_cache))
    assert out[0].weights_path.read_bytes() == weights_of(0)
    assert not any(h.reserved for h in live_holds_of(isolated_hf_cache))  # the reservation ended with the transfer
    assert {r.repo_id for r in list_cache()} == {"acme/a00", "acme/a01"} and disk_bytes(isolated_hf_cache) <= limit


def test_a_download_in_progress_keeps_its_room_and_another_is_refused_at_once_naming_it(
        adapters: dict[str, str], hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limit = bound(monkeypatch, 1.5)
    with _slow_download(hub, "acme/a00") as (slow, out):
        started = time.monotonic()
        with pytest.raises(DiskCacheFullError) as e:
            resolve_source("hf:acme/a01")
        assert time.monotonic() - started < 5 and slow.is_alive()
        assert "by other downloads in progress: retry once they finish" in str(e.value) and e.value.in_use >= len(weights_of(0))
        assert not cached(isolated_hf_cache, "acme/a01", adapters["acme/a01"])
    assert out[0].weights_path.read_bytes() == weights_of(0) and disk_bytes(isolated_hf_cache) <= limit
    assert resolve_source("hf:acme/a01").weights_path.read_bytes() == weights_of(1)  # a00 is no longer in use
    assert disk_bytes(isolated_hf_cache) <= limit


def live_holds_of(cache: Path) -> list[Any]:
    from vllm_lora_ext.diskholds import live_holds, locked

    root = cache / ".locks" / "vllm_lora_ext"
    with locked(root):
        return live_holds(root)


def test_a_server_with_only_local_adapters_syncs_its_holds_without_a_warning(
        isolated_hf_cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Nothing to hold (local sources only): no holds file, and no "could not update" warning on every load (a Ray
    replica on the H200 logged one per adapter, 20 at start, before this)."""
    from vllm_lora_ext.diskholds import HeldSources
    from vllm_lora_ext.diskuse import sync_server_holds

    held = HeldSources()
    with caplog.at_level("WARNING", logger="vllm_lora_ext.diskholds"):
        for _ in range(3):
            sync_server_holds(held, {"local": str(tmp_path / "adapter")}, pinned={"local"})
    assert held.held() == [] and not [r for r in caplog.records if "could not update" in r.getMessage()]


def test_holds_survive_an_operator_removing_the_cache_locks_folder(tmp_path: Path) -> None:
    """``rm -rf <cache>/.locks`` (a usual cure for stuck hub downloads) while a server lives: its next hold failed
    (the folder was never made again) and an evictor elsewhere saw none of its holds."""
    import shutil

    code = ("import sys\nfrom vllm_lora_ext import diskholds\n"
            "diskholds.hold('acme/first', 'a' * 40, why='registered', cache_dir=sys.argv[1])\n"
            "print('held', flush=True)\nsys.stdin.readline()\n"
            "diskholds.hold('acme/second', 'a' * 40, why='registered', cache_dir=sys.argv[1])\n"
            "print('held again', flush=True)\nsys.stdin.readline()\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    server = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], env=env, stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout is not None and server.stdin is not None
        assert server.stdout.readline().strip() == "held"
        shutil.rmtree(tmp_path / ".locks")
        server.stdin.write("\n")
        server.stdin.flush()
        assert server.stdout.readline().strip() == "held again"
        from vllm_lora_ext.diskholds import live_holds, locked

        root = state_root(tmp_path)
        with locked(root):
            seen = {(h.repo_id, h.pid) for h in live_holds(root)}
        assert {("acme/first", server.pid), ("acme/second", server.pid)} <= seen
    finally:
        server.kill()
        server.wait()


def test_a_process_leaves_no_holds_files_once_it_holds_nothing_or_exits(tmp_path: Path) -> None:
    """Every CLI run on an ``hf:`` source left a holds file and its owner lock behind (void, but swept only by the
    next eviction): a released last hold removes them, and so does the process's exit with holds still taken."""
    code = ("import sys\nfrom vllm_lora_ext import diskholds\n"
            "h = diskholds.hold('acme/first', 'a' * 40, why='cli', cache_dir=sys.argv[1])\n"
            "print(sorted(p.suffix for p in (diskholds.state_root(sys.argv[1]) / 'holds').iterdir()), flush=True)\n"
            "h.release()\n"
            "print(sorted(p.name for p in (diskholds.state_root(sys.argv[1]) / 'holds').iterdir()), flush=True)\n"
            "diskholds.hold('acme/second', 'a' * 40, why='cli', cache_dir=sys.argv[1])\n")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src")}
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=env, capture_output=True, text=True,
                          check=True, timeout=120)
    assert done.stdout.splitlines() == ["['.json', '.lock']", "[]"], done.stderr
    assert list((state_root(tmp_path) / "holds").iterdir()) == []  # the exit took the second hold's files
