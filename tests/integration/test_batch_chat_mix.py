"""``/v1/chat/completions/batch`` keeps the mix it was routed to while another client asks for a new one.

The handler (`OpenAIServingChatBatch.create_batch_chat_completion`) is not run inside the wrapper the other generation
handlers are (``_with_kv_transfer_rejection_cleanup``), and it copies the request into one ``ChatCompletionRequest``
per conversation, which look the mix up by name. Before r42 nothing held the mix meanwhile: another client's new mix
evicted it and the batch was answered 404 "The model `mix-...` does not exist", though the client named the base
model and the adapters (or only the base model, with a deployment default). The plugin now runs the handler in a
lease scope (`server_patches.make_batch_request_scope`). Found by an attacker helper in r42.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from lease_harness import fresh  # noqa: F401 (one mix slot, no wait)
from lease_harness import BASE, complete, error_response, harness, mix, status, until

pytestmark = pytest.mark.vllm


class ChatRenderer:
    """vLLM's online renderer for chat, as far as the batch route reads it; ``gate`` pauses rendering."""

    use_harmony = False
    parser = None
    reasoning_effort_map: dict = {}
    trust_request_chat_template = False
    chat_template = None
    chat_template_content_format = "auto"
    default_chat_template_kwargs: dict = {}

    def __init__(self, engine) -> None:
        self.model_config, self.renderer = engine.model_config, engine.renderer
        self.gate: asyncio.Event | None = None
        self.entered = 0

    def validate_chat_template(self, **kwargs):
        return None

    async def preprocess_chat(self, request, messages, **kwargs):
        self.entered += 1
        if self.gate is not None:
            await self.gate.wait()
        return [dict(m) for m in messages], [{"type": "token", "prompt_token_ids": [1, 2, 3]}]


def _batch_api(tmp_path: Path, *, default: bool = False):
    from vllm.entrypoints.openai.chat_completion.batch_serving import OpenAIServingChatBatch

    h = harness(tmp_path, default=default)
    h.engine.model_config.hf_config = SimpleNamespace(model_type="llama")
    h.engine.model_config.model = "m"
    h.chat_renderer = ChatRenderer(h.engine)
    h.batch = OpenAIServingChatBatch(h.engine, h.models, "assistant", online_renderer=h.chat_renderer,
                                     request_logger=None, chat_template=None, chat_template_content_format="auto")
    return h


async def _batch(h, **fields):
    from vllm.entrypoints.openai.chat_completion.protocol import BatchChatCompletionRequest

    req = BatchChatCompletionRequest(model=fields.pop("model", BASE), messages=[[{"role": "user", "content": "hi"}]],
                                     max_tokens=2, **fields)
    try:
        return await h.batch.create_batch_chat_completion(req)
    except Exception as err:  # what vLLM's exception handler answers
        return error_response(err)


@pytest.mark.parametrize("how", ["body fields", "deployment default"])
def test_a_batch_chat_request_keeps_its_mix_while_another_client_asks_for_a_new_one(tmp_path: Path, how: str) -> None:
    h = _batch_api(tmp_path, default=(how == "deployment default"))

    async def scenario() -> None:
        alone = await _batch(h, **mix(0.25))  # the route serves a mix at all
        assert status(alone) == 200 and alone.model.startswith("mix-style=0.5+domain=0.25-"), alone
        h.chat_renderer.gate = asyncio.Event()
        fields = mix(0.5) if how == "body fields" else {}
        task = asyncio.create_task(_batch(h, **fields))
        await until(lambda: h.chat_renderer.entered == 2)  # routed (its mix registered), now rendering
        await complete(h, **mix(0.75))  # another client's new mix, meanwhile
        h.chat_renderer.gate.set()
        answer = await task
        assert status(answer) == 200, answer.error.message

    asyncio.run(scenario())
