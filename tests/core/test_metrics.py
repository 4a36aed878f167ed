"""vllm_lora_ext_* metrics: written by several real processes, summed by prometheus_client's own collector."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import REGISTRY, CollectorRegistry, generate_latest
from prometheus_client.multiprocess import MultiProcessCollector
from safetensors.torch import save

from factories import dense_tensors, llama_shapes, lora_config, make_dense_adapter, scrape
from vllm_lora_ext import metrics, resolve_source
from vllm_lora_ext.constants import ENV_METRICS_DIR


def samples(registry: CollectorRegistry = REGISTRY) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return scrape(generate_latest(registry).decode())


def _child_load(n: int) -> None:
    for _ in range(n):
        metrics.ADAPTER_LOADS.inc(kind="adapter", outcome="ok")
        metrics.ADAPTER_LOAD_SECONDS.observe(0.3, kind="adapter")
    metrics.ADAPTER_BYTES_READ.inc(1000 * n)
    metrics.record_error(ValueError("x"), where="worker")


def test_samples_from_forked_and_spawned_processes_are_summed_in_the_default_registry(fresh_metrics: str) -> None:
    metrics.ADAPTER_LOADS.inc(kind="mix", outcome="error")
    metrics.MIXES_ACTIVE.set(3)
    for ctx, n in (("fork", 2), ("spawn", 3)):
        p = mp.get_context(ctx).Process(target=_child_load, args=(n,))
        p.start()
        p.join()
        assert p.exitcode == 0
    got = samples()
    assert got[("vllm_lora_ext_adapter_loads_total", (("kind", "adapter"), ("outcome", "ok")))] == 5
    assert got[("vllm_lora_ext_adapter_loads_total", (("kind", "mix"), ("outcome", "error")))] == 1
    assert got[("vllm_lora_ext_adapter_bytes_read_total", ())] == 5000
    assert got[("vllm_lora_ext_errors_total", (("type", "ValueError"), ("where", "worker")))] == 2
    assert got[("vllm_lora_ext_mixes_active", ())] == 3
    assert got[("vllm_lora_ext_adapter_load_seconds_count", (("kind", "adapter"),))] == 5
    assert got[("vllm_lora_ext_adapter_load_seconds_bucket", (("kind", "adapter"), ("le", "0.25")))] == 0
    assert got[("vllm_lora_ext_adapter_load_seconds_bucket", (("kind", "adapter"), ("le", "+Inf")))] == 5
    assert got[("vllm_lora_ext_adapter_load_seconds_sum", (("kind", "adapter"),))] == pytest.approx(1.5)
    assert all(f.endswith("-vllm_lora_ext.db") for f in os.listdir(fresh_metrics))


def test_setup_is_idempotent_and_a_child_process_reuses_the_parents_directory(fresh_metrics: str) -> None:
    assert metrics.setup() == fresh_metrics
    ctx = mp.get_context("spawn")
    with ctx.Pool(1) as pool:
        assert pool.apply(metrics.setup) == fresh_metrics
    assert os.environ[ENV_METRICS_DIR] == fresh_metrics


def test_a_top_level_process_that_inherits_a_directory_makes_its_own(fresh_metrics: str, tmp_path: Path) -> None:
    """A program that registered the plugin and then starts `vllm serve` must not share its counters with it."""
    import subprocess
    import sys

    code = "from vllm_lora_ext import metrics; print(metrics.setup())"
    out = subprocess.run([sys.executable, "-c", code], env=dict(os.environ), capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out and out != fresh_metrics and not os.path.exists(out)  # and it removed its own at exit


def test_under_prometheus_multiproc_dir_the_files_go_there_and_vllms_kind_of_collector_reads_them(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    metrics.teardown()
    tmp_path = tmp_path / "prom"
    tmp_path.mkdir()
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    monkeypatch.delenv(ENV_METRICS_DIR, raising=False)
    try:
        assert metrics.setup() == str(tmp_path)
        assert ENV_METRICS_DIR not in os.environ  # no private directory, no second collector
        metrics.MIXES_REGISTERED.inc()
        registry = CollectorRegistry()  # what vLLM's get_prometheus_registry() builds
        MultiProcessCollector(registry)
        assert samples(registry)[("vllm_lora_ext_mixes_registered_total", ())] == 1
        # our files never share a name with prometheus_client's own (<type>_<pid>.db)
        assert os.listdir(tmp_path) == [f"counter_{os.getpid()}-vllm_lora_ext.db"]
    finally:
        metrics.teardown()


def test_without_a_directory_recording_does_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    metrics.teardown()
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv(ENV_METRICS_DIR, raising=False)
    metrics.ADAPTER_LOADS.inc(kind="adapter", outcome="ok")  # the CLI: no setup, no files, no error
    assert not any(k[0].startswith("vllm_lora_ext_adapter_loads") for k in samples())


def test_a_vanished_directory_never_fails_the_caller(fresh_metrics: str) -> None:
    metrics.MIXES_EVICTED.inc()
    metrics.teardown()  # the directory is gone while the process still records
    os.environ[ENV_METRICS_DIR] = fresh_metrics
    try:
        metrics.MIXES_EVICTED.inc()
    finally:
        del os.environ[ENV_METRICS_DIR]


def test_teardown_removes_the_directory_and_the_collector(fresh_metrics: str) -> None:
    metrics.MIXES_EVICTED.inc()
    assert samples()
    metrics.teardown()
    assert not os.path.exists(fresh_metrics)
    assert not samples()


def test_bad_metric_use_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="takes labels"):
        metrics.ADAPTER_LOADS.inc(kind="adapter")
    with pytest.raises(ValueError, match="can only grow"):
        metrics.MIXES_EVICTED.inc(-1)


def test_sources_count_local_paths_hub_downloads_and_cache_hits(fresh_metrics: str, hub: object,
                                                                tmp_path: Path) -> None:
    resolve_source(make_dense_adapter(tmp_path / "local"))
    repo = hub.repo("acme/metrics")  # type: ignore[attr-defined]
    weights = save(dense_tensors(llama_shapes(targets=["q_proj"]), rank=4, seed=1))
    sha = repo.commit({"adapter_model.safetensors": weights,
                       "adapter_config.json": json.dumps(lora_config(4, 8, ["q_proj"])).encode()})
    resolve_source("hf:acme/metrics")  # downloads
    resolve_source("hf:acme/metrics")  # asks the hub for main's commit; files cached
    resolve_source(f"hf:acme/metrics@{sha}")  # pinned and cached: no request at all
    got = samples()
    assert got[("vllm_lora_ext_sources_resolved_total", (("cache", "local"),))] == 1
    assert got[("vllm_lora_ext_sources_resolved_total", (("cache", "miss"),))] == 1
    assert got[("vllm_lora_ext_sources_resolved_total", (("cache", "hit"),))] == 2
    assert got[("vllm_lora_ext_source_download_seconds_count", ())] == 1


def test_without_prometheus_client_every_record_call_is_a_no_op(tmp_path: Path) -> None:
    """The core (the CLI, sources) runs where prometheus_client is not installed: the README's main job does."""
    import subprocess
    import sys

    folder = make_dense_adapter(tmp_path / "a")
    code = ("import sys; sys.modules['prometheus_client'] = None\n"
            "from vllm_lora_ext import metrics, resolve_source\n"
            "assert metrics.setup() is None\n"
            f"resolve_source({str(folder)!r})\n"
            "metrics.ADAPTER_LOAD_SECONDS.observe(1.0, kind='adapter'); metrics.MIXES_ACTIVE.set(1)\n"
            "metrics.record_error(ValueError('x'), where='server'); print('ok')\n")
    env = dict(os.environ, **{ENV_METRICS_DIR: str(tmp_path)})  # even with a directory inherited
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_metrics_folder_removed_at_runtime_keeps_the_counts_in_memory_and_says_so(tmp_path: Path) -> None:
    """A /tmp cleaner removed the folder: the counts so far left /metrics and later writes were dropped, while
    health() said nothing was wrong."""
    code = '''
import json, os, shutil, sys, tempfile
tempfile.tempdir = sys.argv[1]
os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None); os.environ.pop("VLLM_LORA_EXT_METRICS_DIR", None)
from prometheus_client import REGISTRY, generate_latest
from vllm_lora_ext import metrics
path = metrics.setup()
metrics.MIXES_REGISTERED.inc(); metrics.MIXES_REGISTERED.inc()
shutil.rmtree(path)
metrics.MIXES_REGISTERED.inc()
metrics.ERRORS.inc(where="server", type="X")
text = generate_latest(REGISTRY).decode()
print(json.dumps({"health": metrics.health(), "lines": text.splitlines()}))
'''
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"), "PYTHONDONTWRITEBYTECODE": "1"}
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert "vllm_lora_ext_mixes_registered_total 3.0" in result["lines"]
    assert 'vllm_lora_ext_errors_total{type="X",where="server"} 1.0' in result["lines"]
    assert "was removed" in (result["health"]["degraded"] or "") and "was removed" in out.stderr


def test_a_metrics_folder_that_never_existed_is_named_as_missing_with_its_fix(tmp_path: Path) -> None:
    """The warning said the folder "was removed" and to free space there, for a folder that was never made."""
    make_dense_adapter(tmp_path / "a", rank=4, alpha=8)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
           ENV_METRICS_DIR: str(tmp_path / "never")}
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    out = subprocess.run([sys.executable, "-m", "vllm_lora_ext.cli", "inspect", str(tmp_path / "a")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "does not exist (removed, or never made)" in out.stderr and "Make it, or set" in out.stderr
    assert "Free space" not in out.stderr
