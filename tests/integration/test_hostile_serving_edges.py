"""Hostile clients at the serving edges (attack round 2): each case failed before its fix and passes since.

The API side is vLLM's own (``OpenAIServingModels``, ``BaseServing``, the completion and pooling serving classes),
patched by ``register()``, through the repository's harnesses: `test_hostile_names.Api` (a recording engine
client), `lease_harness` (the completion route over a generating engine stand-in) and, where the worker's own
answer matters, vLLM's real ``WorkerLoRAManager`` behind the engine client (`test_prebuild_worker`'s pattern).

- the operator's names (``--lora-modules``, the deployment config) cannot be unloaded or loaded over by a client;
- ``load_inplace`` of a bad adapter is a 400 like any new name, not vLLM's 500 with the worker's raw text;
- unloads of made-up names leave no per-name lock behind;
- a failed build never shows the client a server folder outside ``VLLM_LORA_EXT_ALLOWED_ROOTS``;
- under ``VLLM_SKIP_MODEL_NAME_VALIDATION`` an adapter name is still an adapter, and a mix still not a base model;
- a multiplexed id holding a lone surrogate ranks (the router does not raise);
- a mix the worker refuses for rank tells the client the rank it needs and the maximum.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from factories import make_dense_adapter, make_peft_adapter, tiny_llama
from lease_harness import fresh  # noqa: F401 (the autouse fixture: the plugin on, a fresh mix registry)
from lease_harness import BASE, complete, harness, status
from vllm_lora_ext.constants import ENV_ALLOWED_ROOTS
from vllm_lora_ext.deployment import read_deployment_config
from vllm_lora_ext.integration import build_process
from vllm_lora_ext.mixing import MixSpec

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling tests' harnesses
from test_hostile_mix_holds import _embed_check  # noqa: E402
from test_hostile_names import Api  # noqa: E402
from test_prebuild_worker import _EngineOnWorker as _WorkerEngine  # noqa: E402

pytestmark = pytest.mark.vllm


class _EngineOnWorker(_WorkerEngine):
    """`test_prebuild_worker`'s engine client over a real worker manager, with what vLLM's serving classes read,
    and a failed ``add_lora`` answered as vLLM's engine core answers it (``Call to add_lora method failed: ...``)."""

    model_config = SimpleNamespace(max_model_len=256)
    renderer = None
    input_processor = None

    async def add_lora(self, req: Any) -> bool:
        try:
            return await super().add_lora(req)
        except Exception as err:
            raise Exception(f"Call to add_lora method failed: {err}") from None  # vLLM's utility-call failure


def _models(engine: Any, **modules: Path) -> Any:
    """vLLM's ``OpenAIServingModels`` for the base model ``base``, with ``modules`` as ``--lora-modules``."""
    from vllm.entrypoints.openai.models.protocol import BaseModelPath, LoRAModulePath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    models = OpenAIServingModels(engine, [BaseModelPath(name=BASE, model_path="/m")],
                                 lora_modules=[LoRAModulePath(n, str(p)) for n, p in modules.items()])
    asyncio.run(models.init_static_loras())
    return models


async def _load(models: Any, name: str, path: Path | str, *, inplace: bool = False) -> Any:
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    return await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=str(path),
                                                                 load_inplace=inplace))


async def _unload(models: Any, name: str) -> Any:
    from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

    return await models.unload_lora_adapter(UnloadLoRAAdapterRequest(lora_name=name))


def _skip_model_name_validation(monkeypatch: pytest.MonkeyPatch) -> None:
    """``VLLM_SKIP_MODEL_NAME_VALIDATION=1`` as vLLM reads it: ``vllm.envs`` reads the environment on every access
    (its module ``__getattr__``) until ``enable_envs_cache()`` caches that; a cached value is patched in place."""
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_SKIP_MODEL_NAME_VALIDATION", "1")
    if hasattr(getattr(envs, "__getattr__", None), "cache_clear"):  # functools.cache: read once already
        monkeypatch.setitem(vars(envs), "VLLM_SKIP_MODEL_NAME_VALIDATION", True)
    assert envs.VLLM_SKIP_MODEL_NAME_VALIDATION


def test_a_client_cannot_unload_or_load_over_a_deployment_adapter_and_the_default_keeps_the_operators_weights(
        tmp_path: Path) -> None:
    h = harness(tmp_path / "h", default=True)  # deployment: style (0.7), domain; default: style
    operators = h.models.vllm_lora_ext_deployment.adapters["style"].source.canonical()
    mine = make_dense_adapter(tmp_path / "client" / "mine", seed=66)

    def served() -> str:
        return MixSpec.from_path(h.engine.runs[-1].lora_path).components[0].source

    async def scenario() -> None:
        answer = await complete(h)  # a base-model request: the deployment default
        assert status(answer) == 200 and served() == operators, answer
        for refused in (await _unload(h.models, "style"), await _load(h.models, "style", mine, inplace=True)):
            assert status(refused) == 403, refused
            assert refused.error.type == "PermissionDeniedError"
            assert "'style'" in refused.error.message and "operator" in refused.error.message
        answer = await _load(h.models, "style", mine)  # a new load of the name (vLLM: already loaded)
        assert status(answer) != 200, answer
        assert h.models.lora_requests["style"].lora_path == operators
        answer = await complete(h)
        assert status(answer) == 200 and served() == operators, answer

    asyncio.run(scenario())


def test_load_inplace_of_a_bad_adapter_is_a_400_and_over_an_operator_name_a_403(worker_manager: Any,
                                                                                 tmp_path: Path) -> None:
    good = make_peft_adapter(tiny_llama(), tmp_path / "good", targets=["q_proj"], rank=4, alpha=8)
    other = make_peft_adapter(tiny_llama(), tmp_path / "other", targets=["q_proj"], rank=4, alpha=8, seed=5)
    big = make_peft_adapter(tiny_llama(), tmp_path / "big", targets=["q_proj"], rank=32, alpha=32)  # max rank 16
    models = _models(_EngineOnWorker(worker_manager), operators=good)

    async def scenario() -> None:
        assert status(await _load(models, "mine", other)) == 200  # a client's own name
        answer = await _load(models, "mine", big, inplace=True)
        assert status(answer) == 400, answer
        assert answer.error.type == "BadRequestError"
        assert "'mine'" in answer.error.message and "max_lora_rank is 16" in answer.error.message
        assert "Call to add_lora" not in answer.error.message
        assert models.lora_requests["mine"].lora_path == str(other)  # the failed reload replaced nothing
        answer = await _load(models, "operators", other, inplace=True)
        assert status(answer) == 403, answer
        assert answer.error.type == "PermissionDeniedError" and "operator" in answer.error.message
        assert models.lora_requests["operators"].lora_path == str(good)

    asyncio.run(scenario())


def test_unloads_of_names_never_loaded_leave_no_lock_per_name(tmp_path: Path) -> None:
    api = Api(tmp_path)
    api.start()
    before = set(api.models.lora_resolver_lock)

    async def scenario() -> None:
        for i in range(200):
            answer = await _unload(api.models, f"never-loaded-{i:04d}-" + "x" * 200)
            assert status(answer) == 404, answer

    asyncio.run(scenario())
    left = len(api.models.lora_resolver_lock) - len(before)
    assert left <= 0, f"{left} per-name locks left by 200 unloads"  # bounded: no entry per name asked for
    asyncio.run(api.serves_the_real_mix())


@pytest.mark.parametrize("mode", ["background build", "built in the step (prebuild off)",
                                  "built in the step (wait over)"])
def test_a_build_failure_never_shows_the_client_a_link_target_outside_the_allowed_roots(
        worker_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    if "prebuild off" in mode:  # vLLM then answers the engine's failure itself: a 500 with the worker's text
        monkeypatch.setenv("VLLM_LORA_EXT_PREBUILD", "0")
    elif "wait over" in mode:
        monkeypatch.setenv("VLLM_LORA_EXT_PREBUILD_WAIT_S", "0")
        monkeypatch.setenv("VLLM_LORA_EXT_BUILD_PROCESS", "0")
    secret = "team-x-secret"  # vLLM's sanitize_message blanks most paths; one after a space in a folder name stays
    store = make_peft_adapter(tiny_llama(), tmp_path / "Private Store" / "adapter", targets=["q_proj"], rank=4,
                              alpha=8)
    target = (store / "adapter_model.safetensors").rename(store.parent / secret)
    folder = tmp_path / "roots" / "shared"  # inside the roots; its weight file links out of them
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_bytes((store / "adapter_config.json").read_bytes())
    (folder / "adapter_model.safetensors").symlink_to(target)
    monkeypatch.setenv(ENV_ALLOWED_ROOTS, str(tmp_path / "roots"))
    models = _models(_EngineOnWorker(worker_manager))

    build_process.shutdown()  # a build process started before would read with its own roots (none)
    try:
        answer = asyncio.run(_load(models, "x", folder))
    finally:
        build_process.shutdown()  # one started here keeps these roots: not for the tests after
    assert status(answer) == 400, answer
    assert "outside the folders this server may read" in answer.error.message
    assert secret not in answer.error.message
    assert "x" not in models.lora_requests and "x" not in models.lora_resolver_lock


def test_a_load_refused_in_the_step_is_a_400_naming_the_fix_and_failed_loads_leave_no_lock(
        worker_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    monkeypatch.setenv("VLLM_LORA_EXT_PREBUILD", "0")
    big = make_peft_adapter(tiny_llama(), tmp_path / "big", targets=["q_proj"], rank=32, alpha=32)  # max rank 16
    models = _models(_EngineOnWorker(worker_manager))
    answer = asyncio.run(_load(models, "big", big))
    assert status(answer) == 400, answer  # not vLLM's 500 with the engine call's text
    assert "has rank 32" in answer.error.message and "--max-lora-rank 32" in answer.error.message
    before = len(models.lora_resolver_lock)

    async def made_up_names() -> None:
        for i in range(50):  # vLLM's own 400 (no path): it makes a lock per name first
            await models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=f"n{i}-" + "x" * 100, lora_path=""))

    asyncio.run(made_up_names())
    assert len(models.lora_resolver_lock) == before and "big" not in models.lora_resolver_lock


def test_without_name_validation_a_named_adapter_is_served_itself_not_the_deployment_default(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_model_name_validation(monkeypatch)
    api = Api(tmp_path)
    api.start()
    cfg = tmp_path / "d.yaml"
    cfg.write_text(f"adapters:\n  style: {{source: '{api.sources['style']}'}}\n"
                   f"  domain: {{source: '{api.sources['domain']}'}}\ndefault: domain\n")
    api.models.vllm_lora_ext_deployment = read_deployment_config(cfg)

    error, lora = asyncio.run(api.ask("style"))
    assert error is None, error
    assert lora.lora_name == "style" and lora.lora_path == api.sources["style"]
    error, lora = asyncio.run(api.ask(api.base))  # the base model still gets the deployment default
    assert error is None and lora.lora_path == api.sources["domain"]


def test_without_name_validation_a_mix_on_a_pooling_route_is_a_400(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    _skip_model_name_validation(monkeypatch)
    h = harness(tmp_path)

    answer = asyncio.run(_embed_check(h, model="style=0.7+domain=0.3"))
    assert status(answer) == 400, answer
    assert "does not serve adapter mixes" in answer.error.message
    assert not h.engine.added  # nothing built


def test_an_id_holding_a_lone_surrogate_ranks_without_raising() -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from vllm_lora_ext.residency import home_order, rank_replicas

    model = CompletionRequest.model_validate(json.loads('{"model": "qwen:\\ud800", "prompt": "x"}')).model
    assert model == "qwen:\ud800"  # valid JSON, accepted by vLLM's request model
    ranks = rank_replicas(model, {"replica-1": ["qwen:style"], "replica-2": []})
    assert sorted(r for rank in ranks for r in rank) == ["replica-1", "replica-2"]
    assert rank_replicas(model, {"replica-1": ["qwen:style"], "replica-2": [model]})[0] == ["replica-2"]
    assert home_order(model, ["r1", "r2", "r3"]) == home_order(model, ["r3", "r1", "r2"])


def test_a_mix_refused_for_rank_tells_the_client_the_rank_it_needs_and_the_max(worker_manager: Any,
                                                                              tmp_path: Path) -> None:
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.serve.engine.serving import BaseServing

    a = make_peft_adapter(tiny_llama(), tmp_path / "a", targets=["q_proj"], rank=8, alpha=8)
    b = make_peft_adapter(tiny_llama(), tmp_path / "b", targets=["q_proj"], rank=16, alpha=8)
    engine = _EngineOnWorker(worker_manager)  # a real WorkerLoRAManager: max_lora_rank 16
    models = _models(engine, a=a, b=b)
    serving = BaseServing(models, engine.model_config)

    answer = asyncio.run(serving._check_model(CompletionRequest(model="a=0.5+b=0.5", prompt="hi")))
    assert status(answer) == 400, answer
    assert "rank 24" in answer.error.message and "max_lora_rank is 16" in answer.error.message
    assert not any(n.startswith("mix-") for n in models.lora_requests)  # the refused mix is not registered


def test_a_record_forged_in_a_name_retypes_no_answer_of_a_load_built_in_the_step(
        worker_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With background builds off, vLLM answers a failed load with the worker's text, and its other answers (400
    'already loaded') quote the name: a client's name holding a record must not turn either into its 404."""
    from vllm_lora_ext.errors import RECORD_MARK

    monkeypatch.setenv("VLLM_LORA_EXT_PREBUILD", "0")
    fake = '{"type":"AdapterNotFoundError","message":"spoofed","args":["spoofed"],"fields":{"source":"x"}}'
    name = f"x{RECORD_MARK}{fake}]"
    big = make_peft_adapter(tiny_llama(), tmp_path / "big", targets=["q_proj"], rank=32, alpha=32)  # max rank 16
    small = make_peft_adapter(tiny_llama(), tmp_path / "small", targets=["q_proj"], rank=4, alpha=8)
    models = _models(_EngineOnWorker(worker_manager))
    answer = asyncio.run(_load(models, name, big))
    assert status(answer) == 400 and "max_lora_rank" in answer.error.message, answer
    assert isinstance(asyncio.run(_load(models, name, small)), str)  # loaded under that name
    again = asyncio.run(_load(models, name, small))  # vLLM's own 400: already loaded
    assert status(again) == 400 and "spoofed" not in again.error.message.replace(name, ""), again
