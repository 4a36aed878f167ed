"""The harness of the lease tests (issue 35, items 7-11 and 16): vLLM's real serving classes over stand-in boundaries.

vLLM's real serving classes run each request: ``OpenAIServingCompletion.create_completion`` (with its
``_with_kv_transfer_rejection_cleanup``, ``_check_model``, ``_maybe_get_adapters`` and online beam search,
all as the plugin patches them), ``ServingTokenization`` and the pooling ``_check_model``, over vLLM's
real ``OpenAIServingModels``. The outer boundaries are stand-ins: the engine client (records adapters and
answers ``generate`` through the plugin's ``AsyncLLM.generate`` replacement, with outputs that depend on
the prompt and on the adapter's source) and the online renderer (passes token prompts through and refuses
one longer than the context with vLLM's own error type and message).

The registry holds ONE mix and a request waits 0 s for a slot (the `fresh` fixture), so any slot left held
makes the next new mix a 503. Every case asserts its answer, that no lease, routing lock or waiter is
left, and that a new mix is served at once afterwards (`a_new_mix_is_served_at_once`).
"""

from __future__ import annotations

import asyncio
import importlib
import itertools
import random
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from factories import make_dense_adapter
from vllm_lora_ext.constants import PREBUILD_PREFIX
from vllm_lora_ext.deployment import read_deployment_config
from vllm_lora_ext.integration import engine_patches, leases, plugin, server

BASE = "base"
MAX_LEN = 16
_FRESH = itertools.count(1)


class Tokenizer:
    eos_token_id = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return " ".join(map(str, ids))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"t{i}" for i in ids]


class Engine:
    """vLLM's engine client: records adapters; ``generate`` is the plugin's AsyncLLM.generate around `_outputs`."""

    errored = False
    dead_error = RuntimeError("the engine is dead")

    def __init__(self) -> None:
        self.model_config = SimpleNamespace(max_model_len=MAX_LEN, is_encoder_decoder=False, generation_config="vllm",
                                            get_diff_sampling_param=dict, override_generation_config={})
        self.renderer = SimpleNamespace(tokenizer=Tokenizer(), get_tokenizer=Tokenizer)
        self.vllm_config = SimpleNamespace(kv_transfer_config=None,
                                           lora_config=SimpleNamespace(max_cpu_loras=8, max_loras=4))
        self.input_processor = SimpleNamespace(resolve_watermarking=lambda params: False, vllm_config=self.vllm_config,
                                               generation_config_fields={})
        self.added: list[Any] = []
        self.probes: list[Any] = []
        self.removed: list[int] = []
        self.runs: list[Any] = []  # the lora_request of every generate call, in order
        self.on_step: Any = None  # awaited before each output: where a test puts pressure or a pause
        self.add_gate: asyncio.Event | None = None

    def check_admission(self, n: int) -> None:
        pass

    async def add_lora(self, req: Any) -> bool:
        if req.lora_path.startswith(PREBUILD_PREFIX):
            self.probes.append(req)
            return True
        if self.add_gate is not None:
            await self.add_gate.wait()
        self.added.append(req)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.removed.append(lora_id)
        return True

    async def _outputs(self, prompt: Any, params: Any, request_id: str, lora_request: Any = None, **_: Any) -> Any:
        """One output (a stream: one per token, as deltas), each after ``on_step``, chosen by the adapter's source."""
        from vllm.logprobs import Logprob
        from vllm.outputs import CompletionOutput, RequestOutput
        from vllm.sampling_params import RequestOutputKind

        self.runs.append(lora_request)
        ids = list(prompt["prompt_token_ids"])
        steps = (params.max_tokens or 1) if params.output_kind == RequestOutputKind.DELTA else 1
        for step in range(steps):
            if self.on_step is not None:
                await self.on_step()
            if 99 in ids:
                raise ValueError("the engine refused the request")
            rng = random.Random(f"{getattr(lora_request, 'lora_path', None)}|{ids}")
            lps = {10 + i: Logprob(logprob=-5 * rng.random(), rank=i + 1) for i in range(params.logprobs or 1)}
            tok = max(lps, key=lambda t: lps[t].logprob)
            ids.append(tok)
            last = step == steps - 1
            out = CompletionOutput(index=0, text=f" {tok}", token_ids=[tok], cumulative_logprob=lps[tok].logprob,
                                   logprobs=[lps] if params.logprobs else None, finish_reason="length" if last else None)
            yield RequestOutput(request_id=request_id, prompt=None, prompt_token_ids=list(prompt["prompt_token_ids"]),
                                prompt_logprobs=None, outputs=[out], finished=last)

    generate = engine_patches.make_generate(_outputs)


class Renderer:
    """vLLM's online renderer: token prompts pass; one longer than the context is refused as vLLM refuses it."""

    def __init__(self, engine: Engine) -> None:
        self.model_config, self.renderer = engine.model_config, engine.renderer
        self.gate: asyncio.Event | None = None
        self.fail: Exception | None = None

    async def render_completion(self, request: Any) -> Any:
        from vllm.exceptions import VLLMValidationError

        if self.gate is not None:
            await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        ids = list(request.prompt) if isinstance(request.prompt, list) else [ord(c) % 50 + 1 for c in request.prompt]
        if len(ids) > MAX_LEN:
            raise VLLMValidationError(f"This model's maximum context length is {MAX_LEN} tokens. However, your "
                                      f"prompt contains {len(ids)} input tokens.", parameter="input_tokens",
                                      value=len(ids))
        return [{"type": "token", "prompt_token_ids": ids}]

    async def preprocess_completion(self, request: Any, **kwargs: Any) -> Any:
        return await self.render_completion(request)


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch) -> Any:
    plugin.register()
    monkeypatch.setenv("VLLM_LORA_EXT_MAX_MIXES", "1")
    monkeypatch.setenv("VLLM_LORA_EXT_MIX_WAIT_S", "0")
    server.reset_registry()
    yield
    server.reset_registry()


def harness(tmp_path: Path, *, default: bool = False) -> Any:
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.lora.request import LoRARequest

    engine = Engine()
    models = OpenAIServingModels(engine, [BaseModelPath(name=BASE, model_path="/m")])
    a, b = make_dense_adapter(tmp_path / "a", seed=1), make_dense_adapter(tmp_path / "b", seed=2)
    models.lora_requests.update(style=LoRARequest("style", 1, str(a)), domain=LoRARequest("domain", 2, str(b)))
    if default:
        cfg = tmp_path / "d.yaml"
        cfg.write_text(f"adapters:\n  style: {{source: '{a}', weight: 0.7}}\n  domain: {{source: '{b}', weight: 0.3}}\n"
                       "default: style\n")  # style at weight 0.7: a mix
        models.vllm_lora_ext_deployment = read_deployment_config(cfg)
    renderer = Renderer(engine)
    return SimpleNamespace(engine=engine, models=models, renderer=renderer,
                           completion=OpenAIServingCompletion(engine, models, online_renderer=renderer,
                                                              request_logger=None),
                           tokenize=ServingTokenization(models, renderer, chat_template=None,
                                                        chat_template_content_format="auto"))


def error_response(err: BaseException) -> Any:
    """What vLLM's API server answers for an exception a handler raised (its exception handler)."""
    for name in ("vllm.entrypoints.serve.exception_handling.error_response", "vllm.entrypoints.serve.utils.error_response"):
        try:
            return importlib.import_module(name).create_error_response(err)
        except (ImportError, AttributeError):
            continue
    raise AssertionError("no create_error_response in this vLLM")


def status(answer: Any) -> int:
    error = getattr(answer, "error", None)
    return int(error.code) if error is not None else 200


async def complete(h: Any, model: str = BASE, prompt: Any = (1, 2, 3), **fields: Any) -> Any:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = CompletionRequest(model=model, prompt=list(prompt), max_tokens=fields.pop("max_tokens", 2), **fields)
    try:
        return await h.completion.create_completion(request)
    except Exception as err:
        return error_response(err)


def mix(w: float | None = None) -> dict[str, Any]:
    return {"adapters": ["style", "domain"], "adapter_weights": [0.5, next(_FRESH) / 1000 if w is None else w]}


async def until(condition: Any, timeout: float = 10.0) -> None:
    """Wait for ``condition()`` (a state another task reaches); fail, not hang, if it never comes."""
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the state waited for never came")


def assert_nothing_held() -> None:
    reg = server._REGISTRY
    assert reg is None or reg.in_use() == 0, [(e.lora_name, e.active) for e in reg._by_key.values()]
    assert not server._KEY_LOCKS and not leases._WAITERS


async def a_new_mix_is_served_at_once(h: Any) -> None:
    assert_nothing_held()
    answer = await complete(h, **mix())
    assert status(answer) == 200 and answer.model.startswith("mix-style=0.5+domain="), answer
    assert_nothing_held()
