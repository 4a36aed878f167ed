"""Slots and locks are held only by requests that generate (issue 35, items 7-11 and 16).

vLLM's real serving classes run each request: ``OpenAIServingCompletion.create_completion`` (with its
``_with_kv_transfer_rejection_cleanup``, ``_check_model``, ``_maybe_get_adapters`` and online beam search,
all as the plugin patches them), ``ServingTokenization`` and the pooling ``_check_model``, over vLLM's
real ``OpenAIServingModels``. The outer boundaries are stand-ins: the engine client (records adapters and
answers ``generate`` through the plugin's ``AsyncLLM.generate`` replacement, with outputs that depend on
the prompt and on the adapter's source) and the online renderer (passes token prompts through and refuses
one longer than the context with vLLM's own error type and message).

The registry holds ONE mix and a request waits 0 s for a slot, so any slot left held makes the next new
mix a 503. Every case asserts its answer, that no lease, routing lock or waiter is left, and that a new
mix is served at once afterwards.
"""

from __future__ import annotations

import asyncio
import gc
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
from vllm_lora_ext.integration import leases, plugin, server

pytestmark = pytest.mark.vllm
BASE = "base"
MAX_LEN = 16
_FRESH = itertools.count(1)


class _Tokenizer:
    eos_token_id = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        return " ".join(map(str, ids))

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"t{i}" for i in ids]


class _Engine:
    """vLLM's engine client: records adapters; ``generate`` is the plugin's AsyncLLM.generate around `_outputs`."""

    errored = False
    dead_error = RuntimeError("the engine is dead")

    def __init__(self) -> None:
        self.model_config = SimpleNamespace(max_model_len=MAX_LEN, is_encoder_decoder=False, generation_config="vllm",
                                            get_diff_sampling_param=dict, override_generation_config={})
        self.renderer = SimpleNamespace(tokenizer=_Tokenizer(), get_tokenizer=_Tokenizer)
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

    generate = plugin._make_generate(_outputs)


class _Renderer:
    """vLLM's online renderer: token prompts pass; one longer than the context is refused as vLLM refuses it."""

    def __init__(self, engine: _Engine) -> None:
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


def _harness(tmp_path: Path, *, default: bool = False) -> Any:
    from vllm.entrypoints.openai.completion.serving import OpenAIServingCompletion
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.tokenize.serving import ServingTokenization
    from vllm.lora.request import LoRARequest

    engine = _Engine()
    models = OpenAIServingModels(engine, [BaseModelPath(name=BASE, model_path="/m")])
    a, b = make_dense_adapter(tmp_path / "a", seed=1), make_dense_adapter(tmp_path / "b", seed=2)
    models.lora_requests.update(style=LoRARequest("style", 1, str(a)), domain=LoRARequest("domain", 2, str(b)))
    if default:
        cfg = tmp_path / "d.yaml"
        cfg.write_text(f"adapters:\n  style: {{source: '{a}', weight: 0.7}}\n  domain: {{source: '{b}', weight: 0.3}}\n"
                       "default: style\n")  # style at weight 0.7: a mix
        models.vllm_lora_ext_deployment = read_deployment_config(cfg)
    renderer = _Renderer(engine)
    return SimpleNamespace(engine=engine, models=models, renderer=renderer,
                           completion=OpenAIServingCompletion(engine, models, online_renderer=renderer,
                                                              request_logger=None),
                           tokenize=ServingTokenization(models, renderer, chat_template=None,
                                                        chat_template_content_format="auto"))


def _error_response(err: BaseException) -> Any:
    """What vLLM's API server answers for an exception a handler raised (its exception handler)."""
    for name in ("vllm.entrypoints.serve.exception_handling.error_response", "vllm.entrypoints.serve.utils.error_response"):
        try:
            return importlib.import_module(name).create_error_response(err)
        except (ImportError, AttributeError):
            continue
    raise AssertionError("no create_error_response in this vLLM")


def _status(answer: Any) -> int:
    error = getattr(answer, "error", None)
    return int(error.code) if error is not None else 200


async def _complete(h: Any, model: str = BASE, prompt: Any = (1, 2, 3), **fields: Any) -> Any:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    request = CompletionRequest(model=model, prompt=list(prompt), max_tokens=fields.pop("max_tokens", 2), **fields)
    try:
        return await h.completion.create_completion(request)
    except Exception as err:
        return _error_response(err)


def _mix(w: float | None = None) -> dict[str, Any]:
    return {"adapters": ["style", "domain"], "adapter_weights": [0.5, next(_FRESH) / 1000 if w is None else w]}


async def _until(condition: Any, timeout: float = 10.0) -> None:
    """Wait for ``condition()`` (a state another task reaches); fail, not hang, if it never comes."""
    for _ in range(int(timeout / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("the state waited for never came")


def _assert_nothing_held() -> None:
    reg = server._REGISTRY
    assert reg is None or reg.in_use() == 0, [(e.lora_name, e.active) for e in reg._by_key.values()]
    assert not server._KEY_LOCKS and not leases._WAITERS


async def _a_new_mix_is_served_at_once(h: Any) -> None:
    _assert_nothing_held()
    answer = await _complete(h, **_mix())
    assert _status(answer) == 200 and answer.model.startswith("mix-style=0.5+domain="), answer
    _assert_nothing_held()


# ------------------------------------------------------------------ item 7: routed to a mix, failed before generating

TOO_LONG = list(range(1, MAX_LEN + 5))


@pytest.mark.parametrize("how", ["body fields", "model syntax", "default weights"])
def test_a_too_long_prompt_on_a_mix_is_a_400_and_frees_its_slot_at_once(tmp_path: Path, how: str) -> None:
    h = _harness(tmp_path, default=how == "default weights")
    choice = {"body fields": _mix(0.25), "model syntax": {"model": "style=0.5+domain=0.25"},
              "default weights": {"model": BASE}}[how]

    async def scenario() -> None:
        answer = await _complete(h, prompt=TOO_LONG, **choice)
        assert _status(answer) == 400 and "maximum context length is 16" in answer.error.message
        assert h.engine.runs == [] and len(h.engine.added) == 1  # routed and built, never generated
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_too_long_prompt_on_a_registered_mix_named_by_its_name_frees_its_slot(tmp_path: Path) -> None:
    h = _harness(tmp_path)

    async def scenario() -> None:
        first = await _complete(h, **_mix(0.25))
        answer = await _complete(h, model=first.model, prompt=TOO_LONG)
        assert _status(answer) == 400 and "maximum context length" in answer.error.message
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


@pytest.mark.parametrize("failure", ["render error", "engine dead", "bad sampling params", "engine refuses"])
def test_a_mix_request_that_fails_on_the_way_to_the_engine_frees_its_slot(tmp_path: Path, failure: str) -> None:
    h = _harness(tmp_path)
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
        answer = await _complete(h, prompt=prompt, **_mix(0.25), **fields)
        assert _status(answer) != 200, answer
        h.renderer.fail, h.engine.errored = None, False
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_twenty_too_long_requests_on_twenty_mixes_through_one_slot_are_all_400_not_503(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MIX_WAIT_S", "30")  # each waits for the slot; each holds it only while handled
    h = _harness(tmp_path)

    async def scenario() -> None:
        answers = await asyncio.gather(*(_complete(h, prompt=TOO_LONG, **_mix()) for _ in range(20)))
        assert [_status(a) for a in answers] == [400] * 20
        assert len(h.engine.added) == 20 and len(server._REGISTRY) == 1
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_stream_dropped_before_its_first_chunk_frees_its_slot(tmp_path: Path) -> None:
    h = _harness(tmp_path)

    async def scenario() -> None:
        stream = await _complete(h, stream=True, **_mix(0.25))
        assert hasattr(stream, "__anext__") and server._REGISTRY.in_use() == 1  # generation admitted: its lease holds
        del stream
        gc.collect()
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_stream_whose_client_disconnects_after_the_first_chunk_frees_its_slot(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    never = asyncio.Event()

    async def scenario() -> None:
        stream = await _complete(h, stream=True, max_tokens=4, **_mix(0.25))
        chunks: list[str] = []

        async def client() -> None:  # the server's streaming task, cancelled when the client goes away
            async for chunk in stream:
                chunks.append(chunk)
                h.engine.on_step = never.wait  # the next output never comes

        task = asyncio.create_task(client())
        await _until(lambda: chunks)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        assert task.cancelled() and len(chunks) == 1
        h.engine.on_step = None
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_stream_closed_after_its_first_chunk_frees_its_slot_once_dropped(tmp_path: Path) -> None:
    h = _harness(tmp_path)

    async def scenario() -> None:
        stream = await _complete(h, stream=True, max_tokens=4, **_mix(0.25))
        assert (await stream.__anext__()).startswith("data: ")
        await stream.aclose()
        del stream
        gc.collect()  # the inner streams are closed by asyncio's async-generator finalizer, on the next loop turns
        for _ in range(5):
            await asyncio.sleep(0)
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_client_that_disconnects_during_generation_frees_its_slot(tmp_path: Path) -> None:
    h = _harness(tmp_path)
    never = asyncio.Event()

    async def scenario() -> None:
        h.engine.on_step = never.wait
        task = asyncio.create_task(_complete(h, **_mix(0.25)))
        await _until(lambda: h.engine.runs)
        assert server._REGISTRY.in_use() == 1
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        h.engine.on_step = None
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


# ------------------------------------------------------------------ item 8: routes that never generate


async def _tokenize(h: Any, **fields: Any) -> Any:
    from vllm.entrypoints.serve.tokenize.protocol import TokenizeCompletionRequest

    try:
        return await h.tokenize.create_tokenize(TokenizeCompletionRequest(prompt="hello", **fields), None)
    except Exception as err:
        return _error_response(err)


@pytest.mark.parametrize("fields", [{"model": "style=0.7+domain=0.3"}, {"model": "style+domain"},
                                    {"model": BASE, "adapters": ["style", "domain"], "adapter_weights": [0.5, 0.5]},
                                    {"model": BASE}, {"model": "style"}],
                         ids=["model syntax", "default weights", "body fields", "base under a default", "named"])
def test_tokenize_on_a_mix_answers_the_base_tokens_and_never_builds_or_holds_anything(tmp_path: Path,
                                                                                       fields: dict[str, Any]) -> None:
    h = _harness(tmp_path, default=True)

    async def scenario() -> None:
        base = await _tokenize(h, model=BASE)
        answer = await _tokenize(h, **fields)
        assert _status(answer) == 200 and answer.tokens == base.tokens and answer.count == 5
        assert not h.engine.added and not h.engine.probes and server._REGISTRY is None  # nothing built, no slot
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


@pytest.mark.parametrize(("fields", "fragment"), [
    ({"model": "style=0.7+nope=0.3"}, "Unknown adapter(s) ['nope']"),
    ({"model": "style=abc+domain"}, "is not a number"),
    ({"adapters": ["style"], "adapter_weights": [1e308]}, "outside [-100, 100]"),
])
def test_tokenize_checks_a_mix_and_answers_400_for_a_bad_one(tmp_path: Path, fields: dict[str, Any],
                                                             fragment: str) -> None:
    h = _harness(tmp_path)

    async def scenario() -> None:
        answer = await _tokenize(h, **{"model": BASE, **fields})
        assert _status(answer) == 400 and fragment in answer.error.message, answer
        assert not h.engine.added and server._REGISTRY is None
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_tokenize_on_twenty_distinct_mixes_leaves_the_one_slot_free_for_a_real_mix(tmp_path: Path) -> None:
    h = _harness(tmp_path)

    async def scenario() -> None:
        answers = await asyncio.gather(*(_tokenize(h, model=f"style=0.5+domain={i / 100}") for i in range(1, 21)))
        assert [_status(a) for a in answers] == [200] * 20
        assert not h.engine.added and server._REGISTRY is None
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_request_on_an_unwrapped_route_routes_but_holds_nothing_once_routed(tmp_path: Path) -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    h = _harness(tmp_path)

    async def scenario() -> None:  # a vLLM route whose handler the plugin does not wrap (no request scope)
        req = CompletionRequest(model=BASE, prompt=[1, 2], **_mix(0.25))
        assert await server.route_adapters(h.completion, req) is None and server.routed_lora(req) is not None
        await _a_new_mix_is_served_at_once(h)  # evicts it: the routed request still names its exact mix
        assert h.completion._maybe_get_adapters(req).lora_path.startswith("mix:")

    asyncio.run(scenario())


# ------------------------------------------------------------------ item 9: routing locks go with their last waiter


def test_twenty_cancelled_waiters_for_one_mix_leave_no_routing_lock(tmp_path: Path) -> None:
    h = _harness(tmp_path)

    async def scenario() -> None:
        h.engine.add_gate = asyncio.Event()  # the first request's mix is still loading
        first = asyncio.create_task(_complete(h, **_mix(0.25)))
        waiters = [asyncio.create_task(_complete(h, **_mix(0.25))) for _ in range(20)]
        await _until(lambda: sum(n for _, n in server._KEY_LOCKS.values()) == 21)
        for w in waiters:
            w.cancel()
        await asyncio.gather(*waiters, return_exceptions=True)
        assert [n for _, n in server._KEY_LOCKS.values()] == [1]  # only the request that holds it
        h.engine.add_gate.set()
        assert _status(await first) == 200
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_request_cancelled_while_waiting_for_a_slot_leaves_no_lock_waiter_or_lease(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MIX_WAIT_S", "30")
    h = _harness(tmp_path)
    pause = asyncio.Event()

    async def scenario() -> None:
        h.engine.on_step = pause.wait
        first = asyncio.create_task(_complete(h, **_mix(0.25)))  # generating: holds the one slot
        await _until(lambda: h.engine.runs)
        waiting = asyncio.create_task(_complete(h, **_mix(0.75)))
        await _until(lambda: leases._WAITERS)
        waiting.cancel()
        await asyncio.gather(waiting, return_exceptions=True)
        assert not leases._WAITERS and not server._KEY_LOCKS and server._REGISTRY.in_use() == 1
        pause.set()
        assert _status(await first) == 200
        h.engine.on_step = None
        await _a_new_mix_is_served_at_once(h)

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


# ------------------------------------------------------------------ item 11: held from the model check to the lookup


@pytest.mark.parametrize("named", ["by its registered name", "by body fields"])
def test_a_mix_is_held_from_the_model_check_until_generation_so_a_competitor_cannot_evict_it(tmp_path: Path,
                                                                                          named: str) -> None:
    h = _harness(tmp_path)

    async def scenario() -> None:
        name = (await _complete(h, **_mix(0.25))).model
        h.renderer.gate = asyncio.Event()  # the request is between vLLM's _check_model and its adapter lookup
        fields = {"model": name} if named == "by its registered name" else _mix(0.25)
        task = asyncio.create_task(_complete(h, **fields))
        await _until(lambda: server._REGISTRY.in_use())
        h.renderer.gate.set()
        competitor = await _complete(h, **_mix(0.75))  # one slot, no wait: the mix in flight is not evicted
        assert _status(competitor) == 503 and "VLLM_LORA_EXT_MAX_MIXES" in competitor.error.message
        answer = await task
        assert _status(answer) == 200 and answer.model == name, answer
        assert h.engine.runs[-1].lora_name == name and not h.engine.removed
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


def test_a_request_naming_an_evicted_mix_by_name_is_refused_not_served_another_adapter(tmp_path: Path) -> None:
    h = _harness(tmp_path)

    async def scenario() -> None:
        name = (await _complete(h, **_mix(0.25))).model
        await _a_new_mix_is_served_at_once(h)  # evicts it (one slot)
        runs = len(h.engine.runs)
        answer = await _complete(h, model=name)
        assert _status(answer) in (400, 404) and len(h.engine.runs) == runs  # (issue 35 item 15 makes it a 404)
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


# ------------------------------------------------------------------ item 10: one lease for a whole beam search

BEAM = {"use_beam_search": True, "n": 2, "max_tokens": 4, "ignore_eos": True}


def _beams(answer: Any) -> list[tuple[str, ...]]:
    return [tuple(c.text.split()) for c in answer.choices]


def test_beam_search_on_a_mix_under_eviction_pressure_returns_the_beams_it_returns_alone(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    alone_h = _harness(tmp_path)
    alone = asyncio.run(_complete(alone_h, **_mix(0.25), **BEAM))
    assert _status(alone) == 200 and len(alone_h.engine.runs) == 1 + 3 * 2  # one beam, then two a step
    server.reset_registry()
    monkeypatch.setenv("VLLM_LORA_EXT_MIX_WAIT_S", "30")
    h = _harness(tmp_path)  # the same adapter files: the same mix source
    competitors: list[Any] = []
    removed_at_steps: list[list[int]] = []

    async def pressure() -> None:  # before every step, another mix asks for the one slot
        removed_at_steps.append(list(h.engine.removed))
        competitors.append(asyncio.create_task(_complete(h, **_mix())))
        await asyncio.sleep(0.02)

    async def scenario() -> Any:
        h.engine.on_step = pressure
        answer = await _complete(h, **_mix(0.25), **BEAM)
        h.engine.on_step = None
        served = await asyncio.gather(*competitors)
        return answer, served

    answer, served = asyncio.run(scenario())
    assert _beams(answer) == _beams(alone) and len(set(_beams(answer))) == 2
    mix_id = h.engine.runs[0].lora_int_id
    beam_runs = [r for r in h.engine.runs if r.lora_int_id == mix_id]
    assert len(beam_runs) == len(alone_h.engine.runs)  # every step ran on the mix
    assert removed_at_steps == [[]] * len(beam_runs)  # nothing was evicted while the beam search ran
    assert [_status(a) for a in served] == [200] * len(competitors)  # each competitor was served once it ended
    assert h.engine.removed[0] == mix_id
    asyncio.run(_a_new_mix_is_served_at_once(h))


def test_a_beam_search_consumed_after_its_handler_returned_keeps_its_mix_for_every_step(tmp_path: Path) -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.sampling_params import BeamSearchParams

    h = _harness(tmp_path)
    answers: list[int] = []

    async def handler(request: Any) -> Any:  # chat's streaming path: the beam stream outlives its handler
        error = await h.completion._check_model(request)
        assert error is None
        return h.completion.beam_search(prompt={"type": "token", "prompt_token_ids": [1, 2, 3]}, request_id="b",
                                        params=BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True),
                                        lora_request=h.completion._maybe_get_adapters(request))

    async def competitor() -> None:
        answers.append(_status(await _complete(h, **_mix())))

    async def scenario() -> Any:
        request = CompletionRequest(model=BASE, prompt=[1, 2, 3], **_mix(0.25))
        stream = await h.completion._with_kv_transfer_rejection_cleanup(handler(request), request, None)
        assert server._REGISTRY.in_use() == 1  # the handler has returned: the beam's own lease holds the mix
        h.engine.on_step = competitor
        outputs = [out async for out in stream]
        h.engine.on_step = None
        return outputs

    outputs = asyncio.run(scenario())
    assert len(outputs) == 1 and len(outputs[0].outputs) == 2
    assert answers and set(answers) == {503} and not h.engine.removed  # never evicted between steps
    asyncio.run(_a_new_mix_is_served_at_once(h))


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
        return _error_response(err)


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
    h = _harness(tmp_path)

    async def scenario() -> None:
        if fields["model"] == "registered mix":
            fields["model"] = (await _complete(h, **_mix(0.25))).model
        added = len(h.engine.added)
        answer = await _embed_check(h, **fields)
        assert _status(answer) == 400, answer
        assert "does not serve adapter mixes" in answer.error.message and "/v1/completions" in answer.error.message
        assert len(h.engine.added) == added  # nothing built
        await _a_new_mix_is_served_at_once(h)

    asyncio.run(scenario())


@pytest.mark.parametrize("model", [BASE, "style"])
def test_embeddings_on_the_base_model_or_a_loaded_adapter_pass(tmp_path: Path, model: str) -> None:
    h = _harness(tmp_path)
    assert asyncio.run(_embed_check(h, model=model)) is None and not h.engine.added
