"""A generation's mix lease ends when the engine is done with it, not when the client has read the stream (r43
attacker): vLLM's real ``RequestOutputCollector`` between a stand-in engine core and the plugin's ``generate``, as
``AsyncLLM.generate`` uses it (tests/lease_harness.py: vLLM's real serving classes over stand-in boundaries)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from lease_harness import fresh  # noqa: F401
from lease_harness import complete, harness, mix, status

pytestmark = pytest.mark.vllm


def _engine_core_ahead_of_the_client(h: Any, finished: list[str]) -> None:
    """Make the stand-in engine answer as AsyncLLM does: its outputs go into a RequestOutputCollector made in the
    generation's first step, put by an engine loop that runs to the end whatever the reader does."""
    from vllm.sampling_params import RequestOutputKind
    from vllm.v1.engine.output_processor import RequestOutputCollector

    from vllm_lora_ext.integration import engine_patches

    engine = h.engine
    outputs = type(engine)._outputs

    async def generate(self: Any, prompt: Any, params: Any, request_id: str, lora_request: Any = None,
                       **kw: Any) -> Any:
        queue = RequestOutputCollector(params.output_kind or RequestOutputKind.CUMULATIVE, request_id)

        async def engine_loop() -> None:
            async for out in outputs(self, prompt, params, request_id, lora_request=lora_request, **kw):
                queue.put(out)
            finished.append(request_id)

        task = asyncio.ensure_future(engine_loop())
        try:
            done = False
            while not done:
                out = queue.get_nowait() or await queue.get()
                done = out.finished
                yield out
        finally:
            task.cancel()

    engine.generate = engine_patches.make_generate(generate).__get__(engine)


def test_a_stream_the_client_stops_reading_releases_its_mix_when_the_engine_finishes(tmp_path: Path) -> None:
    """A client opened a stream on a mix, read one chunk and stopped reading (a full TCP window): its lease was
    released only when the stream was drained, so with the registry's one slot held, another client's new mix got a
    503 although the engine had long finished the first request."""
    h = harness(tmp_path)
    finished: list[str] = []
    _engine_core_ahead_of_the_client(h, finished)

    async def scenario() -> int:
        stream = await complete(h, stream=True, max_tokens=4, **mix(0.125))
        first = await stream.__anext__()  # the client reads one chunk, then stops reading
        assert "mix-style=0.5+domain=0.125" in first
        for _ in range(200):
            if finished:
                break
            await asyncio.sleep(0.01)
        assert finished, "the engine never finished the first request"
        other = await complete(h, **mix(0.375))  # another client, another mix, once the engine is done
        rest = [chunk async for chunk in stream]  # the first client still gets the rest of its output
        assert rest and rest[-1].strip().endswith("[DONE]"), rest[-2:]
        return status(other)

    assert asyncio.run(scenario()) == 200


def test_a_lease_is_held_while_the_engine_still_generates(tmp_path: Path) -> None:
    """The control: while the engine has not finished, the slot stays held and another new mix waits, then 503s."""
    h = harness(tmp_path)
    gate = asyncio.Event()

    async def step() -> None:
        await gate.wait()

    h.engine.on_step = step
    finished: list[str] = []
    _engine_core_ahead_of_the_client(h, finished)

    async def scenario() -> int:
        stream = await complete(h, stream=True, max_tokens=4, **mix(0.125))
        reader = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0.05)
        other = await complete(h, **mix(0.375))
        gate.set()
        await reader
        async for _ in stream:
            pass
        return status(other)

    assert asyncio.run(scenario()) == 503
