"""A request holds a mix slot only while it is handled and while it generates (issue 35, items 7, 8 and 9).

Requests that fail before generating (a too-long prompt, a render error, a dead engine, bad sampling
parameters), streams dropped or cancelled, and routes that never generate (tokenize) leave every slot
free; routing locks go with their last waiter, cancelled or not. The harness is `lease_harness`.
"""

from __future__ import annotations

import asyncio
import gc
from pathlib import Path
from typing import Any

import pytest

from lease_harness import fresh  # noqa: F401 (the autouse fixture: one mix slot, no wait)
from lease_harness import BASE, MAX_LEN, a_new_mix_is_served_at_once, complete, error_response, harness, mix, status, until
from vllm_lora_ext.integration import leases, server

pytestmark = pytest.mark.vllm


# ------------------------------------------------------------------ item 7: routed to a mix, failed before generating

TOO_LONG = list(range(1, MAX_LEN + 5))


@pytest.mark.parametrize("how", ["body fields", "model syntax", "default weights"])
def test_a_too_long_prompt_on_a_mix_is_a_400_and_frees_its_slot_at_once(tmp_path: Path, how: str) -> None:
    h = harness(tmp_path, default=how == "default weights")
    choice = {"body fields": mix(0.25), "model syntax": {"model": "style=0.5+domain=0.25"},
              "default weights": {"model": BASE}}[how]

    async def scenario() -> None:
        answer = await complete(h, prompt=TOO_LONG, **choice)
        assert status(answer) == 400 and "maximum context length is 16" in answer.error.message
        assert h.engine.runs == [] and len(h.engine.added) == 1  # routed and built, never generated
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_too_long_prompt_on_a_registered_mix_named_by_its_name_frees_its_slot(tmp_path: Path) -> None:
    h = harness(tmp_path)

    async def scenario() -> None:
        first = await complete(h, **mix(0.25))
        answer = await complete(h, model=first.model, prompt=TOO_LONG)
        assert status(answer) == 400 and "maximum context length" in answer.error.message
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


@pytest.mark.parametrize("failure", ["render error", "engine dead", "bad sampling params", "engine refuses"])
def test_a_mix_request_that_fails_on_the_way_to_the_engine_frees_its_slot(tmp_path: Path, failure: str) -> None:
    h = harness(tmp_path)
    fields: dict[str, Any] = {}
    prompt: Any = (1, 2, 3)
    if failure == "render error":
        h.renderer.fail = ValueError("chat template error: 'messages' is undefined")
    elif failure == "engine dead":
        h.engine.errored = True
    elif failure == "bad sampling params":
        fields = {"temperature": -1.0}
    else:
        prompt = (1, 99)  # the engine raises on its first output

    async def scenario() -> None:
        answer = await complete(h, prompt=prompt, **mix(0.25), **fields)
        assert status(answer) != 200, answer
        h.renderer.fail, h.engine.errored = None, False
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_twenty_too_long_requests_on_twenty_mixes_through_one_slot_are_all_400_not_503(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MIX_WAIT_S", "30")  # each waits for the slot; each holds it only while handled
    h = harness(tmp_path)

    async def scenario() -> None:
        answers = await asyncio.gather(*(complete(h, prompt=TOO_LONG, **mix()) for _ in range(20)))
        assert [status(a) for a in answers] == [400] * 20
        assert len(h.engine.added) == 20 and len(server._REGISTRY) == 1
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_stream_dropped_before_its_first_chunk_frees_its_slot(tmp_path: Path) -> None:
    h = harness(tmp_path)

    async def scenario() -> None:
        stream = await complete(h, stream=True, **mix(0.25))
        assert hasattr(stream, "__anext__") and server._REGISTRY.in_use() == 1  # generation admitted: its lease holds
        del stream
        gc.collect()
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_stream_whose_client_disconnects_after_the_first_chunk_frees_its_slot(tmp_path: Path) -> None:
    h = harness(tmp_path)
    never = asyncio.Event()

    async def scenario() -> None:
        stream = await complete(h, stream=True, max_tokens=4, **mix(0.25))
        chunks: list[str] = []

        async def client() -> None:  # the server's streaming task, cancelled when the client goes away
            async for chunk in stream:
                chunks.append(chunk)
                h.engine.on_step = never.wait  # the next output never comes

        task = asyncio.create_task(client())
        await until(lambda: chunks)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled() and len(chunks) == 1
        h.engine.on_step = None
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_stream_closed_after_its_first_chunk_frees_its_slot_once_dropped(tmp_path: Path) -> None:
    h = harness(tmp_path)

    async def scenario() -> None:
        stream = await complete(h, stream=True, max_tokens=4, **mix(0.25))
        assert (await stream.__anext__()).startswith("data: ")
        await stream.aclose()
        del stream
        gc.collect()  # the inner streams are closed by asyncio's async-generator finalizer, on the next loop turns
        for _ in range(5):
            await asyncio.sleep(0)
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_client_that_disconnects_during_generation_frees_its_slot(tmp_path: Path) -> None:
    h = harness(tmp_path)
    never = asyncio.Event()

    async def scenario() -> None:
        h.engine.on_step = never.wait
        task = asyncio.create_task(complete(h, **mix(0.25)))
        await until(lambda: h.engine.runs)
        assert server._REGISTRY.in_use() == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        h.engine.on_step = None
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


# ------------------------------------------------------------------ item 8: routes that never generate


async def _tokenize(h: Any, **fields: Any) -> Any:
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeCompletionRequest

    try:
        return await h.tokenize.create_tokenize(TokenizeCompletionRequest(prompt="hello", **fields), None)
    except Exception as err:
        return error_response(err)


@pytest.mark.parametrize("fields", [{"model": "style=0.7+domain=0.3"}, {"model": "style+domain"},
                                    {"model": BASE, "adapters": ["style", "domain"], "adapter_weights": [0.5, 0.5]},
                                    {"model": BASE}, {"model": "style"}],
                         ids=["model syntax", "default weights", "body fields", "base under a default", "named"])
def test_tokenize_on_a_mix_answers_the_base_tokens_and_never_builds_or_holds_anything(tmp_path: Path,
                                                                                       fields: dict[str, Any]) -> None:
    h = harness(tmp_path, default=True)

    async def scenario() -> None:
        base = await _tokenize(h, model=BASE)
        answer = await _tokenize(h, **fields)
        assert status(answer) == 200 and answer.tokens == base.tokens and answer.count == 5
        assert not h.engine.added and not h.engine.probes and server._REGISTRY is None  # nothing built, no slot
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"model": "style=0.7+nope=0.3"}, "Unknown adapter(s) ['nope']"),
    ({"model": "style=abc+domain"}, "is not a number"),
    ({"adapters": ["style"], "adapter_weights": [1e308]}, "outside [-100, 100]"),
])
def test_tokenize_checks_a_mix_and_answers_400_for_a_bad_one(tmp_path: Path, fields: dict[str, Any],
                                                             fragment: str) -> None:
    h = harness(tmp_path)

    async def scenario() -> None:
        answer = await _tokenize(h, **{"model": BASE, **fields})
        assert status(answer) == 400 and fragment in answer.error.message, answer
        assert not h.engine.added and server._REGISTRY is None
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_tokenize_on_twenty_distinct_mixes_leaves_the_one_slot_free_for_a_real_mix(tmp_path: Path) -> None:
    h = harness(tmp_path)

    async def scenario() -> None:
        answers = await asyncio.gather(*(_tokenize(h, model=f"style=0.5+domain={i / 100}") for i in range(1, 21)))
        assert [status(a) for a in answers] == [200] * 20
        assert not h.engine.added and server._REGISTRY is None
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_request_on_an_unwrapped_route_routes_but_holds_nothing_once_routed(tmp_path: Path) -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    h = harness(tmp_path)

    async def scenario() -> None:  # a vLLM route whose handler the plugin does not wrap (no request scope)
        req = CompletionRequest(model=BASE, prompt=[1, 2], **mix(0.25))
        assert await server.route_adapters(h.completion, req) is None and server.routed_lora(req) is not None
        await a_new_mix_is_served_at_once(h)  # evicts it: the routed request still names its exact mix
        assert h.completion._maybe_get_adapters(req).lora_path.startswith("mix:")

    asyncio.run(scenario())


# ------------------------------------------------------------------ item 9: routing locks go with their last waiter


def test_twenty_cancelled_waiters_for_one_mix_leave_no_routing_lock(tmp_path: Path) -> None:
    h = harness(tmp_path)

    async def scenario() -> None:
        h.engine.add_gate = asyncio.Event()  # the first request's mix is still loading
        first = asyncio.create_task(complete(h, **mix(0.25)))
        waiters = [asyncio.create_task(complete(h, **mix(0.25))) for _ in range(20)]
        await until(lambda: sum(n for _, n in server._KEY_LOCKS.values()) == 21)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert [n for _, n in server._KEY_LOCKS.values()] == [1]  # only the request that holds it
        h.engine.add_gate.set()
        assert status(await first) == 200
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_request_cancelled_while_waiting_for_a_slot_leaves_no_lock_waiter_or_lease(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MIX_WAIT_S", "30")
    h = harness(tmp_path)
    pause = asyncio.Event()

    async def scenario() -> None:
        h.engine.on_step = pause.wait
        first = asyncio.create_task(complete(h, **mix(0.25)))  # generating: holds the one slot
        await until(lambda: h.engine.runs)
        waiting = asyncio.create_task(complete(h, **mix(0.75)))
        await until(lambda: leases._WAITERS)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert not leases._WAITERS and not server._KEY_LOCKS and server._REGISTRY.in_use() == 1
        pause.set()
        assert status(await first) == 200
        h.engine.on_step = None
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_key_lock_is_removed_with_its_last_waiter_cancelled_or_not() -> None:
    async def scenario() -> None:
        holder = leases.KeyLock("k")
        await holder.__aenter__()
        tasks = [asyncio.create_task(leases.KeyLock("k").__aenter__()) for _ in range(20)]
        await asyncio.sleep(0.01)
        assert server._KEY_LOCKS["k"][1] == 21
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        assert server._KEY_LOCKS["k"][1] == 1
        await holder.__aexit__(None, None, None)
        assert not server._KEY_LOCKS

    asyncio.run(scenario())
