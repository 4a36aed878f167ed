"""The ``vllm_lora_ext_adapter_resident`` gauge's samples through prometheus_client's multi-process collector:
what is held now, never every name ever seen, and never more than the bound."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from factories import scrape
from vllm_lora_ext.resident_metric import MAX_LABEL_CHARS, RESIDENT_METRIC, clear_resident, write_resident


@pytest.fixture
def collect(fresh_metrics: str) -> Iterator[Any]:
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.multiprocess import MultiProcessCollector

    clear_resident()

    def run() -> dict[tuple[str, str], float]:
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=fresh_metrics)
        got = scrape(generate_latest(registry).decode())
        return {(dict(labels)["adapter_name"], dict(labels)["level"]): v
                for (name, labels), v in got.items() if name == RESIDENT_METRIC}

    yield run
    clear_resident()


def test_the_gauge_shows_what_is_held_now_with_its_level(collect: Any) -> None:
    write_resident({"style": "gpu", "domain": "cpu", "mix-a=1-0123": "building"}, max_series=8)
    assert collect() == {("style", "gpu"): 1, ("domain", "cpu"): 1, ("mix-a=1-0123", "building"): 1}


def test_an_evicted_adapter_leaves_no_series_so_churn_never_grows_the_scrape(collect: Any) -> None:
    for i in range(200):  # 200 adapters pass through a cache of 4
        write_resident({f"a{j}": "cpu" for j in range(i, i + 4)}, max_series=4)
    assert collect() == {(f"a{j}", "cpu"): 1 for j in range(199, 203)}


def test_more_samples_than_the_bound_are_left_out_and_counted(collect: Any, caplog: pytest.LogCaptureFixture) -> None:
    dropped = write_resident({f"a{j:03d}": "cpu" for j in range(100)}, max_series=10)
    assert dropped == 90 and len(collect()) == 10
    assert "at most 10 samples" in caplog.text


def test_a_very_long_name_is_shortened_with_a_digest_so_two_stay_apart(collect: Any) -> None:
    long_a, long_b = "q:hf:acme/" + "x" * 5000 + "a", "q:hf:acme/" + "x" * 5000 + "b"
    write_resident({long_a: "cpu", long_b: "cpu"}, max_series=4)
    names = [name for name, _ in collect()]
    assert len(names) == 2 and len(set(names)) == 2 and all(len(n) <= MAX_LABEL_CHARS for n in names)


def test_nothing_is_written_without_a_metrics_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext import metrics

    metrics.teardown()
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv("VLLM_LORA_EXT_METRICS_DIR", raising=False)
    assert write_resident({"a": "cpu"}, max_series=4) == 0


def test_a_process_can_hand_back_its_trees_plugin_metrics_as_slash_metrics_shows_them(collect: Any) -> None:
    from vllm_lora_ext.resident_metric import scrape_plugin_metrics

    write_resident({"style": "cpu"}, max_series=4)
    got = scrape_plugin_metrics()
    assert got["metrics_dir"] and scrape(str(got["text"]))[(RESIDENT_METRIC, (("adapter_name", "style"),
                                                                                ("level", "cpu")))] == 1
