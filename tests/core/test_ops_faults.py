"""Operations faults in the core: strict settings, config files that are not files, shared files of owners in
other PID namespaces, dead servers' metrics folders, and metric writes with no room.

Each case asserts the error, or the degraded but working behaviour, and that nothing leaked.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import pytest

from factories import scrape, tiny_tmpfs
from vllm_lora_ext import metrics
from vllm_lora_ext._util import read_capped
from vllm_lora_ext.transport.files import sweep_stale
from vllm_lora_ext.constants import ENV_METRICS_DIR, build_spare_bytes, check_settings, parse_size
from vllm_lora_ext.deployment import read_deployment_config
from vllm_lora_ext.errors import DeploymentConfigError, SettingsError
from vllm_lora_ext.sharedfiles import claim_owner, folder_problem, sweep_dead_owners


def _env() -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    for name in ("PROMETHEUS_MULTIPROC_DIR", ENV_METRICS_DIR):
        env.pop(name, None)
    return env


def _in_time(fn: Any, seconds: float = 30) -> Any:
    """Run ``fn`` on a thread; fail (rather than hang the suite) if it does not return in time."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(_outcome(fn)), daemon=True)
    worker.start()
    worker.join(seconds)
    assert out, f"{fn} did not return within {seconds} s"
    return out[0]


def _outcome(fn: Any) -> Any:
    try:
        return fn()
    except BaseException as err:
        return err


# ------------------------------------------------------------------------------------------------ sizes and settings


@pytest.mark.parametrize(("raw", "size"), [
    ("2GiB", 2 * 2**30), ("2GB", 2 * 10**9), ("512MiB", 512 * 2**20), ("500mb", 500 * 10**6), ("1.5GiB", 3 * 2**29),
    ("2 GiB", 2 * 2**30), ("1024", 1024), ("0", 0), ("1e9", 10**9), ("64KiB", 65536), ("1TB", 10**12), ("7B", 7),
])
def test_sizes_take_bytes_or_a_unit_of_1000_or_1024(raw: str, size: int) -> None:
    assert parse_size(raw, name="X") == size


@pytest.mark.parametrize("raw", ["2 bananas", "-1", "nan", "inf", "1e400", "GiB", "2XB", "2GiBs", "0x10", "1.5", "2,000"])
def test_a_bad_size_names_the_setting_and_the_accepted_forms(raw: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_BUILD_SPARE_BYTES", raw)
    with pytest.raises(SettingsError, match="VLLM_LORA_EXT_BUILD_SPARE_BYTES") as caught:
        build_spare_bytes()
    assert "2GiB" in str(caught.value) and "2GB" in str(caught.value)
    with pytest.raises(SettingsError, match="VLLM_LORA_EXT_BUILD_SPARE_BYTES"):
        check_settings()


def test_check_settings_names_every_bad_setting_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    bad = {"VLLM_LORA_EXT_STAGE_GPU_BYTES": "lots", "VLLM_LORA_EXT_MAX_MIXES": "0", "VLLM_LORA_EXT_HOST_ARENAS": "sometimes",
           "VLLM_LORA_EXT_PREBUILD_WAIT_S": "-3"}
    for name, value in bad.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError) as caught:
        check_settings()
    assert all(name in str(caught.value) for name in bad)


@pytest.mark.parametrize(("name", "raw"), [("VLLM_LORA_EXT_MAX_MIXES", "2.5"), ("VLLM_LORA_EXT_PREBUILD_BUILDS", "1e1"),
                                         ("VLLM_LORA_EXT_COMPONENT_CACHE", "lots"), ("VLLM_LORA_EXT_MIX_THREADS", "0.5")])
def test_counts_must_be_whole_numbers_never_silently_rounded(name: str, raw: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, raw)
    with pytest.raises(SettingsError, match=name):
        check_settings()


@pytest.mark.parametrize(("name", "said"), [
    ("VLLM_LORA_EXT_ALLOWED_ROOT", "did you mean VLLM_LORA_EXT_ALLOWED_ROOTS?"),  # a security setting, mistyped
    ("VLLM_LORA_EXT_PREBULD", "did you mean VLLM_LORA_EXT_PREBUILD?"),
    ("vllm_lora_ext_allowed_roots", "did you mean VLLM_LORA_EXT_ALLOWED_ROOTS?"),  # the wrong case
])
def test_a_plugin_variable_that_is_no_setting_is_refused_naming_the_nearest(name: str, said: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A misspelt name would do nothing at all (vLLM only calls every VLLM_* name it does not know "unknown"), so
    it stops the start as a malformed value does; every documented setting passes (the next test)."""
    monkeypatch.setenv(name, "1")
    with pytest.raises(SettingsError, match=re.escape(f"{name} is not a setting of vllm_lora_ext; {said}")):
        check_settings()


def test_a_plugin_variable_far_from_any_setting_is_a_warning_not_a_stop(monkeypatch: pytest.MonkeyPatch,
                                                                        caplog: pytest.LogCaptureFixture) -> None:
    """An old setting (the removed ``VLLM_LORA_EXT_PIN_SHARED``) or a foreign name left in a shell profile must not
    break every vLLM command: it is named in a warning, and the start goes on."""
    monkeypatch.setenv("VLLM_LORA_EXT_PIN_SHARED", "0")
    with caplog.at_level("WARNING", logger="vllm_lora_ext.constants"):
        check_settings()
    assert ("VLLM_LORA_EXT_PIN_SHARED is not a setting of vllm_lora_ext and has no effect; unset it"
            in caplog.text)


def test_the_cli_says_an_unknown_plugin_variable_on_a_warning_line(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The CLI printed the bare message, with no ``warning:`` as its other lines have (r43 newcomer); ``-q`` hides it."""
    from vllm_lora_ext.cli import main

    monkeypatch.setenv("VLLM_LORA_EXT_PIN_SHARED", "0")
    assert main(["cache", "ls", "--cache-dir", str(tmp_path)]) == 0
    assert "warning: VLLM_LORA_EXT_PIN_SHARED is not a setting of vllm_lora_ext" in capsys.readouterr().err
    assert main(["-q", "cache", "ls", "--cache-dir", str(tmp_path)]) == 0
    assert "PIN_SHARED" not in capsys.readouterr().err


def test_the_log_level_error_lists_warning_among_the_levels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_LOG_LEVEL", "verbose")
    with pytest.raises(SettingsError, match="give one of DEBUG, INFO, WARNING, ERROR, CRITICAL"):
        check_settings()


def test_good_settings_pass_and_flags_take_every_documented_spelling(monkeypatch: pytest.MonkeyPatch) -> None:
    for i, word in enumerate(["1", "true", "YES", "On", "0", "false", "no", "OFF"]):
        monkeypatch.setenv(["VLLM_LORA_EXT_PREBUILD", "VLLM_LORA_EXT_BUILD_PROCESS"][i % 2], word)
        check_settings()
    monkeypatch.setenv("VLLM_LORA_EXT_PREBUILD_BYTES", "4GiB")
    monkeypatch.setenv("VLLM_LORA_EXT_LOG_LEVEL", "debug")
    check_settings()


@pytest.mark.parametrize("kind", ["fifo", "folder", "missing"])
def test_a_config_setting_that_is_no_regular_file_is_refused_at_once(kind: str, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "deploy.yaml"
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    monkeypatch.setenv("VLLM_LORA_EXT_CONFIG", str(path))
    err = _in_time(check_settings)
    assert isinstance(err, SettingsError) and "VLLM_LORA_EXT_CONFIG" in str(err)
    err = _in_time(lambda: read_deployment_config(path))
    assert isinstance(err, DeploymentConfigError) and str(path) in str(err)


def test_reading_a_fifo_never_waits_for_a_writer(tmp_path: Path) -> None:
    fifo = tmp_path / "adapter_config.json"
    os.mkfifo(fifo)
    err = _in_time(lambda: read_capped(fifo, 1 << 20))
    assert isinstance(err, OSError) and "FIFO" in str(err)


@pytest.mark.parametrize("name", ["deploy.YAML", "deploy.Yml", "deploy.yaml"])
def test_a_yaml_suffix_in_any_case_is_parsed_as_yaml(name: str, tmp_path: Path) -> None:
    path = tmp_path / name
    path.write_text("adapters:\n  sql: {source: 'hf:acme/sql', weight: 0.5}\ndefault: sql\n")
    assert read_deployment_config(path).get("sql").weight == 0.5


# ------------------------------------------------------------------------------------------------ shared files


def _owner(folder: Path, *prefix: str) -> subprocess.Popen[str]:
    code = ("import sys; from vllm_lora_ext.transport.arena import SharedArena; a = SharedArena(4096, sys.argv[1]); "
            "print(a.path, flush=True); sys.stdin.read()")
    return subprocess.Popen([*prefix, sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, env=_env())


def test_a_live_owner_in_another_pid_namespace_keeps_its_shared_files(tmp_path: Path) -> None:
    """``docker --ipc=host``: a server whose pids mean nothing here shares /dev/shm with this one."""
    probe = subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True) if os.geteuid() == 0 else None
    if probe is None or probe.returncode != 0:
        pytest.skip("cannot make a PID namespace here (needs root and unshare)")
    folder = tmp_path / "shm"
    folder.mkdir()
    owner = _owner(folder, "unshare", "--pid", "--fork", "--kill-child")
    try:
        name = os.path.basename(owner.stdout.readline().strip())  # type: ignore[union-attr]
        assert name.startswith("vllm-lora-ext-1.")  # pid 1 in its namespace: no pid of this one
        for _ in range(3):
            assert sweep_stale(str(folder)) == []
        assert name in os.listdir(folder)
    finally:
        owner.stdin.close()  # type: ignore[union-attr]
        owner.wait(30)
    assert sweep_stale(str(folder)) == [name]  # gone for real: swept, lock file too
    assert os.listdir(folder) == []


def test_an_owner_killed_mid_hand_over_is_swept_and_a_live_one_is_kept(tmp_path: Path) -> None:
    folder = tmp_path / "shm"
    folder.mkdir()
    killed, live = _owner(folder), _owner(folder)
    names = [os.path.basename(p.stdout.readline().strip()) for p in (killed, live)]  # type: ignore[union-attr]
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    try:
        assert sweep_stale(str(folder)) == [names[0]]
        assert sorted(n for n in os.listdir(folder) if not n.endswith(".lock")) == [names[1]]
    finally:
        live.stdin.close()  # type: ignore[union-attr]
        live.wait(30)


def test_a_forked_child_that_inherits_the_lock_keeps_its_owner_alive(tmp_path: Path) -> None:
    folder = tmp_path / "shm"
    folder.mkdir()
    code = ("import os, sys, time; from vllm_lora_ext.transport.arena import SharedArena; a = SharedArena(4096, sys.argv[1]); "
            "print(a.path, flush=True)\n"
            "if os.fork() == 0:\n    sys.stdin.read(); os._exit(0)\n"
            "os._exit(0)")  # the owner exits at once; its child still holds the descriptor
    proc = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True, env=_env())
    name = os.path.basename(proc.stdout.readline().strip())  # type: ignore[union-attr]
    proc.wait(30)
    assert sweep_stale(str(folder)) == [] and name in os.listdir(folder)
    proc.stdin.close()  # type: ignore[union-attr]  # the child reads EOF and exits
    for _ in range(300):
        if sweep_stale(str(folder)) == [name]:
            break
        threading.Event().wait(0.05)
    assert os.listdir(folder) == []


def test_files_named_the_old_way_and_stray_names_are_never_swept(tmp_path: Path) -> None:
    folder = tmp_path / "shm"
    folder.mkdir()
    keep = ["vllm-lora-ext-999999-abc.bin", "vllm-lora-ext-1.dead-x.bin", "vllm-lora-ext-2.x.lock.new", "other.lock"]
    for name in keep:
        (folder / name).write_bytes(b"x")
    assert sweep_stale(str(folder)) == [] and sorted(os.listdir(folder)) == sorted(keep)


def test_an_owner_never_sweeps_its_own_files(tmp_path: Path) -> None:
    tag = claim_owner(str(tmp_path), "t-")
    (tmp_path / f"t-{tag}-x.bin").write_bytes(b"x")
    assert sweep_dead_owners(str(tmp_path), "t-", suffix=".bin") == []
    assert claim_owner(str(tmp_path), "t-") == tag  # one lock per process and folder


def test_a_sweep_of_a_missing_folder_removes_nothing(tmp_path: Path) -> None:
    assert sweep_stale(str(tmp_path / "nope")) == []


def test_folder_problem_names_missing_file_and_good_folders(tmp_path: Path) -> None:
    tmp_path = tmp_path / "probe"
    tmp_path.mkdir()
    (tmp_path / "f").write_text("x")
    assert folder_problem(str(tmp_path / "nope")) == "does not exist"
    assert folder_problem(str(tmp_path / "f")) == "is not a folder"
    assert folder_problem(str(tmp_path)) is None and sorted(os.listdir(tmp_path)) == ["f"]  # the probe is gone


# ------------------------------------------------------------------------------------------------ metrics folders


def _server(tmp: Path) -> subprocess.Popen[str]:
    code = "import sys; from vllm_lora_ext import metrics; print(metrics.setup(), flush=True); sys.stdin.read()"
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env=dict(_env(), TMPDIR=str(tmp)))


def test_a_sigkilled_servers_metrics_folder_is_removed_by_the_next_server_and_a_live_ones_kept(tmp_path: Path) -> None:
    tmp_path = tmp_path / "tmp"
    tmp_path.mkdir()
    killed, live = _server(tmp_path), _server(tmp_path)
    folders = [p.stdout.readline().strip() for p in (killed, live)]  # type: ignore[union-attr]
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    legacy = tmp_path / "vllm_lora_ext_metrics_oldstyle1"  # made by an older version: no lock, left alone
    legacy.mkdir()
    assert os.path.isdir(folders[0]) and os.path.isdir(folders[1])
    try:
        nxt = subprocess.run([sys.executable, "-c", "from vllm_lora_ext import metrics; print(metrics.setup())"],
                             env=dict(_env(), TMPDIR=str(tmp_path)), capture_output=True, text=True, timeout=120)
        assert nxt.returncode == 0, nxt.stderr[-2000:]
        assert not os.path.exists(folders[0]) and os.path.isdir(folders[1]) and legacy.is_dir()
    finally:
        live.stdin.close()  # type: ignore[union-attr]
        live.wait(60)
    assert sorted(os.listdir(tmp_path)) == [legacy.name]  # the live one removed its own folder and lock at exit


def test_without_room_for_a_metrics_folder_metrics_stay_in_memory_and_show(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from prometheus_client import REGISTRY, generate_latest

    metrics.teardown()
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv(ENV_METRICS_DIR, raising=False)
    (tmp_path / "not-a-folder").write_text("x")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "not-a-folder"))
    try:
        with caplog.at_level(logging.WARNING, logger="vllm_lora_ext.metrics"):
            assert metrics.setup() is None
            assert metrics.setup() is None  # idempotent: no second collector, no second warning
            for _ in range(3):
                metrics.MIXES_EVICTED.inc()
            metrics.MIXES_ACTIVE.set(2)
            metrics.ADAPTER_LOAD_SECONDS.observe(0.3, kind="mix")
        got = scrape(generate_latest(REGISTRY).decode())
        assert got[("vllm_lora_ext_mixes_evicted_total", ())] == 3 and got[("vllm_lora_ext_mixes_active", ())] == 2
        assert got[("vllm_lora_ext_adapter_load_seconds_count", (("kind", "mix"),))] == 1
        assert len([r for r in caplog.records if "in memory" in r.getMessage()]) == 1
        assert metrics.health()["degraded"] and ENV_METRICS_DIR not in os.environ
    finally:
        metrics.teardown()
    assert not any(k[0].startswith("vllm_lora_ext_mixes") for k in scrape(generate_latest(REGISTRY).decode()))


def test_a_metrics_file_that_cannot_be_made_degrades_to_memory_and_keeps_the_counts(fresh_metrics: str) -> None:
    from prometheus_client import REGISTRY, generate_latest

    metrics.MIXES_EVICTED.inc()  # the counter file exists and holds 1
    os.mkdir(os.path.join(fresh_metrics, f"gauge_sum_{os.getpid()}-vllm_lora_ext.db"))  # its name taken by a folder
    metrics.MIXES_ACTIVE.set(5)
    metrics.MIXES_EVICTED.inc()
    got = scrape(generate_latest(REGISTRY).decode())
    assert got[("vllm_lora_ext_mixes_evicted_total", ())] == 2  # file + memory, neither lost nor doubled
    assert got[("vllm_lora_ext_mixes_active", ())] == 5
    assert metrics.health()["degraded"] and metrics.health()["write_failures"] == 0


def test_an_empty_metrics_file_from_another_writer_never_breaks_a_scrape(fresh_metrics: str) -> None:
    from prometheus_client import REGISTRY, generate_latest

    Path(fresh_metrics, "counter_1-other.db").write_bytes(b"")
    metrics.MIXES_EVICTED.inc()
    assert scrape(generate_latest(REGISTRY).decode())[("vllm_lora_ext_mixes_evicted_total", ())] == 1


def test_metric_files_are_allocated_before_they_are_mapped(fresh_metrics: str) -> None:
    metrics.MIXES_EVICTED.inc()
    path = Path(fresh_metrics, f"counter_{os.getpid()}-vllm_lora_ext.db")
    st = path.stat()
    assert st.st_blocks * 512 >= st.st_size == 1 << 16  # every page has its block: no SIGBUS on a full disk
    assert not any(n.endswith(".new") for n in os.listdir(fresh_metrics))


_GROWTH_CHILD = """
import json, os, sys, tempfile
tempfile.tempdir = sys.argv[1]
from prometheus_client import REGISTRY, generate_latest
from vllm_lora_ext import metrics
metrics.setup()
metrics.ERRORS.inc(where="server", type="first")  # the file exists, 64 KiB allocated
fd = os.open(os.path.join(sys.argv[1], "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
try:
    while True:
        os.write(fd, bytes(4096))
except OSError:
    os.close(fd)
for i in range(1500):  # ~200 bytes a key: the file must grow past 64 KiB, and the disk is full
    metrics.ERRORS.inc(where="server", type=f"E{i}")
text = generate_latest(REGISTRY).decode()
print(json.dumps({"health": metrics.health(), "lines": text.count('vllm_lora_ext_errors_total{')}))
"""


def test_a_metrics_file_that_must_grow_on_a_full_disk_degrades_instead_of_dying(tmp_path: Path) -> None:
    with tiny_tmpfs("2m") as disk:
        done = subprocess.run([sys.executable, "-c", _GROWTH_CHILD, str(disk)], env=_env(), capture_output=True,
                              text=True, timeout=120)
        left = os.listdir(disk)
    assert done.returncode == 0, f"exit status {done.returncode} (negative: a signal)\n{done.stderr[-2000:]}"
    import json

    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "full" in result["health"]["degraded"] and result["lines"] == 1501  # none lost: file + memory
    assert done.stderr.count("in memory") == 1 and left == ["filler"]


_ARENA_CHILD = """
import json, os, sys
from vllm_lora_ext.transport.arena import SharedArena
disk = sys.argv[1]
out = {}
try:
    SharedArena(4 << 20, disk)  # twice what the disk holds: refused at once, not a SIGBUS at the first write past it
    out["big"] = "made"
except OSError as err:
    out["big"] = err.__class__.__name__
arena = SharedArena(1 << 20, disk)  # fits, but the folder is tight: every page taken now
fd = os.open(os.path.join(disk, "filler"), os.O_WRONLY | os.O_CREAT, 0o600)
try:
    while True:
        os.write(fd, bytes(4096))
except OSError:
    os.close(fd)
arena.buffer.fill_(7)  # the disk is full now; every page of the arena is still there
out["sum"] = int(arena.buffer[::4096].sum())
out["files"] = sorted(n for n in os.listdir(disk) if n.endswith(".bin"))
print(json.dumps(out))
"""


def test_a_shared_arena_in_a_nearly_full_folder_is_refused_or_fully_allocated_never_a_sigbus(tmp_path: Path) -> None:
    with tiny_tmpfs("2m") as disk:
        done = subprocess.run([sys.executable, "-c", _ARENA_CHILD, str(disk)], env=_env(), capture_output=True,
                              text=True, timeout=120)
    assert done.returncode == 0, f"exit status {done.returncode} (negative: a signal)\n{done.stderr[-2000:]}"
    import json

    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["big"] == "OSError" and result["sum"] == 7 * 256
    assert len(result["files"]) == 1  # only the arena that was made: the refused one left no file
