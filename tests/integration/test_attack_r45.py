"""Attacker pass r45 through vLLM's real objects: per-module alpha on a model whose weights mapper renames modules, and
an adapter name vLLM's engine client cannot send.

- ``alpha_pattern``/``rank_pattern`` keys name the trained model's modules (PEFT matches them against the key without
  ``base_model.model.``, and vLLM 0.33's ``from_lora_tensors`` matches the same names, "before weights mapping"). The
  plugin matched them against vLLM's names after the model's ``hf_to_vllm_mapper``: on a vision-language model
  (``model.language_model.`` -> ``language_model.model.``) a key written with the trained name took no effect, and the
  module was served at the global alpha, silently (scaling 2 instead of 16 below). Mix components too.
- A load whose name holds a lone surrogate reached vLLM's engine client, which cannot encode it: a 500
  ("UnicodeEncodeError") where the name is the client's error.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from factories import write_adapter
from vllm_lora_ext.integration import server

pytestmark = pytest.mark.vllm

TRAINED = "model.language_model.layers.{i}.self_attn.q_proj"  # transformers v5 names of a VL model's text layers


def _vl_manager(mgr: Any) -> Any:
    """The ``worker_manager`` fixture's Llama view, its modules moved under vLLM's ``language_model.model.`` and the
    model's mapper renaming the trained ``model.language_model.`` to it."""
    from vllm.model_executor.models.utils import WeightsMapper

    view = mgr._adapter_manager
    move = lambda n: n.replace("model.", "language_model.model.", 1)  # noqa: E731
    view.modules = {move(k): v for k, v in view.modules.items()}
    view.packed_modules = {move(k): [move(p) for p in v] for k, v in view.packed_modules.items()}
    view.model = SimpleNamespace(hf_to_vllm_mapper=WeightsMapper(
        orig_to_new_prefix={"model.language_model.": "language_model.model."}))
    return mgr


def _vl_adapter(folder: Path, alpha_pattern: dict[str, float]) -> Path:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for i in range(2):
        tensors[f"base_model.model.{TRAINED.format(i=i)}.lora_A.weight"] = torch.randn(4, 64, generator=g)
        tensors[f"base_model.model.{TRAINED.format(i=i)}.lora_B.weight"] = torch.randn(64, 4, generator=g)
    write_adapter(folder, tensors, {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                    "alpha_pattern": alpha_pattern})
    return folder


@pytest.mark.parametrize("key", [TRAINED.format(i=0), "language_model.layers.0.self_attn.q_proj"])
def test_an_alpha_pattern_naming_the_trained_module_applies_on_a_model_whose_mapper_renames_it(
        worker_manager: Any, tmp_path: Path, key: str) -> None:
    from peft.utils.other import get_pattern_key
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager

    from vllm_lora_ext.integration import plugin

    plugin.register()
    mgr = _vl_manager(worker_manager)
    req = LoRARequest("vl", 1, str(_vl_adapter(tmp_path / "vl", {key: 64})))
    ours = WorkerLoRAManager._load_adapter(mgr, req)
    for i in range(2):
        served = f"language_model.model.layers.{i}.self_attn.q_proj"
        peft = 64 / 4 if get_pattern_key([key], TRAINED.format(i=i)) == key else 8 / 4
        assert ours.loras[served].scaling == peft, (i, key)  # (vLLM 0.33's own loader gives it too; 0.26's: none)


def test_a_mix_component_on_such_a_model_keeps_its_trained_alpha(worker_manager: Any, tmp_path: Path) -> None:
    from vllm_lora_ext.integration.loader import load_component

    from vllm_lora_ext.integration import plugin

    plugin.register()
    mapped = load_component(_vl_manager(worker_manager), "vl", str(_vl_adapter(tmp_path / "vl", {TRAINED.format(i=0): 64})))
    scalings = {name: m.scaling for name, m in mapped.modules.items()}
    assert scalings == {"language_model.model.layers.0.self_attn.q_proj": 16.0,
                        "language_model.model.layers.1.self_attn.q_proj": 2.0}


class _MsgpackEngine:
    """vLLM's engine client at its real boundary: every request it sends to the engine is msgpack-encoded first."""

    model_config = SimpleNamespace(max_model_len=256)
    renderer = None
    input_processor = None

    def __init__(self) -> None:
        try:
            from vllm.v1.serial_utils import MsgpackEncoder

            self.encoder: Any = MsgpackEncoder()
        except ImportError:  # (what it does to a name: UTF-8)
            self.encoder = SimpleNamespace(encode=lambda req: req.lora_name.encode("utf-8"))
        self.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_cpu_loras=8, max_loras=4))
        self.sent: list[Any] = []

    async def add_lora(self, req: Any) -> bool:
        self.encoder.encode(req)  # UnicodeEncodeError for a name that is no UTF-8
        self.sent.append(req)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return True


@pytest.fixture
def plugin_on() -> Any:
    from vllm_lora_ext.integration import plugin

    plugin.register()
    server.reset_registry()
    yield
    server.reset_registry()


def test_a_load_whose_name_holds_a_lone_surrogate_is_a_400_naming_it(plugin_on: None, tmp_path: Path) -> None:
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    from factories import make_dense_adapter

    engine = _MsgpackEngine()
    models = OpenAIServingModels(engine, [BaseModelPath(name="base", model_path="/m")])
    asyncio.run(models.init_static_loras())
    body = '{"lora_name": "mine\\ud800", "lora_path": "%s"}' % make_dense_adapter(tmp_path / "a")
    answer = asyncio.run(models.load_lora_adapter(LoadLoRAAdapterRequest.model_validate(json.loads(body))))  # (as FastAPI)
    assert not isinstance(answer, str) and answer.error.code == 400, answer
    assert "lone UTF-16 surrogate" in answer.error.message and "Choose a name" in answer.error.message
    assert not models.lora_requests and not engine.sent and not models.lora_resolver_lock


@pytest.mark.parametrize(("declared", "stored", "extra"), [(4, 8, {}), (8, 4, {}), (4, 4, {"rank_pattern": {"q_proj": 8}})],
                         ids=["r4-over-rank-8", "r8-over-rank-4", "rank_pattern-8-over-rank-4"])
def test_the_worker_loader_refuses_a_config_rank_the_tensors_do_not_have(worker_manager: Any, tmp_path: Path,
                                                                         declared: int, stored: int,
                                                                         extra: dict[str, Any]) -> None:
    """``r: 4`` over rank-8 factors: PEFT refuses it, ``vllm-lora inspect``/``mix``/``convert`` and a deployment
    registered unbuilt (``VLLM_LORA_EXT_BUILD_AT_START=0``) refuse it (``check_declared_ranks``), but the worker
    loader, behind ``--lora-modules`` and ``/v1/load_lora_adapter``, served it at ``lora_alpha / 4``: twice the delta
    of the same factors saved with ``r: 8``, silently."""
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager

    from factories import dense_tensors, llama_shapes, lora_config
    from vllm_lora_ext.errors import AdapterFormatError
    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.sources import resolve_source
    from vllm_lora_ext.summary import summarize_adapter

    plugin.register()
    folder = tmp_path / "a"
    write_adapter(folder, dense_tensors(llama_shapes(hidden=64, kv=32, inter=128), rank=stored),
                  lora_config(declared, 8, **extra))
    assert summarize_adapter(resolve_source(str(folder)), name="a").problems  # what inspect and a deployment say
    with pytest.raises(AdapterFormatError, match="but the config gives it r") as info:
        WorkerLoRAManager._load_adapter(worker_manager, LoRARequest("a", 1, str(folder)))
    assert "Set \"r\" (or a rank_pattern entry) to the tensors' rank" in str(info.value)


@pytest.mark.parametrize(("form", "key"), [("2d", "model.language_model.layers.0.mlp.experts.0.down_proj"),
                                           ("3d", "model.language_model.layers.0.mlp.experts.down_proj")])
def test_an_moe_alpha_pattern_naming_the_trained_experts_applies_on_a_model_whose_mapper_renames_them(
        tmp_path: Path, form: str, key: str) -> None:
    """The MoE read scaled each expert block by the pattern of the model's block name (``spec.prefix``), not the
    file's: an ``alpha_pattern`` key PEFT matched (``model.language_model...experts...down_proj``) took no effect on a
    vision-language MoE, and ``language_model.model...``, which PEFT never matched, did."""
    from dataclasses import replace as _replace

    from vllm.model_executor.models.utils import WeightsMapper

    from factories import lora_config
    from moe_factories import BUILD_E, BUILD_H, BUILD_I, BUILD_R, block_tensors, make_truth, moe_build_job
    from vllm_lora_ext import building
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.integration.key_router import VllmKeyRouter
    from vllm_lora_ext.planning import ModelSpec

    truths = [make_truth(BUILD_E, BUILD_H, BUILD_I, BUILD_R, seed=i) for i in range(2)]
    tensors: dict[str, torch.Tensor] = {}
    for layer, t in enumerate(truths):
        tensors.update(block_tensors(f"model.language_model.layers.{layer}.mlp", t, form))  # type: ignore[arg-type]
    write_adapter(tmp_path / "a", tensors, lora_config(BUILD_R, 8, ["gate_proj", "up_proj", "down_proj"],
                                                      alpha_pattern={key: 64}))
    blocks = tuple(f"language_model.model.layers.{i}.mlp.experts" for i in range(2))
    job = _replace(moe_build_job(tmp_path / "a"), dtype=torch.float32, model=ModelSpec(
        frozenset(blocks), moe={p: MoESpec(p, BUILD_E, BUILD_H, BUILD_I) for p in blocks},
        local_experts={p: tuple(range(BUILD_E)) for p in blocks}, max_rank=16), wrappers={p: "2d" for p in blocks})
    router = VllmKeyRouter(WeightsMapper(orig_to_new_prefix={"model.language_model.": "language_model.model."}), None)
    built = building.build_adapter(job, router)
    for layer, block in enumerate(blocks):
        down_b = built.moe[block][1][1]  # [w1, w2, w3]: w2 is down
        scaling = (down_b[0].float().norm() / truths[layer].bd[0].float().norm()).item()
        assert scaling == pytest.approx(64 / BUILD_R if layer == 0 else 8 / BUILD_R), (layer, scaling)


def test_a_client_cannot_load_an_adapter_under_the_base_models_name(plugin_on: None, tmp_path: Path) -> None:
    """vLLM 0.26's load route does not refuse a served base model's name (0.33's does), and its adapter lookup
    (``_maybe_get_adapters``) looks in the loaded adapters before it looks at the base model: a client that loaded
    its adapter as ``base-model`` was served to every client naming the base model (before r45, on vLLM 0.26)."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.engine.serving import BaseServing
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    from factories import make_dense_adapter

    engine = _MsgpackEngine()
    models = OpenAIServingModels(engine, [BaseModelPath(name="base-model", model_path="/m"),
                                          BaseModelPath(name="alias", model_path="/m")])
    asyncio.run(models.init_static_loras())
    mine = str(make_dense_adapter(tmp_path / "mine"))
    for name in ("base-model", "alias"):
        for inplace in (False, True):
            answer = asyncio.run(models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name=name, lora_path=mine,
                                                                                 load_inplace=inplace)))
            assert not isinstance(answer, str) and answer.error.code == 400, (name, answer)
            assert "base model" in answer.error.message, answer.error.message
    assert not models.lora_requests and not engine.sent
    serving = BaseServing(models, engine.model_config)
    request = CompletionRequest(model="base-model", prompt="hi")
    assert asyncio.run(serving._check_model(request)) is None
    assert serving._maybe_get_adapters(request) is None  # the base model, never a client's adapter


def test_a_load_inplace_leaves_no_reload_flag_on_the_adapter_every_request_is_served(plugin_on: None,
                                                                                     tmp_path: Path) -> None:
    """vLLM 0.26 registers the very request of a ``load_inplace`` (0.33 resets its flag first), so every later
    request on that adapter carried ``load_inplace=True``, and 0.26's ``LRUCacheWorkerLoRAManager.add_adapter``
    reloads an adapter so flagged in every engine step that has it: one load by any client made the engine read the
    adapter again step after step, for every client of it."""
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.entrypoints.serve.engine.serving import BaseServing
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    from factories import make_dense_adapter

    engine = _MsgpackEngine()
    models = OpenAIServingModels(engine, [BaseModelPath(name="base-model", model_path="/m")])
    asyncio.run(models.init_static_loras())
    first, second = (str(make_dense_adapter(tmp_path / n, seed=i)) for i, n in enumerate(("one", "two")))
    assert isinstance(asyncio.run(models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="mine",
                                                                                  lora_path=first))), str)
    answer = asyncio.run(models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="mine", lora_path=second,
                                                                         load_inplace=True)))
    assert isinstance(answer, str), answer
    serving = BaseServing(models, engine.model_config)
    request = CompletionRequest(model="mine", prompt="hi")
    assert asyncio.run(serving._check_model(request)) is None
    served = serving._maybe_get_adapters(request)
    assert served.lora_path == second and served.load_inplace is False
