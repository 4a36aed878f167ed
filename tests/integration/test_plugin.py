"""register(): the entry point, idempotence, the version gate, the patches it installs."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import entry_points

import pytest

from vllm_lora_ext.errors import UnsupportedVLLMError
from vllm_lora_ext.integration._compat import check_vllm_version

pytestmark = pytest.mark.vllm


def _python(code: str, *, timeout: int = 300) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (plugin state is per process)."""
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout)


def test_entry_point_is_listed_in_vllm_general_plugins() -> None:
    eps = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert eps["vllm_lora_ext"] == "vllm_lora_ext.integration.plugin:register"


def test_register_twice_installs_one_patch() -> None:
    from vllm_lora_ext.integration import plugin

    plugin.register()
    plugin.register()
    import vllm.lora.worker_manager as wm

    patched = wm.WorkerLoRAManager._load_adapter
    assert getattr(patched, plugin.PATCH_MARK)
    assert not getattr(patched.__wrapped__, plugin.PATCH_MARK, False)  # wrapped once, not twice
    from vllm_lora_ext.integration.patching import apply_patch

    apply_patch(wm, plugin.PATCHES[0])
    assert wm.WorkerLoRAManager._load_adapter is patched


def test_load_general_plugins_installs_the_hooks_lazily_in_a_fresh_process() -> None:
    code = """
import sys
from vllm.plugins import load_general_plugins
load_general_plugins()
load_general_plugins()
heavy = 'vllm.lora.worker_manager' in sys.modules
import vllm.lora.worker_manager as wm
import vllm.v1.engine.llm_engine as le
from vllm_lora_ext.integration.plugin import PATCH_MARK, is_registered
print(heavy, is_registered(), getattr(wm.WorkerLoRAManager._load_adapter, PATCH_MARK, False),
      getattr(le.LLMEngine.add_request, PATCH_MARK, False))
"""
    out = _python(code, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-4:] == ["False", "True", "vllm.lora.worker_manager.WorkerLoRAManager._load_adapter",
                                       "vllm.v1.engine.llm_engine.LLMEngine.add_request"]
    assert "vllm_lora_ext 0.1.0 active in process" in out.stderr


def test_vllms_check_of_vllm_variables_keeps_quiet_on_the_plugins_settings_and_a_typo_stops_the_start() -> None:
    """vLLM warns of every VLLM_* variable it does not know ("Unknown vLLM environment variable detected"), so each
    of the plugin's settings used to draw a warning in every process, a valid one as much as a typo. With the plugin
    registered, vLLM's own check (0.26-0.30 ``envs.validate_environ``, 0.31-0.33 the platform's) stays quiet on the
    settings and still warns of its other unknown names; a ``VLLM_LORA_EXT_*`` name that is no setting stops
    ``register()``, naming the setting it is closest to."""
    code = """
import logging, os
os.environ.update(VLLM_LORA_EXT_PREBUILD="1", VLLM_NOT_A_REAL_VLLM_SETTING="1")
from vllm_lora_ext.integration import plugin
plugin.register()
import vllm.envs as envs
class Said(logging.Handler):  # what reaches a handler of vLLM's checking loggers, whatever vLLM's own logging set-up
    def emit(self, record):
        print("SAID", record.getMessage())
for name in ("vllm.envs", "vllm.platforms.interface"):
    logging.getLogger(name).addHandler(Said())
check = getattr(envs, "validate_environ", None)
if check is None:
    from vllm.platforms import current_platform
    check = current_platform.validate_environ
check(False)
os.environ["VLLM_LORA_EXT_ALLOWED_ROOT"] = "/srv"
plugin.unregister()
try:
    plugin.register()
except Exception as err:
    print("REFUSED", type(err).__name__, err)
"""
    out = _python(code, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "SAID Unknown vLLM environment variable detected: VLLM_NOT_A_REAL_VLLM_SETTING" in out.stdout
    assert "Unknown vLLM environment variable detected: VLLM_LORA_EXT" not in out.stdout + out.stderr
    assert ("REFUSED SettingsError Bad settings: VLLM_LORA_EXT_ALLOWED_ROOT is not a setting of vllm_lora_ext; "
            "did you mean VLLM_LORA_EXT_ALLOWED_ROOTS?") in out.stdout


def test_plugin_disabled_by_env_stays_inert() -> None:
    code = ("import os; os.environ['VLLM_LORA_EXT_DISABLE']='1'\n"
            "from vllm_lora_ext.integration import plugin; plugin.register()\n"
            "import vllm.lora.worker_manager as wm\n"
            "print(getattr(wm.WorkerLoRAManager._load_adapter, plugin.PATCH_MARK, False))")
    out = _python(code, timeout=300)
    assert out.stdout.split()[-1] == "False" and "disabled" in out.stderr


@pytest.mark.parametrize("version", ["0.26.0", "0.26.3", "0.26.0+cu130", "0.26.1.dev4+g1234", "0.27.1", "0.30.0",
                                     "0.33.0", "0.33.2+cu130"])
def test_version_gate_accepts_the_supported_range(version: str) -> None:
    assert check_vllm_version(version) == version


@pytest.mark.parametrize("version", ["0.25.2", "0.34.0", "0.34.0.dev1", "1.0.0"])
def test_version_gate_refuses_other_versions_naming_both(version: str) -> None:
    with pytest.raises(UnsupportedVLLMError) as e:
        check_vllm_version(version)
    msg = str(e.value)
    assert version in msg and ">=0.26.0,<0.34.0" in msg and "VLLM_LORA_EXT_ALLOW_UNSUPPORTED_VLLM=1" in msg


def test_version_gate_can_be_overridden(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOW_UNSUPPORTED_VLLM", "1")
    assert check_vllm_version("0.33.0") == "0.33.0"


def test_unsupported_vllm_stops_register_in_a_fresh_process() -> None:
    code = ("import vllm_lora_ext.integration._compat as c\n"
            "c.installed_vllm_version = lambda: '0.25.0'\n"
            "from vllm_lora_ext.integration import plugin\n"
            "plugin.register()")
    out = _python(code, timeout=120)
    assert out.returncode != 0 and "UnsupportedVLLMError" in out.stderr and "0.25.0" in out.stderr


@pytest.mark.parametrize("debug", [False, True])
def test_a_bad_setting_that_ends_the_program_is_printed_without_vllms_frames(debug: bool) -> None:
    """``vllm serve`` loads plugins while it builds its argument parser, so a bad setting's message came last under
    15 lines of vLLM's frames. Uncaught, it is now its message alone and exit status 1 (the traceback with
    ``VLLM_LORA_EXT_LOG_LEVEL=DEBUG``); caught, it is the exception as raised; another uncaught error keeps its
    traceback."""
    level = "'DEBUG'" if debug else "'INFO'"
    code = ("import os\n"
            f"os.environ.update(VLLM_LORA_EXT_MAX_MIXES='abc', VLLM_LORA_EXT_LOG_LEVEL={level})\n"
            "from vllm.plugins import load_general_plugins\n"
            "try:\n"
            "    load_general_plugins()\n"
            "except Exception as err:\n"
            "    print('CAUGHT', type(err).__name__)\n"
            "import vllm.plugins as p; p.plugins_loaded = False\n"
            "load_general_plugins()")
    out = _python(code, timeout=300)
    said = "VLLM_LORA_EXT_MAX_MIXES='abc' is not a number; unset it or give a number >= 1."
    assert out.returncode == 1 and "CAUGHT SettingsError" in out.stdout and said in out.stderr
    if debug:
        assert "Traceback (most recent call last)" in out.stderr
    else:
        assert "Traceback" not in out.stderr, out.stderr[-3000:]
        assert f"vllm_lora_ext: SettingsError: Bad settings: {said}" in out.stderr
        assert "VLLM_LORA_EXT_LOG_LEVEL=DEBUG" in out.stderr
    other = _python("import os\nos.environ['VLLM_LORA_EXT_MAX_MIXES'] = 'abc'\n"  # the hook installed, then
                    "from vllm_lora_ext.integration import plugin\n"  # another error ends the program
                    "try:\n    plugin.register()\nexcept Exception:\n    pass\nraise KeyError('x')")
    assert other.returncode == 1 and "Traceback" in other.stderr and "KeyError: 'x'" in other.stderr
    assert "vllm_lora_ext: SettingsError" not in other.stderr


def test_core_imports_without_vllm() -> None:
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import vllm_lora_ext, vllm_lora_ext.cli, vllm_lora_ext.sources, vllm_lora_ext.summary\n"
            "print(sorted(m for m in sys.modules if m.startswith('vllm') and sys.modules[m] is not None "
            "and not m.startswith('vllm_lora_ext')))")
    out = _python(code, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_patch_table_in_patches_md_matches_the_patches_applied() -> None:
    import re
    from pathlib import Path

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.patching import applied

    plugin.register()
    import vllm.entrypoints.anthropic.serving  # noqa: F401
    import vllm.entrypoints.generate.base.serving  # noqa: F401
    import vllm.entrypoints.generate.beam_search.online  # noqa: F401
    import vllm.entrypoints.scale_out.token_in_token_out.serving  # noqa: F401
    import importlib.util

    cohere = importlib.util.find_spec("cohere") is not None and importlib.util.find_spec("vllm.entrypoints.cohere")
    if cohere:  # (0.33 with the optional cohere SDK)
        import vllm.entrypoints.cohere.serving  # noqa: F401
    import vllm.lora.layers.base_linear  # noqa: F401
    import vllm.entrypoints.openai.chat_completion.batch_serving  # noqa: F401
    import vllm.entrypoints.openai.models.serving  # noqa: F401
    import vllm.entrypoints.serve.engine.serving  # noqa: F401
    import vllm.entrypoints.pooling.base.serving  # noqa: F401
    import vllm.lora.layers.fused_moe  # noqa: F401
    import vllm.lora.punica_wrapper.punica_gpu  # noqa: F401
    import vllm.lora.ops.triton_ops.lora_expand_op  # noqa: F401
    import vllm.lora.ops.triton_ops.lora_shrink_op  # noqa: F401
    import vllm.lora.worker_manager  # noqa: F401
    import vllm.v1.engine.async_llm  # noqa: F401
    import vllm.v1.engine.llm_engine  # noqa: F401
    import vllm.v1.worker.gpu_worker  # noqa: F401
    import vllm.model_executor.layers.fused_moe.experts.triton_moe  # noqa: F401

    table = (Path(plugin.__file__).parent / "PATCHES.md").read_text()
    documented = re.findall(r"^\| \d+ \| `([^`]+)` \|", table, re.M)
    assert documented == [p.name for p in plugin.PATCHES]
    assert sorted(applied()) == sorted(n for n in documented if cohere or not n.startswith("vllm.entrypoints.cohere."))
    from vllm_lora_ext._util import generated_part
    from vllm_lora_ext.integration.patch_table import PART, render_patch_table

    assert generated_part(table, PART) == render_patch_table(plugin.PATCHES), \
        "PATCHES.md differs from plugin.PATCHES: run `python -m vllm_lora_ext.integration.patch_table`"


def test_unregister_restores_every_original_and_register_applies_them_again() -> None:
    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.patching import PATCH_MARK, applied

    plugin.register()
    import vllm.lora.worker_manager as wm

    patched = wm.WorkerLoRAManager._load_adapter
    original = patched.__wrapped__
    plugin.unregister()
    try:
        assert wm.WorkerLoRAManager._load_adapter is original and not applied()
        assert not getattr(wm.WorkerLoRAManager.add_adapter, PATCH_MARK, False)
    finally:
        plugin.register()
    assert getattr(wm.WorkerLoRAManager._load_adapter, PATCH_MARK, False)


def test_a_patch_whose_target_changed_signature_is_refused_naming_it() -> None:
    import types

    from vllm_lora_ext.errors import UnsupportedVLLMError
    from vllm_lora_ext.integration.patching import Patch, apply_patch

    class WorkerLoRAManager:
        def _load_adapter(self, request, extra):  # renamed parameter
            return None

    module = types.ModuleType("fake")
    module.WorkerLoRAManager = WorkerLoRAManager
    patch = Patch("fake", "WorkerLoRAManager._load_adapter", ("lora_request",), lambda o: o, why="", delete_when="")
    with pytest.raises(UnsupportedVLLMError, match="without \\['lora_request'\\]"):
        apply_patch(module, patch)
    missing = Patch("fake", "WorkerLoRAManager.gone", (), lambda o: o, why="", delete_when="")
    with pytest.raises(UnsupportedVLLMError, match="does not exist in this vLLM"):
        apply_patch(module, missing)


def test_a_patch_reading_a_private_attribute_its_class_lacks_is_refused_naming_it() -> None:
    import types

    from vllm_lora_ext.integration.patching import Patch, apply_patch, undo

    class Manager:
        table = None  # a class attribute

        def __init__(self) -> None:
            self._adapter_manager = None  # an attribute only instances have

        def add(self, request):
            return request

    module = types.ModuleType("fake")
    module.Manager = Manager
    gone = Patch("fake", "Manager.add", ("request",), lambda o: o, why="", delete_when="", reads=("_renamed",))
    with pytest.raises(UnsupportedVLLMError, match="reads \\['_renamed'\\], which Manager neither defines nor sets"):
        apply_patch(module, gone)
    assert Manager.add.__name__ == "add"  # nothing was patched
    found = Patch("fake", "Manager.add", ("request",), lambda o: o, why="", delete_when="",
                  reads=("table", "_adapter_manager"))
    try:
        apply_patch(module, found)
        assert Manager().add(3) == 3
    finally:
        undo(found.name)
    assert Manager.add.__name__ == "add"


def test_a_dotted_read_is_checked_on_the_first_call_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    import logging
    import types

    from vllm_lora_ext.integration.patching import Patch, apply_patch, missing_reads, undo

    class Manager:
        def __init__(self, inner: object) -> None:
            self._adapter_manager = inner

        def add(self, request):
            return request

    module = types.ModuleType("fake")
    module.Manager = Manager
    patch = Patch("fake", "Manager.add", ("request",), lambda o: o, why="", delete_when="",
                  reads=("_adapter_manager", "_adapter_manager._registered"))
    assert missing_reads(Manager(types.SimpleNamespace(_registered={})), patch) == []
    assert missing_reads(Manager(object()), patch) == ["_adapter_manager._registered"]
    try:
        apply_patch(module, patch)
        with caplog.at_level(logging.ERROR, logger="vllm_lora_ext.integration.patching"):
            assert Manager(object()).add(1) == 1 and Manager(object()).add(2) == 2
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "fake.Manager.add reads ['_adapter_manager._registered']" in errors[0]
    finally:
        undo(patch.name)


def test_each_dotted_read_is_an_attribute_of_the_class_vllm_puts_there() -> None:
    # What register() cannot check (the objects exist only at run time), checked here on the classes vLLM uses.
    from vllm.lora.model_manager import LRUCacheLoRAModelManager
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.patching import class_has

    holders = {"_adapter_manager": LRUCacheLoRAModelManager, "model_runner": GPUModelRunner}
    dotted = [(p.name, path) for p in plugin.PATCHES for path in p.reads if "." in path]
    assert dotted and {path.split(".")[0] for _, path in dotted} == set(holders)
    for name, path in dotted:
        first, _, rest = path.partition(".")
        assert "." not in rest and class_has(holders[first], rest), (name, path)


def test_a_patch_names_one_of_the_three_processes() -> None:
    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.patching import Patch

    assert {p.process for p in plugin.PATCHES} == {"server", "engine", "worker"}
    with pytest.raises(ValueError, match="process 'gpu'"):
        Patch("fake", "f", (), lambda o: o, why="", delete_when="", process="gpu")  # type: ignore[arg-type]


def test_every_post_load_check_of_vllms_own_loader_runs_in_the_plugins_loader_too() -> None:
    # vLLM adds checks to its _load_adapter between releases (0.32: modules_to_save, token classification;
    # 0.33: classification heads); the plugin's loader replaces it, so it must run each of them.
    import inspect
    import re

    from vllm.lora.worker_manager import WorkerLoRAManager

    from vllm_lora_ext.integration._compat import POST_LOAD_VALIDATORS

    original = inspect.unwrap(WorkerLoRAManager._load_adapter)
    called = set(re.findall(r"_adapter_manager\.(_validate_\w+)", inspect.getsource(original)))
    assert called <= set(POST_LOAD_VALIDATORS), called - set(POST_LOAD_VALIDATORS)


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:0", object(), "not a device"])
def test_binding_a_helper_thread_to_no_gpu_is_a_no_op(device: object) -> None:
    # load_lora_model binds every thread it runs on to the manager's GPU; a CPU manager, a device without an index,
    # a GPU this process has not used (CUDA not initialized here) or something that is no device at all must leave
    # the thread as it is, never raise
    from vllm_lora_ext.transport.cuda import bind_worker_gpu

    assert bind_worker_gpu(device) is False


@pytest.mark.parametrize("device", [None, "cpu", "cuda", "cuda:0", object(), "not a device"])
def test_a_worker_whose_gpu_is_not_in_use_transposes_3d_factors_on_the_cpu(device: object,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    # a build in the worker is handed the GPU to turn fused 3D factors on only where the manager's device is a CUDA
    # device this process uses; anything else builds as before, and so does a worker with the switch off
    import types

    import torch

    from vllm_lora_ext.constants import ENV_TRANSPOSE_ON_GPU
    from vllm_lora_ext.integration.loader import _gpu_of

    manager = types.SimpleNamespace(device=device)
    assert _gpu_of(manager) is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)  # as in a worker that has used its GPU
    want = torch.device("cuda", 0) if device == "cuda:0" else torch.device("cuda") if device == "cuda" else None
    assert _gpu_of(manager) == want
    monkeypatch.setenv(ENV_TRANSPOSE_ON_GPU, "0")
    assert _gpu_of(manager) is None
