"""``/v1/messages`` and ``/inference/v1/generate``: vLLM's request types there drop the mix body fields
(``adapters``, ``adapter_weights``) before any handler sees them, so the plugin refuses a request that sends them
(400, the fields named, the ``model`` syntax offered) rather than serving it without its mix.

Through vLLM's own routers in a FastAPI app, with the real request parsing and dependencies; the serving objects
behind them are vLLM's classes as patched by the registered plugin, bare (no engine): a request the guard passes on
reaches vLLM's handler, which fails on the bare object (a 500 or an exception, never the guard's 400)."""

from __future__ import annotations

import json
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


# Hostile bodies (an attacker helper, r44)
ROUTES = [("/v1/messages", MESSAGES), ("/inference/v1/generate", TOKENS)]
JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_escaped_key_is_refused(client: Any, path: str, body: dict) -> None:
    raw = json.dumps(body)[:-1] + ', "\\u0061dapters": ["style", "domain"], "adapter\\u005fweights": [0.7, 0.3]}'
    assert json.loads(raw)["adapters"] == ["style", "domain"]  # what vLLM's parser (and pydantic) sees
    r = client.post(path, content=raw.encode(), headers=JSON)
    assert r.status_code == 400 and "does not read the body field(s) adapters, adapter_weights" in r.text, r.text


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_utf16_body_is_refused(client: Any, path: str, body: dict) -> None:
    raw = json.dumps({**body, "adapters": ["style"]}).encode("utf-16")  # json.loads(bytes) detects UTF-16
    r = client.post(path, content=raw, headers=JSON)
    assert r.status_code == 400 and "does not read the body field(s) adapters" in r.text, r.text


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_chunked_body_is_refused(client: Any, path: str, body: dict) -> None:
    raw = json.dumps({**body, "adapters": ["style"]}).encode()
    r = client.post(path, content=iter([raw[:7], raw[7:20], raw[20:]]), headers=JSON)
    assert r.status_code == 400 and "adapters" in r.text, r.text


@pytest.mark.parametrize(("dups", "refused"), [('"adapters": ["a"], "adapters": null', False),
                                               ('"adapters": null, "adapters": ["a"]', True)])
def test_duplicate_keys_follow_the_parser(client: Any, dups: str, refused: bool) -> None:
    raw = json.dumps(MESSAGES)[:-1] + ", " + dups + "}"
    r = client.post("/v1/messages", content=raw.encode(), headers=JSON)
    assert (r.status_code == 400) is refused, r.text


def test_anthropic_error_shape(client: Any) -> None:
    r = client.post("/v1/messages", json={**MESSAGES, "stream": True, "adapters": ["a"]})
    assert r.status_code == 400
    body = r.json()
    # vLLM's Anthropic route translates the error's type: 0.33 to Anthropic's own word, 0.26 keeps it
    assert body["type"] == "error" and body["error"]["type"] in ("invalid_request_error", "BadRequestError"), body
    assert "does not read the body field(s) adapters" in body["error"]["message"]


@pytest.mark.parametrize(("path", "body"), ROUTES)
def test_the_guard_never_parses_the_body_again(client: Any, path: str, body: dict, monkeypatch: Any) -> None:
    """A body that names "adapters" anywhere (a tool schema, metadata) is parsed once, by vLLM's route."""
    import starlette.requests

    import vllm_lora_ext.naming as naming

    calls: list[int] = []

    class CountingJson:
        def __getattr__(self, name: str) -> Any:
            return getattr(json, name)

        @staticmethod
        def loads(*args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            return json.loads(*args, **kwargs)

    monkeypatch.setattr(starlette.requests, "json", CountingJson())
    monkeypatch.setattr(naming, "json", CountingJson(), raising=False)  # (naming parses nothing now)
    r = client.post(path, json={**body, "metadata": {"adapters": ["x"]}, "adapters": ["a"]})
    assert r.status_code == 400 and calls == [1], (calls, r.text)


def test_cohere_v2_chat_refuses_a_body_mix() -> None:
    """vLLM 0.33's /cohere/v2/chat (VLLM_ENABLE_COHERE_API=1, cohere SDK): CohereChatV2Request drops unknown fields
    and the handler builds a ChatCompletionRequest from the fields it knows, so adapters/adapter_weights never reach
    the plugin's routing: the request ran on the base model (or the deployment default), without an error."""
    cohere_router = pytest.importorskip("vllm.entrypoints.cohere.api_router")
    if not getattr(cohere_router, "_SDK_AVAILABLE", False):
        pytest.skip("no cohere SDK")
    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from vllm.entrypoints.cohere.serving import CohereServingChatV2
    from vllm.entrypoints.serve.engine.protocol import ErrorResponse

    from vllm_lora_ext.integration import plugin

    plugin.register()
    seen: list[Any] = []

    async def create_chat_completion(chat_req: Any, raw_request: Any = None) -> Any:
        seen.append(chat_req)  # where the plugin's routing (BaseServing._check_model) would read the fields
        return ErrorResponse(error={"message": "reached", "type": "x", "code": 500})

    serving = CohereServingChatV2.__new__(CohereServingChatV2)
    serving.create_chat_completion = create_chat_completion
    app = FastAPI()
    app.include_router(cohere_router.router)
    app.state.cohere_serving_chat_v2 = serving
    app.state.server_load_metrics, app.state.enable_server_load_tracking = 0, False
    client = TestClient(app, raise_server_exceptions=False)
    r = client.post("/cohere/v2/chat", json={"model": "base", "messages": [{"role": "user", "content": "hi"}],
                                            "adapters": ["style", "domain"], "adapter_weights": [0.7, 0.3]})
    assert not seen or getattr(seen[0], "adapters", None) is not None, "the mix fields were dropped silently"
    assert r.status_code == 400 and "adapters, adapter_weights" in r.text, r.text


# /v2/embed: its request type drops the fields too; the other pooling routes keep and refuse them

def _embed_request(body: dict) -> Any:
    """A real Starlette request carrying ``body``, parsed once as vLLM's route parses it."""
    import json as _json

    from starlette.requests import Request

    chunks = [{"type": "http.request", "body": _json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        return chunks.pop(0)

    raw = Request({"type": "http", "method": "POST", "path": "/v2/embed", "headers": []}, receive=receive)
    return raw


@pytest.mark.parametrize("fields", [{"adapters": ["style", "domain"]}, {"adapter_weights": [1.0]}])
def test_v2_embed_refuses_a_body_mix_as_the_other_pooling_routes_do(tmp_path: Any, fields: dict) -> None:
    import asyncio

    from lease_harness import harness
    from vllm.entrypoints.pooling.embed.protocol import CohereEmbedRequest
    from vllm.entrypoints.pooling.embed.serving import ServingEmbedding

    from vllm_lora_ext.errors import MixError
    from vllm_lora_ext.integration import plugin

    plugin.register()
    serving = ServingEmbedding.__new__(ServingEmbedding)
    serving.models = harness(tmp_path).models
    body = {"model": "base-model", "texts": ["hi"], **fields}

    async def run() -> None:
        raw = _embed_request(body)
        await raw.json()  # vLLM's route parsed it
        await serving._init_ctx(None, CohereEmbedRequest(**body), raw)

    with pytest.raises(MixError, match="does not serve adapter mixes") as caught:
        asyncio.run(run())
    assert ", ".join(f for f in ("adapters", "adapter_weights") if f in fields) in str(caught.value)


def test_v2_embed_without_a_body_mix_reaches_vllms_init(tmp_path: Any) -> None:
    import asyncio

    from lease_harness import harness
    from vllm.entrypoints.pooling.embed.protocol import CohereEmbedRequest
    from vllm.entrypoints.pooling.embed.serving import ServingEmbedding

    from vllm_lora_ext.errors import MixError
    from vllm_lora_ext.integration import plugin

    plugin.register()
    serving = ServingEmbedding.__new__(ServingEmbedding)
    serving.models = harness(tmp_path).models
    body = {"model": "base-model", "texts": ["hi"], "adapters": []}

    async def run() -> None:
        raw = _embed_request(body)
        await raw.json()
        await serving._init_ctx(None, CohereEmbedRequest(**body), raw)

    with pytest.raises(Exception) as caught:  # vLLM's own _init_ctx, on a bare object
        asyncio.run(run())
    assert not isinstance(caught.value, MixError), caught.value
