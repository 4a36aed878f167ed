"""The path of one new-mix request through the package: how many of its modules it crosses, and no callbacks.

A mix not built before, of components an earlier mix loaded (so cached), is loaded through vLLM's real
``WorkerLoRAManager._load_adapter`` with the plugin registered, on the CPU, while every Python call is traced
(``sys.setprofile``, and ``threading.setprofile`` for threads started meanwhile). Reading a component from disk
is the read path's own (resolve, read, plan, check), not the mix's, and is left out.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from factories import make_peft_adapter, tiny_llama
from vllm_lora_ext.mixing import MixComponent, MixSpec

pytestmark = pytest.mark.vllm

PACKAGE = "vllm_lora_ext"
INTEGRATION = "vllm_lora_ext.integration"
# The distinct package modules one new-mix request crosses (issue 38's goal: at most 12). Copied into new tensors:
# 11. Into a host arena, what a mix of real size (4 MiB and up) gets: transport.arena too, 12.
MAX_MODULES = {False: 11, True: 12}


@contextmanager
def package_calls() -> Iterator[set[tuple[str, str]]]:
    """Collect ``(caller module, callee module)`` for every call into a package module while the block runs."""
    seen: set[tuple[str, str]] = set()

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event != "call":
            return
        callee = frame.f_globals.get("__name__", "")
        if callee.startswith(PACKAGE):
            caller = frame.f_back.f_globals.get("__name__", "") if frame.f_back is not None else ""
            seen.add((caller, callee))

    hook: Callable[..., Any] = profile
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        yield seen
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


@pytest.mark.parametrize("host_arena", [False, True], ids=["new tensors", "host arena"])
def test_a_new_mix_crosses_few_modules_and_the_core_never_calls_back_into_integration(
        worker_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, host_arena: bool) -> None:
    import vllm.lora.worker_manager as wm
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.composite import clear_component_cache

    a = make_peft_adapter(tiny_llama(), tmp_path / "a", targets=["q_proj", "o_proj"], rank=4, alpha=8, seed=1)
    b = make_peft_adapter(tiny_llama(), tmp_path / "b", targets=["q_proj", "v_proj"], rank=8, alpha=8, seed=2)
    plugin.register()

    def request(wa: float, wb: float, lora_id: int) -> Any:
        spec = MixSpec((MixComponent("a", str(a), wa), MixComponent("b", str(b), wb)))
        return LoRARequest(lora_name=spec.lora_name, lora_int_id=lora_id, lora_path=spec.lora_path)

    from vllm_lora_ext.constants import ENV_HOST_ARENA_MIN
    from vllm_lora_ext.transport.arena import clear_spare

    # A mix of real size (4 MiB and up, the default) is copied into a host arena, these tiny ones only when asked.
    monkeypatch.setenv(ENV_HOST_ARENA_MIN, "0" if host_arena else str(1 << 40))
    clear_component_cache()
    clear_spare()
    try:
        wm.WorkerLoRAManager._load_adapter(worker_manager, request(0.7, 0.3, 1 << 30))  # loads a and b
        with package_calls() as calls:
            wm.WorkerLoRAManager._load_adapter(worker_manager, request(0.5, -0.5, (1 << 30) + 1))
    finally:
        clear_component_cache()
    modules = {callee for _, callee in calls}
    callbacks = sorted((caller, callee) for caller, callee in calls
                       if caller.startswith(PACKAGE) and not caller.startswith(INTEGRATION)
                       and callee.startswith(INTEGRATION))
    assert callbacks == []
    assert len(modules) <= MAX_MODULES[host_arena], " ".join(sorted(modules))
