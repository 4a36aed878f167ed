"""hf: sources through the real huggingface_hub client against the local Hub server (HF_ENDPOINT)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from safetensors.torch import load_file, save

from factories import dense_tensors, lora_config, llama_shapes
from vllm_lora_ext import AdapterNotFoundError, resolve_source
from vllm_lora_ext.errors import AdapterDownloadError
from vllm_lora_ext.summary import load_config


def adapter_files(seed: int, *, rank: int = 4) -> tuple[bytes, bytes]:
    tensors = dense_tensors(llama_shapes(), rank=rank, seed=seed)
    return save(tensors), json.dumps(lora_config(r=rank)).encode()


@pytest.fixture
def repos(hub):  # type: ignore[no-untyped-def]
    """acme/single (root adapter, two commits on main, tag v1), acme/multi (subfolders and side-by-side files)."""
    w1, c1 = adapter_files(1)
    w2, c2 = adapter_files(2)
    single = hub.repo("acme/single")
    first = single.commit({"adapter_model.safetensors": w1, "adapter_config.json": c1, "README.md": b"x" * 10},
                          tags=("v1",))
    second = single.commit({"adapter_model.safetensors": w2})
    multi = hub.repo("acme/multi")
    wa, ca = adapter_files(3)
    wb, _ = adapter_files(4, rank=8)
    multi.commit({"sql/adapter_model.safetensors": wa, "sql/adapter_config.json": ca,
                  "files/a.safetensors": wa, "files/a_config.json": ca,
                  "files/b.safetensors": wb, "files/b.json": json.dumps(lora_config(r=8)).encode(),
                  "files/adapter_config.json": json.dumps(lora_config(r=99)).encode(),
                  "big/unrelated.bin": b"\0" * 4096})
    return {"hub": hub, "first": first, "second": second, "w1": w1, "w2": w2, "wa": wa, "wb": wb}


def _bytes(p: Path) -> bytes:
    return p.read_bytes()


def test_repo_root_source_downloads_only_config_and_weights(repos) -> None:  # type: ignore[no-untyped-def]
    r = resolve_source("hf:acme/single")
    assert _bytes(r.weights_path) == repos["w2"]
    assert r.commit == repos["second"] and r.config_rule == "adapter_config.json"
    assert r.source.canonical() == f"hf:acme/single@{repos['second']}"
    got = {p for _, p in repos["hub"].requests}
    assert not any("README" in p for p in got)


def test_revision_tag_and_sha_pin_the_older_commit(repos) -> None:  # type: ignore[no-untyped-def]
    assert _bytes(resolve_source("hf:acme/single@v1").weights_path) == repos["w1"]
    r = resolve_source(f"hf:acme/single@{repos['first']}")
    assert _bytes(r.weights_path) == repos["w1"] and r.commit == repos["first"]


def test_subfolder_source(repos) -> None:  # type: ignore[no-untyped-def]
    r = resolve_source("hf:acme/multi:sql")
    assert _bytes(r.weights_path) == repos["wa"] and r.config_path is not None
    assert r.config_path.name == "adapter_config.json" and r.config_path.parent.name == "sql"


def test_file_sources_pick_their_own_config_among_side_by_side_adapters(repos) -> None:  # type: ignore[no-untyped-def]
    a = resolve_source("hf:acme/multi:files/a.safetensors")
    b = resolve_source("hf:acme/multi:files/b.safetensors")
    assert (a.config_rule, load_config(a).r) == ("<stem>_config.json", 4)
    assert (b.config_rule, load_config(b).r) == ("<stem>.json", 8)
    assert _bytes(b.weights_path) == repos["wb"]
    assert not any("unrelated" in p for _, p in repos["hub"].requests)


def test_pinned_cached_source_resolves_offline_with_zero_requests(repos, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    pinned = resolve_source("hf:acme/multi:files/b.safetensors").source.canonical()
    hub = repos["hub"]
    before = hub.count()
    r = resolve_source(pinned)  # online, but pinned + cached: no request
    assert hub.count() == before
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    r2 = resolve_source(pinned)
    assert hub.count() == before and r2.weights_path == r.weights_path and r2.config_rule == "<stem>.json"


def test_branch_source_resolves_offline_from_cache(repos, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    online = resolve_source("hf:acme/single")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    before = repos["hub"].count()
    offline = resolve_source("hf:acme/single")
    assert offline.weights_path == online.weights_path and repos["hub"].count() == before


def test_offline_source_not_in_cache_says_to_fetch(repos, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AdapterNotFoundError, match="vllm-lora fetch hf:acme/single") as info:
        resolve_source("hf:acme/single")
    assert repos["hub"].count() == 0
    from vllm_lora_ext.diskcache import cache_path

    cache = str(cache_path(None))
    assert cache in str(info.value) and cache not in info.value.client_message()  # the operator's log only
    with pytest.raises(AdapterNotFoundError) as plain:  # read as org/repo: the server's working folder stays out
        resolve_source("acme/single")
    assert os.getcwd() not in plain.value.client_message() and "No local folder 'acme/single'" in str(plain.value)


@pytest.mark.parametrize(("source", "fragment"), [
    ("hf:acme/nope", "Repo 'acme/nope'"),
    ("hf:acme/single@nobranch", "Revision 'nobranch'"),
    ("hf:acme/multi:files/missing.safetensors", "files/missing.safetensors' not found"),
    ("hf:acme/multi:nosub", "adapter_model.safetensors in the folder 'nosub'"),
])
def test_missing_repo_revision_or_file_is_a_clear_not_found(repos, source: str, fragment: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(AdapterNotFoundError) as e:
        resolve_source(source)
    assert fragment in str(e.value)


def test_interrupted_download_resumes_to_the_complete_file(repos) -> None:  # type: ignore[no-untyped-def]
    repos["hub"].drop_once["adapter_model.safetensors"] = [1000]
    r = resolve_source("hf:acme/single")
    assert _bytes(r.weights_path) == repos["w2"]


def test_failed_download_is_a_clear_error_and_a_retry_works_without_poisoning_the_cache(repos) -> None:  # type: ignore[no-untyped-def]
    hub = repos["hub"]
    hub.drop_once["adapter_model.safetensors"] = [100] * 20  # more cuts than the client retries
    with pytest.raises(AdapterDownloadError, match="Retry"):
        resolve_source("hf:acme/single")
    hub.drop_once.clear()
    r = resolve_source("hf:acme/single")  # a plain retry works
    assert _bytes(r.weights_path) == repos["w2"]
    assert set(load_file(str(r.weights_path)))  # a complete, readable file
    blobs = Path(r.weights_path).resolve().parent
    assert not list(blobs.glob("*.incomplete"))


def test_concurrent_resolution_from_threads_gives_one_complete_file(repos) -> None:  # type: ignore[no-untyped-def]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: resolve_source("hf:acme/multi:files/b.safetensors"), range(8)))
    assert len({r.weights_path for r in results}) == 1
    assert _bytes(results[0].weights_path) == repos["wb"]


def _resolve_in_child(args: tuple[str, str, str]) -> str:
    source, cache, endpoint = args
    import huggingface_hub.constants as hc

    hc.HF_HUB_CACHE = cache
    os.environ["HF_HUB_OFFLINE"] = "0"
    r = resolve_source(source)
    return r.weights_path.read_bytes().hex()[:64] + ":" + str(r.weights_path.stat().st_size)


def test_concurrent_resolution_from_processes_gives_one_complete_file(repos, isolated_hf_cache) -> None:  # type: ignore[no-untyped-def]
    ctx = mp.get_context("fork")
    with ctx.Pool(4) as pool:
        out = pool.map(_resolve_in_child, [("hf:acme/single", str(isolated_hf_cache), repos["hub"].url)] * 4)
    assert len(set(out)) == 1 and out[0].endswith(":" + str(len(repos["w2"])))


def test_new_commit_on_branch_changes_the_pinned_identity(repos) -> None:  # type: ignore[no-untyped-def]
    first = resolve_source("hf:acme/single").identity
    w3, _ = adapter_files(9)
    repos["hub"].repo("acme/single").commit({"adapter_model.safetensors": w3})
    time.sleep(0.01)
    second = resolve_source("hf:acme/single").identity
    assert first != second and second.startswith("hf:acme/single@")


def test_a_missing_file_names_a_real_file_of_the_repo_and_that_spelling_resolves(repos) -> None:  # type: ignore[no-untyped-def]
    import re

    with pytest.raises(AdapterNotFoundError) as e:
        resolve_source("hf:acme/multi:files/missing.safetensors")
    msg = str(e.value)
    assert "files/a.safetensors" in msg and "path/to" not in msg and "<" not in msg
    example = re.search(r"e\.g\. '([^']+)'", msg).group(1)  # type: ignore[union-attr]
    assert example == "hf:acme/multi:files/a.safetensors"
    assert resolve_source(example).weights_path.read_bytes() == repos["wa"]


def test_a_folder_without_the_standard_file_is_answered_with_a_file_of_that_folder(repos) -> None:  # type: ignore[no-untyped-def]
    """The example to name comes from the folder asked for when it has weights, not from the repo's first file."""
    w, c = adapter_files(5)
    repos["hub"].repo("acme/folders").commit({"a/x.safetensors": w, "sql/weights.safetensors": w,
                                              "sql/weights_config.json": c})
    with pytest.raises(AdapterNotFoundError, match=r"e\.g\. 'hf:acme/folders:sql/weights\.safetensors'"):
        resolve_source("hf:acme/folders:sql")


def test_a_repo_of_pickle_weights_only_is_answered_with_the_pickle_advice(repos) -> None:  # type: ignore[no-untyped-def]
    """Not "holds no .safetensors file ... check the revision" (the revision was right): the files are named, with
    what to do about pickle weights; with the opt-in, the pickle file is read."""
    repos["hub"].repo("acme/pickle").commit({"adapter_model.bin": b"\0" * 64, "adapter_config.json": b"{}"})
    with pytest.raises(AdapterNotFoundError) as e:
        resolve_source("hf:acme/pickle")
    msg = str(e.value)
    assert "only pickle weights, ['adapter_model.bin']" in msg and "VLLM_LORA_EXT_ALLOW_PICKLE=1" in msg
    assert "check the revision" not in msg


def test_downloads_draw_no_progress_bar_where_huggingface_hubs_bars_are_off(repos, monkeypatch, capsys,  # type: ignore[no-untyped-def]
                                                                          caplog) -> None:
    """The download's tqdm class is huggingface_hub's, so its switches hold: ``HF_HUB_DISABLE_PROGRESS_BARS`` (and a
    stderr that is no terminal) draw no bar, while the progress lines are still logged. A plain tqdm subclass got no
    ``disable`` from huggingface_hub and drew its bar on every download, into server logs too."""
    import logging

    import vllm_lora_ext._progress as progress
    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

    monkeypatch.setattr(progress, "AFTER_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    was_off = are_progress_bars_disabled()  # (the test session sets HF_HUB_DISABLE_PROGRESS_BARS=1)
    disable_progress_bars()
    try:
        with caplog.at_level(logging.INFO, logger="vllm_lora_ext.progress"):
            resolve_source("hf:acme/multi:files/b.safetensors")
    finally:
        if not was_off:
            enable_progress_bars()
    assert "|" not in capsys.readouterr().err  # no bar
    assert any("downloading acme/multi:files/b.safetensors" in r.getMessage() for r in caplog.records)


def test_a_slow_download_logs_bytes_rate_and_percent(repos, monkeypatch, caplog) -> None:  # type: ignore[no-untyped-def]
    import logging

    import vllm_lora_ext._progress as progress

    monkeypatch.setattr(progress, "AFTER_S", 0.0)  # every update counts as slow
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    with caplog.at_level(logging.INFO, logger="vllm_lora_ext.progress"):
        resolve_source("hf:acme/multi:files/a.safetensors")
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm_lora_ext.progress"
             and r.getMessage().startswith("downloading acme/multi:files/a.safetensors: ")]
    assert lines and "(100%)" in lines[-1] and "MiB/s" in lines[-1]


def test_a_failed_download_puts_the_branch_back_so_its_cached_commit_still_serves_offline(
        repos, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """huggingface_hub moves refs/main to the commit the Hub names before the transfer: a download cut every time
    left main at a commit with nothing cached, and the branch, cached a minute before, failed offline."""
    hub = repos["hub"]
    r = resolve_source("hf:acme/single")
    ref = Path(r.weights_path).parents[2] / "refs" / "main"
    assert ref.read_text() == repos["second"]
    w3, _ = adapter_files(3)
    hub.repos["acme/single"].commit({"adapter_model.safetensors": w3})  # main moves on
    hub.drop_once["adapter_model.safetensors"] = [100] * 20  # and its new weights never arrive
    with pytest.raises(AdapterDownloadError):
        resolve_source("hf:acme/single")
    assert ref.read_text() == repos["second"]
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert _bytes(resolve_source("hf:acme/single").weights_path) == repos["w2"]


def test_a_download_that_succeeds_after_another_put_the_branch_back_points_it_at_its_commit(
        repos, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Two fetches of a moved branch, one failing: its put-back could land after the other's ref write, leaving the
    branch at the old commit while the new one was complete on disk. The last success now writes the ref."""
    from vllm_lora_ext import diskcache

    r = resolve_source("hf:acme/single")
    ref = Path(r.weights_path).parents[2] / "refs" / "main"
    w3, _ = adapter_files(3)
    third = repos["hub"].repos["acme/single"].commit({"adapter_model.safetensors": w3})
    real = diskcache.download_file

    calls = []

    def then_put_back(*args, **kwargs):  # type: ignore[no-untyped-def]
        path = real(*args, **kwargs)
        if not calls:  # the branch's download (the config's after it is pinned to the commit)
            ref.write_text(repos["second"])  # another process's put-back, after this download's own ref write
        calls.append(args)
        return path

    monkeypatch.setattr(diskcache, "download_file", then_put_back)
    assert _bytes(resolve_source("hf:acme/single").weights_path) == w3
    assert ref.read_text() == third
