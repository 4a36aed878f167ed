"""A mix in flight cannot be evicted: from vLLM's model check to its lookup, and across beam search steps; pooling
routes refuse mixes (issue 35, items 10, 11 and 16). The harness is `lease_harness`.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from lease_harness import fresh  # noqa: F401 (the autouse fixture: one mix slot, no wait)
from lease_harness import BASE, a_new_mix_is_served_at_once, complete, error_response, harness, mix, status, until
from vllm_lora_ext.integration import server

pytestmark = pytest.mark.vllm


# ------------------------------------------------------------------ item 11: held from the model check to the lookup


@pytest.mark.parametrize("named", ["by its registered name", "by body fields"])
def test_a_mix_is_held_from_the_model_check_until_generation_so_a_competitor_cannot_evict_it(tmp_path: Path,
                                                                                          named: str) -> None:
    h = harness(tmp_path)

    async def scenario() -> None:
        name = (await complete(h, **mix(0.25))).model
        h.renderer.gate = asyncio.Event()  # the request is between vLLM's _check_model and its adapter lookup
        fields = {"model": name} if named == "by its registered name" else mix(0.25)
        task = asyncio.create_task(complete(h, **fields))
        await until(lambda: server._REGISTRY.in_use())
        h.renderer.gate.set()
        competitor = await complete(h, **mix(0.75))  # one slot, no wait: the mix in flight is not evicted
        assert status(competitor) == 503 and "VLLM_LORA_EXT_MAX_MIXES" in competitor.error.message
        answer = await task
        assert status(answer) == 200 and answer.model == name, answer
        assert h.engine.runs[-1].lora_name == name and not h.engine.removed
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_request_naming_an_evicted_mix_by_name_gets_that_exact_mix_never_another_adapter(tmp_path: Path) -> None:
    h = harness(tmp_path)

    async def scenario() -> None:
        first = await complete(h, **mix(0.25))
        path = h.engine.runs[-1].lora_path
        await a_new_mix_is_served_at_once(h)  # evicts it (one slot)
        answer = await complete(h, model=first.model)  # rebuilt from its name's label, digest checked (item 15)
        assert status(answer) == 200 and answer.model == first.model
        assert h.engine.runs[-1].lora_path == path  # the same exact mix, not whatever holds the slot now
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


# ------------------------------------------------------------------ item 10: one lease for a whole beam search

BEAM = {"use_beam_search": True, "n": 2, "max_tokens": 4, "ignore_eos": True}


def _beams(answer: Any) -> list[tuple[str, ...]]:
    return [tuple(c.text.split()) for c in answer.choices]


def test_beam_search_on_a_mix_under_eviction_pressure_returns_the_beams_it_returns_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    alone_h = harness(tmp_path)
    alone = asyncio.run(complete(alone_h, **mix(0.25), **BEAM))
    assert status(alone) == 200 and len(alone_h.engine.runs) == 1 + 3 * 2  # one beam, then two a step
    server.reset_registry()
    monkeypatch.setenv("VLLM_LORA_EXT_MIX_WAIT_S", "30")
    h = harness(tmp_path)  # the same adapter files: the same mix source
    competitors: list[Any] = []
    removed_at_steps: list[list[int]] = []

    async def pressure() -> None:  # before every step, another mix asks for the one slot
        removed_at_steps.append(list(h.engine.removed))
        competitors.append(asyncio.create_task(complete(h, **mix())))
        await asyncio.sleep(0.02)

    async def scenario() -> Any:
        h.engine.on_step = pressure
        answer = await complete(h, **mix(0.25), **BEAM)
        h.engine.on_step = None
        served = await asyncio.gather(*competitors)
        return answer, served

    answer, served = asyncio.run(scenario())
    assert _beams(answer) == _beams(alone) and len(set(_beams(answer))) == 2
    mix_id = h.engine.runs[0].lora_int_id
    beam_runs = [r for r in h.engine.runs if r.lora_int_id == mix_id]
    assert len(beam_runs) == len(alone_h.engine.runs)  # every step ran on the mix
    assert removed_at_steps == [[]] * len(beam_runs)  # nothing was evicted while the beam search ran
    assert [status(a) for a in served] == [200] * len(competitors)  # each competitor was served once it ended
    assert h.engine.removed[0] == mix_id
    asyncio.run(a_new_mix_is_served_at_once(h))


def test_a_beam_search_consumed_after_its_handler_returned_keeps_its_mix_for_every_step(tmp_path: Path) -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.sampling_params import BeamSearchParams

    h = harness(tmp_path)
    answers: list[int] = []

    async def handler(request: Any) -> Any:  # chat's streaming path: the beam stream outlives its handler
        error = await h.completion._check_model(request)
        assert error is None
        return h.completion.beam_search(prompt={"type": "token", "prompt_token_ids": [1, 2, 3]}, request_id="b",
                                        params=BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True),
                                        lora_request=h.completion._maybe_get_adapters(request))

    async def competitor() -> None:
        answers.append(status(await complete(h, **mix())))

    async def scenario() -> Any:
        request = CompletionRequest(model=BASE, prompt=[1, 2, 3], **mix(0.25))
        stream = await h.completion._with_kv_transfer_rejection_cleanup(handler(request), request, None)
        assert server._REGISTRY.in_use() == 1  # the handler has returned: the beam's own lease holds the mix
        h.engine.on_step = competitor
        outputs = [out async for out in stream]
        h.engine.on_step = None
        return outputs

    outputs = asyncio.run(scenario())
    assert len(outputs) == 1 and len(outputs[0].outputs) == 2
    assert answers and set(answers) == {503} and not h.engine.removed  # never evicted between steps
    asyncio.run(a_new_mix_is_served_at_once(h))


# ------------------------------------------------------------------ item 16: pooling routes refuse mixes


def _embedding_serving(h: Any) -> Any:
    from vllm.entrypoints.pooling.embed.serving import ServingEmbedding

    serving = object.__new__(ServingEmbedding)  # its __init__ needs a pooling engine; _check_model reads models only
    serving.models = h.models
    return serving


async def _embed_check(h: Any, **fields: Any) -> Any:
    from vllm.entrypoints.pooling.embed.protocol import EmbeddingCompletionRequest

    serving = _embedding_serving(h)
    try:
        return await serving._check_model(EmbeddingCompletionRequest(input="hello", **fields))
    except Exception as err:
        return error_response(err)


@pytest.mark.parametrize("fields", [
    {"model": BASE, "adapters": ["style", "domain"], "adapter_weights": [0.5, 0.5]},
    {"model": BASE, "adapters": ["style"]},
    {"model": BASE, "adapter_weights": [0.5]},
    {"model": "style=0.7+domain=0.3"},
    {"model": "style+domain"},
    {"model": "registered mix"},
], ids=["body fields", "one adapter field", "weights field", "model syntax", "default weights", "registered mix"])
def test_embeddings_refuse_a_mix_with_a_400_naming_the_generation_routes(tmp_path: Path,
                                                                         fields: dict[str, Any]) -> None:
    h = harness(tmp_path)

    async def scenario() -> None:
        if fields["model"] == "registered mix":
            fields["model"] = (await complete(h, **mix(0.25))).model
        added = len(h.engine.added)
        answer = await _embed_check(h, **fields)
        assert status(answer) == 400, answer
        assert "does not serve adapter mixes" in answer.error.message and "/v1/completions" in answer.error.message
        assert len(h.engine.added) == added  # nothing built
        await a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


@pytest.mark.parametrize("model", [BASE, "style"])
def test_embeddings_on_the_base_model_or_a_loaded_adapter_pass(tmp_path: Path, model: str) -> None:
    h = harness(tmp_path)
    assert asyncio.run(_embed_check(h, model=model)) is None and not h.engine.added
