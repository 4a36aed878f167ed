"""A hostile Hub or mirror (``HF_ENDPOINT``): huggingface_hub names cache files after its ETag and X-Repo-Commit and
writes a body until it ends, so the plugin checks those answers first (`hubguard`). The real huggingface_hub client
against the local Hub server, told to lie (``lies``)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save

from factories import dense_tensors, llama_shapes, lora_config
from vllm_lora_ext import resolve_source
from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES
from vllm_lora_ext.diskcache import list_cache
from vllm_lora_ext.errors import HubAnswerError

WEIGHTS = "adapter_model.safetensors"


@pytest.fixture
def repo(hub: Any) -> str:
    hub.repo("acme/a").commit({WEIGHTS: save(dense_tensors(llama_shapes(), rank=4, seed=0)),
                               "adapter_config.json": json.dumps(lora_config(r=4)).encode()})
    return "hf:acme/a"


def point_hub_at(monkeypatch: pytest.MonkeyPatch, url: str) -> None:
    """Send huggingface_hub (and the plugin) to ``url``: both read the endpoint at import."""
    import huggingface_hub.constants as hc

    monkeypatch.setattr(hc, "ENDPOINT", url)
    monkeypatch.setattr(hc, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")


def files_outside(root: Path, cache: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p != cache and cache not in p.parents]


@pytest.mark.parametrize("etag", ["../../../outside/blob", "a/b", "..", ".hidden", "x" * 300])
def test_an_etag_that_is_not_a_file_name_is_refused_before_any_write(
        hub: Any, repo: str, isolated_hf_cache: Path, tmp_path: Path, etag: str) -> None:
    hub.lies[WEIGHTS] = {"etag": etag}
    with pytest.raises(HubAnswerError, match="answered ETag .*not a plain file name.*HF_ENDPOINT") as info:
        resolve_source(repo)
    assert info.value.header == "ETag" and info.value.source == repo
    assert f"for {repo!r} (file {WEIGHTS!r})" in str(info.value)  # which file of the repo the Hub answered for
    assert files_outside(tmp_path, isolated_hf_cache) == []
    assert not any(p.name.startswith(("blob", "x" * 20)) for p in isolated_hf_cache.rglob("*"))


def test_an_absolute_etag_never_makes_the_adapter_a_link_to_another_file(
        hub: Any, repo: str, tmp_path: Path) -> None:
    secret = tmp_path / "tenant-b" / WEIGHTS
    secret.parent.mkdir()
    secret.write_bytes(save(dense_tensors(llama_shapes(), rank=4, seed=9)))
    hub.lies[WEIGHTS] = {"etag": str(secret)}
    with pytest.raises(HubAnswerError, match="ETag"):
        resolve_source(repo)


@pytest.mark.parametrize("commit", [".", "x/y", "refs/../../x", "A" * 40, "../../../../outside/p"])
def test_a_commit_that_is_not_a_sha_is_refused_also_on_a_404(
        hub: Any, repo: str, isolated_hf_cache: Path, tmp_path: Path, commit: str) -> None:
    hub.lies[WEIGHTS] = {"commit": commit}
    with pytest.raises(HubAnswerError, match="X-Repo-Commit .*not a 40-hex-digit commit"):
        resolve_source(repo)
    hub.lies.clear()
    hub.lies["missing.safetensors"] = {"commit": commit}  # a 404 names its commit too: .no_exist/<commit>/...
    with pytest.raises(HubAnswerError, match="X-Repo-Commit"):
        resolve_source(repo + ":missing.safetensors")
    assert files_outside(tmp_path, isolated_hf_cache) == []
    assert list_cache() == []


@pytest.mark.parametrize("announced", [100, -1])
def test_a_body_longer_than_announced_or_than_the_bound_is_cut_and_not_kept(
        hub: Any, repo: str, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch, announced: int) -> None:
    """100: the HEAD says 100 bytes; -1: it says no size, and the disk cache bound caps the transfer."""
    limit = 1 << 20
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(limit))
    hub.lies[WEIGHTS] = {"body": b"\0" * (8 << 20), "size": announced}
    with pytest.raises(HubAnswerError, match=f"sent more than {100 if announced > 0 else limit} bytes"):
        resolve_source(repo)
    on_disk = sum(p.stat().st_size for p in isolated_hf_cache.rglob("*") if p.is_file() and not p.is_symlink())
    assert on_disk < limit


def test_a_cached_link_out_of_the_cache_is_not_read(hub: Any, repo: str, isolated_hf_cache: Path,
                                                    tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache poisoned before (or by hand): the snapshot's file links to a file outside the repo's folder."""
    resolved = resolve_source(repo)
    sha = resolved.commit
    outside = tmp_path / "elsewhere.safetensors"
    outside.write_bytes(Path(resolved.weights_path).read_bytes())
    link = Path(resolved.weights_path)
    link.unlink()
    os.symlink(outside, link)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubAnswerError, match="links outside the Hugging Face cache") as info:
        resolve_source(f"{repo}@{sha}")
    assert str(tmp_path) not in info.value.client_message()


def test_an_honest_hub_still_downloads_pinned_and_counted(hub: Any, repo: str,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(64 << 20))
    resolved = resolve_source(repo)
    assert resolved.commit is not None and len(resolved.commit) == 40
    assert [c.key for c in list_cache()] == [f"acme/a@{resolved.commit}"]


def test_a_hub_busy_through_every_retry_costs_one_round_and_the_cache_still_answers(hub: Any, repo: str) -> None:
    """huggingface_hub retries a 503 about 23 s, but only for a file not cached: a cached branch is answered from
    the cache after one busy answer, as hf_hub_download alone would answer it; a file not cached gets one round."""
    first = resolve_source(repo)
    hub.requests.clear()
    hub.busy[WEIGHTS] = 99
    try:
        again = resolve_source(repo)
    finally:
        hub.busy.clear()
    assert again.weights_path == first.weights_path and again.commit == first.commit
    heads = [p for m, p in hub.requests if m == "HEAD" and p.endswith(WEIGHTS)]
    assert len(heads) == 1, heads
    hub.requests.clear()
    hub.busy["adapter_model.safetensors"] = 99
    hub.repo("acme/b").commit({WEIGHTS: save(dense_tensors(llama_shapes(), rank=4, seed=1)),
                               "adapter_config.json": json.dumps(lora_config(r=4)).encode()})
    try:
        with pytest.raises(Exception):
            resolve_source("hf:acme/b")
    finally:
        hub.busy.clear()
    heads = [p for m, p in hub.requests if m == "HEAD" and p.endswith(WEIGHTS)]
    assert 2 < len(heads) <= 8, heads  # nothing cached: one round of retries, as hf_hub_download alone sends


def test_a_cached_branch_answers_within_2_s_when_the_hub_is_unreachable(
        hub: Any, repo: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """An unreachable Hub is not retried (huggingface_hub does not retry it either): the cache's copy answers,
    with a warning that it may be older than the Hub's."""
    import socket
    import time


    first = resolve_source(repo)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    point_hub_at(monkeypatch, f"http://127.0.0.1:{port}")  # nothing listens there
    t0 = time.perf_counter()
    again = resolve_source(repo)
    assert time.perf_counter() - t0 < 2.0
    assert again.weights_path == first.weights_path
    assert "the Hub did not answer" in caplog.text and "may be older than the Hub's" in caplog.text


def test_a_hub_that_accepts_and_never_answers_fails_after_one_timeout_naming_the_fix(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy or endpoint that takes the connection and says nothing: one metadata timeout (10 s), not
    huggingface_hub's retries of it (about 400 s), then an error naming the endpoint and HF_HUB_OFFLINE."""
    import socket
    import time


    from vllm_lora_ext.errors import AdapterDownloadError

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        point_hub_at(monkeypatch, f"http://127.0.0.1:{listener.getsockname()[1]}")
        monkeypatch.setenv("HF_HUB_OFFLINE", "0")
        t0 = time.perf_counter()
        with pytest.raises(AdapterDownloadError, match="did not answer in time .*HF_HUB_OFFLINE=1"):
            resolve_source("hf:acme/silent")
        assert time.perf_counter() - t0 < 30


def _local_cache(root: Path, *, shared: bool) -> None:
    """A cached ``org/ad`` at one commit: its blob in the repo folder, or (``shared``) a link into huggingface_hub
    2's xet store, ``<cache>/blobs/<xx>/<hash>``, which every repo of the cache shares."""
    sha, etag, xet = "a" * 40, "c" * 64, "b" * 64
    repo = root / "models--org--ad"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    (repo / "blobs").mkdir()
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    if shared:
        store = root / "blobs" / xet[:2]
        store.mkdir(parents=True)
        (store / xet).write_bytes(b"{}")
        os.symlink(os.path.relpath(store / xet, repo / "blobs"), repo / "blobs" / etag)
    else:
        (repo / "blobs" / etag).write_bytes(b"{}")
    os.symlink(f"../../blobs/{etag}", snap / "adapter_config.json")


@pytest.mark.parametrize("layout", ["xet-store", "cache-through-a-link"])
def test_honest_cache_layouts_are_read(tmp_path: Path, layout: str) -> None:
    """huggingface_hub 2's shared xet store, and a cache folder reached through a symlink (HF_HOME on a link)."""
    from vllm_lora_ext import diskcache

    _local_cache(tmp_path / "real", shared=layout == "xet-store")
    os.symlink(tmp_path / "real", tmp_path / "link")
    cache = tmp_path / ("link" if layout == "cache-through-a-link" else "real")
    for revision in (None, "a" * 40):
        path = diskcache.download_file("org/ad", "adapter_config.json", revision=revision, cache_dir=cache,
                                       local_files_only=True)
        assert Path(path).read_bytes() == b"{}"


def test_a_pinned_commit_answered_with_another_is_refused_and_the_cache_never_maps_it_there(
        hub: Any, repo: str, isolated_hf_cache: Path) -> None:
    """``hf:acme/a@S`` answered as commit D (another of the repo's commits, or another repo's): refused, and the
    cache's ``refs/S`` -> D that huggingface_hub wrote is removed, so no later (offline) read serves D as S."""
    pinned = hub.repo("acme/a").refs["main"]
    other = hub.repo("acme/a").commit({WEIGHTS: save(dense_tensors(llama_shapes(), rank=4, seed=5)),
                                       "adapter_config.json": json.dumps(lora_config(r=4)).encode()})
    hub.lies[WEIGHTS] = {"commit": other}
    with pytest.raises(HubAnswerError, match=f"answered X-Repo-Commit '{other}' .*not the commit asked for, {pinned}"):
        resolve_source(f"{repo}@{pinned}")
    assert not list(isolated_hf_cache.rglob(f"refs/{pinned}"))
    hub.lies.clear()
    assert resolve_source(f"{repo}@{pinned}").source.revision == pinned  # the honest answer still loads


def test_a_push_between_the_hubs_head_and_the_download_is_refused_not_pinned_to_the_older_commit(
        hub: Any, repo: str, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from dataclasses import replace

    from vllm_lora_ext import hubguard

    older = hub.repo("acme/a").refs["main"]
    hub.repo("acme/a").commit({WEIGHTS: save(dense_tensors(llama_shapes(), rank=4, seed=6)),
                               "adapter_config.json": json.dumps(lora_config(r=4)).encode()})
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "1GiB")
    real_head = hubguard.head
    monkeypatch.setattr(hubguard, "head", lambda *a, **k: replace(real_head(*a, **k), commit=older))  # main moved on
    with pytest.raises(HubAnswerError, match=f"not the commit asked for, {older} .*pushed meanwhile") as info:
        resolve_source(repo)
    assert "HF_ENDPOINT" not in info.value.client_message()  # an honest race: retry, nothing to repoint
    monkeypatch.setattr(hubguard, "head", real_head)
    assert resolve_source(repo).source.revision == hub.repo("acme/a").refs["main"]  # the retry
    assert all(rev.evictable for rev in list_cache())  # what the refused try placed is listed: the bound evicts it


def test_a_hubs_file_listing_reaches_an_error_message_only_as_names_one_could_give(hub: Any) -> None:
    """A repo without adapter_model.safetensors: the error suggests the repo's weight files, never a listed name
    with '..', an absolute path, a control character or 200 kB of text."""
    from vllm_lora_ext.errors import AdapterNotFoundError

    hostile = ["../../etc/evil.safetensors", "/abs/evil.safetensors", "new\nline.safetensors",
               "x" * 200_000 + ".safetensors"]
    hub.repo("acme/b").commit({**{name: b"0" for name in hostile}, "ok/adapter_model.safetensors": b"0"})
    with pytest.raises(AdapterNotFoundError) as info:
        resolve_source("hf:acme/b")
    text = str(info.value) + info.value.client_message()
    assert "ok/adapter_model.safetensors" in text and len(text) < 5_000
    assert not any(name[:20] in text for name in hostile)


# huggingface_hub asks for a file's metadata itself after the plugin did (request 2 of the file), then downloads it
# (request 3). A Hub that answers that second request otherwise than the first is refused before huggingface_hub
# names or writes anything by it.
@pytest.mark.parametrize(("lie", "header"), [
    ({"etag": "../../../outside/blob"}, "ETag"),
    ({"etag": "0" * 64}, "ETag"),  # a plain name, but not the one told just before (e.g. an already cached blob)
    ({"size": 10}, "Content-Length"),
    ({"commit": "../../../../outside/p"}, "X-Repo-Commit"),
    ({"commit": "f" * 40}, "X-Repo-Commit"),
    ({"xet": True}, "X-Xet-Hash"),  # hf_xet's transfer, which no byte counter can stop, after a plain one was told
])
def test_a_second_metadata_answer_unlike_the_first_is_refused_before_any_write(
        hub: Any, repo: str, isolated_hf_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        lie: dict[str, Any], header: str) -> None:
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "1GiB")
    hub.lies[WEIGHTS] = {**lie, "from": 2}
    with pytest.raises(HubAnswerError, match=f"answered {header} ") as info:
        resolve_source(repo)
    assert info.value.header == header
    assert "127.0.0.1" not in info.value.client_message()  # the server's Hub address stays with the operator
    assert files_outside(tmp_path, isolated_hf_cache) == []
    assert not [p for p in isolated_hf_cache.rglob("*") if "blobs" in p.parts and p.is_file()]  # nothing written
    assert ("GET", f"/acme/a/resolve/main/{WEIGHTS}") not in hub.requests  # the download never started
    hub.lies.clear()
    assert Path(resolve_source(repo).weights_path).is_file()  # an honest answer after it loads


def test_a_second_404_naming_a_path_for_a_commit_writes_no_marker_outside_the_cache(
        hub: Any, repo: str, isolated_hf_cache: Path, tmp_path: Path) -> None:
    hub.lies["missing.safetensors"] = {"commit": "../../../../outside/p", "from": 2}
    with pytest.raises(HubAnswerError, match="X-Repo-Commit"):
        resolve_source(repo + ":missing.safetensors")
    assert files_outside(tmp_path, isolated_hf_cache) == []
    assert not list(isolated_hf_cache.rglob(".no_exist"))


def test_a_config_announced_over_1_mib_is_refused_undownloaded_and_an_unannounced_one_is_cut(
        hub: Any, isolated_hf_cache: Path) -> None:
    from vllm_lora_ext.errors import AdapterFormatError

    big = json.dumps({**lora_config(r=4), "pad": "x" * (2 << 20)}).encode()
    hub.repo("acme/c").commit({WEIGHTS: save(dense_tensors(llama_shapes(), rank=4, seed=0)),
                               "adapter_config.json": big})
    with pytest.raises(AdapterFormatError, match=r"'adapter_config.json' of 'hf:acme/c@[0-9a-f]{40}' is \d+ bytes on the Hub, "
                                                 r"larger than a config may be \(1048576 bytes\); nothing was downloaded"):
        resolve_source("hf:acme/c")
    assert not [r for r in hub.requests if r[0] == "GET" and r[1].endswith("adapter_config.json")]
    hub.lies["adapter_config.json"] = {"size": -1}  # a HEAD that tells no size: the transfer stops past 1 MiB
    with pytest.raises(HubAnswerError, match="sent more than 1048576 bytes of 'adapter_config.json'"):
        resolve_source("hf:acme/c")
    on_disk = sum(p.stat().st_size for p in isolated_hf_cache.rglob("*") if p.is_file() and not p.is_symlink())
    assert on_disk < (2 << 20)


def adapters(hub: Any, name: str, n: int, *, fetched: int = 0) -> int:
    """Repos ``<name>0`` .. (or ``name`` itself for one), the first ``fetched`` of them resolved; returns one
    adapter's bytes on disk."""
    names = [name] if n == 1 else [f"{name}{i}" for i in range(n)]
    for i, repo_id in enumerate(names):
        hub.repo(repo_id).commit({WEIGHTS: save(dense_tensors(llama_shapes(), rank=4, seed=i)),
                                  "adapter_config.json": json.dumps(lora_config(r=4)).encode()})
    for repo_id in names[:fetched]:
        resolve_source(f"hf:{repo_id}")
    return len(save(dense_tensors(llama_shapes(), rank=4, seed=0))) + len(json.dumps(lora_config(r=4)))


def test_a_size_announced_far_too_high_evicts_for_the_bytes_sent_not_for_the_size_announced(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext import diskcache
    from vllm_lora_ext.errors import AdapterDownloadError

    rev = adapters(hub, "acme/r", 6, fetched=6)
    adapters(hub, "acme/liar", 1)
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(8 * rev))
    monkeypatch.setattr(diskcache, "_STEP", rev)  # room made one adapter's bytes ahead of what arrived
    hub.lies[WEIGHTS] = {"size": 7 * rev}  # announces seven adapters' bytes, sends one
    with pytest.raises(AdapterDownloadError, match="Consistency check failed"):
        resolve_source("hf:acme/liar")
    assert len(list_cache()) >= 5  # before: the six were evicted down to one, making room for the announced size


def test_an_honest_download_past_its_first_step_makes_room_as_its_bytes_arrive(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext import diskcache

    import huggingface_hub.constants as hc

    rev = adapters(hub, "acme/s", 4, fetched=3)
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(int(3.5 * rev)))
    monkeypatch.setattr(diskcache, "_STEP", rev // 4)  # the first step fits; the rest needs the oldest evicted
    monkeypatch.setattr(hc, "DOWNLOAD_CHUNK_SIZE", 256)  # many updates, as a large file's chunks give
    at_end: list[list[str]] = []  # what was cached when the transfer ended, before the check after it
    real_after = diskcache._after_download
    monkeypatch.setattr(diskcache, "_after_download", lambda *a, **k: (
        at_end.append(sorted(r.repo_id for r in list_cache())), real_after(*a, **k))[1])
    assert Path(resolve_source("hf:acme/s3").weights_path).is_file()
    assert at_end[0] == ["acme/s1", "acme/s2", "acme/s3"]  # the oldest went while the bytes arrived, not after
    assert sorted(r.repo_id for r in list_cache()) == ["acme/s1", "acme/s2", "acme/s3"]


def test_a_download_in_progress_counts_its_announced_size_against_a_new_one(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A download reserves only the room its bytes need next, but a new download must fit beside the whole size the
    first one's Hub announced, so two never count on the same room."""
    import threading

    from vllm_lora_ext import diskcache
    from vllm_lora_ext.errors import DiskCacheFullError

    rev = adapters(hub, "acme/t", 2)
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(int(2.5 * rev)))
    monkeypatch.setattr(diskcache, "_STEP", rev // 4)
    hub.lies[WEIGHTS] = {"size": 2 * rev, "from": 1}  # t0's Hub announces two adapters' bytes (t1's too: refused)
    gate = hub.gates["acme/t0/" + WEIGHTS] = threading.Event()
    first = threading.Thread(target=lambda: pytest.raises(Exception, resolve_source, "hf:acme/t0"))
    first.start()
    try:
        for _ in range(200):  # until t0's transfer has begun (its GET reached the Hub)
            if ("GET", f"/acme/t0/resolve/main/{WEIGHTS}") in hub.requests:
                break
            threading.Event().wait(0.05)
        hub.lies.clear()
        with pytest.raises(DiskCacheFullError, match="by other downloads in progress"):
            resolve_source("hf:acme/t1")  # 1 adapter beside t0's announced 2 pass the 2.5 bound
    finally:
        gate.set()
        first.join(30)
