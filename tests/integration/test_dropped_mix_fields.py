"""``/v1/messages`` and ``/inference/v1/generate``: vLLM's request types there drop the mix body fields
(``adapters``, ``adapter_weights``) before any handler sees them, so the plugin refuses a request that sends them
(400, the fields named, the ``model`` syntax offered) rather than serving it without its mix.

Through vLLM's own routers in a FastAPI app, with the real request parsing and dependencies; the serving objects
behind them are vLLM's classes as patched by the registered plugin, bare (no engine): a request the guard passes on
reaches vLLM's handler, which fails on the bare object (a 500 or an exception, never the guard's 400)."""

from __future__ import annotations

from typing import Any

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture
def client() -> Any:
    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from vllm.entrypoints.anthropic.api_router import router as messages_router
    from vllm.entrypoints.anthropic.serving import AnthropicServingMessages
    from vllm.entrypoints.scale_out.token_in_token_out.api_router import router as tokens_router
    from vllm.entrypoints.scale_out.token_in_token_out.serving import ServingTokens

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.patching import PATCH_MARK

    plugin.register()
    assert getattr(AnthropicServingMessages.create_messages, PATCH_MARK, False)
    assert getattr(ServingTokens.serve_tokens, PATCH_MARK, False)
    app = FastAPI()
    app.include_router(messages_router)
    app.include_router(tokens_router)
    app.state.anthropic_serving_messages = AnthropicServingMessages.__new__(AnthropicServingMessages)
    app.state.serving_tokens = ServingTokens.__new__(ServingTokens)
    app.state.server_load_metrics, app.state.enable_server_load_tracking = 0, False
    return TestClient(app, raise_server_exceptions=False)


MESSAGES = {"model": "base", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
TOKENS = {"model": "base", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 4}}


@pytest.mark.parametrize(("path", "body"), [("/v1/messages", MESSAGES), ("/inference/v1/generate", TOKENS)])
@pytest.mark.parametrize(("fields", "named"), [
    ({"adapters": ["style", "domain"], "adapter_weights": [0.7, 0.3]}, "adapters, adapter_weights"),
    ({"adapters": ["style"]}, "adapters"),
    ({"adapter_weights": [1.0]}, "adapter_weights"),
])
def test_a_mix_in_the_body_is_refused_where_vllm_drops_it(client: Any, path: str, body: dict, fields: dict,
                                                          named: str) -> None:
    r = client.post(path, json={**body, **fields})
    assert r.status_code == 400, r.text
    text = r.text
    assert f"{path} does not read the body field(s) {named}" in text
    assert "a=0.7+b=0.3" in text and "/v1/chat/completions" in text


@pytest.mark.parametrize(("path", "body"), [("/v1/messages", MESSAGES), ("/inference/v1/generate", TOKENS)])
@pytest.mark.parametrize("fields", [{}, {"adapters": []}, {"adapters": None, "adapter_weights": None},
                                    {"model": "style=0.7+domain=0.3"}, {"metadata": {"user_id": "adapters"}}])
def test_requests_without_a_body_mix_reach_vllms_handler(client: Any, path: str, body: dict, fields: dict) -> None:
    r = client.post(path, json={**body, **fields})
    assert r.status_code == 500 and "does not read the body field" not in r.text, r.text  # vLLM's handler ran


def test_a_body_that_cannot_be_read_again_leaves_the_route_to_vllm() -> None:
    """A request whose body stream was consumed without being kept (Starlette then refuses to read it again): the
    guard passes it on rather than failing the route."""
    import asyncio

    from starlette.requests import Request

    from vllm_lora_ext.integration.server_patches import make_dropped_mix_fields_guard

    async def run() -> Any:
        chunks = [{"type": "http.request", "body": b'{"adapters": ["a"]}', "more_body": False}]
        raw = Request({"type": "http", "method": "POST", "path": "/v1/messages", "headers": []},
                      receive=lambda: asyncio.sleep(0, chunks.pop(0)))
        async for _ in raw.stream():  # consumed, not kept
            pass
        calls: list[Any] = []

        async def original(self: Any, request: Any, raw_request: Any = None) -> str:
            calls.append(raw_request)
            return "vllm's answer"

        answer = await make_dropped_mix_fields_guard(original)(object(), object(), raw)
        return answer, calls == [raw]

    assert asyncio.run(run()) == ("vllm's answer", True)
