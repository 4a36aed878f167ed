"""A server-side failure while an adapter or mix is built is an internal error (500), not a 400: a dead engine
(vLLM's ``EngineDeadError``), a CUDA out-of-memory in the worker (a ``RemoteError``) and a killed build process
(``BuildProcessError``). Before r42 each became a 400 "could not be loaded", which clients and load balancers do
not retry, and which told a client naming the operator's own adapter that its request was wrong. Found by an
attacker helper in r42; the load route's case is in ``test_hostile_names.py``.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from factories import make_dense_adapter
from lease_harness import fresh  # noqa: F401
from lease_harness import complete, harness, mix, status
from vllm_lora_ext.errors import BuildProcessError, RemoteError, with_record

pytestmark = pytest.mark.vllm
FAILED = "Call to add_lora method failed: "  # vLLM's text for a failed engine utility call


def _fault(kind: str) -> Exception:
    from vllm.v1.engine.exceptions import EngineDeadError

    if kind == "engine dead":
        return EngineDeadError()
    if kind == "worker OOM":
        return Exception(FAILED + str(with_record(RemoteError("CUDA out of memory. Tried to allocate 2.00 GiB",
                                                                type_name="torch.OutOfMemoryError"))))
    return Exception(FAILED + str(with_record(BuildProcessError("the build process exited (signal 9) during a build"))))


KINDS = ["engine dead", "worker OOM", "build process killed"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("route", ["a new mix", "a registered adapter, not recently used"])
def test_a_server_fault_while_building_is_a_5xx_not_a_400(tmp_path: Path, kind: str, route: str) -> None:
    h = harness(tmp_path)
    fault = _fault(kind)

    async def add_lora(req):
        raise fault

    h.engine.add_lora = add_lora
    fields = mix(0.25) if route == "a new mix" else {"model": "style"}
    answer = asyncio.run(complete(h, **fields))
    assert status(answer) >= 500, f"{status(answer)}: {answer.error.message}"
