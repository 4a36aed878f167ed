"""Modules vLLM accepts and never applies (MLA's kv_b_proj) are refused at every entry point, with vLLM's real classes.

The worker is vLLM's ``WorkerLoRAManager`` and ``LoRAModel`` (the conftest's ``worker_manager``) over the module
names and sizes vLLM gives a tiny DeepSeek-V2 (``q_lora_rank=None``; dense MLPs, so no MoE layer is needed on the
CPU) and a model object of vLLM's own classes: ``DeepseekV2ForCausalLM`` holding an ``MLAAttention`` layer, as
``model_config.use_mla`` builds it (their ``__init__``s pick a GPU attention backend, so only ``nn.Module``'s runs).
Adapters are real PEFT adapters of transformers' ``DeepseekV2ForCausalLM``. The engine client (the GPU side of
``add_lora``) is the outer boundary: a stand-in that runs the real worker loader.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from factories import make_peft_adapter
from vllm_lora_ext.constants import PREBUILD_PREFIX
from vllm_lora_ext.errors import AdapterCompatibilityError
from vllm_lora_ext.mixing import MixComponent, MixSpec
from vllm_lora_ext.registry import MIX_ID_BASE

pytestmark = pytest.mark.vllm
LAYERS, HIDDEN, HEADS, KV_RANK, NOPE, ROPE, V, INTER = 2, 64, 4, 16, 16, 8, 16, 128
ATTN = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
BASE = "deepseek-tiny"


def _hf_deepseek() -> Any:
    import transformers

    torch.manual_seed(0)
    return transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=INTER, moe_intermediate_size=32,
        num_hidden_layers=LAYERS, num_attention_heads=HEADS, num_key_value_heads=HEADS, n_routed_experts=4,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=LAYERS, kv_lora_rank=KV_RANK,
        q_lora_rank=None, qk_nope_head_dim=NOPE, qk_rope_head_dim=ROPE, v_head_dim=V, max_position_embeddings=256))


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("mla")
    return {"all": make_peft_adapter(_hf_deepseek(), d / "all", targets=list(ATTN), rank=4, seed=1),
            "no_kv_b": make_peft_adapter(_hf_deepseek(), d / "no_kv_b", targets=["q_proj", "kv_a_proj_with_mqa",
                                                                                "o_proj"], rank=4, seed=2)}


def _vllm_model(*, mla: bool) -> Any:
    """vLLM's DeepseekV2ForCausalLM object holding an MLAAttention layer (mla) or none (VLLM_MLA_DISABLE=1)."""
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM

    model = DeepseekV2ForCausalLM.__new__(DeepseekV2ForCausalLM)
    torch.nn.Module.__init__(model)
    if mla:
        layer = MLAAttention.__new__(MLAAttention)
        torch.nn.Module.__init__(layer)
        model.add_module("mla_attn", layer)
    return model


def _deepseek(manager: Any, *, mla: bool = True) -> Any:
    """Point the worker's adapter-manager view at DeepSeek-V2's LoRA modules, sizes and packing (vLLM's own)."""
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2ForCausalLM

    sizes = {"q_proj": (HIDDEN, HEADS * (NOPE + ROPE)), "kv_a_proj_with_mqa": (HIDDEN, KV_RANK + ROPE),
             "kv_b_proj": (KV_RANK, HEADS * (NOPE + V)), "o_proj": (HEADS * V, HIDDEN),
             "gate_up_proj": (HIDDEN, [INTER, INTER]), "down_proj": (INTER, HIDDEN)}
    mapping = {"gate_up_proj": DeepseekV2ForCausalLM.packed_modules_mapping["gate_up_proj"]}
    modules: dict[str, Any] = {}
    packed: dict[str, list[str]] = {}
    for i in range(LAYERS):
        for block, names in (("self_attn", ATTN), ("mlp", ("gate_up_proj", "down_proj"))):
            for n in names:
                d_in, out = sizes[n]
                full = f"model.layers.{i}.{block}.{n}"
                modules[full] = SimpleNamespace(base_layer=SimpleNamespace(
                    input_size=d_in, output_size=sum(out), output_sizes=out) if isinstance(out, list)
                    else SimpleNamespace(input_size=d_in, output_size=out))
                if n in mapping:
                    packed[full] = [f"model.layers.{i}.{block}.{m}" for m in mapping[n]]
    view = manager._adapter_manager
    view.modules, view.packed_modules, view.packed_modules_mapping = modules, packed, mapping
    view.supported_lora_modules = [*ATTN, "gate_up_proj", "down_proj"]
    view.model = _vllm_model(mla=mla)
    return manager


@pytest.fixture
def deepseek(worker_manager: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.delenv("VLLM_LORA_EXT_DROP_UNAPPLIED", raising=False)
    return _deepseek(worker_manager)


def _load(manager: Any, path: str, name: str = "ds", lora_id: int = 1) -> Any:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.loader import load_lora_model

    return load_lora_model(manager, LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path))


def _assert_mla_refusal(message: str) -> None:
    assert "MLA folds kv_b_proj into its attention weights" in message
    assert "model.layers.0.self_attn.kv_b_proj" in message and "kv_b_proj.lora_A.weight" in message
    assert "target_modules" in message and "VLLM_LORA_EXT_DROP_UNAPPLIED=kv_b_proj" in message


def test_the_worker_loader_refuses_kv_b_proj_on_an_mla_model(deepseek: Any, adapters: dict[str, Path]) -> None:
    with pytest.raises(AdapterCompatibilityError) as e:
        _load(deepseek, str(adapters["all"]))
    _assert_mla_refusal(str(e.value))


@pytest.mark.usefixtures("build_dir")
def test_a_build_in_the_build_process_refuses_it_alike(deepseek: Any, adapters: dict[str, Path],
                                                      jobs_sent: list[str]) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.build_process import build_elsewhere
    from vllm_lora_ext.integration.loader import build_job

    job, router = build_job(deepseek, LoRARequest("ds", 1, str(adapters["all"])))
    with pytest.raises(AdapterCompatibilityError) as e:  # the server's background builds run there
        build_elsewhere(job, router)
    _assert_mla_refusal(str(e.value))
    assert jobs_sent == ["ds"]


def test_without_kv_b_proj_the_adapter_loads_every_module_it_has(deepseek: Any, adapters: dict[str, Path]) -> None:
    lora = _load(deepseek, str(adapters["no_kv_b"]))
    assert sorted(lora.loras) == sorted(f"model.layers.{i}.self_attn.{m}" for i in range(LAYERS)
                                        for m in ("q_proj", "kv_a_proj_with_mqa", "o_proj"))


def test_without_mla_attention_kv_b_proj_is_a_plain_layer_and_loads(worker_manager: Any,
                                                                    adapters: dict[str, Path]) -> None:
    lora = _load(_deepseek(worker_manager, mla=False), str(adapters["all"]))
    assert "model.layers.0.self_attn.kv_b_proj" in lora.loras


def test_the_opt_in_drops_kv_b_proj_with_a_warning_naming_it(deepseek: Any, adapters: dict[str, Path],
                                                             monkeypatch: pytest.MonkeyPatch,
                                                             caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_DROP_UNAPPLIED", "kv_b_proj")
    with caplog.at_level(logging.WARNING, logger="vllm_lora_ext"):
        lora = _load(deepseek, str(adapters["all"]))
    assert not any(name.endswith("kv_b_proj") for name in lora.loras)
    assert sorted(lora.loras) == sorted(f"model.layers.{i}.self_attn.{m}" for i in range(LAYERS)
                                        for m in ("q_proj", "kv_a_proj_with_mqa", "o_proj"))
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert "model.layers.0.self_attn.kv_b_proj" in warning and "VLLM_LORA_EXT_DROP_UNAPPLIED" in warning


def test_offline_llm_generate_refuses_it_before_the_request_is_queued(deepseek: Any,
                                                                      adapters: dict[str, Path]) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.loader import load_lora_model
    from vllm_lora_ext.integration.engine_patches import preload_offline

    engine = SimpleNamespace(add_lora=lambda req: load_lora_model(deepseek, req))  # LLMEngine.add_lora's worker
    with pytest.raises(AdapterCompatibilityError) as e:
        preload_offline(engine, LoRARequest("ds", 1, str(adapters["all"])))
    _assert_mla_refusal(str(e.value))
    assert engine.__dict__["_vllm_lora_ext_loaded"] == {}  # nothing recorded as loaded


def test_a_mix_including_the_adapter_is_refused(deepseek: Any, adapters: dict[str, Path]) -> None:
    from vllm_lora_ext.integration.composite import clear_component_cache

    clear_component_cache()
    good = MixSpec((MixComponent("b", str(adapters["no_kv_b"]), 1.0),))
    assert "model.layers.0.self_attn.q_proj" in _load(deepseek, good.lora_path, good.lora_name, MIX_ID_BASE).loras
    spec = MixSpec((MixComponent("b", str(adapters["no_kv_b"]), 0.5), MixComponent("a", str(adapters["all"]), 0.5)))
    with pytest.raises(AdapterCompatibilityError) as e:
        _load(deepseek, spec.lora_path, spec.lora_name, MIX_ID_BASE + 1)
    _assert_mla_refusal(str(e.value))


class _EngineClient:
    """vLLM's engine client as the API server sees it; ``add_lora`` runs the real worker loader (probes included)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.model_config = SimpleNamespace(max_model_len=256)
        self.renderer = self.input_processor = None
        self.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_cpu_loras=8, max_loras=4))
        self.added: list[str] = []

    async def add_lora(self, req: Any) -> bool:
        path = req.lora_path.removeprefix(PREBUILD_PREFIX)
        _load(self.manager, path, req.lora_name, req.lora_int_id)
        if not req.lora_path.startswith(PREBUILD_PREFIX):
            self.added.append(req.lora_name)
        return True


def _serving_models(manager: Any, lora_modules: list[Any] | None = None) -> Any:
    from vllm.entrypoints.openai.models.protocol import BaseModelPath
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.server import reset_registry

    plugin.register()  # patches OpenAIServingModels.load_lora_adapter / init_static_loras
    reset_registry()
    return OpenAIServingModels(_EngineClient(manager), [BaseModelPath(name=BASE, model_path="/m")],
                               lora_modules=lora_modules)


def test_the_load_lora_adapter_route_answers_400_and_registers_nothing(deepseek: Any,
                                                                       adapters: dict[str, Path]) -> None:
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    models = _serving_models(deepseek)
    result = asyncio.run(models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="ds",
                                                                         lora_path=str(adapters["all"]))))
    assert result.error.code == 400, result
    _assert_mla_refusal(result.error.message)
    assert "ds" not in models.lora_requests and models.engine_client.added == []
    ok = asyncio.run(models.load_lora_adapter(LoadLoRAAdapterRequest(lora_name="ok",
                                                                     lora_path=str(adapters["no_kv_b"]))))
    assert isinstance(ok, str) and "ok" in models.lora_requests


def test_lora_modules_at_server_start_refuse_it_before_serving(deepseek: Any, adapters: dict[str, Path]) -> None:
    from vllm.entrypoints.openai.models.protocol import LoRAModulePath

    models = _serving_models(deepseek, [LoRAModulePath(name="ds", path=str(adapters["all"]))])
    with pytest.raises(ValueError) as e:  # vLLM's init_static_loras stops the server with the load's message
        asyncio.run(models.init_static_loras())
    _assert_mla_refusal(str(e.value))
    assert models.lora_requests == {}


# ------------------------------------------------------------------------------------------------ quantized MoE

MOE, EXPERTS, MOE_INTER = "model.layers.1.mlp.experts", 4, 32


def _moe_wrapper(kernel: type) -> Any:
    """vLLM's FusedMoEWithLoRA for a 4-expert block whose modular kernel runs ``kernel`` (vLLM's own class).

    Its ``__init__`` selects that kernel from the quantization on a GPU; here the fields it sets are filled in.
    """
    from vllm.lora.layers.fused_moe import FusedMoEWithLoRA

    wrapper = FusedMoEWithLoRA.__new__(FusedMoEWithLoRA)
    torch.nn.Module.__init__(wrapper)
    wrapper.base_layer = SimpleNamespace(expert_map=None)
    wrapper.moe_config = SimpleNamespace(
        num_experts=EXPERTS, num_local_experts=EXPERTS, hidden_dim=HIDDEN, intermediate_size_per_partition=MOE_INTER,
        intermediate_size_per_partition_unpadded=None,
        moe_parallel_config=SimpleNamespace(ep_rank=0, use_ep=False, tp_size=1))
    wrapper.tp_size = 1
    wrapper._moe_kernel = SimpleNamespace(fused_experts=kernel.__new__(kernel))
    return wrapper


def _with_moe_block(manager: Any, kernel: type) -> Any:
    import types

    from vllm.lora.model_manager import LoRAModelManager

    view = manager._adapter_manager
    for name in ("_get_text_lora_name", "_get_text_lora_names"):  # 0.33's post-load check looks MoE blocks up so
        if hasattr(LoRAModelManager, name):
            setattr(view, name, types.MethodType(getattr(LoRAModelManager, name), view))
    view.modules[MOE] = _moe_wrapper(kernel)
    view.packed_modules[MOE] = [f"{MOE}.{e}.{p}" for e in range(EXPERTS) for p in ("gate_proj", "down_proj", "up_proj")]
    return manager


def _expert_adapter(folder: Path) -> Path:
    from factories import PREFIX, lora_config, write_adapter

    g = torch.Generator().manual_seed(3)
    tensors = {}
    for e in range(EXPERTS):
        for proj, (d_in, d_out) in (("gate_proj", (HIDDEN, MOE_INTER)), ("up_proj", (HIDDEN, MOE_INTER)),
                                    ("down_proj", (MOE_INTER, HIDDEN))):
            tensors[f"{PREFIX}{MOE}.{e}.{proj}.lora_A.weight"] = torch.randn(4, d_in, generator=g)
            tensors[f"{PREFIX}{MOE}.{e}.{proj}.lora_B.weight"] = torch.randn(d_out, 4, generator=g)
    for proj, (d_in, d_out) in (("q_proj", (HIDDEN, HEADS * (NOPE + ROPE))), ("o_proj", (HEADS * V, HIDDEN))):
        tensors[f"{PREFIX}model.layers.0.self_attn.{proj}.lora_A.weight"] = torch.randn(4, d_in, generator=g)
        tensors[f"{PREFIX}model.layers.0.self_attn.{proj}.lora_B.weight"] = torch.randn(d_out, 4, generator=g)
    write_adapter(folder, tensors, lora_config(4, 8, ("q_proj", "o_proj", "gate_proj", "up_proj", "down_proj")))
    return folder


def test_expert_lora_on_a_moe_kernel_that_ignores_it_is_refused_and_dropped_only_on_opt_in(
        worker_manager: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonWNA16Experts

    monkeypatch.delenv("VLLM_LORA_EXT_DROP_UNAPPLIED", raising=False)
    manager = _with_moe_block(_deepseek(worker_manager, mla=False), TritonWNA16Experts)
    adapter = _expert_adapter(tmp_path / "a")
    with pytest.raises(AdapterCompatibilityError) as e:
        _load(manager, str(adapter))
    msg = str(e.value)
    assert "TritonWNA16Experts kernel" in msg and MOE in msg and "VLLM_LORA_EXT_DROP_UNAPPLIED=experts" in msg
    assert f"{MOE}.0.gate_proj.lora_A.weight" in msg  # the first keys
    monkeypatch.setenv("VLLM_LORA_EXT_DROP_UNAPPLIED", "experts")
    with caplog.at_level(logging.WARNING, logger="vllm_lora_ext"):
        lora = _load(manager, str(adapter))
    assert sorted(lora.loras) == ["model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.q_proj"]
    assert any(MOE in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_expert_lora_on_a_moe_kernel_that_applies_it_loads(worker_manager: Any, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    monkeypatch.delenv("VLLM_LORA_EXT_DROP_UNAPPLIED", raising=False)
    manager = _with_moe_block(_deepseek(worker_manager, mla=False), TritonExperts)  # unquantized and FP8 MoE
    lora = _load(manager, str(_expert_adapter(tmp_path / "a")))
    assert MOE in lora.loras and "model.layers.0.self_attn.q_proj" in lora.loras


def _experts_classes() -> list[type]:
    """Every experts kernel class the installed vLLM defines (the modules that import on this machine)."""
    import importlib
    import pkgutil

    import vllm.model_executor.layers.fused_moe.experts as pkg
    from vllm.model_executor.layers.fused_moe import modular_kernel as mk

    for info in pkgutil.iter_modules(pkg.__path__):
        try:
            importlib.import_module(f"{pkg.__name__}.{info.name}")
        except Exception:  # a backend this machine lacks (ROCm, FlashInfer builds)
            continue
    seen: list[type] = []
    todo = [mk.FusedMoEExpertsModular]
    while todo:
        cls = todo.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.append(sub)
                todo.append(sub)
    return seen


def test_the_table_of_moe_kernels_that_drop_lora_matches_the_installed_vllm() -> None:
    """A kernel whose supports_lora() is true applies LoRA only if its own apply reads the LoRA context or calls
    its parent's: every other such kernel must be in the table, and every kernel in the table is one of them."""
    import ast
    import inspect
    import textwrap

    from vllm_lora_ext.unapplied import MOE_KERNELS_DROPPING_LORA

    dropping = set()
    for cls in _experts_classes():
        if not cls.supports_lora() or "apply" not in cls.__dict__:
            continue
        code = ast.unparse(ast.parse(textwrap.dedent(inspect.getsource(cls.__dict__["apply"]))))  # no comments
        if "lora" not in code.lower() and "super().apply" not in code:
            dropping.add(cls.__name__)
    assert "TritonWNA16Experts" in dropping
    assert dropping <= MOE_KERNELS_DROPPING_LORA, dropping - MOE_KERNELS_DROPPING_LORA
    installed = {c.__name__ for c in _experts_classes()}
    assert dropping == MOE_KERNELS_DROPPING_LORA & installed


# ---------------------------------------------- a wrapped module the model still calls through a second attribute

def _gated_block() -> Any:
    """Qwen2-MoE's shape of the problem with plain torch modules: the shared expert holds the block's gate too."""
    block = torch.nn.Module()
    block.shared_expert_gate = torch.nn.Linear(8, 1, bias=False)
    block.shared_expert = torch.nn.Module()
    block.shared_expert.expert_gate = block.shared_expert_gate  # what vLLM's Qwen2MoeMLP(expert_gate=...) keeps
    block.shared_expert.down_proj = torch.nn.Linear(8, 8, bias=False)
    model = torch.nn.Module()
    model.mlp = block
    return model


class _Wrapper(torch.nn.Module):
    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base


def test_a_wrapper_the_model_bypasses_through_a_second_attribute_is_found() -> None:
    from vllm_lora_ext.integration.loader import bypassed_wrappers

    model = _gated_block()
    gate, down = _Wrapper(model.mlp.shared_expert_gate), _Wrapper(model.mlp.shared_expert.down_proj)
    model.mlp.shared_expert_gate, model.mlp.shared_expert.down_proj = gate, down  # what vLLM's replace_submodule does
    wrapped = {"mlp.shared_expert_gate": gate, "mlp.shared_expert.down_proj": down}
    assert bypassed_wrappers(model, wrapped) == ["mlp.shared_expert.expert_gate is mlp.shared_expert_gate"]
    model.mlp.shared_expert.expert_gate = gate  # re-pointed: nothing bypasses the wrapper any more
    assert bypassed_wrappers(model, wrapped) == []


def test_a_lora_on_the_bypassed_shared_expert_gate_is_refused_naming_it_and_the_fix() -> None:
    from vllm_lora_ext.unapplied import TRAIT_ALIASED, screen_unapplied

    traits = {TRAIT_ALIASED: "Qwen2MoeForCausalLM (e.g. model.layers.0.mlp.shared_expert.expert_gate is ...)"}
    keys = {"model.layers.0.mlp.shared_expert_gate": ["base_model.model.model.layers.0.mlp.shared_expert_gate"
                                                     ".lora_A.weight"],
            "model.layers.0.mlp.shared_expert.down_proj": ["x.lora_A.weight"]}
    with pytest.raises(AdapterCompatibilityError) as info:
        screen_unapplied(keys, {}, traits, adapter="qwen2")
    msg = str(info.value)
    assert "shared_expert_gate" in msg and "never called" in msg and "Retrain without shared_expert_gate" in msg
    assert "VLLM_LORA_EXT_DROP_UNAPPLIED=shared_expert_gate" in msg and "down_proj" not in msg
    dropped = screen_unapplied(keys, {}, traits, drop=frozenset({"shared_expert_gate"}), adapter="qwen2")
    assert dropped == set(keys["model.layers.0.mlp.shared_expert_gate"])



@pytest.mark.parametrize(("lora_n", "w2_rows", "padding"), [
    (96, 8, ("MarlinExperts", 96, 128)),  # Marlin padded 96 to its tile: the LoRA buffers stay 96 wide
    (128, 8, None),  # aligned: nothing padded
])
def test_the_worker_finds_a_marlin_kernel_that_padded_the_experts(lora_n: int, w2_rows: int, padding: Any) -> None:
    """`_compat.moe_kernel_padding` on vLLM's own Marlin experts class, with weights shaped as Marlin packs them
    (the kernel's size is vLLM's ``marlin_moe_intermediate_size`` of them), and the traits it gives."""
    import inspect
    import types

    import torch
    from vllm.lora.layers.fused_moe import FusedMoEWithLoRA
    from vllm.model_executor.layers.fused_moe.experts.marlin_moe import MarlinExperts
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    from vllm_lora_ext.integration._compat import moe_kernel_padding
    from vllm_lora_ext.unapplied import padding_traits

    def wrapper(experts: Any, base: Any) -> Any:
        return types.SimpleNamespace(_moe_kernel=types.SimpleNamespace(fused_experts=experts), base_layer=base,
                                     intermediate_size_per_partition=lora_n)

    marlin = object.__new__(MarlinExperts)  # the real class; its __init__ wants a model's MoE config
    # The wrapper's base_layer is a MoERunner; the packed weights live on its routed_experts layer (an H200 run
    # with the weights looked up on the runner itself found none, and refused an aligned int4 base).
    experts = types.SimpleNamespace(w13_weight=torch.zeros(2, 4, 2 * 16 * w2_rows),
                                    w2_weight=torch.zeros(2, w2_rows, 4))
    base = types.SimpleNamespace(routed_experts=experts)
    assert "self.base_layer.routed_experts" in inspect.getsource(FusedMoEWithLoRA.__init__)
    assert moe_kernel_padding(wrapper(marlin, base)) == padding
    assert bool(padding_traits([padding] if padding else [])) == (padding is not None)
    assert moe_kernel_padding(wrapper(object.__new__(TritonExperts), base)) is None  # not Marlin: not padded
    unreadable = moe_kernel_padding(wrapper(marlin, types.SimpleNamespace()))
    assert unreadable == ("MarlinExperts", lora_n, None)  # refused rather than served unchecked
