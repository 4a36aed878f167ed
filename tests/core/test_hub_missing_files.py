"""A Hub or mirror that wrongly answers 404 for a file at a commit: huggingface_hub records the 404 in the cache
(``.no_exist/<commit>/<file>``) and never drops the record, so a resolve that believed it went on without the
adapter's own config for good. With the real huggingface_hub client and tests/hubserver.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from factories import hub_adapter_files
from vllm_lora_ext import AdapterNotFoundError, resolve_source
from vllm_lora_ext.cli import main
from vllm_lora_ext.sources import fetch_source
from vllm_lora_ext.summary import load_config

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


def wrong_404(hub: Any, filename: str) -> None:
    """Answer every request for ``filename`` with the Hub's 404 for a missing file (with the commit, as the Hub
    does), whatever the repo holds: a mirror not yet synced, or a Hub answering wrongly."""
    def script(nth: int, method: str, code: int, hdrs: list, body: bytes) -> tuple:
        commit = dict(hdrs)["X-Repo-Commit"]
        return 404, [("X-Error-Code", "EntryNotFound"), ("X-Repo-Commit", commit), ("Content-Length", "0")], b""

    hub.script[filename] = script


def record_of(cache: Path, commit: str, filename: str) -> Path:
    return cache / "models--acme--a" / ".no_exist" / commit / filename


@pytest.fixture
def commit(hub: Any) -> str:
    return hub.repo("acme/a").commit(hub_adapter_files())


def requests_for(hub: Any, filename: str, since: int) -> list[tuple[str, str]]:
    return [r for r in hub.requests[since:] if r[1].endswith("/" + filename)]


def test_a_config_the_hub_wrongly_answered_404_for_is_got_by_vllm_lora_fetch_and_then_served(
        hub: Any, commit: str, isolated_hf_cache: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The first resolve goes on without the config, and says so (a warning, and ``config_note``). Once the Hub
    answers truly, a plain resolve still believes the cache's record (a pinned, cached source costs no request),
    and says how to clear it; 'vllm-lora fetch' asks again, gets the real config and drops the record, so that every
    later resolve, offline and huggingface_hub's own cache lookup find it."""
    wrong_404(hub, CONFIG)
    with caplog.at_level(logging.WARNING, logger="vllm_lora_ext"):
        first = resolve_source("hf:acme/a")
    assert (first.config_rule, first.commit) == ("inferred", commit)
    assert first.config_note is not None and "the Hub answered 404 for 'adapter_config.json'" in first.config_note
    assert "'vllm-lora fetch hf:acme/a' asks again" in first.config_note
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'hf:acme/a' has no config file, so its config is inferred" in w for w in warned), warned
    assert record_of(isolated_hf_cache, commit, CONFIG).is_file()

    hub.script.clear()  # the Hub is fixed
    before = hub.count()
    believed = resolve_source(f"hf:acme/a@{commit}")
    assert believed.config_rule == "inferred" and hub.count() == before  # no request on the pinned, cached path
    assert f"run 'vllm-lora fetch hf:acme/a@{commit}' with the Hub reachable" in str(believed.config_note)
    fetched = fetch_source(f"hf:acme/a@{commit}")
    assert fetched.config_rule == CONFIG and fetched.config_note is None
    assert json.loads(fetched.config_path.read_bytes()) == json.loads(hub_adapter_files()[CONFIG])
    assert load_config(fetched).r == 4
    assert not record_of(isolated_hf_cache, commit, CONFIG).exists()

    from huggingface_hub import try_to_load_from_cache

    assert try_to_load_from_cache("acme/a", CONFIG, revision=commit) == str(fetched.config_path)
    before = hub.count()
    assert resolve_source(f"hf:acme/a@{commit}").config_rule == CONFIG and hub.count() == before  # no request


def test_a_config_missing_on_the_hub_costs_a_resolve_no_request_and_fetch_asks_once(
        hub: Any, isolated_hf_cache: Path) -> None:
    """An adapter that truly has no config: an online resolve of its pinned, cached source believes the cache's
    record and makes no request; 'vllm-lora fetch' asks the Hub once more (one round, not one per retry), and goes
    on inferred, saying that the Hub answered 404 again."""
    files = hub_adapter_files()
    sha = hub.repo("acme/a").commit({WEIGHTS: files[WEIGHTS]})
    assert resolve_source("hf:acme/a").config_rule == "inferred"
    for _ in range(2):
        since = hub.count()
        plain = resolve_source(f"hf:acme/a@{sha}")
        assert plain.config_rule == "inferred" and hub.count() == since, hub.requests[since:]
        assert "records that the Hub answered 404 before for 'adapter_config.json'" in str(plain.config_note)
        since = hub.count()
        again = fetch_source(f"hf:acme/a@{sha}")
        assert again.config_rule == "inferred" and "the Hub answered 404 again for 'adapter_config.json'" in str(
            again.config_note)
        asked = requests_for(hub, CONFIG, since)
        assert asked and all(method == "HEAD" for method, _ in asked) and len(asked) <= 2, asked  # (ours, then hf's)
        assert len(hub.requests[since:]) == len(asked)  # the cached weights: no request
    assert record_of(isolated_hf_cache, sha, CONFIG).is_file()


def test_offline_a_config_the_cache_records_missing_is_said_with_how_to_clear_the_record(
        hub: Any, commit: str, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str], released: None) -> None:
    """Offline, the record is believed (the Hub cannot be asked), and the note and the warning say the cache
    records the file missing, name the record's path, and how to clear it: 'vllm-lora fetch' with the Hub
    reachable, which asks again and drops it."""
    wrong_404(hub, CONFIG)
    resolve_source("hf:acme/a")
    hub.script.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with caplog.at_level(logging.WARNING, logger="vllm_lora_ext"):
        offline = resolve_source(f"hf:acme/a@{commit}")
    note = str(offline.config_note)
    assert offline.config_rule == "inferred"
    assert "the local cache records that the Hub answered 404 before for 'adapter_config.json'" in note, note
    assert "not asked again (offline mode is on)" in note and "unset HF_HUB_OFFLINE" in note, note
    assert f"'vllm-lora fetch hf:acme/a@{commit}'" in note and str(record_of(isolated_hf_cache, commit, CONFIG)) in note
    assert any(note in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert main(["fetch", f"hf:acme/a@{commit}", "--json"]) == 0  # what 'vllm-lora fetch' reports says it too
    assert json.loads(capsys.readouterr().out)["config_note"] == note

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # the fix the note gives
    assert fetch_source(f"hf:acme/a@{commit}").config_rule == CONFIG
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_source(f"hf:acme/a@{commit}").config_rule == CONFIG


def test_a_config_another_client_got_since_the_404_is_used_offline_and_the_record_dropped(
        hub: Any, commit: str, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub keeps the record after its own download of the file ('hf download'), and its cache lookup
    believes the record first: the plugin takes the cached file, offline too."""
    from huggingface_hub import hf_hub_download

    wrong_404(hub, CONFIG)
    resolve_source("hf:acme/a")
    hub.script.clear()
    got = hf_hub_download("acme/a", CONFIG, revision=commit)
    assert record_of(isolated_hf_cache, commit, CONFIG).is_file()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    offline = resolve_source(f"hf:acme/a@{commit}")
    assert offline.config_rule == CONFIG and offline.config_path == Path(got)
    assert not record_of(isolated_hf_cache, commit, CONFIG).exists()


def test_where_the_hub_cannot_be_asked_again_the_record_stands_and_the_resolve_says_so(
        hub: Any, commit: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Online but the Hub unreachable: 'vllm-lora fetch' of the pinned source still resolves from the cache (as
    before the record was ever doubted), its note saying why the Hub was not asked again."""
    import socket

    import huggingface_hub.constants as hc

    wrong_404(hub, CONFIG)
    resolve_source("hf:acme/a")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(hc, "ENDPOINT", f"http://127.0.0.1:{port}")  # nothing listens there
    closed = fetch_source(f"hf:acme/a@{commit}")
    assert closed.config_rule == "inferred"
    assert "not asked again (asking failed, AdapterNotFoundError: see the warning before)" in str(closed.config_note)


def test_weights_the_hub_wrongly_answered_404_for_at_a_pinned_commit_are_got_once_it_answers_truly(
        hub: Any, commit: str, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights of a pinned source recorded missing: offline, the refusal says the cache records them missing
    and how to clear it (not 'the repo holds no .safetensors'); online, once the Hub answers truly, they load."""
    wrong_404(hub, WEIGHTS)
    with pytest.raises(AdapterNotFoundError):
        resolve_source(f"hf:acme/a@{commit}")
    assert record_of(isolated_hf_cache, commit, WEIGHTS).is_file()
    hub.script.clear()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(AdapterNotFoundError) as info:
        resolve_source(f"hf:acme/a@{commit}")
    text = str(info.value)
    assert "the local cache records that the Hub answered 404 before for 'adapter_model.safetensors'" in text, text
    assert "vllm-lora fetch" in text and str(record_of(isolated_hf_cache, commit, WEIGHTS)) in text, text
    public = info.value.client_message()  # a client is not told the server's cache folder or settings
    assert str(isolated_hf_cache) not in public and "HF_HUB_OFFLINE" not in public and "operator" in public, public
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    online = resolve_source(f"hf:acme/a@{commit}")
    assert online.weights_path.read_bytes() == hub_adapter_files()[WEIGHTS] and online.config_rule == CONFIG
    assert not record_of(isolated_hf_cache, commit, WEIGHTS).exists()
