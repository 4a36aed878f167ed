"""vLLM's render routes answer the request ``/inference/v1/generate`` then runs, naming only ``model``: a mix there
(body fields or ``model`` syntax) is refused with a 400 rather than rendered as a request for the base model, which
would lose it between the two without an error. Tokenize still takes a mix (its tokenizer is the base model's)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from lease_harness import BASE, harness, mix
from vllm_lora_ext.integration import server

pytestmark = pytest.mark.vllm


def _chat(**fields: object) -> object:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    return ChatCompletionRequest(**{"model": BASE, "messages": [{"role": "user", "content": "hi"}], **fields})


@pytest.mark.parametrize("fields", [mix(0.3), {"model": "style=0.7+domain=0.3"}])
def test_render_refuses_a_mix_it_could_not_pass_on(tmp_path: Path, fields: dict) -> None:
    from vllm.entrypoints.scale_out.render.serving import ServingRender

    h = harness(tmp_path)
    render = ServingRender.__new__(ServingRender)
    render.models = h.models
    answer = asyncio.run(server.route_adapters(render, _chat(**fields)))
    assert answer is not None and answer.error.code == 400, answer
    assert "/inference/v1/generate" in answer.error.message and "'model'" in answer.error.message
    assert "style=" in answer.error.message and "domain=0.3" in answer.error.message


def test_render_of_the_base_model_or_a_named_adapter_and_tokenize_of_a_mix_pass(tmp_path: Path) -> None:
    from vllm.entrypoints.scale_out.render.serving import ServingRender
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization

    h = harness(tmp_path)
    render = ServingRender.__new__(ServingRender)
    render.models = h.models
    for fields in ({}, {"model": "style"}):
        request = _chat(**fields)
        assert asyncio.run(server.route_adapters(render, request)) is None
    tokenize = ServingTokenization.__new__(ServingTokenization)
    tokenize.models = h.models
    request = _chat(model="style=0.7+domain=0.3")
    assert asyncio.run(server.route_adapters(tokenize, request)) is None and request.model == BASE
