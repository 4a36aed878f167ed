"""Requests waiting for one new mix whose build fails share that failure: one build, not one per request (before
r42, N concurrent requests made N builds one after another, each reading every component, and the last client
waited for all of them). Requests arriving after the failure try again. Found by an attacker helper in r42.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lease_harness import fresh  # noqa: F401
from lease_harness import complete, harness, mix, status
from vllm_lora_ext.constants import PREBUILD_PREFIX

pytestmark = pytest.mark.vllm


def test_twenty_concurrent_requests_for_one_failing_mix_build_it_once(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MAX_MIXES", "8")
    h = harness(tmp_path)
    builds: list[str] = []

    async def add_lora(req):
        if req.lora_path.startswith(PREBUILD_PREFIX):  # a build-ahead probe: the worker builds, then refuses
            builds.append(req.lora_path)
            await asyncio.sleep(0.05)
            raise RuntimeError("Call to add_lora method failed: Mix needs rank 64 (the sum of its adapters' ranks) "
                               "but max_lora_rank is 16")
        h.engine.added.append(req)
        return True

    h.engine.add_lora = add_lora

    async def scenario() -> None:
        fields = mix(0.25)
        answers = await asyncio.gather(*(complete(h, **fields) for _ in range(20)))
        assert [status(a) for a in answers] == [400] * 20
        assert len(set(builds)) == 1
        assert len(builds) == 1, f"{len(builds)} builds of one mix for 20 concurrent requests"

    asyncio.run(scenario())


def test_a_request_after_the_failed_build_tries_again(tmp_path: Path) -> None:
    h = harness(tmp_path)
    builds: list[str] = []

    async def add_lora(req):
        if req.lora_path.startswith(PREBUILD_PREFIX):
            builds.append(req.lora_path)
            raise RuntimeError("Call to add_lora method failed: Mix needs rank 64 but max_lora_rank is 16")
        h.engine.added.append(req)
        return True

    h.engine.add_lora = add_lora
    for _ in range(2):
        assert status(asyncio.run(complete(h, **mix(0.25)))) == 400
    assert len(builds) == 2
