"""A hostile Hub or mirror (HF_ENDPOINT) against hubguard's hold of huggingface_hub's own requests, and honest Hubs
that must not be refused. Uses tests/hubserver.py's ``script`` (rewrite a file's answer per request: 1 is the
plugin's HEAD, 2 huggingface_hub's HEAD, 3 the GET) and ``routes`` (answer any other path)."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save

from factories import dense_tensors, llama_shapes, lora_config
from vllm_lora_ext import resolve_source
from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def weights(seed: int = 0) -> bytes:
    return save(dense_tensors(llama_shapes(), rank=4, seed=seed))


@pytest.fixture
def repo(hub: Any) -> str:
    hub.repo("acme/a").commit({WEIGHTS: weights(), CONFIG: json.dumps(lora_config(r=4)).encode()})
    return "hf:acme/a"


def files_outside(root: Path, cache: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p != cache and cache not in p.parents]


def refused_writing_nothing(repo: str, tmp_path: Path, cache: Path) -> None:
    from vllm_lora_ext.errors import VllmLoraExtError

    with pytest.raises(VllmLoraExtError):
        resolve_source(repo)
    written = {str(p.relative_to(tmp_path)): p.stat().st_size for p in files_outside(tmp_path, cache) if p.is_file()}
    assert written == {}, f"huggingface_hub wrote outside the cache: {written}"


def set_header(hdrs: list[tuple[str, str]], name: str, value: str | None) -> list[tuple[str, str]]:
    out = [(k, v) for k, v in hdrs if k.lower() != name.lower()]
    return out if value is None else [*out, (name, value)]


def header(hdrs: list[tuple[str, str]], name: str) -> str | None:
    return next((v for k, v in hdrs if k.lower() == name.lower()), None)


# --- The plugin's HEAD answered with a 4xx, huggingface_hub's with the file: refused ----------------------------
@pytest.mark.parametrize("first", [404, 401, 403])
def test_a_4xx_to_the_plugins_head_then_200_with_a_traversing_etag_is_refused_and_writes_nothing(
        hub: Any, repo: str, isolated_hf_cache: Path, tmp_path: Path, first: int) -> None:
    """Request 1 (the plugin's HEAD) gets a 4xx, so `head` returns empty facts; request 2 (huggingface_hub's HEAD)
    answers the file with ETag ``../../../outside/blob``, which would name a blob outside the HF cache. Refused
    before the GET, by the ETag's shape and by the answer differing from the first."""
    commit = hub.repo("acme/a").refs["main"]
    code = {404: "EntryNotFound", 401: "RepoNotFound", 403: "GatedRepo"}[first]

    def script(nth: int, method: str, status: int, hdrs: list, body: bytes) -> tuple:
        if nth == 1:
            return first, [("X-Error-Code", code), ("X-Error-Message", code), ("X-Repo-Commit", commit),
                           ("Content-Length", "0")], b""
        return status, set_header(hdrs, "ETag", '"../../../outside/blob"'), body

    hub.script[WEIGHTS] = script
    refused_writing_nothing(repo, tmp_path, isolated_hf_cache)


# --- A 3xx huggingface_hub does not follow is read as the file's metadata: checked as such ----------------------
@pytest.mark.parametrize(("status", "location"), [(304, "/elsewhere"), (300, "/elsewhere"), (302, "https:/elsewhere")])
def test_a_second_head_answer_huggingface_hub_does_not_follow_is_checked_as_the_files_metadata(
        hub: Any, repo: str, isolated_hf_cache: Path, tmp_path: Path, status: int, location: str) -> None:
    """huggingface_hub follows only 301/302/303/307/308 to the same Hub (``has_redirect_location`` and its
    ``_is_same_or_hub_host``), and ``hf_raise_for_status`` never raises on a 3xx, so a 304 (or 300) is read as the
    file's metadata; so is a 302 to ``https:/elsewhere`` (no host once joined). Its ETag ``../../../outside/blob``
    would name the blob and lock outside the cache: refused as a final answer."""
    def script(nth: int, method: str, code: int, hdrs: list, body: bytes) -> tuple:
        if nth == 2:
            hdrs = set_header(hdrs, "ETag", '"../../../outside/blob"')
            hdrs = set_header(hdrs, "Location", location)
            hdrs += [("X-Xet-Hash", "0" * 64), ("X-Xet-Refresh-Route", "/api/models/acme/a/xet-read-token/x")]
            return status, hdrs, b""
        return code, hdrs, body

    hub.script[WEIGHTS] = script
    refused_writing_nothing(repo, tmp_path, isolated_hf_cache)


# --- A failed download tells a client its kind and status, never the library's text with the Hub's address ----
@pytest.mark.parametrize("how", ["get-500", "redirect-loop", "head-timeout"])
def test_a_failed_download_does_not_tell_a_client_the_hubs_address(hub: Any, repo: str, how: str) -> None:
    """A GET answered 500 (HfHubHTTPError: '... for url: http://<hub>/...'), a HEAD that redirects in a loop
    (httpx2.TooManyRedirects: "... resolving 'http://<hub>/...'") or a Hub past its timeout: the operator's message
    names the Hub, the client's does not."""
    from vllm_lora_ext.errors import AdapterDownloadError

    def script(nth: int, method: str, code: int, hdrs: list, body: bytes) -> tuple:
        if how == "get-500" and method == "GET":
            return 500, [("Content-Length", "0")], b""
        if how == "head-timeout" and nth == 1:
            import time
            time.sleep(6)  # past HF_HUB_ETAG_TIMEOUT=5: the message names hub_endpoint() outright
        if how == "redirect-loop" and nth >= 2:
            return 307, [("Location", "/acme/a/resolve/main/" + WEIGHTS), ("Content-Length", "0")], b""
        return code, hdrs, body

    hub.script[WEIGHTS] = script
    with pytest.raises(AdapterDownloadError) as info:
        resolve_source(repo)
    assert hub.url.split("//")[1] not in info.value.client_message(), info.value.client_message()


# --- Honest Hubs --------------------------------------------------------------------------------------------------
def _renamed(hub: Any, absolute: bool) -> None:
    """``acme/old`` was renamed ``acme/a``: the Hub answers each of its files with a 307 to the new name."""
    def route(method: str, hdrs: dict) -> tuple:
        target = "/acme/a/" + hub.requests[-1][1].split("/acme/old/", 1)[1]
        text = f"Temporary Redirect. Redirecting to {target}".encode()
        return 307, [("Location", (hub.url if absolute else "") + target), ("Content-Length", str(len(text))),
                     ("Content-Type", "text/plain")], text
    hub.routes["/acme/old/resolve/*"] = route


@pytest.mark.parametrize("absolute", [False, True], ids=["relative", "absolute-same-host"])
def test_a_renamed_repo_whose_head_redirects_then_answers_200_loads(
        hub: Any, repo: str, monkeypatch: pytest.MonkeyPatch, absolute: bool) -> None:
    """huggingface.co answers a renamed repo's files with a 307 (relative); a mirror behind a proxy may give the
    same Location absolute, on its own host, which huggingface_hub follows just the same. The redirect's own
    Content-Length (its text's) is not the file's size, and no check reads it: huggingface_hub reads the 200."""
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "1GiB")
    _renamed(hub, absolute)
    resolved = resolve_source("hf:acme/old")
    assert Path(resolved.weights_path).read_bytes() == weights()


def _lfs_on_cdn(hub: Any, *, cdn_host: str = "localhost") -> None:
    """The Hub's answer to an LFS file: a 302 to a signed CDN URL on another host, with X-Linked-Etag/-Size (the
    file's sha256 and size), an ETag and Content-Length of the redirect itself; the CDN serves the bytes."""
    import hashlib

    port = hub.url.rsplit(":", 1)[1]
    data = hub.repo("acme/a").commits[hub.repo("acme/a").refs["main"]][WEIGHTS]
    sha = hashlib.sha256(data).hexdigest()

    def script(nth: int, method: str, code: int, hdrs: list, body: bytes) -> tuple:
        text = b"Found. Redirecting to the CDN"
        return 302, [("X-Repo-Commit", header(hdrs, "X-Repo-Commit")), ("ETag", '"0123456789abcdef0123"'),
                     ("X-Linked-Etag", f'"{sha}"'), ("X-Linked-Size", str(len(data))),
                     ("Location", f"http://{cdn_host}:{port}/cdn/{sha}?sig=x"), ("Content-Length", str(len(text)))], \
            text if method == "GET" else b""

    hub.script[WEIGHTS] = script
    hub.routes[f"/cdn/{sha}"] = lambda method, hdrs: (200, [("ETag", '"cdn-etag-1"'), ("Content-Length", str(len(data))),
                                                            ("Content-Type", "binary/octet-stream")], data)


def test_an_lfs_file_redirected_to_a_cdn_loads(hub: Any, repo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "1GiB")
    _lfs_on_cdn(hub)
    resolved = resolve_source(repo)
    assert Path(resolved.weights_path).read_bytes() == weights()
    assert any(p.startswith("/cdn/") for m, p in hub.requests if m == "GET")


def test_a_file_whose_blob_is_cached_already_loads_again_at_a_new_commit(
        hub: Any, repo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """main moves to a commit that changes the weights only: the config's blob is cached; huggingface_hub links it."""
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "1GiB")
    first = resolve_source(repo)
    hub.repo("acme/a").commit({WEIGHTS: weights(seed=3)})
    second = resolve_source(repo)
    assert second.commit != first.commit
    assert Path(second.weights_path).read_bytes() == weights(seed=3)
    hub.repo("acme/a").commit({WEIGHTS: weights(seed=0)})  # back to the first weights: both blobs cached
    third = resolve_source(repo)
    assert Path(third.weights_path).read_bytes() == weights()


def test_parallel_downloads_of_several_repos_while_one_lies_only_that_one_is_refused(
        hub: Any, monkeypatch: pytest.MonkeyPatch, isolated_hf_cache: Path, tmp_path: Path) -> None:
    from vllm_lora_ext.errors import HubAnswerError

    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "1GiB")
    names = [f"acme/p{i}" for i in range(6)]
    for i, name in enumerate(names):
        hub.repo(name).commit({f"w{i}.safetensors": weights(seed=i), CONFIG: json.dumps(lora_config(r=4)).encode()})
    hub.lies["w3.safetensors"] = {"etag": "../../../outside/blob", "from": 2}
    hub.lies["w4.safetensors"] = {"commit": "e" * 40, "from": 2}
    barrier = threading.Barrier(len(names))
    results: dict[str, object] = {}

    def run(i: int, name: str) -> None:
        barrier.wait()
        try:
            results[name] = resolve_source(f"hf:{name}:w{i}.safetensors")
        except Exception as err:  # noqa: BLE001
            results[name] = err

    threads = [threading.Thread(target=run, args=(i, n)) for i, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert isinstance(results["acme/p3"], HubAnswerError) and isinstance(results["acme/p4"], HubAnswerError)
    for i in (0, 1, 2, 5):
        got = results[f"acme/p{i}"]
        assert not isinstance(got, Exception), got
        assert Path(got.weights_path).read_bytes() == weights(seed=i)  # type: ignore[attr-defined]
    assert files_outside(tmp_path, isolated_hf_cache) == []


# --- A pinned download with Xet on reads a cached tree listing instead of asking: the listing is checked ------
def test_a_pinned_downloads_cached_tree_listing_is_checked_like_an_answer(
        hub: Any, repo: str, isolated_hf_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With Xet on (the default) and ``trees/<sha>.json`` in the repo's cache folder (written by any
    snapshot_download of the repo from this Hub, e.g. vLLM's own LoRA path), hf_hub_download of a pinned commit takes
    the file's ETag (``lfs_sha256``) from that listing and sends no HEAD, so no hook sees it: the listing's
    ``../../../outside/blob`` is refused before the download (`hubguard.check_listing`)."""
    import huggingface_hub.constants as hc
    from huggingface_hub._tree_cache import TreeCacheEntry, write_tree_cache

    from vllm_lora_ext.errors import VllmLoraExtError

    monkeypatch.setattr(hc, "HF_HUB_DISABLE_XET", False)
    sha = hub.repo("acme/a").refs["main"]
    data = hub.repo("acme/a").commits[sha][WEIGHTS]
    write_tree_cache(str(isolated_hf_cache / "models--acme--a"), sha, {
        WEIGHTS: TreeCacheEntry(size=len(data), blob_id="0" * 40, lfs_sha256="../../../outside/blob",
                                lfs_size=len(data), xet_hash="a" * 64)})
    with pytest.raises(VllmLoraExtError):
        resolve_source(f"{repo}@{sha}")
    written = {str(p.relative_to(tmp_path)): p.stat().st_size for p in files_outside(tmp_path, isolated_hf_cache)
               if p.is_file()}
    assert written == {}, f"huggingface_hub wrote outside the cache: {written}"


# --- What held -----------------------------------------------------------------------------------------------------
def _second(change: Any) -> Any:
    def script(nth: int, method: str, code: int, hdrs: list, body: bytes) -> tuple:
        return change(code, hdrs, body) if nth == 2 else (code, hdrs, body)
    return script


HELD = {
    "x-linked-etag-differs": lambda c, h, b: (c, [*h, ("X-Linked-Etag", '"' + "1" * 64 + '"')], b),
    "weak-etag-traversal": lambda c, h, b: (c, set_header(h, "ETag", 'W/"../../../outside/blob"'), b),
    "leading-slash-etag": lambda c, h, b: (c, set_header(h, "ETag", '"/tmp/outside-blob"'), b),
    "etag-all-stripped": lambda c, h, b: (c, set_header(h, "ETag", 'W/W/'), b),
    "linked-size-huge": lambda c, h, b: (c, [*h, ("X-Linked-Size", str(1 << 60))], b),
    "linked-size-negative": lambda c, h, b: (c, [*h, ("X-Linked-Size", "-1")], b),
    "linked-size-nonnumeric": lambda c, h, b: (c, [*h, ("X-Linked-Size", "lots")], b),
    "redirect-307-relative-to-traversal": lambda c, h, b: (307, [("Location", "/acme/a/resolve/evil/" + WEIGHTS),
                                                                 ("X-Repo-Commit", header(h, "X-Repo-Commit"))], b""),
    "cdn-redirect-lying-linked-etag": lambda c, h, b: (302, [
        ("X-Repo-Commit", header(h, "X-Repo-Commit")), ("X-Linked-Etag", '"../../../outside/blob"'),
        ("X-Linked-Size", header(h, "Content-Length")), ("Location", "http://localhost:1/cdn/x")], b""),
}


@pytest.mark.parametrize("lie", sorted(HELD))
def test_held_a_second_head_that_lies_is_refused_before_any_write(
        hub: Any, repo: str, isolated_hf_cache: Path, tmp_path: Path, lie: str) -> None:
    from vllm_lora_ext.errors import VllmLoraExtError

    def evil(method: str, hdrs: dict) -> tuple:  # where the relative redirect leads: a traversing ETag
        return 200, [("X-Repo-Commit", hub.repo("acme/a").refs["main"]), ("ETag", '"../../../outside/blob"'),
                     ("Content-Length", "10")], b"0123456789"
    hub.routes[f"/acme/a/resolve/evil/{WEIGHTS}"] = evil
    hub.script[WEIGHTS] = _second(HELD[lie])
    with pytest.raises(VllmLoraExtError):
        resolve_source(repo)
    assert files_outside(tmp_path, isolated_hf_cache) == []
    assert not [r for r in hub.requests if r[0] == "GET" and r[1].endswith(WEIGHTS)]


def test_held_a_5xx_to_huggingface_hubs_head_then_a_lying_retry_is_refused(
        hub: Any, repo: str, isolated_hf_cache: Path, tmp_path: Path) -> None:
    from vllm_lora_ext.errors import HubAnswerError

    def script(nth: int, method: str, code: int, hdrs: list, body: bytes) -> tuple:
        if nth == 2:
            return 503, [("Content-Length", "0")], b""
        if nth >= 3 and method == "HEAD":
            return code, set_header(hdrs, "ETag", '"../../../outside/blob"'), body
        return code, hdrs, body

    hub.script[WEIGHTS] = script
    with pytest.raises(HubAnswerError, match="ETag"):
        resolve_source(repo)
    assert files_outside(tmp_path, isolated_hf_cache) == []


@pytest.mark.parametrize("resume", ["200-longer", "206-longer"])
def test_held_a_resumed_download_that_sends_more_is_cut_at_the_announced_size(
        hub: Any, repo: str, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch, resume: str) -> None:
    from vllm_lora_ext.errors import HubAnswerError

    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "1GiB")
    hub.drop_once[WEIGHTS] = [1000]
    big = b"\0" * (8 << 20)

    def script(nth: int, method: str, code: int, hdrs: list, body: bytes) -> tuple:
        if nth >= 4:  # the resumed GET
            status = 200 if resume == "200-longer" else 206
            extra = [] if status == 200 else [("Content-Range", f"bytes 1000-{len(big) - 1}/{len(big)}")]
            return status, [("X-Repo-Commit", header(hdrs, "X-Repo-Commit")), ("Content-Length", str(len(big))),
                            *extra], big
        return code, hdrs, body

    hub.script[WEIGHTS] = script
    with pytest.raises(HubAnswerError, match="sent more than"):
        resolve_source(repo)
    on_disk = sum(p.stat().st_size for p in isolated_hf_cache.rglob("*") if p.is_file() and not p.is_symlink())
    assert on_disk < (1 << 20)


def test_held_a_weak_etag_and_a_redirect_to_the_same_file_of_an_honest_hub_load(hub: Any, repo: str) -> None:
    """W/"<sha>" on the second answer reads as the same ETag; a 302 relative hop before the 200 is followed."""
    hub.script[WEIGHTS] = _second(lambda c, h, b: (c, set_header(h, "ETag", 'W/' + header(h, "ETag")), b))
    assert Path(resolve_source(repo).weights_path).read_bytes() == weights()


@pytest.mark.parametrize("planted", ["blobs", "snapshots", "refs", "repo", "locks", "a snapshot", "no_exist", "the ref"])
def test_a_link_planted_in_the_cache_out_of_it_is_refused_before_the_download_writes_through_it(
        hub: Any, repo: str, isolated_hf_cache: Path, tmp_path: Path, planted: str) -> None:
    """`contained` checked the file after huggingface_hub had written it: a ``blobs`` link planted in a shared cache
    had the Hub's bytes (named by its ETag) written where the link pointed, and left there."""
    from vllm_lora_ext.errors import HubAnswerError

    outside = tmp_path / "outside"
    outside.mkdir()
    folder = isolated_hf_cache / "models--acme--a"
    link = {"blobs": folder / "blobs", "snapshots": folder / "snapshots", "refs": folder / "refs", "repo": folder,
            "locks": isolated_hf_cache / ".locks", "a snapshot": folder / "snapshots" / ("0" * 40),
            "no_exist": folder / ".no_exist", "the ref": folder / "refs" / "main"}[planted]
    link.parent.mkdir(parents=True, exist_ok=True)
    if planted == "the ref":  # older huggingface_hub writes the commit through it
        link.symlink_to(outside / "victim")
    else:
        link.symlink_to(outside, target_is_directory=True)
    with pytest.raises(HubAnswerError, match="links outside the cache") as err:
        resolve_source(repo)
    assert str(outside) not in err.value.client_message()
    assert list(outside.iterdir()) == []


def test_a_cache_that_cannot_take_the_file_says_that_retrying_will_not_help(
        hub: Any, repo: str, isolated_hf_cache: Path) -> None:
    """The repo's cache folder is a file (ENOTDIR): the message ended "Retry", which cannot help."""
    from vllm_lora_ext.errors import AdapterDownloadError

    (isolated_hf_cache / "models--acme--a").write_text("not a folder")
    with pytest.raises(AdapterDownloadError) as err:
        resolve_source(repo)
    assert "Retrying will not help: the Hugging Face cache cannot take the file there" in str(err.value)
    assert "Retry;" not in str(err.value)


def test_a_download_announcing_no_size_with_no_disk_bound_stops_short_of_filling_the_disk(tmp_path: Path) -> None:
    """With VLLM_LORA_EXT_DISK_CACHE_BYTES unset (the default), a Hub that announced no size had no cap: an endless
    chunked body filled the disk (9.2 GB in 45 s)."""
    import shutil

    from vllm_lora_ext.hubguard import HubFacts, transfer_cap

    cap = transfer_cap(HubFacts(), None, source="hf:acme/a", filename=WEIGHTS, disk=tmp_path / "hub" / "not-yet")
    usage = shutil.disk_usage(tmp_path)
    assert cap is not None and abs(cap - (usage.free - min(1 << 30, usage.total // 20))) < (64 << 20)
    assert transfer_cap(HubFacts(size=5), None, source="hf:acme/a", filename=WEIGHTS, disk=tmp_path) == 5
    assert transfer_cap(HubFacts(), 7, source="hf:acme/a", filename=WEIGHTS, disk=tmp_path) == 7


# --- The repo listing behind a not-found message: read capped in bytes and time ------------------------------
def _listing_route(chunks: Any, sent: list[int]) -> Any:
    def route(method: str, hdrs: dict) -> tuple:
        def body() -> Any:
            for chunk in chunks:
                sent.append(len(chunk))
                yield chunk
        return 200, [("Content-Type", "application/json")], body()  # no Content-Length: read until closed
    return route


def test_a_listing_of_gigabytes_is_cut_at_the_cap_and_the_message_lists_nothing(hub: Any, repo: str) -> None:
    """A missing file's message asks the Hub for the repo's listing. A Hub that answers it with endless bytes must
    not grow the process's memory with them (``HfApi.model_info`` read the whole body): the read stops at
    ``MAX_LISTING_BYTES`` and the message names no file."""
    from vllm_lora_ext.constants import MAX_LISTING_BYTES
    from vllm_lora_ext.errors import AdapterNotFoundError

    sent: list[int] = []
    endless = (b'{"siblings": [' + b'{"rfilename": "x.safetensors"},' * 30000 for _ in range(10_000))  # ~9 GB
    hub.routes["/api/models/acme/a*"] = _listing_route(endless, sent)
    with pytest.raises(AdapterNotFoundError) as info:
        resolve_source(f"{repo}:missing.safetensors")
    assert "holds no .safetensors file" in str(info.value), str(info.value)
    assert sum(sent) < MAX_LISTING_BYTES + (64 << 20), sum(sent)  # what sat in the sockets' buffers, not 9 GB


def test_a_listing_that_drips_is_given_up_after_the_metadata_timeout(
        hub: Any, repo: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A byte a second never trips a per-read timeout; the listing is given up at HF_HUB_ETAG_TIMEOUT in all."""
    import time

    import huggingface_hub.constants as hc

    from vllm_lora_ext.errors import AdapterNotFoundError

    monkeypatch.setattr(hc, "HF_HUB_ETAG_TIMEOUT", 1)
    stop = threading.Event()

    def drip() -> Any:
        yield b'{"siblings": ['
        while not stop.wait(0.2):
            yield b" "

    hub.routes["/api/models/acme/a*"] = _listing_route(drip(), [])
    began = time.monotonic()
    try:
        with pytest.raises(AdapterNotFoundError, match="holds no .safetensors file"):
            resolve_source(f"{repo}:missing.safetensors")
    finally:
        stop.set()
    assert time.monotonic() - began < 10


def test_an_honest_listing_still_names_the_repos_files(hub: Any, repo: str) -> None:
    """The capped read gives the same names ``model_info`` did, for a listing with other fields around them."""
    from vllm_lora_ext.errors import AdapterNotFoundError

    listing = json.dumps({"id": "acme/a", "cardData": {"nested": [[{"x": 1}]]}, "siblings": [
        {"rfilename": WEIGHTS, "size": 3}, {"rfilename": "sub/other.safetensors"}, {"rfilename": "a.bin"}]}).encode()
    hub.routes["/api/models/acme/a*"] = _listing_route([listing[:7], listing[7:]], [])
    with pytest.raises(AdapterNotFoundError) as info:
        resolve_source(f"{repo}:sub/missing.safetensors")
    assert "['sub/other.safetensors', 'adapter_model.safetensors'" in str(info.value), str(info.value)
