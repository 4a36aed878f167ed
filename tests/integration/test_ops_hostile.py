"""Operations faults on real vLLM objects: bad settings at register, a bad build folder, over-long path components.

Each case asserts the error (or the degraded but working behaviour) and that nothing leaked: no build
process started, no file left, the plugin not half-registered.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import threading
import uuid
from pathlib import Path
from typing import Any

import pytest

from factories import make_dense_adapter, make_peft_adapter, tiny_llama
from vllm_lora_ext.errors import SettingsError
from vllm_lora_ext.integration import build_process, plugin, server
from vllm_lora_ext.integration.prebuild import probe_for

pytestmark = pytest.mark.vllm


# ------------------------------------------------------------------------------------------------ settings at register


@pytest.mark.parametrize(("name", "value", "fragment"), [
    ("VLLM_LORA_EXT_BUILD_SPARE_BYTES", "2 bananas", "2GiB"),
    ("VLLM_LORA_EXT_PREBUILD_BYTES", "-5", "not a size"),
    ("VLLM_LORA_EXT_PREBUILD", "maybe", "not a switch"),
    ("VLLM_LORA_EXT_MIX_WAIT_S", "soon", "not a number"),
    ("VLLM_LORA_EXT_LOG_LEVEL", "LOUD", "not a log level"),
])
def test_register_refuses_a_bad_setting_by_name_and_installs_nothing(name: str, value: str, fragment: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    plugin.unregister()
    monkeypatch.setenv(name, value)
    with pytest.raises(SettingsError, match=name) as caught:
        plugin.register()
    assert fragment in str(caught.value)
    assert not plugin.is_registered()
    monkeypatch.delenv(name)
    plugin.register()  # fixed: it installs
    assert plugin.is_registered()


def test_register_takes_sizes_with_units(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.constants import build_spare_bytes, host_spare_bytes

    plugin.unregister()
    monkeypatch.setenv("VLLM_LORA_EXT_BUILD_SPARE_BYTES", "2GB")  # the value that crash-looped the build process
    monkeypatch.setenv("VLLM_LORA_EXT_HOST_SPARE_BYTES", "512MiB")
    plugin.register()
    assert plugin.is_registered() and build_spare_bytes() == 2 * 10**9 and host_spare_bytes() == 512 * 2**20


def test_a_fifo_as_the_deployment_config_is_refused_at_register_without_waiting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fifo = tmp_path / "deploy.json"
    os.mkfifo(fifo)
    monkeypatch.setenv("VLLM_LORA_EXT_CONFIG", str(fifo))
    plugin.unregister()
    outcome: list[BaseException | None] = []
    worker = threading.Thread(target=lambda: outcome.append(_raised(plugin.register)), daemon=True)
    worker.start()
    worker.join(30)
    assert outcome, "register() hung on a FIFO"
    assert isinstance(outcome[0], SettingsError) and "FIFO" in str(outcome[0]) and "VLLM_LORA_EXT_CONFIG" in str(outcome[0])


def _raised(fn: Any) -> BaseException | None:
    try:
        fn()
    except BaseException as err:
        return err
    return None


# ------------------------------------------------------------------------------------------------ the build folder


def _probe_until_built(manager: Any, req: Any) -> None:
    from vllm.lora.worker_manager import WorkerLoRAManager

    for _ in range(5000):
        if WorkerLoRAManager.add_adapter(manager, probe_for(req)):
            return
        threading.Event().wait(0.002)
    raise AssertionError("the background build never finished")


def _bad_build_dir(kind: str, tmp_path: Path) -> tuple[str, str]:
    """A build folder of ``kind`` and the words the warning gives for it."""
    if kind == "missing":
        return str(tmp_path / "no-such-folder"), "does not exist"
    if kind == "file":
        (tmp_path / "a-file").write_text("x")
        return str(tmp_path / "a-file"), "is not a folder"
    folder = Path("/dev/shm") / f"vllm-lora-ext-test-ro-{uuid.uuid4().hex[:8]}"
    folder.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        folder.rmdir()
        pytest.skip("cannot mount a read-only tmpfs here")
    return str(folder), "cannot be written"


@pytest.mark.parametrize("kind", ["missing", "file", "read-only"])
def test_a_bad_build_dir_makes_background_builds_run_in_the_worker_with_one_warning(
        kind: str, worker_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager

    folder, words = _bad_build_dir(kind, tmp_path)
    try:
        monkeypatch.setenv("VLLM_LORA_EXT_BUILD_DIR", folder)
        build_process.shutdown()
        plugin.register()
        adapters = [make_peft_adapter(tiny_llama(), tmp_path / f"a{i}", targets=["q_proj"], rank=4, alpha=8, seed=i)
                    for i in (1, 2)]
        with caplog.at_level(logging.WARNING, logger="vllm_lora_ext.integration.build_process"):
            for i, adapter in enumerate(adapters):
                req = LoRARequest(f"a{i}", 20 + i, str(adapter))
                _probe_until_built(worker_manager, req)
                assert WorkerLoRAManager._load_adapter(worker_manager, req).id == 20 + i
        warnings = [r.getMessage() for r in caplog.records if "VLLM_LORA_EXT_BUILD_DIR" in r.getMessage()]
        assert len(warnings) == 1 and words in warnings[0] and "in the worker" in warnings[0]
        assert build_process._POOL._child is None  # no build process was started for a folder it cannot use
        if kind == "missing":
            assert not os.path.exists(folder)  # nothing made it
    finally:
        if kind == "read-only":
            subprocess.run(["umount", folder], check=False)
            os.rmdir(folder)


def test_a_good_build_dir_still_uses_the_build_process(build_dir: Path) -> None:
    assert build_process.build_dir_usable()
    assert [n for n in os.listdir(build_dir) if not n.endswith(".lock")] == []  # the probe file is gone


# ------------------------------------------------------------------------------------------------ long path components


def _load_request(name: str, path: str) -> Any:
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    return LoadLoRAAdapterRequest(lora_name=name, lora_path=path)


def _pre(path: str) -> Any:
    return asyncio.run(server.pre_resolve(_load_request("x", path)))


@pytest.mark.parametrize("source", [
    "/models/" + "a" * 300 + "/adapter",
    "/models/" + "a" * 300,
    "/models/" + "é" * 128,  # 128 characters, 256 bytes
    "hf:acme/loras:" + "b" * 300 + "/x.safetensors",
    "hf:acme/loras:" + "c" * 256,
])
def test_a_path_component_over_255_bytes_is_a_400_naming_it_and_the_limit(source: str) -> None:
    err = _pre(source)
    assert getattr(err, "error", None) is not None, err
    assert err.error.code == 400, err.error
    assert "path component" in err.error.message and "255 bytes" in err.error.message


def test_a_255_byte_component_is_looked_up_and_answered_404(tmp_path: Path) -> None:
    err = _pre(str(tmp_path / ("d" * 255)))
    assert err.error.code == 404 and "does not exist" in err.error.message


def test_the_server_keeps_loading_after_long_path_refusals(tmp_path: Path) -> None:
    good = make_dense_adapter(tmp_path / "good")
    for _ in range(3):
        assert _pre(str(tmp_path / ("z" * 400))).error.code == 400
    assert _pre(str(good)).lora_path == str(good)


def test_a_build_process_started_with_a_bad_spare_setting_builds_without_a_spare_instead_of_dying(
        tmp_path: Path, build_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused at register; a build process that still sees such a value (its worker's environment changed) lives."""
    from moe_factories import BUILD_E, BUILD_H, BUILD_I, BUILD_R, make_truth, moe_build_job, write_moe_adapter
    from vllm_lora_ext.integration.loader import VllmKeyRouter

    build_process.shutdown()
    monkeypatch.setenv("VLLM_LORA_EXT_BUILD_SPARE_BYTES", "2 bananas")
    folder = write_moe_adapter(tmp_path / "moe", [make_truth(BUILD_E, BUILD_H, BUILD_I, BUILD_R, s) for s in (0, 1)],
                               ["2d", "2d"], rank=BUILD_R)
    try:
        for _ in range(2):  # the same process answers both: it did not crash-loop
            built, _mapping = build_process.build_elsewhere(moe_build_job(folder, wrapper="2d"), VllmKeyRouter(None, None))
            assert built.moe
        child = build_process._POOL.get()
        assert child.alive and child.proc.returncode is None
        assert not any("-spare-" in n for n in os.listdir(build_dir))  # no spare file made from the bad value
    finally:
        build_process.shutdown()


def test_a_build_dir_removed_while_serving_makes_builds_run_in_the_worker_with_one_warning(
        tmp_path: Path, build_dir: Path, worker_manager: Any, caplog: pytest.LogCaptureFixture) -> None:
    import shutil

    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.loader import load_lora_model

    build_process.shutdown()
    build_process._HAND_OVER_WARNED.clear()
    adapters = [make_peft_adapter(tiny_llama(), tmp_path / f"a{i}", targets=["q_proj"], rank=4, alpha=8, seed=i)
                for i in range(3)]
    try:
        build_process.prestart()
        build_process._POOL.get()  # started, with its spare in the folder
        for _ in range(100):  # an operator's cleanup, a tmpfs unmounted (the process may be renaming a file in it
            shutil.rmtree(build_dir, ignore_errors=True)  # meanwhile: remove until nothing is left)
            if not build_dir.exists():
                break
        with caplog.at_level(logging.WARNING, logger="vllm_lora_ext.integration.build_process"):
            for i, adapter in enumerate(adapters):
                lora = load_lora_model(worker_manager, LoRARequest(f"a{i}", 30 + i, str(adapter)), separate_process=True)
                assert lora.loras and lora.id == 30 + i
        warnings = [r.getMessage() for r in caplog.records if "could not hand it over" in r.getMessage()]
        assert len(warnings) == 1 and "VLLM_LORA_EXT_BUILD_DIR" in warnings[0]
        assert build_process._POOL.get().alive  # the build process lives on
        assert not build_dir.exists()  # nothing re-made the folder
    finally:
        build_process.shutdown()
