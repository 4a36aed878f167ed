"""Per-expert keys routed once per block, projection and factor: only where vLLM's own parser answers alike."""

from __future__ import annotations

import importlib
import re
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

# vLLM MoE models and the checkpoint names of their per-expert projections (the key mapper is the model's own).
_MOE_MODELS = [
    ("qwen3_moe", "Qwen3MoeForCausalLM", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    ("qwen2_moe", "Qwen2MoeForCausalLM", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    ("mixtral", "MixtralForCausalLM", "block_sparse_moe.experts", ("w1", "w2", "w3")),
    ("deepseek_v2", "DeepseekV2ForCausalLM", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    ("olmoe", "OlmoeForCausalLM", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
    ("gpt_oss", "GptOssForCausalLM", "mlp.experts", ("gate_proj", "up_proj", "down_proj")),
]


def _keys(block: str, projs: tuple[str, ...]) -> list[str]:
    keys = []
    for layer in (0, 7, 11):
        for e in (0, 1, 3, 10, 12, 31, 100, 127):
            for proj in projs:
                for w in "AB":
                    keys.append(f"base_model.model.model.layers.{layer}.{block}.{e}.{proj}.lora_{w}.weight")
                    keys.append(f"model.layers.{layer}.{block}.{e}.{proj}.lora_{w}.weight")
    return keys


@pytest.mark.parametrize(("module", "cls", "block", "projs"), _MOE_MODELS, ids=[m[0] for m in _MOE_MODELS])
def test_real_model_mappers_that_route_experts_alike_give_every_key_of_a_pattern_the_same_answer(
        module: str, cls: str, block: str, projs: tuple[str, ...]) -> None:
    from vllm_lora_ext.formats import classify_key
    from vllm_lora_ext.integration._compat import unstacked_mapper
    from vllm_lora_ext.integration.loader import VllmKeyRouter
    from vllm_lora_ext.planning import expert_pattern

    try:
        model = getattr(importlib.import_module(f"vllm.model_executor.models.{module}"), cls)
    except (ImportError, AttributeError) as err:
        pytest.skip(f"{module}.{cls} not in this vLLM: {err}")
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    router = VllmKeyRouter(unstacked_mapper(mapper) if mapper is not None else None,
                           getattr(model, "lora_skip_prefixes", None))
    if not router.routes_experts_alike():
        pytest.skip(f"{cls}'s mapper has rules that could tell experts apart: every key is asked about")
    answers: dict[tuple[str, str], set[tuple[bool, bool]]] = {}
    for key in _keys(block, projs):
        pattern = expert_pattern(key, classify_key(key))
        assert pattern is not None
        answers.setdefault(pattern, set()).add((router.skip(key), router.module(key) is None))
    assert answers and all(len(a) == 1 for a in answers.values())


def test_mapper_rules_that_could_tell_experts_apart_make_every_key_asked_about() -> None:
    from vllm.model_executor.models.utils import WeightsMapper

    from vllm_lora_ext.integration._compat import mapper_ignores_expert_numbers
    from vllm_lora_ext.integration.loader import VllmKeyRouter

    assert mapper_ignores_expert_numbers(None)
    assert mapper_ignores_expert_numbers(WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."},
                                                       orig_to_new_substr={".mlp.": ".feed_forward."}))
    assert not mapper_ignores_expert_numbers(WeightsMapper(orig_to_new_substr={".experts.3.": ".experts.4."}))
    assert not mapper_ignores_expert_numbers(WeightsMapper(orig_to_new_suffix={"0.w1.lora_A.weight": "x"}))
    assert not mapper_ignores_expert_numbers(WeightsMapper(orig_to_new_regex={re.compile(r"experts\.\d+"): "e"}))
    assert not mapper_ignores_expert_numbers(object())  # something this list does not know
    assert not VllmKeyRouter(None, ["model.layers.61."]).routes_experts_alike()  # a skipped layer, say
    assert VllmKeyRouter(None, ["mtp."]).routes_experts_alike()


def test_a_mapper_that_drops_one_expert_still_has_that_expert_refused(tmp_path: object) -> None:
    from vllm.model_executor.models.utils import WeightsMapper

    from vllm_lora_ext.config import config_from_dict
    from vllm_lora_ext.errors import UnmatchedKeysError
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.integration.loader import VllmKeyRouter
    from vllm_lora_ext.planning import ModelSpec, plan_adapter

    block = "model.layers.0.mlp.experts"
    shapes = {f"base_model.model.{block}.{e}.{p}.lora_{w}.weight": ((4, 16) if w == "A" else (6, 4)) if p != "down_proj"
              else ((4, 6) if w == "A" else (16, 4)) for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")
              for w in "AB"}
    spec = ModelSpec(frozenset({block}), moe={block: MoESpec(block, 4, 16, 6)})
    router = VllmKeyRouter(WeightsMapper(orig_to_new_regex={re.compile(r"experts\.2\."): None}), None)
    assert not router.routes_experts_alike()
    with pytest.raises(UnmatchedKeysError) as e:
        plan_adapter(shapes, config_from_dict({"r": 4}), spec, router=router)
    assert sorted(e.value.keys) == sorted(k for k in shapes if ".experts.2." in k)


def test_one_dense_factor_spelled_twice_with_a_doubled_prefix_is_refused_not_one_dropped(tmp_path: Any) -> None:
    from factories import dense_tensors, llama_shapes, lora_config, write_adapter
    from vllm_lora_ext.building import BuildJob, build_adapter
    from vllm_lora_ext.errors import AdapterFormatError
    from vllm_lora_ext.integration.key_router import VllmKeyRouter
    from vllm_lora_ext.planning import ModelSpec
    from vllm_lora_ext.validation import ModuleDims

    tensors = dense_tensors(llama_shapes(), rank=4, seed=0)
    a_key = next(k for k in tensors if k.endswith("lora_A.weight"))
    tensors["base_model.model." + a_key] = tensors[a_key] * 2  # vLLM names both q_proj: one would vanish
    tensors["base_model.model." + a_key.replace("lora_A", "lora_B")] = tensors[a_key.replace("lora_A", "lora_B")].clone()
    dims = {m: ModuleDims(i, o) for m, (i, o) in llama_shapes().items()}
    job = BuildJob(str(write_adapter(tmp_path / "a", tensors, lora_config(4, 8))), "twice",
                   ModelSpec(frozenset(dims), dims=dims, max_rank=16))
    with pytest.raises(AdapterFormatError, match=r"two keys hold its lora_A, .*keep one"):
        build_adapter(job, VllmKeyRouter(None, None))  # vLLM's parser: both are q_proj


def test_an_adapter_giving_a_packed_module_and_its_parts_is_refused_not_packed_over(worker_manager: Any,
                                                                                     tmp_path: Any) -> None:
    """``qkv_proj`` beside ``q_proj``: vLLM packs q/k/v over the file's own ``qkv_proj`` factors, which then
    vanish. Refused, naming both; either alone loads."""
    import torch

    from factories import lora_config, write_adapter
    from vllm_lora_ext.errors import AdapterFormatError
    from vllm_lora_ext.integration.loader import load_lora_model
    from vllm.lora.request import LoRARequest

    attn = "base_model.model.model.layers.0.self_attn"
    parts = {f"{attn}.q_proj.lora_A.weight": torch.randn(4, 64), f"{attn}.q_proj.lora_B.weight": torch.randn(64, 4)}
    whole = {f"{attn}.qkv_proj.lora_A.weight": torch.randn(4, 64),
             f"{attn}.qkv_proj.lora_B.weight": torch.randn(128, 4)}
    cfg = lora_config(4, 8, ["q_proj", "qkv_proj"])
    assert load_lora_model(worker_manager, LoRARequest("parts", 1, str(write_adapter(tmp_path / "p", parts, cfg))))
    both = write_adapter(tmp_path / "both", {**parts, **whole}, cfg)
    with pytest.raises(AdapterFormatError, match=r"qkv_proj: given both as the packed module and as its parts "
                                                 r"\['model.layers.0.self_attn.q_proj'\].*keep one"):
        load_lora_model(worker_manager, LoRARequest("both", 2, str(both)))


def test_routers_are_equal_only_with_equal_mappers_and_skipped_prefixes_as_a_pickled_job_brings_them() -> None:
    """A build process gets each job's mapper unpickled anew: equal routers let it keep one plan
    (``building._planned``); any other rule or skipped prefix is another router."""
    import pickle

    from vllm.model_executor.models.utils import WeightsMapper

    from vllm_lora_ext.integration.loader import VllmKeyRouter

    mapper = WeightsMapper(orig_to_new_prefix={"model.": "language_model.model."})
    router = VllmKeyRouter(mapper, ["vision_tower"])
    again = VllmKeyRouter(pickle.loads(pickle.dumps(mapper)), ["vision_tower"])
    assert again == router and hash(again) == hash(router)
    assert VllmKeyRouter(mapper, None) != router
    assert VllmKeyRouter(WeightsMapper(orig_to_new_prefix={"model.": "other.model."}), ["vision_tower"]) != router
    assert VllmKeyRouter(None, None) == VllmKeyRouter(None, [])  # no prefix either way
    rules = {"model.": "language_model.model.", "model.layers.": "x."}  # applied in order: the order is a rule too
    assert (VllmKeyRouter(WeightsMapper(orig_to_new_prefix=rules), None)
            != VllmKeyRouter(WeightsMapper(orig_to_new_prefix=dict(reversed(rules.items()))), None))
    assert router != object()
