"""Review findings on the redesign's merge (issue 38): each failed on the merged tree and passes since its fix.

Typed errors across processes: a record is read back from text (`errors.error_from_text`) more than once on the
way to the client, and also from text that carries no record of the plugin's.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from factories import make_peft_adapter, tiny_llama
from vllm_lora_ext.constants import PREBUILD_PREFIX
from vllm_lora_ext.errors import RECORD_MARK
from vllm_lora_ext.integration import plugin, server

pytestmark = pytest.mark.vllm

_FAKE_404 = '{"type":"AdapterNotFoundError","message":"spoofed","args":["spoofed"],"fields":{"source":"x"}}'


def _request(path: Path | str, name: str) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=7, lora_path=str(path))


class _TextOnlyEngine:
    """vLLM's engine core client over a real worker manager: a failed ``add_lora`` reaches the server as text."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager

    async def add_lora(self, req: Any) -> bool:
        from vllm.lora.worker_manager import WorkerLoRAManager

        assert req.lora_path.startswith(PREBUILD_PREFIX)
        try:
            return bool(await asyncio.to_thread(WorkerLoRAManager.add_adapter, self.manager, req))
        except Exception as err:
            raise Exception(f"Call to add_lora method failed: {err}") from None


def test_a_record_in_an_adapter_name_does_not_retype_a_failed_build(worker_manager: Any, tmp_path: Path) -> None:
    """The worker's record is read once in ``server._probe``; ``build_failure`` reads the rebuilt error's message
    again, where the client's name holds a record unescaped: the rank refusal (400) answers 404 'spoofed'."""
    plugin.register()
    server.reset_registry()
    big = make_peft_adapter(tiny_llama(), tmp_path / "big", targets=["q_proj"], rank=32, alpha=32)  # max rank 16
    name = f"x{RECORD_MARK}{_FAKE_404}]"
    with pytest.raises(Exception) as caught:
        asyncio.run(server.ensure_built(_TextOnlyEngine(worker_manager), _request(big, name)))
    answer = server.http_error(server.build_failure(caught.value, name=name, source=str(big)))
    assert answer.error.code == 400 and "max_lora_rank" in answer.error.message, answer.error


class _WorkerWithoutPlugin:
    """A worker where the plugin is not active: vLLM's own not-found error, whose text holds the client's name."""

    async def add_lora(self, req: Any) -> bool:
        from vllm.exceptions import LoRAAdapterNotFoundError

        raise Exception(f"Call to add_lora method failed: {LoRAAdapterNotFoundError(req.lora_name, '/nowhere')}")


def test_a_record_in_a_name_cannot_raise_a_non_exception_in_the_server() -> None:
    """Text with no record of the worker's is searched for one too, and ``rebuild_error`` rebuilds any builtin
    BaseException: a client's name makes the server's build wait raise SystemExit (it passes every
    ``except Exception``, and in the event loop's task it stops the loop)."""
    server.reset_registry()
    record = '{"type":"builtins.SystemExit","message":"bye","args":["bye"],"fields":{}}'
    name = f"x{RECORD_MARK}{record}]"
    raised: BaseException | None = None
    try:
        asyncio.run(server.ensure_built(_WorkerWithoutPlugin(), _request("/nowhere", name)))
    except BaseException as err:  # noqa: BLE001 - the point is which kind arrives
        raised = err
    assert isinstance(raised, Exception), f"{type(raised).__name__} reached the server's caller"
    answer = server.http_error(server.build_failure(raised, name=name, source="/nowhere"))
    # A worker without the plugin sends no record of its own, so a client's forged one is read for its own failed
    # load: it chooses between the 4xx answers of that load only, never a non-Exception or a 5xx.
    assert answer.error.code in (400, 404)
